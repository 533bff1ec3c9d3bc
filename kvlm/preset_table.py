"""Named model configurations that reproduce the papers, plus FFN-width matching.

Families (``families()``), names as ``family/variant``:

- ``mlra-2.9b/<v>``: mlra.md Appendix F.1 Tables 7-17 (v = mha mqa gqa mla mfa tpa gla-2 gla-4 gta mlra-2
  mlra-4), ``<v>-gated`` Tables 33-37 (gqa mla gla-2 mlra-2 mlra-4), ``<v>-2xheads`` Tables 30-32 (gqa mla
  gla-2). Llama-3 blocks, 24 layers, d = 3072, h = 24, d_h = 128, GPT-2 vocabulary padded to 50,304, tied
  embeddings, zero-initialised output projections (Sec. 4.2.1), latent scaling for MLA/GLA/MLRA (Sec. 3.3).
  The other ablations are overrides: ``get_preset("mlra-2.9b/mla", latent_scaling=False)`` (Tables 27-29),
  ``zero_init_out=False`` (Tables 18-26).
- ``mlra-table1/<v>``: one attention layer of mlra.md Table 1 / Sec. 3.4 (64 heads, d_h = 128, d = 7168 as
  Kimi-K2; GQA/GTA g = 8, MLA/GLA/MLRA d_c = 4 d_h, d_h^R = d_h / 2, d'_c = 1536; TPA beta = 6 / 2; MFA one
  K/V head of 2 d_h). One layer because Table 1 counts per layer.
- ``eg-mla-base/<name>``: eg-mla.md Tables 7 and 10 at Base size (nanoGPT / GPT-2 blocks, 12 layers,
  d = 768, 12 heads of 64 (+64 RoPE), vocabulary 50,304): mha-base, mla-base, eg-mla-base-kv{256,128,64,16},
  eg-mla-base-emb{64,...,2048}, and the Table 3 ablations eg-mla-base-kv256-noln / -add.
- ``eg-mla-large/<name>``: the Large (12 x 2048) and XLarge (24 x 2048) rows of Tables 7, 11 and 13,
  including the layer-group sharing rows (``-lgz2/4/6``, Appendix H).
- ``small-lm/<config>[/<attention>]``: mla-small-lm.md Table 1 (6L-256d ... 12L-1024d; GPT-2 blocks, heads
  of 64, context 512, dropout 0.1). ``small-lm/6L-256d`` is the MHA baseline; ``.../mla-r<r>`` is MLA with
  separate K and V latents of rank r (the paper's Eqs. 2-3) and no RoPE, ``.../mla-rope-r<r>`` adds a
  decoupled RoPE key of d_h / 2, for r = d, d/2, ..., d/32 (Table 2's grid).
- ``tiny/<v>``: every mechanism at ~2.5 M parameters (4 layers, d = 192, 8 heads of 24, vocabulary 4096,
  context 256) for CPU experiments; the FFN width of each is matched to tiny/mha as mlra.md Appendix F does.

``match_ffn_dim(cfg, reference)`` picks the FFN width whose parameter count is closest to the reference's.
"""

from __future__ import annotations

import difflib
import functools
import json
import math
from collections.abc import Callable
from typing import Any

from kvlm.config import ConfigError, ModelConfig
from kvlm.model import count_parameters

# --------------------------------------------------------------------------------------------------
# FFN width matching (mlra.md Sec. 4.1: "we adjust the FFN intermediate dimension to match the total
# number of parameters of this MHA baseline")
# --------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=512)
def _count_cached(key: str) -> dict[str, int]:
    return count_parameters(ModelConfig.from_dict(json.loads(key)))


def count_parameters_cached(cfg: ModelConfig) -> dict[str, int]:
    """``count_parameters(cfg)``, memoised by the config's fields (FFN matching counts the same models often)."""
    return dict(_count_cached(json.dumps(cfg.to_dict(), sort_keys=True)))


