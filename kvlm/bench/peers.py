"""Hugging Face transformers peers of kvlm models, for side-by-side benchmarks.

A peer is the transformers implementation a user would otherwise pick for the same configuration
(LlamaForCausalLM for MHA/MQA/GQA, DeepseekV3ForCausalLM for MLA), holding kvlm's weights so that both
compute the same function (``max_logit_diff`` checks it), and generating through its own cache
(``DynamicCache``). Which peer a mechanism has is its ``Attention.hf_peer`` (a transformers model_type, the key
of ``PEERS``). transformers is an optional extra (``pip install 'kvlm[hf]'``); without it
``build_peer`` raises ``PeerUnavailable`` with the reason.
"""

from __future__ import annotations

import torch

from kvlm.attention import get_attention_class
from kvlm.model import KVLM


class PeerUnavailable(ValueError):
    """No transformers peer for this model (transformers missing, or a configuration it cannot express)."""


def transformers_version() -> str | None:
    try:
        import transformers
    except ImportError:
        return None
    return transformers.__version__


def build_peer(model: KVLM) -> Peer:
    """The transformers model computing the same function as ``model`` (weights copied): the one named by
    the mechanism's ``hf_peer``."""
    if transformers_version() is None:
        raise PeerUnavailable("transformers is not installed (pip install 'kvlm[hf]')")
    cfg = model.cfg
    _require(
        cfg.arch == "llama", f"arch={cfg.arch!r}: the peers are Llama-style models (RMSNorm, SwiGLU, RoPE)"
    )
    _require(not cfg.gated, "gated attention has no transformers peer")
    _require(cfg.rope and cfg.rope_head_dim != 0, "the peers always apply RoPE; rope=False has none")
    kind = get_attention_class(cfg.attention).hf_peer
    if kind not in PEERS:
        raise PeerUnavailable(f"no transformers implementation of {cfg.attention!r}")
    peer = PEERS[kind](model)
    p = model.embed.weight
    peer.model.to(device=p.device, dtype=p.dtype).eval()
    return peer


def agreement_tolerance(dtype: torch.dtype) -> float:
    """Largest |logit difference| / max(1, |logit|) accepted as 'the same function'. transformers rounds
    RoPE angles and RMSNorm through float32, so even float64 agrees only to ~1e-7."""
    return 1e-3 if dtype in (torch.float32, torch.float64) else 5e-2


def _require(cond: bool, why: str) -> None:
    if not cond:
        raise PeerUnavailable(why)


class Peer:
    """A transformers causal LM with kvlm's weights, driven the way ``generate`` drives it."""

    def __init__(self, name: str, model: torch.nn.Module):
        self.name = name
        self.model = model

    @property
    def attn_implementation(self) -> str:
        return str(self.model.config._attn_implementation)

    def new_cache(self):
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, cache, last_only: bool = False) -> torch.Tensor:
        """Append tokens (B, T) to cache (prefill or decode); logits (B, T or 1, vocab)."""
        out = self.model(
            input_ids=tokens, past_key_values=cache, use_cache=True, logits_to_keep=int(last_only)
        )
        return out.logits

    def synthetic_cache(self, batch: int, length: int):
        """A cache holding ``length`` random tokens per sequence, as if a prompt had been prefilled:
        decode speed depends on the cache's size, not its contents, and this skips a long prefill."""
        cache = self.new_cache()
        p = next(self.model.parameters())
        for i, (k_shape, v_shape) in enumerate(self.cache_shapes(batch, length)):
            k = torch.randn(k_shape, dtype=p.dtype, device=p.device)
            v = torch.randn(v_shape, dtype=p.dtype, device=p.device)
            cache.update(k, v, i)
        return cache

    def cache_shapes(self, batch: int, length: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        raise NotImplementedError

    @staticmethod
    def cache_nbytes(cache) -> int:
        total = 0
        for layer in cache.layers:
            for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
                if isinstance(t, torch.Tensor):
                    total += t.numel() * t.element_size()
        return total


# --- Llama (MHA / MQA / GQA) ------------------------------------------------------------------------
class LlamaPeer(Peer):
    def cache_shapes(self, batch, length):
        c = self.model.config
        shape = (batch, c.num_key_value_heads, length, c.head_dim)
        return [(shape, shape)] * c.num_hidden_layers


def _llama_peer(model: KVLM) -> Peer:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = model.cfg
    hf_cfg = LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.d_model,
        intermediate_size=cfg.ffn_dim,
        num_hidden_layers=cfg.n_layer,
        num_attention_heads=cfg.n_head,
        num_key_value_heads=cfg.n_kv_head,
        head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_seq_len,
        rms_norm_eps=cfg.norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        tie_word_embeddings=cfg.tie_embeddings,
        attention_bias=cfg.bias,
        mlp_bias=cfg.bias,
    )
    hf = LlamaForCausalLM(hf_cfg)
    names = {"wq": "q_proj", "wk": "k_proj", "wv": "v_proj", "wo": "o_proj"}
    mlp = {"w1": "gate_proj", "w2": "up_proj", "wo": "down_proj"}
    state = {}
    for key, value in model.state_dict().items():
        state[_llama_key(key, names, mlp)] = value
    _load(hf, state)
    return LlamaPeer("transformers LlamaForCausalLM", hf)


