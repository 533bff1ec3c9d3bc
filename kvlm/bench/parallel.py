"""Benchmarks of parallel execution (kvlm.parallel): tensor-parallel decode and EG-MLA embedding parallelism.

- ``tp_bench``: prefill and decode timings of each variant at the launch's tensor-parallel degree, and what each
  rank holds (KV bytes per token, which must equal ``kvlm kv-table --tp N``'s per-device column; weight bytes;
  plan); ``check_against_single_process`` compares greedy decoding with the unsharded model. Every rank runs the
  same calls; rank 0 gets every rank's rows. ``tp_report`` formats them. ``kvlm bench --tp N`` and
  ``kvlm bench-parallel tp-bench`` under torchrun.
- ``embedding_parallel_bench``: DDP training steps of an EG-MLA model with whole ("vanilla") or column-sharded
  ("dimension-wise") gate tables: per-rank memory, step time, time in the exchange (eg-mla.md Table 6's columns).
  ``embedding_parallel_table`` launches it under torchrun for each worker count (``kvlm bench-parallel
  embedding-parallel-table``); ``EP_HEADER`` / ``ep_line`` format the table.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

from kvlm.accounting import per_device_elements
from kvlm.attention import GateEmbedding
from kvlm.bench.measure import bench_decode, bench_prefill
from kvlm.bench.routes import set_gate_tables
from kvlm.config import ConfigError
from kvlm.logs import get_logger
from kvlm.model import build_model
from kvlm.parallel.collectives import gather_objects
from kvlm.parallel.data_parallel import optimizer_bytes, peak_memory, wrap_ddp
from kvlm.parallel.embedding_parallel import ShardedGateEmbedding, shard_gate_embeddings, sharded_gate_tables
from kvlm.parallel.mesh import ParallelContext
from kvlm.parallel.tensor_parallel import kv_bytes_per_token, parameter_bytes, shard_model, tp_plan

logger = get_logger(__name__)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --- tensor-parallel decode ---------------------------------------------------------------------------


@torch.inference_mode()
def check_against_single_process(
    model: nn.Module, tp_model: nn.Module, steps: int = 8, batch: int = 2
) -> dict:
    """Greedy decoding with the full model and with this rank's shard from the same prompt: the largest
    |logit difference| and whether every step picked the same token."""
    cfg = model.cfg
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, cfg.vocab_size, (batch, 8), generator=gen).to(model.embed.weight.device)
    out = []
    for m in (model, tp_model):
        cache = m.new_cache(batch, 8 + steps)
        logits = [m(prompt, cache=cache, last_only=True)]
        for _ in range(steps - 1):
            logits.append(m(logits[-1].argmax(-1), cache=cache))
        out.append(torch.cat(logits, dim=1).float())
    return {
        "max_logit_diff": (out[0] - out[1]).abs().max().item(),
        "same_tokens": bool(torch.equal(out[0].argmax(-1), out[1].argmax(-1))),
    }


def tp_bench(
    variants,
    ctx: ParallelContext,
    batch=(1,),
    context=(512,),
    prompt=(128,),
    steps=8,
    warmup=2,
    repeats=3,
    dtype=torch.float32,
    seed=0,
    check=False,
    attention="tp",
) -> list[dict]:
    """Prefill and decode timings of every (label, config, modes) at this launch's TP degree, and what each
    rank holds: its KV bytes per token (which must equal ``kvlm kv-table --tp N``'s per-device column), its
    weight bytes, its plan. Every rank runs the same calls; rank 0 gets every rank's rows.
    attention="dp": data-parallel attention, each rank decoding its own `batch` requests (whole layers,
    the full per-token cache of its requests), the FFN sharded."""
    rows = []
    elt = torch.empty((), dtype=dtype).element_size()
    for label, cfg, modes in variants:
        need = max(max(context) + warmup + steps, max(prompt), 16)
        if cfg.max_seq_len < need:
            cfg = cfg.replace(max_seq_len=need)
        torch.manual_seed(seed)  # the same weights on every rank
        model = build_model(cfg, device=ctx.device, dtype=dtype).eval()
        full = model if check else None
        model = shard_model(model, ctx.rank, ctx.world, inplace=not check, attention=attention)
        row = {
            "variant": label,
            "attention": cfg.attention,
            "attention_parallel": attention,
            "tp": ctx.world,
            "rank": ctx.rank,
            "plan": tp_plan(model)[0],
            "kv_bytes_per_token": kv_bytes_per_token(model, elt),
            "kv_table_bytes_per_token": round(
                sum(
                    per_device_elements(cfg, ctx.world if attention == "tp" else 1, i)
                    for i in range(cfg.n_layer)
                )
                * elt
            ),
            "parameter_bytes": parameter_bytes(model),
            "prefill": [],
            "decode": [],
        }
        if check:
            row["check"] = check_against_single_process(full, model)
            del full
        for mode in modes:
            run_mode = mode
            if mode == "table":  # EG-MLA-A: each rank precomputes the gate of its heads for every token
                set_gate_tables(model, True)
                run_mode = "auto"
            for b in batch:
                for p in prompt:
                    r = bench_prefill(model, b, p, "naive" if mode == "naive" else "auto", 1, repeats)
                    row["prefill"].append({"mode": mode, "batch": b, "prompt": p, **r})
                for c in context:
                    r = bench_decode(model, b, c, run_mode, warmup, steps)
                    row["decode"].append({"mode": mode, "batch": b, "context": c, **r})
            if mode == "table":
                set_gate_tables(model, False)
        rows.extend(gather_objects(row, ctx.group) if ctx.enabled else [row])
        logger.info("tp-bench: %s done (%s ranks)", label, ctx.world)
        del model
    return rows


def tp_report(rows: list[dict]) -> list[str]:
    """The lines that summarise tp_bench's rows: per variant, what each rank holds, the check against one
    process, and the slowest rank's time of every decode and prefill measurement."""
    lines = []
    world = rows[0]["tp"] if rows else 1
    for start in range(0, len(rows), world):
        lines += _variant_lines(rows[start : start + world])
    return lines


def _variant_lines(rows: list[dict]) -> list[str]:
    r0 = rows[0]
    how = "tp" if r0.get("attention_parallel", "tp") == "tp" else "dp-attention"
    lines = [
        f"{r0['variant']} ({how}={r0['tp']}, {r0['attention']}): KV bytes/token per rank "
        f"{[r['kv_bytes_per_token'] for r in rows]} (kv-table per device {r0['kv_table_bytes_per_token']}), "
        f"weights per rank {[round(r['parameter_bytes'] / 2**20, 1) for r in rows]} MiB"
    ]
    if "check" in r0:
        lines.append(
            f"  vs one process: max |logit diff| {max(r['check']['max_logit_diff'] for r in rows):.2e}, "
            f"same greedy tokens: {all(r['check']['same_tokens'] for r in rows)}"
        )
    for i, d in enumerate(r0["decode"]):
        slowest = max(r["decode"][i]["median_ms"] for r in rows)
        lines.append(
            f"  decode {d['mode']:8s} B={d['batch']:<3d} L={d['context']:<6d} {slowest:9.2f} ms/token "
            f"({d['batch'] * (r0['tp'] if how != 'tp' else 1) / slowest * 1e3:.1f} tokens/s, all ranks)"
        )
    for i, p in enumerate(r0["prefill"]):
        slowest = max(r["prefill"][i]["median_ms"] for r in rows)
        lines.append(f"  prefill {p['mode']:7s} B={p['batch']:<3d} T={p['prompt']:<6d} {slowest:9.2f} ms")
    return lines


# --- embedding parallelism: the Table 6 comparison ----------------------------------------------------


def embedding_parallel_bench(
    cfg, mode: str, ctx: ParallelContext, batch=4, seq=128, steps=5, warmup=2, lr=1e-4, seed=0
) -> dict:
    """DDP training steps of an EG-MLA model, "vanilla" (every rank holds every gate table) or
    "dimension-wise" (each holds a 1/W column slice, eg-mla.md Eqs. 9-11). Per rank: parameter, gradient
    and AdamW-state bytes, peak memory (CUDA allocator, or the process's peak RSS on CPU), step time and the
    time in the gate exchange; throughput counts every rank's tokens (eg-mla.md Table 6's columns)."""
    if mode not in ("vanilla", "dimension-wise"):
        raise ConfigError(f"mode must be 'vanilla' or 'dimension-wise', got {mode!r}")
    device = ctx.device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    torch.manual_seed(seed)
    model = build_model(cfg, device=device).train()
    exchange = None
    if mode == "dimension-wise" and ctx.world > 1:
        shard_gate_embeddings(model, ctx.rank, ctx.world)
        exchange = sharded_gate_tables(model)[0].exchange
        exchange.timing = True
    net = wrap_ddp(model, device) if ctx.world > 1 else model
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    gen = torch.Generator(device=device).manual_seed(seed + 1 + ctx.rank)
    times, comm = [], []
    grad_bytes = 0
    for i in range(warmup + steps):
        tokens = torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=gen, device=device)
        if exchange is not None:
            exchange.comm_seconds = 0.0
        _sync(device)
        t0 = time.perf_counter()
        logits = net(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        grad_bytes = sum(
            p.grad.numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None
        )
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
            comm.append(exchange.comm_seconds if exchange is not None else None)
    state_bytes = optimizer_bytes(opt)
    gate = sum(
        p.numel() * p.element_size()
        for m in model.modules()
        if isinstance(m, (GateEmbedding, ShardedGateEmbedding))
        for p in m.parameters()
    )
    step_ms = 1e3 * sorted(times)[len(times) // 2]
    peak, peak_kind = peak_memory(device)
    return {
        "mode": mode,
        "workers": ctx.world,
        "rank": ctx.rank,
        "parameter_bytes": parameter_bytes(model),
        "gate_table_bytes": gate,
        "gradient_bytes": grad_bytes,
        "optimizer_state_bytes": state_bytes,
        "model_state_bytes": parameter_bytes(model) + grad_bytes + state_bytes,
        "peak_memory_bytes": peak,
        "peak_memory_kind": peak_kind,
        "step_ms": step_ms,
        "comm_ms": None if exchange is None else 1e3 * sorted(comm)[len(comm) // 2],
        "throughput_tokens_per_s": ctx.world * batch * seq / (step_ms / 1e3),
        "loss": loss.item(),
    }


def embedding_parallel_table(
    workers=(1, 2, 4), modes=("vanilla", "dimension-wise"), bench_args=()
) -> list[dict]:
    """Run `kvlm bench-parallel embedding-parallel-bench` under torchrun for each worker count and mode; one
    row per run with the per-rank maximum of memory and time (the busiest rank, as the paper's Table 6 reports
    per node). `bench_args`: that command's options (preset, --set, sizes, device)."""
    rows = []
    for w in workers:
        for mode in modes:
            if w == 1 and mode == "dimension-wise":
                continue  # nothing to shard
            cmd = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                f"--nproc-per-node={w}",
                "-m",
                "kvlm.cli",
                "bench-parallel",
                "embedding-parallel-bench",
                "--mode",
                mode,
                "--json",
                *bench_args,
            ]
            env = dict(os.environ, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // w)))
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
            if proc.returncode:
                first = [ln for ln in proc.stderr.splitlines() if "error" in ln.lower()][:3]
                raise RuntimeError(f"{' '.join(cmd)} failed: {' / '.join(first) or proc.stderr[-2000:]}")
            ranks = json.loads(proc.stdout.strip().splitlines()[-1])["ranks"]
            row = {"mode": mode, "workers": w}
            for k in (
                "parameter_bytes",
                "gate_table_bytes",
                "model_state_bytes",
                "peak_memory_bytes",
                "step_ms",
            ):
                row[k] = max(r[k] for r in ranks)
            comm = [r["comm_ms"] for r in ranks if r["comm_ms"] is not None]
            row["comm_ms"] = max(comm) if comm else None
            row["throughput_tokens_per_s"] = min(r["throughput_tokens_per_s"] for r in ranks)
            row["peak_memory_kind"] = ranks[0]["peak_memory_kind"]
            rows.append(row)
            logger.info(
                "embedding-parallel-table: %s, %d workers: %.0f tokens/s",
                mode,
                w,
                row["throughput_tokens_per_s"],
            )
    return rows


def ep_line(r: dict) -> str:
    comm = f"{r['comm_ms']:.2f}" if r.get("comm_ms") is not None else "-"
    return (
        f"{r['mode']:15s} {r['workers']:>7d} {r['parameter_bytes'] / 2**20:12.1f} {r['model_state_bytes'] / 2**20:14.1f} "
        f"{r['peak_memory_bytes'] / 2**20:12.1f} {r['throughput_tokens_per_s']:12.0f} {r['step_ms']:10.2f} {comm:>9s}"
    )


EP_HEADER = (
    f"{'method':15s} {'workers':>7s} {'params MiB':>12s} {'states MiB':>14s} {'peak MiB':>12s} "
    f"{'tokens/s':>12s} {'step ms':>10s} {'comm ms':>9s}"
)