def match_ffn_dim(
    cfg: ModelConfig,
    reference: ModelConfig | str,
    multiple: int = 8,
    key: str = "activated",
) -> ModelConfig:
    """A copy of cfg whose ffn_dim (a multiple of ``multiple``) makes count_parameters(cfg)[key] closest to
    the reference's (ties: the smaller width). ``key="activated"`` (the default) equals "total" except for
    eg-mla, whose per-layer token tables are matched out, as eg-mla.md compares at equal activated size.

    With multiple=8 this reproduces every d_f of mlra.md Tables 7-17 and 30-37 from the MHA baseline."""
    if isinstance(reference, str):
        reference = get_preset(reference)
    if multiple <= 0:
        raise ConfigError(f"multiple must be positive, got {multiple}")
    target = count_parameters_cached(reference)[key]
    here = count_parameters_cached(cfg)[key]
    # FFN parameters are affine in d_f and every layer has its own FFN, so the slope is n_layer times that
    # of a one-layer model (cheap to count even for the 2.9B presets).
    one = cfg.replace(n_layer=1, eg_group_size=1)
    a, b = multiple, 2 * multiple
    slope = (
        (
            count_parameters_cached(one.replace(ffn_dim=b))[key]
            - count_parameters_cached(one.replace(ffn_dim=a))[key]
        )
        // (b - a)
        * cfg.n_layer
    )
    if slope <= 0:
        raise ConfigError("the FFN has no parameters to adjust")
    exact = cfg.ffn_dim + (target - here) / slope
    lo = math.floor(exact / multiple) * multiple
    candidates = [d for d in (lo, lo + multiple) if d >= multiple]
    if not candidates:
        raise ConfigError(
            f"cannot match {reference.attention} parameters with {cfg.attention}: even ffn_dim={multiple} "
            f"gives {here + slope * (multiple - cfg.ffn_dim):,} > {target:,} ({key})"
        )
    best = min(candidates, key=lambda d: (abs(here + slope * (d - cfg.ffn_dim) - target), d))
    return cfg.replace(ffn_dim=best)


# --------------------------------------------------------------------------------------------------
# mlra.md: 2.9B models (Appendix F)
# --------------------------------------------------------------------------------------------------

_MLRA_29B = dict(
    arch="llama",
    n_layer=24,
    d_model=3072,
    n_head=24,
    head_dim=128,
    vocab_size=50304,
    max_seq_len=2048,
    tie_embeddings=True,
    # the authors' model files (github.com/SongtaoLiu0823/MLRA, model/*.py): Rotary(base=10000) and
    # RMSNorm(eps=1e-6) in every one, whatever the paper's "Llama-3" blocks suggest
    rope_theta=10000.0,
    norm_eps=1e-6,
    zero_init_out=True,  # Sec. 4.2.1: zero-initialised W^{O,attn}, W^{O,mlp} for all models
    init_std=0.02,
)
# MLA: d'_c = 12 d_h, d_c = 4 d_h, d_h^R = d_h / 2; GLA / MLRA: d'_c = 8 d_h (Appendix F.1)
_MLA_DIMS = dict(q_lora_rank=1536, kv_lora_rank=512, rope_head_dim=64, latent_scaling=True)
_GLA_DIMS = dict(q_lora_rank=1024, kv_lora_rank=512, rope_head_dim=64, latent_scaling=True)

