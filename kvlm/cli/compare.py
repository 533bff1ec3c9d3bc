"""`kvlm compare`: train several attention variants and report which is best at what cost (kvlm.compare)."""

from __future__ import annotations

import json
import sys

from kvlm.cli.common import parse_int_list
from kvlm.compare import COMPARE_PRESETS, compare, default_train_config
from kvlm.config import ConfigError


def add_arguments(p) -> None:
    p.add_argument(
        "--preset", default="tiny", help=f"comparison preset: {', '.join(COMPARE_PRESETS)} (default tiny)"
    )
    p.add_argument(
        "--variants", help="YAML list of variants instead of a preset (label, preset or config fields)"
    )
    p.add_argument(
        "--data",
        default="synthetic",
        help="'synthetic' (built-in generated stories, default), a prepared data folder, or text files",
    )
    p.add_argument(
        "--out", default="runs/compare", help="output folder (re-running resumes finished variants)"
    )
    p.add_argument(
        "--steps", type=int, help="training steps per variant (default 300 when no budget is given)"
    )
    p.add_argument("--tokens", type=int, help="training tokens per variant")
    p.add_argument("--minutes", type=float, help="training minutes per variant")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seeds", default="0", help="comma-separated seeds; several give mean and std")
    p.add_argument(
        "--contexts",
        help="context lengths for the decode-speed measurement (default: 1/8, 1/2 and nearly all of max_seq_len)",
    )
    p.add_argument(
        "--paper-sizes", action="store_true", help="use the papers' model sizes instead of scaled ones"
    )
    p.add_argument("--json", action="store_true", help="print a JSON summary as the last line")


def main(args) -> int:
    for name in ("steps", "tokens", "minutes", "batch_size", "seq_len"):
        v = getattr(args, name)
        if v is not None and v <= 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be positive, got {v}")
    train_cfg = default_train_config(
        max_steps=args.steps,
        max_tokens=args.tokens,
        max_minutes=args.minutes,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        lr=args.lr,
    )
    seeds = parse_int_list(args.seeds, "seeds", minimum=0)
    contexts = parse_int_list(args.contexts, "contexts") if args.contexts else None
    summary = compare(
        preset=args.preset,
        out=args.out,
        data_source=args.data,
        train_cfg=train_cfg,
        seeds=seeds,
        variants_file=args.variants,
        paper_sizes=args.paper_sizes,
        contexts=contexts,
        command="kvlm " + " ".join(sys.argv[1:])
        if sys.argv[0].endswith("kvlm")
        else "kvlm compare " + " ".join(sys.argv[2:]),
    )
    print(f"report: {summary['report']}", file=sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json.dumps(summary))
    return 0
