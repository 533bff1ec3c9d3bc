"""kvlm MLA <-> transformers' own ``DeepseekV3ForCausalLM`` (model_type "deepseek_v3"), the format vLLM and SGLang
serve: ``kvlm export-hf CKPT OUT --format deepseek-v3`` and ``kvlm import-hf`` of a DeepseekV3 folder.

Every layer is dense (``first_k_dense_replace = num_hidden_layers``, no experts, no MTP layer). Weight names map
one to one (kvlm uses DeepSeek's own inference names)::

    wq | wq_a, q_norm, wq_b    ->  q_proj | q_a_proj, q_a_layernorm, q_b_proj
    wkv_a, kv_norm, wkv_b, wo  ->  kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj
    mlp.w1, w2, wo             ->  mlp.gate_proj, up_proj, down_proj

What differs, and how it is carried over exactly:

- RoPE layout. kvlm rotates the d_h^R RoPE dims as two halves (pair a = dims a and a + d_h^R/2, Llama's
  ``rotate_half``); DeepSeek's checkpoints pair adjacent dims (2a, 2a + 1) and transformers follows them with
  ``rope_interleave=True``, as vLLM / SGLang always do. The RoPE rows of the query (per head) and of k^R in
  ``kv_a_proj_with_mqa`` are permuted (``ROPE_TO_INTERLEAVED``); attention scores are unchanged since q and k
  are permuted alike.
- The latent RMSNorms (q_a_layernorm, kv_a_layernorm) use eps 1e-6 in transformers, whatever rms_norm_eps is
  (kvlm's use cfg.norm_eps). RMSNorm_eps(W x) = RMSNorm_{s^2 eps}(s W x), so the rows of the projection feeding the
  norm are scaled by s = sqrt(1e-6 / eps) (exact up to float rounding).
- latent_scaling's alpha_q, alpha_kv multiply the normalised latent: folded into the norm weights.
- latent_norm = False (kvlm's conversions, ``import-hf --mla``, make no latent norms; the format always has
  them): the norm is made an identity. The projection feeding it is scaled by s = 2^-30 (a power of two:
  exact) and the norm weight is sqrt(1e-6) / s, so RMSNorm(s y) w = y / sqrt(1 + s^2 mean(y^2) / 1e-6): the
  latent y is kept to a relative 5e-13 mean(y^2) (4e-7 for latents of RMS 1000). The tiny and huge values fit
  float32 and bfloat16, not float16 (refused).

What the format cannot hold is refused (``FormatError`` naming the option): another mechanism than "mla",
rope_kv_heads > 1 (the format has one shared k^R), separate latents, rope_head_dim = 0 or rope = False, bias = True (kvlm's bias covers every projection, DeepseekV3's
only q_a/kv_a/o), gated outputs, arch "gpt2". The import refuses MoE layers, MTP-only weights are dropped, and
RoPE scaling (YaRN) or v_head_dim != qk_nope_head_dim are refused.
"""

from __future__ import annotations

import math

import torch

from kvlm.config import ModelConfig

