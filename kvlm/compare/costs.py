"""The cost side of a comparison, where it means something: KV bytes per token per cache dtype, cache memory at
a stated deployment point, and decode time projected at a realistic model size on named hardware.

- ``kv_bytes_by_dtype(cfg)``: bytes per token of every layer's ``cache_spec()`` at fp32 / bf16 / int8. int8
  stores one byte per element plus one fp32 scale per cached vector (per token and per leading row of each
  tensor, e.g. per head of MHA's k), the symmetric per-token layout kvlm's quantized cache describes.
- ``at_reference_size(cfg)``: the same mechanism at the bench reference size (``kvlm.bench.suites``:
  6 layers, d = 768, vocabulary 32,000): every width (d_model, head_dim, FFN, latent ranks, RoPE and gate
  widths) times d_ref / d, head counts and TPA ranks kept, so every ratio of the trained model is kept.
- ``project(cfgs, hardware, batch, context)``: ``kvlm.bench.costmodel.project_decode`` of each config,
  the per-operation roofline floor (bytes and FLOPs from the mechanism's own accounting): a lower bound on
  the decode step, not a measurement. Tiny trained models are overhead-bound, so their timings say nothing
  about KV cost; the projection at the reference size does.
"""

from __future__ import annotations

import math

from kvlm.bench.costmodel import Hardware, get_hardware, project_decode
from kvlm.bench.suites import REFERENCE_SHAPE
from kvlm.config import ConfigError, ModelConfig

KV_DTYPES = {"fp32": 4, "bf16": 2, "int8": 1}
HEADLINE_DTYPE = "bf16"  # how the papers and deployments count the cache
SCALE_BYTES = 4  # int8: one fp32 scale per cached vector
DEFAULT_DEPLOY = (8, 4096)  # batch, context: the bench reference point
DEFAULT_HARDWARE = ("cpu-measured", "h100")

# widths scaled with the model; head counts (n_head, n_kv_head, rope_kv_heads) and ranks that count factors
# (tpa_q_rank, tpa_kv_rank) are kept, as are the number of latent groups a mechanism's name fixes
_WIDTHS = ("head_dim", "kv_lora_rank", "q_lora_rank", "kv_emb_dim")


def kv_bytes_by_dtype(cfg: ModelConfig) -> dict[str, int]:
    """{dtype: KV bytes per token, all layers} for fp32, bf16 and int8 (int8 with its per-vector scales)."""
    out = {}
    for name, nbytes in KV_DTYPES.items():
        total = 0
        for layer in range(cfg.n_layer):
            for shape in cfg.cache_spec(layer).values():
                total += math.prod(shape) * nbytes
                if name == "int8":  # one scale per leading row (per head), per token
                    total += math.prod(shape[:-1]) * SCALE_BYTES
        out[name] = total
    return out


def cache_bytes(kv_bytes_per_token: int, batch: int, context: int) -> int:
    """The cache of ``batch`` sequences of ``context`` tokens."""
    return kv_bytes_per_token * batch * context


def at_reference_size(cfg: ModelConfig, context: int = DEFAULT_DEPLOY[1]) -> ModelConfig:
    """``cfg`` grown to the bench reference size with every ratio kept (module docstring)."""
    d_ref = REFERENCE_SHAPE["d_model"]
    k = d_ref / cfg.d_model
    changes: dict = {
        "d_model": d_ref,
        "n_layer": REFERENCE_SHAPE["n_layer"],
        "vocab_size": REFERENCE_SHAPE["vocab_size"],
        "max_seq_len": max(cfg.max_seq_len, context + 1),
        "eg_group_size": 1 if REFERENCE_SHAPE["n_layer"] % cfg.eg_group_size else cfg.eg_group_size,
    }
    for f in _WIDTHS:
        v = getattr(cfg, f)
        if v:
            changes[f] = max(1, round(v * k))
    if cfg.rope_head_dim:  # RoPE rotates pairs: keep it even
        changes["rope_head_dim"] = max(2, 2 * round(cfg.rope_head_dim * k / 2))
    if cfg.ffn_dim:
        changes["ffn_dim"] = max(8, 8 * round(cfg.ffn_dim * k / 8))
    try:
        return cfg.replace(**changes, note=f"{cfg.note} (widths x{k:g} to the bench reference size)".strip())
    except ConfigError as e:
        raise ConfigError(f"cannot scale {cfg.attention} to the reference size (widths x{k:g}): {e}") from e


def hardware_list(names: list[str], threads: int | None = None) -> list[Hardware]:
    """Hardware by name (``kvlm.bench.costmodel``: cpu-measured, h100, a100, ...); cpu-measured measures now."""
    if not names:
        raise ConfigError("give at least one hardware name (e.g. cpu-measured,h100)")
    return [get_hardware(n, threads) for n in names]


def project(cfg: ModelConfig, hardware: list[Hardware], batch: int, context: int) -> dict[str, dict]:
    """{hardware name: {ms_per_step, ms_per_token, tokens_per_s, dtype, bound}} of one config's decode floor.
    The cache is stored in the dtype the hardware decodes in (bf16 on GPUs, fp32 on this CPU)."""
    out = {}
    for hw in hardware:
        p = project_decode(cfg, hw, batch, context)
        top, op = max(p["operations"].items(), key=lambda kv: kv[1]["floor_ms"])
        out[hw.name] = {
            "ms_per_step": p["ms_per_step"],
            "ms_per_token": p["ms_per_token"],
            "tokens_per_s": p["tokens_per_s"],
            "dtype": p["dtype"],
            "mostly": f"{top} ({op['bound']}-bound)",
            "attention_share": p["operations"]["attention"]["share"],
        }
    return out