# name -> (attention, overrides, d_f, source). d_f typed from the tables; tests check that match_ffn_dim
# derives the same width and that the parameter counts equal the tables' "# Parameters".
_MLRA_29B_ROWS: dict[str, tuple[str, dict, int, str]] = {
    "mha": ("mha", {}, 8192, "Table 7"),
    "mqa": ("mqa", {}, 10152, "Table 8"),
    "gqa": ("gqa", {"n_kv_head": 6}, 9728, "Table 9"),
    "mla": ("mla", _MLA_DIMS, 9448, "Table 10"),
    "mfa": ("mfa", {"n_kv_head": 1, "head_dim": 256, "q_lora_rank": 2048}, 8024, "Table 11"),
    "tpa": ("tpa", {"tpa_q_rank": 6, "tpa_kv_rank": 2}, 10760, "Table 12"),
    "gla-2": ("gla-2", _GLA_DIMS, 10048, "Table 13"),
    "gla-4": ("gla-4", _GLA_DIMS, 10136, "Table 14"),
    "gta": ("gta", {"n_kv_head": 6, "rope_head_dim": 64}, 9960, "Table 15"),
    "mlra-2": ("mlra-2", {**_GLA_DIMS, "attn_out_scaling": True}, 10048, "Table 16"),
    "mlra-4": ("mlra-4", {**_GLA_DIMS, "attn_out_scaling": True}, 9880, "Table 17"),
    # F.5 gated attention (Appendix E): sigmoid gate before W^O, FFN shrunk to keep the budget
    "gqa-gated": ("gqa", {"n_kv_head": 6, "gated": True}, 8704, "Table 33"),
    "mla-gated": ("mla", {**_MLA_DIMS, "gated": True}, 8424, "Table 34"),
    "gla-2-gated": ("gla-2", {**_GLA_DIMS, "gated": True}, 9024, "Table 35"),
    "mlra-2-gated": ("mlra-2", {**_GLA_DIMS, "attn_out_scaling": True, "gated": True}, 9024, "Table 36"),
    "mlra-4-gated": ("mlra-4", {**_GLA_DIMS, "attn_out_scaling": True, "gated": True}, 8856, "Table 37"),
    # F.4 double heads: h = 48 at the same KV cache
    "gqa-2xheads": ("gqa", {"n_kv_head": 6, "n_head": 48}, 7680, "Table 30"),
    "mla-2xheads": ("mla", {**_MLA_DIMS, "n_head": 48}, 7320, "Table 31"),
    "gla-2-2xheads": ("gla-2", {**_GLA_DIMS, "n_head": 48}, 8344, "Table 32"),
}


def _mlra_29b(row: str) -> ModelConfig:
    attention, overrides, ffn_dim, table = _MLRA_29B_ROWS[row]
    kw = {**_MLRA_29B, **overrides}
    return ModelConfig(attention=attention, ffn_dim=ffn_dim, note=f"mlra.md {table} (2.9B)", **kw)


# --------------------------------------------------------------------------------------------------
# mlra.md Table 1 / Sec. 3.4: KV loading per device (Qwen3-32B / Kimi-K2 shapes)
# --------------------------------------------------------------------------------------------------

_TABLE1 = dict(
    arch="llama", n_layer=1, d_model=7168, n_head=64, head_dim=128, vocab_size=50304, max_seq_len=4096
)
_TABLE1_LATENT = dict(q_lora_rank=1536, kv_lora_rank=512, rope_head_dim=64)
_TABLE1_ROWS: dict[str, tuple[str, dict]] = {
    "mha": ("mha", {}),
    "mqa": ("mqa", {}),
    "gqa": ("gqa", {"n_kv_head": 8}),
    "mla": ("mla", _TABLE1_LATENT),
    "mfa": ("mfa", {"n_kv_head": 1, "head_dim": 256, "q_lora_rank": 1536}),  # K, V of 2 d_h: 4 d_h
    "tpa": ("tpa", {"tpa_q_rank": 6, "tpa_kv_rank": 2}),
    "gla-2": ("gla-2", _TABLE1_LATENT),
    "gla-4": ("gla-4", _TABLE1_LATENT),  # not a Table 1 row; for comparison
    "gta": ("gta", {"n_kv_head": 8, "rope_head_dim": 64}),
    "mlra-2": ("mlra-2", {**_TABLE1_LATENT, "attn_out_scaling": True}),
    "mlra-4": ("mlra-4", {**_TABLE1_LATENT, "attn_out_scaling": True}),
}


def _table1(row: str) -> ModelConfig:
    attention, overrides = _TABLE1_ROWS[row]
    return ModelConfig(
        attention=attention,
        note="mlra.md Table 1 (one layer, 64 heads, d_h = 128)",
        **{**_TABLE1, **overrides},
    )


# --------------------------------------------------------------------------------------------------
# eg-mla.md Appendix A (Table 7), F (Table 10), G (Table 11), H (Table 13)
# --------------------------------------------------------------------------------------------------

