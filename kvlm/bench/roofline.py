"""The decode step against the hardware's limits.

A decode step reads every streamed weight once and every cached tensor of every layer, so its time is
bounded below by ``bytes / memory bandwidth`` (the bandwidth floor) and by ``FLOPs / matmul throughput``
(the compute floor). ``roofline`` compares a measured step with both, from the bytes it must read and the
FLOPs counted while it ran. ``operation_roofline`` splits the step into its operation classes:

- weight GEMMs: every streamed matrix but the LM head, 2 FLOPs per element per sequence;
- attention over the cache: what the mechanism's ``decode_cost`` says its route reads and computes;
- LM head: vocab x d_model, 2 FLOPs per element per sequence;

each with its own floors and arithmetic intensity (FLOPs per byte), which says which limit binds it.
"""

from __future__ import annotations

import torch

from kvlm.attention import GateEmbedding, get_attention_class
from kvlm.config import ModelConfig


def streamed_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of weights a decode step reads in full: every unique parameter, except tables that are only
    gathered a few rows at a time (an untied input embedding, learned positions, eg-mla gate tables)."""
    w = weight_classes(model)
    return w["gemm_bytes"] + w["norm_bytes"] + w["lm_head_bytes"]


def weight_classes(model: torch.nn.Module) -> dict[str, int]:
    """The streamed weights by operation class: ``gemm_bytes`` / ``gemm_elements`` (matrices other than the
    LM head), ``norm_bytes`` (vectors: norms, biases), ``lm_head_bytes`` / ``lm_head_elements``."""
    gate_tables = {id(m.weight) for m in model.modules() if isinstance(m, GateEmbedding)}
    seen: set[int] = set()
    tied = getattr(model, "cfg", None) is not None and model.cfg.tie_embeddings
    head = getattr(getattr(model, "lm_head", None), "weight", None)
    out = dict(gemm_bytes=0, gemm_elements=0, norm_bytes=0, lm_head_bytes=0, lm_head_elements=0)
    for name, p in model.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        gathered = id(p) in gate_tables or name.startswith("pos_embed.")
        if name == "embed.weight" and not tied:
            gathered = True
        if gathered:
            continue
        kind = "lm_head" if p is head else "gemm" if p.dim() >= 2 else "norm"
        out[f"{kind}_bytes"] += p.numel() * p.element_size()
        if kind != "norm":
            out[f"{kind}_elements"] += p.numel()
    return out


def roofline(
    weight_bytes: int, kv_bytes: int, hw: dict[str, float], median_ms: float, flops: int = 0
) -> dict[str, float]:
    """The decode step against the hardware: ``floor_ms`` = bytes that must be read / bandwidth (the
    bandwidth roofline), ``compute_floor_ms`` = counted FLOPs / fp32 matmul throughput; a step cannot be
    faster than either."""
    bytes_per_step = weight_bytes + kv_bytes
    floor_ms = bytes_per_step / (hw["bandwidth_gbs"] * 1e9) * 1e3
    compute_ms = flops / (hw["matmul_fp32_gflops"] * 1e9) * 1e3
    return {
        "bytes_per_step": bytes_per_step,
        "floor_ms": floor_ms,
        "roofline_ratio": median_ms / floor_ms,
        "achieved_gbs": bytes_per_step / (median_ms * 1e-3) / 1e9,
        "flops_per_step": flops,
        "compute_floor_ms": compute_ms,
        "compute_ratio": median_ms / compute_ms if compute_ms else None,
        "roofline_floor_ms": max(floor_ms, compute_ms),  # the hardware limit: the larger of the two floors
        "x_roofline": median_ms / max(floor_ms, compute_ms),
    }


def attention_cost(cfg: ModelConfig, batch: int, n_cached: int, mode: str, dtype_bytes: int) -> dict:
    """Attention over the cache in one decode step, all layers: {"bytes", "flops"} from the mechanism's
    ``decode_cost`` for the route ``mode`` takes (cache elements and derived weights read, FLOPs; None
    when the mechanism does not count them)."""
    cls = get_attention_class(cfg.attention)
    total: dict = {"bytes": 0, "flops": 0.0}
    for layer in range(cfg.n_layer):
        cost = cls.decode_cost(cfg, batch, n_cached, route=mode, layer_idx=layer)
        total["bytes"] += int(cost["cache_elements"] + cost["weight_elements"]) * dtype_bytes
        if cost["flops"] is None or total["flops"] is None:
            total["flops"] = None
        else:
            total["flops"] += float(cost["flops"])
    return total


def operation_classes(weights: dict[str, int], attention: dict, batch: int) -> dict[str, dict]:
    """{class: {"bytes", "flops"}} of one decode step of ``batch`` sequences (one new token each), from
    ``weight_classes`` of the model and the step's ``attention_cost``."""
    return {
        "weight GEMMs": {
            "bytes": weights["gemm_bytes"] + weights["norm_bytes"],
            "flops": 2.0 * batch * weights["gemm_elements"],
        },
        "attention": {"bytes": attention["bytes"], "flops": attention["flops"]},
        "LM head": {"bytes": weights["lm_head_bytes"], "flops": 2.0 * batch * weights["lm_head_elements"]},
    }


def operation_roofline(classes: dict[str, dict], hw: dict[str, float]) -> dict[str, dict]:
    """Each class's floors (ms): ``bandwidth_floor_ms`` = bytes / bandwidth, ``compute_floor_ms`` = FLOPs /
    matmul throughput, ``floor_ms`` = the larger; and ``flops_per_byte``, its arithmetic intensity."""
    out = {}
    for name, c in classes.items():
        bw_ms = c["bytes"] / (hw["bandwidth_gbs"] * 1e9) * 1e3
        counted = (
            c["flops"] is not None
        )  # a mechanism that does not count its FLOPs: the bandwidth floor only
        compute_ms = c["flops"] / (hw["matmul_fp32_gflops"] * 1e9) * 1e3 if counted else None
        out[name] = {
            **c,
            "bandwidth_floor_ms": bw_ms,
            "compute_floor_ms": compute_ms,
            "floor_ms": max(bw_ms, compute_ms) if counted else bw_ms,
            "flops_per_byte": c["flops"] / c["bytes"] if counted and c["bytes"] else None,
        }
    return out