def _llama_key(key: str, attn_names: dict[str, str], mlp_names: dict[str, str]) -> str:
    if key == "embed.weight":
        return "model.embed_tokens.weight"
    if key == "norm.weight":
        return "model.norm.weight"
    if key == "lm_head.weight":
        return key
    parts = key.split(".")  # layers.{i}.{sub}.{name}.{weight|bias}
    i, sub = parts[1], parts[2]
    if sub == "attn_norm":
        return f"model.layers.{i}.input_layernorm.weight"
    if sub == "mlp_norm":
        return f"model.layers.{i}.post_attention_layernorm.weight"
    if sub == "attn":
        return f"model.layers.{i}.self_attn.{attn_names[parts[3]]}.{parts[4]}"
    if sub == "mlp":
        return f"model.layers.{i}.mlp.{mlp_names[parts[3]]}.{parts[4]}"
    raise PeerUnavailable(f"kvlm weight {key!r} has no place in the transformers model")


def _load(hf: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    target = hf.state_dict()
    missing = [
        k for k in target if k not in state and not (k == "lm_head.weight" and hf.config.tie_word_embeddings)
    ]
    extra = [k for k in state if k not in target]
    if missing or extra:
        raise PeerUnavailable(f"weight mapping mismatch: missing {missing[:4]}, unexpected {extra[:4]}")
    for k, v in state.items():
        if target[k].shape != v.shape:
            raise PeerUnavailable(
                f"{k}: transformers shape {tuple(target[k].shape)} != kvlm {tuple(v.shape)}"
            )
    hf.load_state_dict(state, strict=False)
    if hf.config.tie_word_embeddings:
        hf.tie_weights()


# --- DeepSeek-V3 (MLA) ----------------------------------------------------------------------------
class DeepseekV3Peer(Peer):
    def cache_shapes(self, batch, length):
        c = self.model.config
        # transformers caches the normalised latent c_kv as "keys" and the roped k_rope as "values"
        return [
            ((batch, 1, length, c.kv_lora_rank), (batch, 1, length, c.qk_rope_head_dim))
        ] * c.num_hidden_layers


def _deepseek_v3_peer(model: KVLM) -> Peer:
    """DeepseekV3ForCausalLM with every layer a dense SwiGLU (first_k_dense_replace = n_layer, no experts).

    Weight layout (kvlm -> transformers), the same names and layouts but for RoPE rows: wq_a -> q_a_proj; wq_b
    ([W^UQ_i; W^QR_i] per head) -> q_b_proj (or wq -> q_proj); wkv_a ([W^DKV; W^KR]) -> kv_a_proj_with_mqa;
    wkv_b ([W^UK_i; W^UV_i] per head) -> kv_b_proj; wo -> o_proj. transformers' default ``rope_interleave=True`` rotates the pairs (x_2j, x_2j+1) and
    returns them half-split, so the rows that make q^R and k^R are interleaved ([0, d/2, 1, d/2 + 1, ...]):
    the roped outputs (and the cached k^R) are then exactly kvlm's half-split ones."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = model.cfg
    _require(cfg.rope_kv_heads == 1, "DeepseekV3 has one shared RoPE key (rope_kv_heads must be 1)")
    _require(cfg.kv_latent == "joint", "separate K and V latents have no DeepseekV3 equivalent")
    _require(cfg.latent_norm and not cfg.latent_scaling, "DeepseekV3 always RMS-normalises latents, unscaled")
    _require(not cfg.bias, "DeepseekV3 has no biases on its up-projections")
    h, dh, dr, dc, dq = cfg.n_head, cfg.head_dim, cfg.rope_head_dim, cfg.kv_lora_rank, cfg.q_lora_rank
    hf_cfg = DeepseekV3Config(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.d_model,
        intermediate_size=cfg.ffn_dim,
        num_hidden_layers=cfg.n_layer,
        num_attention_heads=h,
        num_key_value_heads=h,
        q_lora_rank=dq or None,
        kv_lora_rank=dc,
        qk_nope_head_dim=dh,
        qk_rope_head_dim=dr,
        v_head_dim=dh,
        first_k_dense_replace=cfg.n_layer,  # every layer dense: no MoE
        n_routed_experts=8,
        n_group=1,
        topk_group=1,
        num_experts_per_tok=1,
        num_mtp_layers=0,
        max_position_embeddings=cfg.max_seq_len,
        rms_norm_eps=cfg.norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        rope_interleave=True,
        tie_word_embeddings=cfg.tie_embeddings,
        attention_bias=False,
    )
    hf = DeepseekV3ForCausalLM(hf_cfg)
    interleave = torch.stack([torch.arange(dr // 2), torch.arange(dr // 2) + dr // 2], dim=1).flatten()
    state = {}
    for key, value in model.state_dict().items():
        if ".attn." not in key:
            state[_llama_key(key, {}, {"w1": "gate_proj", "w2": "up_proj", "wo": "down_proj"})] = value
    for i, block in enumerate(model.layers):
        a, pre = block.attn, f"model.layers.{i}.self_attn."
        # kvlm's latent layout is DeepSeek's (kvlm.attention.latent); only the RoPE rows are permuted
        if dq:
            state[pre + "q_a_proj.weight"] = a.wq_a.weight
            state[pre + "q_a_layernorm.weight"] = a.q_norm.weight
            state[pre + "q_b_proj.weight"] = _interleave_rope_rows(a.wq_b.weight, h, dh, interleave)
        else:
            state[pre + "q_proj.weight"] = _interleave_rope_rows(a.wq.weight, h, dh, interleave)
        w_kv_a = a.wkv_a.weight
        state[pre + "kv_a_proj_with_mqa.weight"] = torch.cat([w_kv_a[:dc], w_kv_a[dc:][interleave]])
        state[pre + "kv_a_layernorm.weight"] = a.kv_norm.weight
        state[pre + "kv_b_proj.weight"] = a.wkv_b.weight  # rows of head i: [W^UK_i; W^UV_i]
        state[pre + "o_proj.weight"] = a.wo.weight
        # transformers builds the latent norms with eps 1e-6 whatever the config says; use kvlm's
        attn = hf.model.layers[i].self_attn
        for norm in (attn.kv_a_layernorm, attn.q_a_layernorm):
            if norm is not None:
                norm.variance_epsilon = cfg.norm_eps
    _load(hf, state)
    return DeepseekV3Peer("transformers DeepseekV3ForCausalLM", hf)


def _interleave_rope_rows(w: torch.Tensor, h: int, dh: int, interleave: torch.Tensor) -> torch.Tensor:
    """A query projection whose rows of head i are [q^C_i (d_h); q^R_i], with q^R_i's rows interleaved."""
    w = w.view(h, -1, w.shape[-1])
    return torch.cat([w[:, :dh], w[:, dh:][:, interleave]], dim=1).flatten(0, 1)


# the transformers model_type a mechanism names as its ``hf_peer`` -> the builder of that peer
PEERS = {"llama": _llama_peer, "deepseek_v3": _deepseek_v3_peer}


# --- agreement --------------------------------------------------------------------------------------
@torch.inference_mode()
def max_logit_diff(model: KVLM, peer: Peer, tokens: torch.Tensor, decode_steps: int = 2) -> float:
    """Largest |logit difference| between kvlm and its peer over a prefill of ``tokens`` followed by
    ``decode_steps`` single-token steps, each side through its own cache."""
    B, T = tokens.shape
    cache = model.new_cache(B, T + decode_steps)
    peer_cache = peer.new_cache()
    diff = (model(tokens, cache=cache) - peer.forward(tokens, peer_cache)).abs().max().item()
    nxt = tokens[:, -1:]
    for _ in range(decode_steps):
        nxt = (nxt * 7 + 3) % model.cfg.vocab_size
        a = model(nxt, cache=cache)
        b = peer.forward(nxt, peer_cache)
        diff = max(diff, (a - b).abs().max().item())
    return diff