# nanoGPT: GPT-2 blocks (LayerNorm, GELU MLP of 4 d, learned positions), vocabulary padded to 50,304 (the
# Embed Size column of Tables 2, 7 and 10 is 12 * 50,304 * kv_emb_dim, truncated to millions).
_EG_BASE = dict(
    arch="gpt2",
    n_layer=12,
    d_model=768,
    n_head=12,
    head_dim=64,
    vocab_size=50304,
    max_seq_len=1024,
    bias=False,
)
# "qk_head_dim / v_head_dim = 64+64 / 64": NoPE 64 + decoupled RoPE 64; q_lora_rank 0 (plain W_Q)
_EG_LATENT = dict(q_lora_rank=0, rope_head_dim=64)
_EG_BASE_ROWS: dict[str, tuple[str, dict]] = {
    "mha-base": ("mha", {"rope": False}),
    "mla-base": ("mla", {**_EG_LATENT, "kv_lora_rank": 256}),
    **{
        f"eg-mla-base-kv{kv}": ("eg-mla", {**_EG_LATENT, "kv_lora_rank": kv, "kv_emb_dim": 256})
        for kv in (256, 128, 64, 16)
    },
    **{
        f"eg-mla-base-emb{e}": ("eg-mla", {**_EG_LATENT, "kv_lora_rank": 64, "kv_emb_dim": e})
        for e in (64, 128, 256, 512, 1024, 2048)
    },
    # Table 3 ablations of EG-MLA-Base-kv256
    "eg-mla-base-kv256-noln": (
        "eg-mla",
        {**_EG_LATENT, "kv_lora_rank": 256, "kv_emb_dim": 256, "eg_norm": False},
    ),
    "eg-mla-base-kv256-add": (
        "eg-mla",
        {**_EG_LATENT, "kv_lora_rank": 256, "kv_emb_dim": 256, "eg_op": "add"},
    ),
}

# Large: 12 x 2048, XLarge: 24 x 2048; "128+64 / 128" -> 16 heads of 128 (+64 RoPE). Table 7's Large rows
# are garbled (274M / 154M, 12/768/512); Tables 11-14 (951M / 961M, 309M embed) fix them at 12 x 2048.
_EG_LARGE = dict(
    arch="gpt2",
    d_model=2048,
    n_head=16,
    head_dim=128,
    vocab_size=50304,
    bias=False,
    q_lora_rank=0,
    rope_head_dim=64,
)
_L = dict(n_layer=12, max_seq_len=2048)
_XL = dict(n_layer=24, max_seq_len=4096)
_EG_LARGE_ROWS: dict[str, tuple[str, dict]] = {
    "mla-large-kv512": ("mla", {**_L, "kv_lora_rank": 512}),
    "eg-mla-large-kv128emb512": ("eg-mla", {**_L, "kv_lora_rank": 128, "kv_emb_dim": 512}),
    "eg-mla-large-kv256emb512": ("eg-mla", {**_L, "kv_lora_rank": 256, "kv_emb_dim": 512}),
    **{
        f"eg-mla-large-kv256emb512-lgz{g}": (
            "eg-mla",
            {**_L, "kv_lora_rank": 256, "kv_emb_dim": 512, "eg_group_size": g},
        )
        for g in (2, 4, 6)
    },
    "mla-xlarge-kv512": ("mla", {**_XL, "kv_lora_rank": 512}),
    "eg-mla-xlarge-kv128emb512": ("eg-mla", {**_XL, "kv_lora_rank": 128, "kv_emb_dim": 512}),
}


def _eg_base(row: str) -> ModelConfig:
    attention, overrides = _EG_BASE_ROWS[row]
    return ModelConfig(
        attention=attention, note=f"eg-mla.md {row} (Tables 7, 10)", **{**_EG_BASE, **overrides}
    )


def _eg_large(row: str) -> ModelConfig:
    attention, overrides = _EG_LARGE_ROWS[row]
    return ModelConfig(
        attention=attention, note=f"eg-mla.md {row} (Tables 7, 11, 13)", **{**_EG_LARGE, **overrides}
    )


# --------------------------------------------------------------------------------------------------
# mla-small-lm.md Table 1 (configs) x Table 2 (attention grid)
# --------------------------------------------------------------------------------------------------

