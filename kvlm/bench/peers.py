"""Hugging Face transformers peers of kvlm models, for side-by-side benchmarks.

A peer is the transformers implementation a user would otherwise pick for the same configuration
(LlamaForCausalLM for MHA/MQA/GQA, DeepseekV3ForCausalLM for MLA), holding kvlm's weights so that both
compute the same function (``max_logit_diff`` checks it), and generating through its own cache
(``DynamicCache``). Which peer a mechanism has is its ``Attention.hf_peer`` (a transformers model_type, the key
of ``PEERS``). transformers is an optional extra (``pip install 'kvlm[hf]'``); without it
``build_peer`` raises ``PeerUnavailable`` with the reason.

``build_peer(model, paged=True)`` builds the peer for transformers' continuous batching (its paged cache). That
cache has one slot shape for keys and values, ``(num_key_value_heads, config.head_dim)``, and caches per-head
keys and values; DeepseekV3's MLA has keys of d_h + d_h^R dims, values of d_h, and a config whose ``head_dim``
is the RoPE width d_h^R (its rotary table is built from it), so nothing fits (``index_copy_(): Source/destination
tensor must have same slice shapes``). The paged MLA peer therefore pads V as vLLM's early MLA path did
(``pad_values``: v_head_dim = d_h + d_h^R, kv_b_proj's V rows and o_proj's input columns zero-padded: the same
function) and sets ``config.head_dim = qk_head_dim`` once the rotary table is built. It pays for the padding (a
cache of 2 h (d_h + d_h^R) per token and layer, a wider o_proj) that a native paged MLA would not.
"""

from __future__ import annotations

import torch

from kvlm.attention import get_attention_class
from kvlm.interop import deepseek_v3, llama
from kvlm.interop.deepseek_v3 import FormatError
from kvlm.model import KVLM


class PeerUnavailable(ValueError):
    """No transformers peer for this model (transformers missing, or a configuration it cannot express)."""


def transformers_version() -> str | None:
    try:
        import transformers
    except ImportError:
        return None
    return transformers.__version__


def build_peer(model: KVLM, paged: bool = False) -> Peer:
    """The transformers model computing the same function as ``model`` (weights copied): the one named by
    the mechanism's ``hf_peer``; ``paged``: one that transformers' continuous batching can run (see the module
    docstring: MLA's values padded)."""
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
    peer = PEERS[kind](model, paged)
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
        from kvlm.interop.hf_modeling import CACHE_NAME  # transformers' name for the cache argument

        out = self.model(
            input_ids=tokens, use_cache=True, logits_to_keep=int(last_only), **{CACHE_NAME: cache}
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


def _llama_peer(model: KVLM, paged: bool = False) -> Peer:  # keys and values of one head size: pages as is
    from transformers import LlamaConfig, LlamaForCausalLM

    hf_cfg, state = _exported(llama, model)
    hf = LlamaForCausalLM(LlamaConfig(**hf_cfg))
    _load(hf, state)
    return LlamaPeer("transformers LlamaForCausalLM", hf)


def _exported(fmt, model: KVLM) -> tuple[dict, dict[str, torch.Tensor]]:
    """The config and weights ``kvlm export-hf --format`` writes for ``model`` (fmt: kvlm.interop.llama or
    kvlm.interop.deepseek_v3); an option the format cannot hold means there is no peer."""
    try:
        return fmt.hf_config(model.cfg), fmt.to_hf_state(model.cfg, model.state_dict())
    except FormatError as e:
        raise PeerUnavailable(str(e)) from e


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


def _deepseek_v3_peer(model: KVLM, paged: bool = False) -> Peer:
    """DeepseekV3ForCausalLM with every layer a dense SwiGLU, holding the weights of ``kvlm export-hf --format
    deepseek-v3`` (kvlm.interop.deepseek_v3: RoPE rows interleaved, kvlm's latent-norm eps and scalings folded);
    ``paged``: values padded for transformers' paged cache (module docstring)."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = model.cfg
    # the export folds these into the weights; a peer stands for a stock DeepSeek model, which has neither
    _require(cfg.latent_norm and not cfg.latent_scaling, "DeepseekV3 always RMS-normalises latents, unscaled")
    hf_cfg, state = _exported(deepseek_v3, model)
    if paged:
        hf_cfg, state = pad_values(hf_cfg, state)
    hf = DeepseekV3ForCausalLM(DeepseekV3Config(**hf_cfg))
    _load(hf, state)
    if not paged:
        return DeepseekV3Peer("transformers DeepseekV3ForCausalLM", hf)
    # the paged cache sizes its slots by config.head_dim, which DeepseekV3Config sets to the RoPE width (its
    # rotary table, already built above, is the only other reader); keys and (padded) values are qk_head_dim wide
    hf.config.head_dim = hf.config.qk_head_dim
    return DeepseekV3Peer("transformers DeepseekV3ForCausalLM (V padded)", hf)


def pad_values(hf_cfg: dict, state: dict[str, torch.Tensor]) -> tuple[dict, dict[str, torch.Tensor]]:
    """A DeepseekV3 config and state whose v_head_dim equals qk_head_dim (d_h + d_h^R) and which computes the
    same function: each head's V rows of kv_b_proj get d_h^R zero rows (zero value dims), and o_proj gets zero
    input columns for them (they add nothing to the output)."""
    h, nope, v = hf_cfg["num_attention_heads"], hf_cfg["qk_nope_head_dim"], hf_cfg["v_head_dim"]
    pad = nope + hf_cfg["qk_rope_head_dim"] - v
    out = dict(state)
    for name, w in state.items():
        if name.endswith("self_attn.kv_b_proj.weight"):  # rows per head: [k_nope (nope); v (v)]
            w = w.reshape(h, nope + v, -1)
            out[name] = torch.cat([w, w.new_zeros(h, pad, w.shape[-1])], 1).reshape(h * (nope + v + pad), -1)
        elif name.endswith("self_attn.o_proj.weight"):  # input columns per head: [v (v)]
            w = w.reshape(w.shape[0], h, v)
            out[name] = torch.cat([w, w.new_zeros(w.shape[0], h, pad)], 2).reshape(w.shape[0], h * (v + pad))
    return {**hf_cfg, "v_head_dim": v + pad}, out


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