MODEL_TYPE = "deepseek_v3"
HF_LATENT_EPS = 1e-6  # DeepseekV3RMSNorm's default, used by q_a_layernorm and kv_a_layernorm
_MLP = {"mlp.w1": "mlp.gate_proj", "mlp.w2": "mlp.up_proj", "mlp.wo": "mlp.down_proj"}
_NORMS = {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"}


class FormatError(ValueError):
    """A model (or a source folder) that the target format cannot represent; the message names the option."""


def rope_to_interleaved(dim: int) -> torch.Tensor:
    """Row order taking kvlm's half-split RoPE dims to DeepSeek's interleaved pairs: new[j] = old[perm[j]]."""
    half = dim // 2
    return torch.stack([torch.arange(half), torch.arange(half) + half], dim=1).reshape(-1)


def _permute_rope_rows(w: torch.Tensor, heads: int, nope: int, rope: int, inverse: bool) -> torch.Tensor:
    """Per head [nope; rope] rows: the rope rows permuted to (or, ``inverse``, from) the interleaved layout."""
    perm = rope_to_interleaved(rope)
    if inverse:
        perm = torch.argsort(perm)
    shape = w.shape
    w = w.reshape(heads, nope + rope, *shape[1:])
    w = torch.cat([w[:, :nope], w[:, nope:][:, perm]], dim=1)
    return w.reshape(shape)


def check_exportable(cfg: ModelConfig) -> None:
    """Raise FormatError naming the first option of ``cfg`` that DeepseekV3's format cannot represent."""
    problems = [
        (cfg.attention != "mla", f"attention={cfg.attention!r} (only 'mla' maps to DeepseekV3's attention)"),
        (cfg.arch != "llama", f"arch={cfg.arch!r} (DeepseekV3 is RMSNorm + SwiGLU + RoPE)"),
        (
            not cfg.rope or not cfg.rope_head_dim,
            "rope=False or rope_head_dim=0 (DeepseekV3 needs a k_rope part)",
        ),
        (
            cfg.rope_kv_heads != 1,
            f"rope_kv_heads={cfg.rope_kv_heads} (DeepseekV3 has one shared k_rope head)",
        ),
        (cfg.kv_latent != "joint", f"kv_latent={cfg.kv_latent!r} (DeepseekV3 has one joint latent)"),
        (cfg.bias, "bias=True (DeepseekV3 has biases only on q_a/kv_a/o projections)"),
        (cfg.gated, "gated=True (DeepseekV3 has no attention output gate)"),
    ]
    for bad, what in problems:
        if bad:
            raise FormatError(f"cannot export to deepseek-v3: {what}")


IDENTITY_NORM_SCALE = 2.0**-30  # s of the identity-norm fold (latent_norm = False)


def check_dtype(cfg: ModelConfig, dtype) -> None:
    """The identity-norm fold needs float32's or bfloat16's exponent range."""
    if not cfg.latent_norm and dtype == torch.float16:
        raise FormatError(
            "cannot export to deepseek-v3 in float16: latent_norm=False is folded into DeepseekV3's latent "
            "norms with weights beyond float16's range; use float32 or bfloat16"
        )


def _norm_fold(cfg: ModelConfig) -> tuple[float, float]:
    """(scale of the rows feeding a latent norm, factor of its weight) for the eps or identity fold."""
    if cfg.latent_norm:
        return math.sqrt(HF_LATENT_EPS / cfg.norm_eps), 1.0
    return IDENTITY_NORM_SCALE, math.sqrt(HF_LATENT_EPS) / IDENTITY_NORM_SCALE


def hf_config(cfg: ModelConfig) -> dict:
    """DeepseekV3Config keyword arguments for a kvlm MLA config (every layer dense)."""
    check_exportable(cfg)
    return dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.d_model,
        intermediate_size=cfg.ffn_dim,
        num_hidden_layers=cfg.n_layer,
        num_attention_heads=cfg.n_head,
        num_key_value_heads=cfg.n_head,
        kv_lora_rank=cfg.kv_lora_rank,
        q_lora_rank=cfg.q_lora_rank or None,
        qk_rope_head_dim=cfg.rope_head_dim,
        qk_nope_head_dim=cfg.head_dim,
        v_head_dim=cfg.head_dim,
        first_k_dense_replace=cfg.n_layer,  # no MoE layer
        n_routed_experts=1,
        n_shared_experts=1,
        num_experts_per_tok=1,
        n_group=1,
        topk_group=1,
        num_mtp_layers=0,
        hidden_act="silu",
        max_position_embeddings=cfg.max_seq_len,
        rms_norm_eps=cfg.norm_eps,
        tie_word_embeddings=cfg.tie_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        rope_interleave=True,
        attention_bias=False,
    )


def _alphas(cfg: ModelConfig) -> tuple[float, float]:
    d = cfg.d_model
    if not cfg.latent_scaling:
        return 1.0, 1.0
    return (math.sqrt(d / cfg.q_lora_rank) if cfg.q_lora_rank else 1.0), math.sqrt(d / cfg.kv_lora_rank)


