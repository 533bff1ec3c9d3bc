"""`kvlm compare`: train several attention variants and report which is best at what cost (kvlm.compare)."""

from __future__ import annotations

import json
import sys

from kvlm.cli.common import parse_int_list
from kvlm.compare import COMPARE_PRESETS, compare, default_train_config
from kvlm.config import ConfigError
from kvlm.files import prepare_output_folder


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
        help="'synthetic' (built-in generated stories: not real text; the default), a prepared data folder, "
        "or text: a .txt / .jsonl file or a folder of them",
    )
    p.add_argument(
        "--tokenizer",
        default="bpe",
        help="for text --data: 'bpe' (trained on it, --vocab-size tokens; default), 'gpt2', or a tokenizer path",
    )
    p.add_argument(
        "--vocab-size", type=int, default=4096, help="BPE vocabulary size for text --data (default 4096)"
    )
    p.add_argument(
        "--out",
        default="runs/compare",
        help="output folder; re-running the same command keeps finished runs and resumes interrupted ones",
    )
    p.add_argument("--steps", type=int, help="training steps per run (default 150 when no budget is given)")
    p.add_argument("--tokens", type=int, help="training tokens per variant")
    p.add_argument("--minutes", type=float, help="training minutes per variant")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per training step")
    p.add_argument("--seq-len", type=int, default=128, help="training window length in tokens")
    p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate")
    p.add_argument(
        "--seeds",
        default="0,1,2",
        help="comma-separated seeds (default 0,1,2): mean, std, 95 %% intervals and Welch tests; a single seed "
        "tests nothing",
    )
    p.add_argument(
        "--baseline",
        help="label every variant is compared with (default: the first MHA variant, else the first)",
    )
    p.add_argument(
        "--match",
        default="preset",
        choices=["preset", "params", "activated"],
        help="model sizing: 'preset' (as the preset defines; default), 'params' (FFN width re-matched so total "
        "parameters, gate tables included, equal the baseline's), 'activated' (the same without gate tables)",
    )
    p.add_argument(
        "--hardware",
        default="cpu-measured,h100",
        help="hardware for the decode projection at the reference size (kvlm.bench.costmodel names; "
        "default cpu-measured,h100)",
    )
    p.add_argument(
        "--deploy-batch", type=int, default=8, help="batch of the cache-memory and projection columns"
    )
    p.add_argument(
        "--deploy-context", type=int, default=4096, help="context of the cache-memory and projection columns"
    )
    p.add_argument(
        "--contexts",
        help="also time the tiny trained models' decode at these context lengths (overhead-bound: an appendix, "
        "not a cost; off by default)",
    )
    p.add_argument(
        "--eval-tokens",
        type=int,
        default=65536,
        help="validation tokens of each run's final loss (default 65536)",
    )
    p.add_argument("--force", action="store_true", help="replace run folders that hold a different run")
    p.add_argument("--no-progress", action="store_true", help="log lines instead of a progress bar")
    p.add_argument(
        "--paper-sizes", action="store_true", help="use the papers' model sizes instead of scaled ones"
    )
    p.add_argument("--json", action="store_true", help="print a JSON summary as the last line")


def main(args) -> int:
    for name in ("steps", "tokens", "minutes", "batch_size", "seq_len", "vocab_size", "deploy_batch", "deploy_context",
                 "eval_tokens"):  # fmt: skip
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
    prepare_output_folder(args.out, "--out")  # before the training: a file or read-only --out fails now
    contexts = parse_int_list(args.contexts, "contexts") if args.contexts else None
    if contexts:
        _check_contexts(contexts, args)
    summary = compare(
        preset=args.preset,
        out=args.out,
        data_source=args.data,
        train_cfg=train_cfg,
        seeds=seeds,
        variants_file=args.variants,
        paper_sizes=args.paper_sizes,
        contexts=contexts,
        baseline=args.baseline,
        match=args.match,
        hardware=[h for h in args.hardware.split(",") if h.strip()],
        deploy=(args.deploy_batch, args.deploy_context),
        tokenizer=args.tokenizer,
        vocab_size=args.vocab_size,
        force=args.force,
        progress=False if args.no_progress else None,
        eval_tokens=args.eval_tokens,
        command="kvlm " + " ".join(sys.argv[1:])
        if sys.argv[0].endswith("kvlm")
        else "kvlm compare " + " ".join(sys.argv[2:]),
    )
    print(f"report: {summary['report']}", file=sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json.dumps(summary))
    return 0


def _check_contexts(contexts: list[int], args) -> None:
    """Refuse (before any training) a --contexts length that some variant cannot decode at: the speed
    measurement needs the context plus its decode steps within max_seq_len, and used to drop it silently."""
    import inspect

    from kvlm.compare import load_variants, measure_speed

    margin = inspect.signature(measure_speed).parameters["decode_steps"].default + 2
    variants, _ = load_variants(args.preset, args.variants, args.paper_sizes)
    for v in variants:
        too_long = [c for c in contexts if c + margin > v.cfg.max_seq_len]
        if too_long:
            raise ConfigError(
                f"--contexts {','.join(map(str, too_long))}: variant {v.label!r} has max_seq_len="
                f"{v.cfg.max_seq_len}, so it decodes at contexts up to {v.cfg.max_seq_len - margin}"
            )
