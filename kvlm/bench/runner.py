"""One `kvlm bench` run: ``run(plan)`` builds every variant of the plan, measures its prefill and decode
in each of its decode modes (and its transformers peer's, once the peer's logits agree with kvlm's),
measures the hardware at the start and the end, and returns the result dict that ``--json`` prints: the
rows, each decode row against the roofline (``kvlm.bench.roofline``), and the derived comparisons
(``kvlm.bench.report``). Progress is logged through ``kvlm.logs``."""

from __future__ import annotations

import datetime
import gc
from typing import Any

import torch

from kvlm.bench.hardware import best_of, load_average, machine_info, measure_hardware
from kvlm.bench.measure import bench_decode, bench_peer_decode, bench_peer_prefill, bench_prefill
from kvlm.bench.opstime import attach, base_times, operation_times
from kvlm.bench.peers import PeerUnavailable, agreement_tolerance, build_peer, max_logit_diff
from kvlm.bench.plan import Plan
from kvlm.bench.report import peer_ratios, route_table
from kvlm.bench.roofline import (
    attention_cost,
    operation_classes,
    operation_roofline,
    roofline,
    streamed_weight_bytes,
    weight_classes,
)
from kvlm.bench.routes import route_name, set_gate_tables
from kvlm.config import spec_numel
from kvlm.logs import get_logger
from kvlm.model import build_model
from kvlm.progress import Progress

log = get_logger(__name__)


def run(plan: Plan) -> dict[str, Any]:
    """Every measurement of the plan; returns the result dict that ``--json`` prints."""
    torch.manual_seed(plan.seed)
    device, dtype = plan.device, plan.dtype
    result: dict[str, Any] = {
        "kvlm_bench": 1,
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "suite": plan.suite,
        "machine": machine_info(device),
        "settings": {
            "batch": plan.batch,
            "context": plan.context,
            "prompt": plan.prompt,
            "steps": plan.steps,
            "warmup": plan.warmup,
            "repeats": plan.repeats,
            "dtype": str(dtype).removeprefix("torch."),
            "device": str(device),
            "peers": plan.peers,
            "seed": plan.seed,
            "budget_s": plan.budget_s,
            "baseline": plan.baseline,
        },
    }
    hw = _hardware(plan)  # again at the end: a busy machine at either end does not lower the floors
    models, prefill, decode, peers = {}, [], [], []
    elt = torch.empty((), dtype=dtype).element_size()
    # kvlm.progress: one step per (variant, mode) and per peer comparison; a bar on a terminal, else log lines
    bar = Progress(sum(len(v.modes) + bool(plan.peers) for v in plan.variants), "bench", "case")
    for variant in plan.variants:
        cfg = variant.cfg
        need = max(max(plan.context) + max(plan.warmup, 1) + plan.steps, max(plan.prompt))
        if cfg.max_seq_len < need:
            cfg = cfg.replace(max_seq_len=need)
        # absorbed weights built once, as after loading a checkpoint
        model = build_model(cfg, device=device, dtype=dtype).eval().prepare_for_inference()
        weight_bytes = streamed_weight_bytes(model)
        models[variant.label] = {
            "attention": cfg.attention,
            "config": {k: v for k, v in cfg.to_dict().items() if k not in ("note", "extra")},
            "parameters": model.parameter_counts(),
            "streamed_weight_bytes": weight_bytes,
            "weight_classes": weight_classes(model),
            "kv_bytes_per_token": cfg.kv_cache_bytes_per_token(elt),
            "naive_kv_bytes_per_token": sum(spec_numel(s) for s in model.cache_specs(naive=True)) * elt,
            "modes": variant.modes,
        }
        log.info(
            f"{variant.label}: {model.parameter_counts()['total'] / 1e6:.1f}M parameters, "
            f"{models[variant.label]['kv_bytes_per_token']} KV bytes/token"
        )
        for mode in variant.modes:
            rows = _run_mode(model, variant.label, mode, plan, hw, weight_bytes, prefill)
            for r in rows:
                r["attention_cost"] = attention_cost(cfg, r["batch"], r["context"], r["mode"], elt)
            decode += rows
            bar.update(1)
        if plan.peers:
            peers.append(_run_peer(variant.label, model, plan, weight_bytes, hw, prefill, decode))
            bar.update(1)
        del model
        gc.collect()
    bar.close()
    result.update(models=models, prefill=prefill, decode=decode, peers=peers)
    result["load_average_end"] = load_average()
    result["hardware"] = best_of(hw, _hardware(plan))
    for r in decode:  # the floors from the best measurements of the run
        m = models[r["variant"]]
        r.update(
            roofline(
                m["streamed_weight_bytes"], r["kv_cache_bytes"], result["hardware"], r["median_ms"],
                r["flops_per_step"],
            )
        )  # fmt: skip
        if "attention_cost" in r:
            classes = operation_classes(m["weight_classes"], r.pop("attention_cost"), r["batch"])
            r["operations"] = operation_roofline(classes, result["hardware"])
            if "op_ms" in r:
                attach(r["operations"], r.pop("op_ms"))
    result["ratios"] = peer_ratios(decode, prefill)
    result["routes"] = route_table(result)
    return result