_SMALL_LM_CONFIGS = {  # config -> (n_layer, d_model); the paper gives no head count: heads of 64 (GPT-2)
    "6L-256d": (6, 256),
    "6L-512d": (6, 512),
    "9L-256d": (9, 256),
    "9L-512d": (9, 512),
    "12L-256d": (12, 256),
    "12L-512d": (12, 512),
    "12L-768d": (12, 768),
    "12L-1024d": (12, 1024),
}
_SMALL_LM_DIVISORS = (1, 2, 4, 8, 16, 32)  # r = d / divisor


def _small_lm_variants(d: int) -> list[str]:
    out = ["mha"]
    for rope in (False, True):
        out += [f"mla{'-rope' if rope else ''}-r{d // k}" for k in _SMALL_LM_DIVISORS]
    return out


def _small_lm(config: str, variant: str) -> ModelConfig:
    n_layer, d = _SMALL_LM_CONFIGS[config]
    # GPT-2 tokenizer (50,257), tied softmax, context 512, dropout 0.1 (Sec. 4.1); nanoGPT keeps biases
    base = dict(
        arch="gpt2",
        n_layer=n_layer,
        d_model=d,
        n_head=d // 64,
        vocab_size=50257,
        max_seq_len=512,
        dropout=0.1,
        bias=True,
        tie_embeddings=True,
    )
    note = f"mla-small-lm.md {config} (Table 1), {variant}"
    if variant == "mha":
        return ModelConfig(attention="mha", rope=False, note=note, **base)
    rope = variant.startswith("mla-rope-")
    r = int(variant.rsplit("-r", 1)[1])
    return ModelConfig(
        attention="mla",
        kv_lora_rank=r,
        kv_latent="separate",
        q_lora_rank=0,
        rope=rope,
        rope_head_dim=32 if rope else 0,
        note=note,
        **base,
    )


# --------------------------------------------------------------------------------------------------
# tiny: every mechanism on 2 CPU cores
# --------------------------------------------------------------------------------------------------

# d = 192, 8 heads of d_h = 24 (8 heads so GLA-4's four groups and MLRA-2's halves divide); the latent sizes
# keep the 2.9B ratios: d_c = 4 d_h, d_h^R = d_h / 2, d'_c = d / 2 (MLA) or d / 3 (GLA, MLRA), g = h / 4.
_TINY = dict(arch="llama", n_layer=4, d_model=192, n_head=8, head_dim=24, vocab_size=4096, max_seq_len=256)
_TINY_MLA = dict(q_lora_rank=96, kv_lora_rank=96, rope_head_dim=12, latent_scaling=True)
_TINY_GLA = dict(q_lora_rank=64, kv_lora_rank=96, rope_head_dim=12, latent_scaling=True)
_TINY_ROWS: dict[str, tuple[str, dict]] = {
    "mha": ("mha", {}),
    "mqa": ("mqa", {}),
    "gqa": ("gqa", {"n_kv_head": 2}),
    "mla": ("mla", _TINY_MLA),
    "mla-norope": ("mla", {**_TINY_MLA, "rope": False}),
    # eg-mla.md's recommended pairing, scaled: kv64 against MLA's kv256 (d_c / 4), kv_emb_dim = d / 3
    "eg-mla": ("eg-mla", {"q_lora_rank": 0, "kv_lora_rank": 24, "rope_head_dim": 12, "kv_emb_dim": 64}),
    "mlra-2": ("mlra-2", {**_TINY_GLA, "attn_out_scaling": True}),
    "mlra-4": ("mlra-4", {**_TINY_GLA, "attn_out_scaling": True}),
    "gla-2": ("gla-2", _TINY_GLA),
    "gla-4": ("gla-4", _TINY_GLA),
    "gta": ("gta", {"n_kv_head": 2, "rope_head_dim": 12}),
    "mfa": ("mfa", {"n_kv_head": 1, "head_dim": 48, "q_lora_rank": 128}),  # one K/V head of 2 d_h
    "tpa": ("tpa", {"tpa_q_rank": 6, "tpa_kv_rank": 2}),
}


