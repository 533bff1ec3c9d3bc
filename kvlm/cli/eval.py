"""`kvlm eval CHECKPOINT`: perplexity, repetition and lm-eval tasks for a checkpoint (kvlm.inference.evaluation).

Results go to stdout, or with ``--json`` to stderr with one JSON object as the last stdout line."""

from __future__ import annotations

import importlib.util
import json
import sys

from kvlm.cli.common import check_utf8, finite_float, nonnegative_int, positive_int, resolve_device
from kvlm.inference.evaluation import (
    DEFAULT_PROMPTS,
    EvalError,
    default_data,
    load_eval_tokens,
    perplexity,
    repetition_metrics,
    sample_continuations,
)
from kvlm.interop.hf_folder import load_model_folder


def add_arguments(p) -> None:
    p.add_argument("checkpoint", help="checkpoint folder, or a Hugging Face folder: a `kvlm export-hf` export "
                   "(any --format), a Llama or dense DeepseekV3 model")  # fmt: skip
    p.add_argument("--data", default=None,
                   help="prepared data folder or raw .txt/.jsonl file (default: the data recorded in the checkpoint)")  # fmt: skip
    p.add_argument("--split", default="val", help="split of a prepared data folder (default val)")
    p.add_argument(
        "--seq-len", type=positive_int, default=None, help="window length (default: the model's max_seq_len)"
    )
    p.add_argument(
        "--stride", type=positive_int, default=None, help="sliding windows (default: seq-len, no overlap)"
    )
    p.add_argument("--max-tokens", type=positive_int, default=None, help="score only the first N tokens")
    p.add_argument("--batch-size", type=positive_int, default=4, help="windows scored together")
    p.add_argument("--samples", type=nonnegative_int, default=None,
                   help="sampled continuations for repetition (0: none; default 8, or 0 with --tasks)")  # fmt: skip
    p.add_argument("--prompts", nargs="+", default=None, help="prompts for the samples (default: fixed set)")
    p.add_argument("--sample-tokens", type=positive_int, default=64, help="tokens per sampled continuation")
    p.add_argument(
        "--temperature", type=finite_float, default=1.0, help="sampling temperature of the samples"
    )
    p.add_argument(
        "--top-k", type=nonnegative_int, default=None, help="sample among the k likeliest (default: all)"
    )
    p.add_argument("--top-p", type=finite_float, default=None, help="nucleus sampling mass (default: off)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampled continuations")
    p.add_argument("--tasks", nargs="+", default=None, help="lm-evaluation-harness tasks (needs lm-eval)")
    p.add_argument("--limit", type=positive_int, default=None, help="lm-eval: examples per task")
    p.add_argument("--perplexity", action="store_true",
                   help="with --tasks, also score perplexity on the checkpoint's recorded data (it is scored "
                   "without --tasks, or when --data is given)")  # fmt: skip
    p.add_argument("--no-progress", action="store_true", help="no progress bar or progress lines")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="default: bfloat16 on cuda, float32 on cpu")  # fmt: skip
    p.add_argument("--json", action="store_true", help="the last stdout line is a JSON object")


def main(args) -> int:
    import torch  # here, not at import: `kvlm eval --help` and argument errors stay fast

    device = resolve_device(args.device)
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else None)
    model, tokenizer, meta = load_model_folder(args.checkpoint, device=device, dtype=dtype)
    result: dict = {"checkpoint": str(args.checkpoint), "attention": model.cfg.attention}
    # --tasks alone runs the tasks: the whole validation set's perplexity only when asked (--data / --perplexity)
    data = args.data or (default_data(meta, args.checkpoint) if not args.tasks or args.perplexity else None)
    samples = args.samples if args.samples is not None else (0 if args.tasks else 8)
    if data is not None:
        tokens = load_eval_tokens(data, tokenizer, args.max_tokens, args.split)
        ppl = perplexity(model, tokens, args.seq_len, args.batch_size, args.stride,
                         progress=not getattr(args, "no_progress", False))  # fmt: skip
        result["perplexity"] = {"data": str(data), **ppl}
        _say(args, f"perplexity {ppl['perplexity']:.3f} (loss {ppl['loss']:.4f}) over {ppl['tokens']} tokens, "
             f"windows of {ppl['seq_len']} stride {ppl['stride']}")  # fmt: skip
    if samples > 0:
        if tokenizer is None:
            raise EvalError("--samples needs the checkpoint's tokenizer (no tokenizer.json); use --samples 0")
        prompts, out = sample_continuations(
            model, tokenizer, [check_utf8(t, f"--prompts {i + 1}") for i, t in enumerate(args.prompts or DEFAULT_PROMPTS)], samples, args.sample_tokens,
            args.temperature, args.top_k, args.top_p, args.seed,
        )  # fmt: skip
        rep = repetition_metrics(out)
        texts = [tokenizer.decode(o) for o in out]
        result["repetition"] = {**rep, "temperature": args.temperature, "seed": args.seed}
        result["samples"] = [{"prompt": p, "text": t} for p, t in zip(prompts, texts)]
        _say(args, "repetition over {} samples: ".format(rep["sequences"]) + ", ".join(
            f"{k} {v:.3f}" for k, v in rep.items() if k.startswith(("distinct", "rep")) and v is not None))  # fmt: skip
        for p, t in list(zip(prompts, texts))[:2]:
            _say(args, f"  sample: {p!r} -> {t[:160]!r}")
    if args.tasks:
        result["tasks"] = run_tasks(model, tokenizer, args.tasks, args.limit)
        _say(args, f"tasks: {json.dumps(result['tasks'])}")
    if len(result) == 2:
        raise EvalError(
            "nothing to evaluate: no --data (and none recorded in the checkpoint), --samples 0, no --tasks"
        )
    if args.json:
        print(json.dumps(result))
    return 0


def run_tasks(model, tokenizer, tasks: list[str], limit: int | None = None, batch_size: int = 8) -> dict:
    """``--tasks``: lm-evaluation-harness through kvlm's adapter (kvlm.interop.lm_eval)."""
    if importlib.util.find_spec("lm_eval") is None:
        raise EvalError("--tasks needs lm-evaluation-harness: pip install 'lm-eval>=0.4.5' (or kvlm[eval])")
    # imported here: lm-eval is an optional dependency, and slow to import
    from kvlm.interop.lm_eval import run_lm_eval

    return run_lm_eval(model, tokenizer, tasks, limit=limit, batch_size=batch_size)


def _say(args, line: str) -> None:
    print(line, file=sys.stderr if args.json else sys.stdout)
