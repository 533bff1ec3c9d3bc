"""`kvlm bench-parallel`: benchmarks of parallel execution (kvlm.bench.parallel), run under torchrun.

    torchrun --nproc-per-node 2 -m kvlm.cli bench-parallel tp-bench --variants mla,mlra-2 --check
    torchrun --nproc-per-node 2 -m kvlm.cli bench-parallel embedding-parallel-bench --mode dimension-wise
    kvlm bench-parallel embedding-parallel-table --workers 1,2,4      # launches torchrun itself

Also ``bench_main(args, plan)``: `kvlm bench --tp N` hands its parsed plan over (every variant sharded N ways).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

from kvlm.attention import registry
from kvlm.bench.parallel import (
    EP_HEADER,
    embedding_parallel_bench,
    embedding_parallel_table,
    ep_line,
    tp_bench,
    tp_report,
)
from kvlm.cli.common import parse_int_list, parse_overrides
from kvlm.config import ConfigError, ModelConfig
from kvlm.logs import setup_logging
from kvlm.model import count_parameters
from kvlm.parallel.collectives import barrier, gather_objects
from kvlm.parallel.mesh import init_distributed, shutdown, tp_setup
from kvlm.preset_table import get_preset

TP_VARIANTS = "mha,gqa,mla,gla-2,gta,mlra-2,mlra-4,tpa,mfa,eg-mla"


def _bench_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--preset",
        default="eg-mla-base/eg-mla-base-emb512",
        help="preset or attention name (default: %(default)s, eg-mla.md's Base model with 512-wide gate tables)",
    )
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field")
    p.add_argument("--batch", type=int, default=4, help="sequences per rank per step (default 4)")
    p.add_argument("--seq", type=int, default=128, help="default 128")
    p.add_argument("--steps", type=int, default=5, help="default 5")
    p.add_argument("--warmup", type=int, default=2, help="default 2")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench", required=True, metavar="BENCH", help="which benchmark")
    p = sub.add_parser("tp-bench", help="tensor-parallel decode bench and per-rank KV (under torchrun)")
    p.add_argument(
        "--variants",
        default=TP_VARIANTS,
        help=f"attentions or presets, comma-separated (default {TP_VARIANTS})",
    )
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field")
    p.add_argument("--batch", type=int, default=1, help="default 1")
    p.add_argument("--context", type=int, default=256, help="default 256")
    p.add_argument("--prompt", type=int, default=64, help="default 64")
    p.add_argument("--steps", type=int, default=5, help="default 5")
    p.add_argument(
        "--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="default float32"
    )
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument("--check", action="store_true", help="also compare greedy decoding with one process")
    p.add_argument(
        "--dp-attention",
        action="store_true",
        help="data-parallel attention: every rank decodes its own --batch requests, FFN sharded",
    )
    p.add_argument("--json", action="store_true", help="the last stdout line is a JSON object")
    p = sub.add_parser(
        "embedding-parallel-bench", help="one Table 6 run: DDP training steps (under torchrun)"
    )
    _bench_options(p)
    p.add_argument("--mode", choices=["vanilla", "dimension-wise"], default="dimension-wise",
                   help="default dimension-wise")  # fmt: skip
    p.add_argument("--json", action="store_true", help="the last stdout line is a JSON object")
    p = sub.add_parser(
        "embedding-parallel-table", help="eg-mla.md Table 6: vanilla vs dimension-wise, launching torchrun"
    )
    _bench_options(p)
    p.add_argument("--workers", default="1,2,4", help="worker counts, comma-separated (default 1,2,4)")
    p.add_argument("--json", action="store_true", help="the last stdout line is a JSON object")


def model_config(preset: str, overrides: list[str]) -> ModelConfig:
    """An attention name or a preset, with --set overrides."""
    changes = parse_overrides(overrides)
    if preset in registry():
        return ModelConfig(attention=preset, **changes)
    cfg = get_preset(preset)
    if "n_head" in changes:  # re-derive what follows from the changed shape unless given
        changes.setdefault("n_kv_head", None)
    if "d_model" in changes:
        changes.setdefault("ffn_dim", None)
    return cfg.replace(**changes) if changes else cfg


def _say(json_out: bool):
    """The command's result lines go to stdout, or to stderr when stdout is for the JSON line."""
    stream = sys.stderr if json_out else sys.stdout
    return lambda line: print(line, file=stream, flush=True)