@functools.lru_cache(maxsize=64)
def _tiny_ffn(row: str) -> int:
    base = _tiny_unmatched(row)
    if row == "mha":
        return base.ffn_dim
    return match_ffn_dim(base, _tiny_unmatched("mha")).ffn_dim


def _tiny_unmatched(row: str) -> ModelConfig:
    attention, overrides = _TINY_ROWS[row]
    return ModelConfig(attention=attention, **{**_TINY, **overrides})


def _tiny(row: str) -> ModelConfig:
    return _tiny_unmatched(row).replace(
        ffn_dim=_tiny_ffn(row), note=f"tiny/{row}: CPU-sized, FFN width matched to tiny/mha"
    )


# --------------------------------------------------------------------------------------------------
# the registry of names
# --------------------------------------------------------------------------------------------------


def _builders() -> dict[str, tuple[str, Callable[[], ModelConfig]]]:
    """name -> (family, builder); building is lazy so that listing needs no mechanism."""
    out: dict[str, tuple[str, Callable[[], ModelConfig]]] = {}
    for row in _MLRA_29B_ROWS:
        out[f"mlra-2.9b/{row}"] = ("mlra-2.9b", functools.partial(_mlra_29b, row))
    for row in _TABLE1_ROWS:
        out[f"mlra-table1/{row}"] = ("mlra-table1", functools.partial(_table1, row))
    for row in _EG_BASE_ROWS:
        out[f"eg-mla-base/{row}"] = ("eg-mla-base", functools.partial(_eg_base, row))
    for row in _EG_LARGE_ROWS:
        out[f"eg-mla-large/{row}"] = ("eg-mla-large", functools.partial(_eg_large, row))
    for config, (_, d) in _SMALL_LM_CONFIGS.items():
        for variant in _small_lm_variants(d):
            out[f"small-lm/{config}/{variant}"] = ("small-lm", functools.partial(_small_lm, config, variant))
    for row in _TINY_ROWS:
        out[f"tiny/{row}"] = ("tiny", functools.partial(_tiny, row))
    return out


_BUILDERS = _builders()
# short names: small-lm/<config> is its MHA baseline
_ALIASES = {f"small-lm/{c}": f"small-lm/{c}/mha" for c in _SMALL_LM_CONFIGS}
_LOWER = {n.lower(): n for n in [*_BUILDERS, *_ALIASES]}


def presets() -> list[str]:
    """Every name ``get_preset`` accepts (canonical names, then short aliases)."""
    return [*_BUILDERS, *_ALIASES]


def families() -> dict[str, list[str]]:
    """family -> its canonical preset names, in table order."""
    out: dict[str, list[str]] = {}
    for name, (family, _) in _BUILDERS.items():
        out.setdefault(family, []).append(name)
    return out


def canonical_name(name: str) -> str:
    """The canonical spelling of a preset name (case-insensitive; aliases resolved)."""
    key = _LOWER.get(name.strip().lower())
    if key is None:
        raise ConfigError(_unknown_message(name))
    return _ALIASES.get(key, key)


def get_preset(name: str, **overrides: Any) -> ModelConfig:
    """A fresh ModelConfig for a preset name (see the module docstring for the families), with ``overrides``
    applied as ``ModelConfig.replace`` applies them."""
    cfg = _BUILDERS[canonical_name(name)][1]()
    return cfg.replace(**overrides) if overrides else cfg


def family_of(name: str) -> str:
    return _BUILDERS[canonical_name(name)][0]


def _unknown_message(name: str) -> str:
    names = presets()
    close = difflib.get_close_matches(name, names, n=5, cutoff=0.5)
    if not close:
        close = difflib.get_close_matches(name.lower(), [n.lower() for n in names], n=5, cutoff=0.4)
        close = [_LOWER[c] for c in close]
    fams = ", ".join(families())
    hint = f"; did you mean: {', '.join(close)}" if close else ""
    return f"unknown preset {name!r}{hint} (families: {fams}; see kvlm.presets())"


__all__ = [
    "canonical_name",
    "count_parameters_cached",
    "families",
    "family_of",
    "get_preset",
    "match_ffn_dim",
    "presets",
]
