"""KV-cache and parameter accounting: ``kv_table()`` (the ``kvlm kv-table`` command is kvlm.cli.kv_table).

Every number comes from the code that runs: cache sizes from the mechanism's ``cache_spec``, tensor-parallel
sharding from its ``tp_shards`` / ``tp_max_degree``, parameters from ``count_parameters`` (meta device).

Per-device KV loading under tensor parallelism (mlra.md Table 1): a cached tensor sharded along heads, latent
blocks or TPA coefficients is split over min(tp, degree) devices; the busiest device holds
ceil(degree / shards) of its degree parts (numel / tp when tp divides the degree); a replicated tensor is read
whole by every device.

Decode arithmetic intensity (mlra.md Table 2): FLOPs of one decode query against one cached token, over the
bytes of that token each device loads, per device at a TP degree (FLOPs split evenly over the devices, capped at
one head per device). The FLOPs are each mechanism's ``decode_flops`` (mlra.md Table 2's counts, with weight
absorption for MLA / GLA / MLRA); the bytes are its cache tensors plus any rows its decode route gathers per
cached token besides (``decode_cost``'s weight_elements: EG-MLA's gate-embedding row).

The paper's Table 2 quotes MHA, MQA, GQA, MLA, MFA, TPA, GTA at tp = 1, GLA-2 at tp = 2 and MLRA at tp = 4.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

from kvlm.attention import get_attention_class
from kvlm.config import ConfigError, ModelConfig, spec_numel
from kvlm.preset_table import (
    canonical_name,
    count_parameters_cached,
    families,
    family_of,
    get_preset,
    match_ffn_dim,
    presets,
)

DTYPE_BYTES = {
    "bf16": 2,
    "fp16": 2,
    "float16": 2,
    "bfloat16": 2,
    "fp32": 4,
    "float32": 4,
    "fp8": 1,
    "int8": 1,
}
SHARD_KINDS = ("heads", "blocks", "coefficients", "replicated")


# --------------------------------------------------------------------------------------------------
# per model
# --------------------------------------------------------------------------------------------------


def cache_tensors(cfg: ModelConfig, layer_idx: int = 0) -> dict[str, dict[str, Any]]:
    """Each cached tensor of one layer: per-token shape, numel and how tensor parallelism splits it."""
    shards = cfg.mechanism().tp_shards(cfg)
    out = {}
    for name, shape in cfg.cache_spec(layer_idx).items():
        kind = shards.get(name, "replicated")
        if kind not in SHARD_KINDS:
            raise ConfigError(f"{cfg.attention}.tp_shards gives {name!r} the unknown kind {kind!r}")
        out[name] = {"shape": list(shape), "numel": spec_numel(shape), "tp": kind}
    return out


def per_device_elements(cfg: ModelConfig, tp: int, layer_idx: int = 0) -> float:
    """Cached elements per token that the busiest of ``tp`` devices loads for one layer (mlra.md Table 1)."""
    if tp < 1:
        raise ConfigError(f"tensor-parallel degree must be >= 1, got {tp}")
    degree = max(1, int(cfg.mechanism().tp_max_degree(cfg)))
    shards = min(tp, degree)
    total = 0.0
    for t in cache_tensors(cfg, layer_idx).values():
        if t["tp"] == "replicated":
            total += t["numel"]
        else:
            total += t["numel"] * math.ceil(degree / shards) / degree
    return total


def decode_flops(cfg: ModelConfig, layer_idx: int = 0) -> float | None:
    """FLOPs of one decode query token against one cached token in one layer, all heads: the mechanism's
    ``decode_flops`` (None for a mechanism that does not say)."""
    return cfg.mechanism().decode_flops(cfg, layer_idx)


def arithmetic_intensity(
    cfg: ModelConfig, tp: int = 1, dtype_bytes: int = 2, layer_idx: int = 0
) -> float | None:
    """Decode FLOPs per byte loaded, per device at TP degree ``tp`` (mlra.md Table 2)."""
    flops = decode_flops(cfg, layer_idx)
    if flops is None:
        return None
    elements = per_device_elements(cfg, tp, layer_idx)
    # rows gathered per cached token besides the cache (eg-mla: the token's gate-embedding row)
    elements += cfg.mechanism().decode_cost(cfg, 1, 1, "auto", layer_idx)["weight_elements"]
    return flops / min(tp, cfg.n_head) / (elements * dtype_bytes)


# --------------------------------------------------------------------------------------------------
# the table
# --------------------------------------------------------------------------------------------------


def resolve(models: Any) -> list[tuple[str, ModelConfig, str | None]]:
    """(label, config, preset name or None) for: a family, a name prefix ("small-lm/6L-512d"), a preset name,
    a ModelConfig, or a list / dict of those."""
    if isinstance(models, ModelConfig):
        return [(_label(models, 0), models, None)]
    if isinstance(models, str):
        return [(n, get_preset(n), n) for n in select(models)]
    if isinstance(models, dict):
        out = []
        known = set(presets())
        for label, cfg in models.items():
            if isinstance(cfg, ModelConfig):
                out.append((label, cfg, canonical_name(label) if label in known else None))
            else:
                out += resolve(cfg)
        return out
    out = []
    for i, m in enumerate(models):
        if isinstance(m, ModelConfig):
            out.append((_label(m, i), m, None))
        else:
            out += resolve(m)
    return out


def select(spec: str) -> list[str]:
    """Preset names for a family, a prefix of names or one name; comma-separated lists allowed."""
    out: list[str] = []
    for part in [p.strip() for p in spec.split(",") if p.strip()]:
        fams = {f.lower(): names for f, names in families().items()}
        if part.lower() in fams:
            out += fams[part.lower()]
            continue
        prefix = part.lower().rstrip("/") + "/"
        group = [n for names in families().values() for n in names if n.lower().startswith(prefix)]
        out += group if group else [canonical_name(part)]
    return list(dict.fromkeys(out))


def _label(cfg: ModelConfig, i: int) -> str:
    return f"{i}:{cfg.attention}"


def _group(name: str) -> str:
    return name.rsplit("/", 1)[0]


def _reference(name: str | None, cfg: ModelConfig, items, attention: str) -> tuple[str, ModelConfig] | None:
    """The model a row is compared with: the preset with this attention in the row's group (mlra-2.9b/mha,
    small-lm/6L-512d/mha) with the row's depth, preferably also its width; for a model that is not a preset,
    the first such model among the requested ones."""
    if name is not None:
        group = [n for n in families()[family_of(name)] if _group(n) == _group(name)]
        cands = [(n, _preset(n)) for n in group if _preset(n).attention == attention]
        cands = [(n, c) for n, c in cands if c.n_layer == cfg.n_layer]
        cands.sort(key=lambda nc: nc[1].d_model != cfg.d_model)  # stable: table order within a tier
        return cands[0] if cands else None
    for label, c, _ in items:
        if c.attention == attention:
            return label, c
    return None


_PRESETS: dict[str, ModelConfig] = {}


def _preset(name: str) -> ModelConfig:
    """Built once per process, for reference lookups (never handed out to be mutated)."""
    if name not in _PRESETS:
        _PRESETS[name] = get_preset(name)
    return _PRESETS[name]


def _same_shape_mha(cfg: ModelConfig) -> ModelConfig:
    return ModelConfig(
        attention="mha",
        n_layer=cfg.n_layer,
        d_model=cfg.d_model,
        n_head=cfg.n_head,
        head_dim=cfg.head_dim,
        vocab_size=cfg.vocab_size,
        max_seq_len=cfg.max_seq_len,
        arch=cfg.arch,
    )


def kv_table(
    models: Any,
    tp: Iterable[int] = (1,),
    dtype_bytes: int = 2,
    params: bool = True,
) -> list[dict[str, Any]]:
    """One dict per model (see ``resolve`` for what ``models`` may be). Keys: name, attention, family, shape,
    cache (per tensor: shape, numel, tp kind), kv_elements_per_token (all layers), kv_elements_per_layer,
    kv_bytes_per_token, reference / kv_reduction_vs_mha (fraction saved against the group's MHA, else a
    same-shape MHA), mla_reference / kv_reduction_vs_mla, unit_d_h (the reference MHA's d_h), tp_max_degree,
    per_device {tp: {elements_per_token, elements_per_layer, d_h}}, decode_flops_per_cached_token,
    arithmetic_intensity {tp: FLOPs/byte}, params {total, activated, gate_embedding, ...}."""
    tps = sorted({int(t) for t in tp})
    if not tps or tps[0] < 1:
        raise ConfigError(f"tensor-parallel degrees must be >= 1, got {list(tp)}")
    if dtype_bytes <= 0:
        raise ConfigError(f"dtype_bytes must be positive, got {dtype_bytes}")
    items = resolve(models)
    if not items:
        raise ConfigError("no models to tabulate")
    rows = []
    for label, cfg, name in items:
        per_layer = cfg.kv_cache_elements_per_layer()
        total = sum(per_layer)
        ref = _reference(name, cfg, items, "mha")
        ref_name, ref_cfg = ref if ref is not None else ("same-shape MHA", _same_shape_mha(cfg))
        ref_total = ref_cfg.kv_cache_elements_per_token()
        mla = _reference(name, cfg, items, "mla")
        unit = ref_cfg.head_dim
        row: dict[str, Any] = {
            "name": label,
            "preset": name,
            "family": family_of(name) if name else None,
            "attention": cfg.attention,
            "shape": {
                "n_layer": cfg.n_layer,
                "d_model": cfg.d_model,
                "n_head": cfg.n_head,
                "head_dim": cfg.head_dim,
                "n_kv_head": cfg.n_kv_head,
                "kv_lora_rank": cfg.kv_lora_rank,
                "rope_head_dim": cfg.rope_head_dim,
                "ffn_dim": cfg.ffn_dim,
                "vocab_size": cfg.vocab_size,
            },
            "cache": cache_tensors(cfg),
            "kv_elements_per_token": total,
            "kv_elements_per_layer": total / cfg.n_layer,
            "kv_bytes_per_token": total * dtype_bytes,
            "reference": ref_name,
            "kv_reduction_vs_mha": 1.0 - total / ref_total,
            "mla_reference": mla[0] if mla else None,
            "kv_reduction_vs_mla": (1.0 - total / mla[1].kv_cache_elements_per_token()) if mla else None,
            "unit_d_h": unit,
            "tp_max_degree": int(cfg.mechanism().tp_max_degree(cfg)),
            "per_device": {},
            "decode_flops_per_cached_token": decode_flops(cfg),
            "arithmetic_intensity": {},
            "note": cfg.note,
        }
        for t in tps:
            layers = [per_device_elements(cfg, t, i) for i in range(cfg.n_layer)]
            row["per_device"][t] = {
                "elements_per_token": sum(layers),
                "elements_per_layer": sum(layers) / cfg.n_layer,
                "d_h": sum(layers) / cfg.n_layer / unit,
            }
            row["arithmetic_intensity"][t] = arithmetic_intensity(cfg, t, dtype_bytes)
        if params:
            row["params"] = count_parameters_cached(cfg)
        rows.append(row)
    return rows


# --------------------------------------------------------------------------------------------------
# text output
# --------------------------------------------------------------------------------------------------


def _num(x: float) -> str:
    return f"{x:,.0f}" if float(x).is_integer() else f"{x:,.1f}"


def _short(x: float) -> str:
    """Paper-style: 18.43K, 2.9M."""
    for div, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "K")):
        if abs(x) >= div:
            return f"{x / div:.2f}{suffix}"
    return _num(x)


def _bytes(n: float) -> str:
    for div, suffix in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if n >= div:
            return f"{n / div:.2f} {suffix}"
    return f"{n:.0f} B"


def _g(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:.3g}" if x < 100 else f"{x:.0f}"


def _params(n: int) -> str:
    return f"{n / 1e6:.2f}M"


def format_table(rows: list[dict[str, Any]], tps: Sequence[int], dtype: str = "bf16") -> str:
    # the saving against MLA where a mechanism's paper reports it (eg-mla.md Table 10); elsewhere only noise
    show_mla = any(
        get_attention_class(r["attention"]).kv_baseline == "mla" and r["kv_reduction_vs_mla"] is not None
        for r in rows
    )
    has_params = all("params" in r for r in rows)
    show_gate = has_params and any(r["params"]["gate_embedding"] for r in rows)
    header = ["model", "attention", "KV/token", "KV/layer", "bytes/token", "vs MHA"]
    if show_mla:
        header.append("vs MLA")
    header += [f"load tp={t}" for t in tps] + [f"AI tp={t}" for t in tps]
    if has_params:
        header += ["params", "activated"] + (["gate emb"] if show_gate else [])
    lines = [header]
    for r in rows:
        line = [
            r["name"],
            r["attention"],
            f"{_short(r['kv_elements_per_token'])} ({_num(r['kv_elements_per_token'])})",
            _num(r["kv_elements_per_layer"]),
            _bytes(r["kv_bytes_per_token"]),
            f"{100 * r['kv_reduction_vs_mha']:.1f}%",
        ]
        if show_mla:
            v = r["kv_reduction_vs_mla"]
            line.append("-" if v is None else f"{100 * v:.1f}%")
        line += [f"{r['per_device'][t]['d_h']:.4g}" for t in tps]
        line += [_g(r["arithmetic_intensity"][t]) for t in tps]
        if has_params:
            p = r["params"]
            line += [_params(p["total"]), _params(p["activated"])] + (
                [_params(p["gate_embedding"])] if show_gate else []
            )
        lines.append(line)
    widths = [max(len(str(line[i])) for line in lines) for i in range(len(header))]
    out = []
    for k, line in enumerate(lines):
        cells = [str(c).ljust(w) if i < 2 else str(c).rjust(w) for i, (c, w) in enumerate(zip(line, widths))]
        out.append("  ".join(cells).rstrip())
        if k == 0:
            out.append("  ".join("-" * w for w in widths))
    units = sorted({r["unit_d_h"] for r in rows})
    refs = sorted({r["reference"] for r in rows})
    out.append("")
    out.append(
        f"KV = cached elements per token (all layers / one layer), bytes at {dtype}; vs MHA: saved against "
        f"{', '.join(refs)}; load tp=N: elements per token per layer the busiest of N devices reads, in units "
        f"of d_h = {', '.join(map(str, units))}; AI: decode FLOPs per byte per device (mlra.md Table 2)."
    )
    return "\n".join(out)


__all__ = [
    "arithmetic_intensity",
    "cache_tensors",
    "decode_flops",
    "format_table",
    "kv_table",
    "match_ffn_dim",
    "per_device_elements",
    "select",
]