def main(args) -> int:
    setup_logging()
    try:
        if args.bench == "embedding-parallel-table":
            return _table(args)
        ctx = init_distributed(args.device, mesh_dim="dp" if args.bench.startswith("embedding") else "tp")
        if ctx.device.type == "cpu":
            torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", 1))))
        if args.bench == "embedding-parallel-bench":
            _ep_bench(args, ctx)
        else:
            _tp_bench(args, ctx)
        barrier(ctx.group)
        return 0
    finally:
        shutdown()


def _table(args) -> int:
    passed = ["--preset", args.preset, "--batch", str(args.batch), "--seq", str(args.seq)]
    passed += ["--steps", str(args.steps), "--warmup", str(args.warmup)]
    passed += [x for s in args.set for x in ("--set", s)] + (["--device", args.device] if args.device else [])
    workers = parse_int_list(args.workers, "workers")
    rows = embedding_parallel_table(workers, bench_args=passed)
    say = _say(args.json)
    say(EP_HEADER)
    for row in rows:
        say(ep_line(row))
    if args.json:
        print(json.dumps({"rows": rows}))
    return 0


def _ep_bench(args, ctx) -> None:
    cfg = model_config(args.preset, args.set)
    if not count_parameters(cfg)["gate_embedding"]:  # counted on the meta device, no weights allocated
        raise ConfigError(
            f"embedding parallelism shards eg-mla's gate tables; {args.preset} is {cfg.attention}"
        )
    row = embedding_parallel_bench(cfg, args.mode, ctx, args.batch, args.seq, args.steps, args.warmup)
    rows = gather_objects(row, ctx.group)
    if ctx.is_main:
        if args.json:
            print(json.dumps({"ranks": rows}))
        else:
            print(EP_HEADER)
            for r in rows:
                print(ep_line(r))


def _tp_bench(args, ctx) -> None:
    variants = [
        (name.strip(), model_config(name.strip(), args.set), ["auto"]) for name in args.variants.split(",")
    ]
    rows = tp_bench(
        variants,
        ctx,
        (args.batch,),
        (args.context,),
        (args.prompt,),
        args.steps,
        1,
        2,
        getattr(torch, args.dtype),
        check=args.check,
        attention="dp" if args.dp_attention else "tp",
    )
    if ctx.is_main:
        say = _say(args.json)
        for line in tp_report(rows):
            say(line)
        if args.json:
            print(json.dumps({"tp": ctx.world, "rows": rows}))


def bench_main(args, plan) -> int:
    """`kvlm bench --tp N` (the bench verb hands its parsed plan over): every variant sharded N ways."""
    ctx = tp_setup(args.tp, str(plan.device) if plan.device.type == "cpu" else None)
    if plan.device.type == "cpu" and args.threads is None:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // ctx.world))
    say = _say(args.json)
    if ctx.is_main:
        say(f"tensor-parallel bench: {ctx.world} ranks on {ctx.device} ({dist.get_backend()})")
    variants = [(v.label, v.cfg, v.modes) for v in plan.variants]
    rows = tp_bench(
        variants,
        ctx,
        plan.batch,
        plan.context,
        plan.prompt,
        plan.steps,
        plan.warmup,
        plan.repeats,
        plan.dtype,
        plan.seed,
        check=getattr(args, "check", False),
    )
    if ctx.is_main:
        for line in tp_report(rows):
            say(line)
    result = {"kvlm_bench": 1, "tp": ctx.world, "device": str(ctx.device), "rows": rows}
    if args.out and ctx.is_main:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    if args.json:
        print(json.dumps(result))
    barrier(ctx.group)
    return 0