def to_hf_state(cfg: ModelConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """kvlm MLA state dict -> DeepseekV3ForCausalLM state dict (see the module docstring for the folds)."""
    check_exportable(cfg)
    h, dh, dr, dc = cfg.n_head, cfg.head_dim, cfg.rope_head_dim, cfg.kv_lora_rank
    s, g = _norm_fold(cfg)
    alpha_q, alpha_kv = _alphas(cfg)
    ones = lambda n: torch.ones(n, dtype=state["embed.weight"].dtype)  # noqa: E731  (no kvlm norm: identity)
    perm = rope_to_interleaved(dr)
    out = {"model.embed_tokens.weight": state["embed.weight"], "model.norm.weight": state["norm.weight"]}
    out["lm_head.weight"] = state["lm_head.weight"] if "lm_head.weight" in state else state["embed.weight"]
    for i in range(cfg.n_layer):
        p, q = f"layers.{i}.", f"model.layers.{i}."
        a, b = p + "attn.", q + "self_attn."
        for mine, theirs in _NORMS.items():
            out[f"{q}{theirs}.weight"] = state[f"{p}{mine}.weight"]
        for mine, theirs in _MLP.items():
            out[f"{q}{theirs}.weight"] = state[f"{p}{mine}.weight"]
        if cfg.q_lora_rank:
            out[b + "q_a_proj.weight"] = state[a + "wq_a.weight"] * s
            q_norm = state[a + "q_norm.weight"] if cfg.latent_norm else ones(cfg.q_lora_rank)
            out[b + "q_a_layernorm.weight"] = q_norm * (alpha_q * g)
            out[b + "q_b_proj.weight"] = _permute_rope_rows(state[a + "wq_b.weight"], h, dh, dr, False)
        else:
            out[b + "q_proj.weight"] = _permute_rope_rows(state[a + "wq.weight"], h, dh, dr, False)
        w = state[a + "wkv_a.weight"]
        out[b + "kv_a_proj_with_mqa.weight"] = torch.cat([w[:dc] * s, w[dc:][perm]])
        kv_norm = state[a + "kv_norm.weight"] if cfg.latent_norm else ones(dc)
        out[b + "kv_a_layernorm.weight"] = kv_norm * (alpha_kv * g)
        out[b + "kv_b_proj.weight"] = state[a + "wkv_b.weight"]
        out[b + "o_proj.weight"] = state[a + "wo.weight"]
    return {k: v.detach().clone().contiguous() for k, v in out.items()}


# --- import ------------------------------------------------------------------------------------------------
def _get(hf_cfg, name, default=None):
    return hf_cfg.get(name, default) if isinstance(hf_cfg, dict) else getattr(hf_cfg, name, default)


def kvlm_config(hf_cfg, max_seq_len: int | None = None) -> ModelConfig:
    """transformers DeepseekV3Config (or its dict) -> kvlm MLA ModelConfig; FormatError for what kvlm lacks."""
    get = lambda name, default=None: _get(hf_cfg, name, default)  # noqa: E731
    if get("model_type") != MODEL_TYPE:
        raise FormatError(f"model_type {get('model_type')!r} is not {MODEL_TYPE!r}")
    n_layer = get("num_hidden_layers")
    dense = get("first_k_dense_replace") or 0
    if dense < n_layer and (get("n_routed_experts") or 0) > 0:
        raise FormatError(
            f"layers {dense}..{n_layer - 1} are mixture-of-experts (first_k_dense_replace={dense} < "
            f"num_hidden_layers={n_layer}); kvlm imports dense DeepseekV3 models only"
        )
    if get("hidden_act", "silu") != "silu":
        raise FormatError(f"hidden_act={get('hidden_act')!r}: kvlm's SwiGLU uses SiLU")
    if get("attention_bias", False):
        raise FormatError("attention_bias=True: kvlm's `bias` covers every projection, not q_a/kv_a/o only")
    rope = get("rope_parameters") or get("rope_scaling") or {}  # transformers 5 / 4.x names
    kind = rope.get("rope_type") or rope.get("type") or "default"
    if kind != "default":
        raise FormatError(f"RoPE scaling (rope_type {kind!r}) is not in kvlm's RotaryEmbedding")
    nope, v = get("qk_nope_head_dim"), get("v_head_dim")
    if v != nope:
        raise FormatError(f"v_head_dim={v} != qk_nope_head_dim={nope}: kvlm's MLA uses one head_dim for both")
    h = get("num_attention_heads")
    return ModelConfig(
        attention="mla",
        n_layer=n_layer,
        d_model=get("hidden_size"),
        n_head=h,
        n_kv_head=h,
        head_dim=nope,
        vocab_size=get("vocab_size"),
        max_seq_len=max_seq_len or get("max_position_embeddings"),
        arch="llama",
        ffn_dim=get("intermediate_size"),
        tie_embeddings=bool(get("tie_word_embeddings", False)),
        norm_eps=float(get("rms_norm_eps", 1e-6)),
        rope=True,
        rope_theta=float(rope.get("rope_theta") or get("rope_theta") or 10000.0),
        rope_head_dim=get("qk_rope_head_dim"),
        q_lora_rank=get("q_lora_rank") or 0,
        kv_lora_rank=get("kv_lora_rank"),
        note=f"imported from DeepseekV3 {get('_name_or_path') or ''}".strip(),
    )


def from_hf_state(cfg: ModelConfig, state: dict[str, torch.Tensor], interleaved: bool = True):
    """DeepseekV3ForCausalLM state dict -> kvlm MLA state dict (``to_hf_state`` inverted; ``interleaved``:
    the config's rope_interleave). Weights of MTP layers (index >= n_layer) are not part of the forward and are
    dropped."""
    h, dh, dr, dc = cfg.n_head, cfg.head_dim, cfg.rope_head_dim, cfg.kv_lora_rank
    t = math.sqrt(cfg.norm_eps / HF_LATENT_EPS)
    perm = torch.argsort(rope_to_interleaved(dr)) if interleaved else torch.arange(dr)
    unperm = lambda w: _permute_rope_rows(w, h, dh, dr, True) if interleaved else w  # noqa: E731
    out = {"embed.weight": state["model.embed_tokens.weight"], "norm.weight": state["model.norm.weight"]}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = state["lm_head.weight"]
    for i in range(cfg.n_layer):
        p, q = f"layers.{i}.", f"model.layers.{i}."
        a, b = p + "attn.", q + "self_attn."
        for mine, theirs in _NORMS.items():
            out[f"{p}{mine}.weight"] = state[f"{q}{theirs}.weight"]
        for mine, theirs in _MLP.items():
            if f"{q}{theirs}.weight" not in state:
                raise FormatError(f"layer {i} has no {theirs} (a mixture-of-experts layer?)")
            out[f"{p}{mine}.weight"] = state[f"{q}{theirs}.weight"]
        if cfg.q_lora_rank:
            out[a + "wq_a.weight"] = state[b + "q_a_proj.weight"] * t
            out[a + "q_norm.weight"] = state[b + "q_a_layernorm.weight"]
            out[a + "wq_b.weight"] = unperm(state[b + "q_b_proj.weight"])
        else:
            out[a + "wq.weight"] = unperm(state[b + "q_proj.weight"])
        w = state[b + "kv_a_proj_with_mqa.weight"]
        out[a + "wkv_a.weight"] = torch.cat([w[:dc] * t, w[dc:][perm]])
        out[a + "kv_norm.weight"] = state[b + "kv_a_layernorm.weight"]
        out[a + "wkv_b.weight"] = state[b + "kv_b_proj.weight"]
        out[a + "wo.weight"] = state[b + "o_proj.weight"]
    return {k: v.detach().float().clone().contiguous() for k, v in out.items()}


def import_deepseek_v3(hf_model, max_seq_len: int | None = None):
    """A transformers ``DeepseekV3ForCausalLM`` (dense layers) -> kvlm MLA model with the same logits
    (float32)."""
    from kvlm.model import build_model

    cfg = kvlm_config(hf_model.config, max_seq_len)
    interleaved = bool(getattr(hf_model.config, "rope_interleave", True))
    state = from_hf_state(cfg, dict(hf_model.state_dict()), interleaved=interleaved)
    model = build_model(cfg)
    expected = set(model.state_dict()) - ({"lm_head.weight"} if cfg.tie_embeddings else set())
    missing, extra = expected - set(state), set(state) - expected
    if missing or extra:
        raise FormatError(
            f"DeepseekV3 weights do not fit: missing {sorted(missing)[:4]}, extra {sorted(extra)[:4]}"
        )
    model.load_state_dict(state, strict=False)
    return model.eval()


def source_model_type(source) -> str | None:
    """model_type of a Hugging Face folder's config.json (None for a GGUF file or no readable config)."""
    import json
    from pathlib import Path

    path = Path(source) / "config.json"
    try:
        return json.loads(path.read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None


def check_source(source) -> None:
    """Refuse a DeepseekV3 folder kvlm cannot import (MoE layers, ...) before its weights are loaded."""
    import json
    from pathlib import Path

    if source_model_type(source) == MODEL_TYPE:
        kvlm_config(json.loads((Path(source) / "config.json").read_text()))


__all__ = [
    "FormatError",
    "MODEL_TYPE",
    "check_dtype",
    "check_exportable",
    "from_hf_state",
    "check_source",
    "hf_config",
    "import_deepseek_v3",
    "kvlm_config",
    "rope_to_interleaved",
    "source_model_type",
    "to_hf_state",
]
