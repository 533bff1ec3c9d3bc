"""`kvlm bench`: prefill / decode latency, throughput, memory, against peers and the roofline.

The measurements live in ``kvlm.bench``; this module only turns the command line into a ``Plan``
(``kvlm.bench.make_plan``), runs it, and writes the result: the markdown tables on stdout (and ``--markdown``),
the JSON (``--out``; ``--json`` prints it as the last stdout line) and the decode plot (``--plot``, or next
to ``--out``). Progress goes to stderr through ``kvlm.logs``. ``--tp N`` under torchrun hands the plan to the
tensor-parallel bench (``kvlm.cli.parallel_bench.bench_main``).
"""

from __future__ import annotations

from pathlib import Path

import torch

from kvlm.bench import SHAPE_FIELDS, SUITES, Plan, make_plan, markdown, plot, run
from kvlm.bench.suites import DTYPES
from kvlm.cli.common import parse_int_list
from kvlm.files import json_text, prepare_output_file
from kvlm.logs import setup_logging


def add_arguments(p) -> None:
    p.add_argument(
        "--suite", choices=sorted(SUITES), help="a named benchmark; other options override its values"
    )
    p.add_argument(
        "--variants",
        help="comma-separated attentions or presets, each optionally name:key=value:... "
        "(e.g. mha,gqa:n_kv_head=4,mla:kv_lora_rank=128)",
    )
    p.add_argument(
        "--modes",
        help="decode routes, comma-separated: auto, naive (materialised K/V), absorbed, expand, table (eg-mla's "
        "precomputed gate table); each mechanism runs those it has (MHA/GQA: auto only; eg-mla: absorbed = auto)",
    )
    p.add_argument("--batch", help="batch sizes, comma-separated")
    p.add_argument("--context", help="cached tokens before decoding, comma-separated")
    p.add_argument("--prompt", help="prefill prompt lengths, comma-separated")
    p.add_argument("--steps", type=int, help="timed decode steps per measurement")
    p.add_argument("--warmup", type=int, help="untimed decode steps before timing")
    p.add_argument("--repeats", type=int, help="timed prefills per measurement")
    for name in SHAPE_FIELDS:
        p.add_argument(
            f"--{name.replace('_', '-')}", type=int, dest=name, help=f"model {name} (overrides the suite)"
        )
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="weights and cache dtype")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (cuda if available)")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--no-peers", action="store_true", help="skip the transformers peers")
    p.add_argument("--bandwidth-mib", type=int, help="buffer size of the bandwidth measurement (default 512)")
    p.add_argument(
        "--budget-s",
        type=float,
        default=30.0,
        help="seconds per measurement: slower ones time fewer steps (at least 3) or prefills (at least 2); 0 = off",
    )
    p.add_argument(
        "--baseline",
        help="the variant every decode route is compared with in the route table (default: the suite's, else "
        "the first variant)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights and prompts")
    p.add_argument("--out", help="write the result JSON here (and the plot next to it unless --plot)")
    p.add_argument("--plot", help="write the decode plot (PNG) here")
    p.add_argument("--markdown", help="write the result tables (markdown) here")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object on the last line")
    p.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel degree N, under `torchrun --nproc-per-node N -m kvlm.cli bench ...`: "
                   "every variant sharded N ways, per-rank KV bytes and timings (kvlm.bench.parallel)")  # fmt: skip


def _names(text: str | None) -> list[str] | None:
    return None if text is None else [x.strip() for x in text.split(",") if x.strip()]


def plan_from_args(args) -> Plan:
    """The plan the command line asks for: its suite (or the defaults) with the given options on top."""
    options = {
        "variants": _names(args.variants),
        "modes": _names(args.modes),
        "batch": None if args.batch is None else parse_int_list(args.batch, "batch"),
        "context": None if args.context is None else parse_int_list(args.context, "context"),
        "prompt": None if args.prompt is None else parse_int_list(args.prompt, "prompt"),
        "steps": args.steps,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "bandwidth_mib": args.bandwidth_mib,
        "baseline": args.baseline,
        **{name: getattr(args, name) for name in SHAPE_FIELDS},
    }
    return make_plan(
        args.suite,
        options,
        dtype=args.dtype,
        device=args.device,
        peers=not args.no_peers,
        seed=args.seed,
        budget_s=args.budget_s,
    )


def main(args) -> int:
    setup_logging()
    if args.threads:
        torch.set_num_threads(args.threads)
    plan = plan_from_args(args)
    # before minutes of measuring: every output path must be writable (parent folders are created)
    prepare_output_file(args.out, "--out")
    prepare_output_file(args.markdown, "--markdown")
    prepare_output_file(args.plot or (Path(args.out).with_suffix(".png") if args.out else None), "--plot")
    if args.tp > 1:  # under torchrun only: the distributed stack is not needed by a plain `kvlm bench`
        from kvlm.cli.parallel_bench import bench_main

        return bench_main(args, plan)
    result = run(plan)
    result["arguments"] = {k: v for k, v in vars(args).items() if not k.startswith("_") and k != "command"}
    table = markdown(result)
    print(table)
    if args.markdown:
        Path(args.markdown).write_text(table + "\n")
    plot_path = args.plot or (str(Path(args.out).with_suffix(".png")) if args.out else None)
    if plot_path:
        Path(plot_path).parent.mkdir(parents=True, exist_ok=True)
        plot(result, plot_path)
        result["plot"] = str(plot_path)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json_text(result, indent=1) + "\n")
    if args.json:
        print(json_text(result))
    return 0