def _hardware(plan: Plan) -> dict[str, float]:
    log.info(f"measuring memory bandwidth ({plan.bandwidth_mib} MiB buffers) and matmul throughput ...")
    hw = measure_hardware(plan.device, plan.bandwidth_mib)
    log.info(
        f"  copy {hw['copy_gbs']:.1f} GB/s, read {hw['read_gbs']:.1f} GB/s, fp32 matmul "
        f"{hw['matmul_fp32_gflops']:.0f} GFLOP/s"
    )
    return hw


def _log_decode(route: str, b: int, c: int, row: dict) -> None:
    log.info(
        f"  decode  {route:12s} B={b:<3d} L={c:<6d} {row['median_ms']:9.2f} ms/token "
        f"(floor {row['floor_ms']:.2f} ms, x{row['roofline_ratio']:.2f}; compute floor "
        f"{row['compute_floor_ms']:.2f} ms), peak +{row['peak_extra_bytes'] / 2**20:.0f} MiB"
    )


def _run_mode(model, label, mode, plan: Plan, hw, weight_bytes, prefill) -> list[dict]:
    """Prefill rows (appended to ``prefill``) and the decode rows (returned) of one kvlm variant in one
    decode mode."""
    cfg = model.cfg
    table_bytes = set_gate_tables(model, mode == "table")  # EG-MLA-A: built once, as at model loading
    run_mode = "auto" if mode == "table" else mode
    pmode = {"naive": "naive", "table": "table"}.get(mode, "auto")  # prefill takes its cache's fast route
    base = {
        "impl": "kvlm",
        "variant": label,
        "route": route_name(cfg, mode),
        "extra_state_bytes": table_bytes,
    }
    decode = []
    for b in plan.batch:
        for p in plan.prompt:
            key = (label, pmode, b, p)
            if any((r["variant"], r["mode"], r["batch"], r["prompt"]) == key for r in prefill):
                continue
            row = bench_prefill(
                model, b, p, "auto" if pmode == "table" else pmode, 1, plan.repeats, plan.budget_s
            )
            proute = "auto" if pmode == "auto" else route_name(cfg, pmode)  # auto prefill: expand
            prefill.append({**base, "route": proute, "mode": pmode, "batch": b, "prompt": p, **row})
            log.info(f"  prefill {proute:12s} B={b:<3d} T={p:<6d} {row['median_ms']:9.2f} ms")
        op_base = None  # the step at 1 cached token and the LM head: what the per-operation times subtract
        for c in plan.context:
            row = bench_decode(model, b, c, run_mode, plan.warmup, plan.steps, plan.budget_s)
            row.update(
                roofline(weight_bytes, row["kv_cache_bytes"], hw, row["median_ms"], row["flops_per_step"])
            )
            op_base = op_base or base_times(model, b, run_mode, plan.warmup, plan.steps, plan.budget_s)
            row["op_ms"] = operation_times(row["median_ms"], op_base)
            decode.append({**base, "mode": mode, "batch": b, "context": c, **row})
            _log_decode(base["route"], b, c, row)
    set_gate_tables(model, False)
    return decode


def _run_peer(label, model, plan: Plan, weight_bytes, hw, prefill, decode) -> dict:
    """The transformers peer of one variant: its logits checked against kvlm's, then, if they agree, its
    prefill and decode rows (appended to ``prefill`` and ``decode``); returns the peer's summary."""
    info: dict[str, Any] = {"variant": label}
    try:
        peer = build_peer(model)
    except PeerUnavailable as e:
        info.update(peer=None, skipped=str(e))
        log.info(f"  peer: none ({e})")
        return info
    info.update(peer=peer.name, attn_implementation=peer.attn_implementation)
    device = model.embed.weight.device
    tokens = torch.randint(0, model.cfg.vocab_size, (2, 16), device=device)
    with torch.inference_mode():
        scale = model(tokens).abs().max().item()
    diff = max_logit_diff(model, peer, tokens, decode_steps=2)
    tol = agreement_tolerance(plan.dtype)
    info.update(max_logit_diff=diff, logit_scale=scale, tolerance=tol, agree=diff <= tol * max(1.0, scale))
    log.info(
        f"  peer {peer.name} ({peer.attn_implementation}): max |logit diff| {diff:.2e} (logits up to {scale:.2f})"
    )
    if not info["agree"]:
        info["skipped"] = "logits disagree with kvlm: not timed"
        log.info("  peer logits disagree: not timed")
        return info
    impl = f"hf:{peer.name.split()[-1]}"
    base = {"impl": impl, "variant": label, "mode": "hf", "route": "hf", "extra_state_bytes": 0}
    for b in plan.batch:
        for p in plan.prompt:
            row = bench_peer_prefill(peer, b, p, model.cfg.vocab_size, device, 1, plan.repeats, plan.budget_s)
            prefill.append({**base, "batch": b, "prompt": p, **row})
            log.info(f"  prefill {'peer':12s} B={b:<3d} T={p:<6d} {row['median_ms']:9.2f} ms")
        for c in plan.context:
            row = bench_peer_decode(
                peer, b, c, model.cfg.vocab_size, device, plan.warmup, plan.steps, plan.budget_s
            )
            row.update(
                roofline(weight_bytes, row["kv_cache_bytes"], hw, row["median_ms"], row["flops_per_step"])
            )
            decode.append({**base, "batch": b, "context": c, **row})
            _log_decode("peer", b, c, row)
    del peer
    gc.collect()
    return info
