"""lm-evaluation-harness for kvlm models: the registered model "kvlm" and ``run_lm_eval``.

The model is lm-eval's own ``HFLM`` around ``kvlm.interop.hf_modeling.KVLMForCausalLM`` (so batching, caching and
scoring are lm-eval's, and generation tasks decode with kvlm's compact cache), built from a kvlm checkpoint:

    from kvlm.interop.lm_eval import run_lm_eval
    run_lm_eval("runs/mla/checkpoint", ["winogrande_local"], limit=40)     # -> {"winogrande_local": {"acc": ...}}

lm-eval finds models in a registry filled by the modules it has imported, and its CLI imports only its own.
Three ways to run the CLI on kvlm checkpoints:

    python -m kvlm.interop.lm_eval --model kvlm --model_args checkpoint=CKPT --tasks winogrande_local --limit 40
        (this module registers "kvlm", then runs lm_eval's CLI with the same arguments; kvlm's example task
        folder is added to --include_path when it exists)
    kvlm eval CKPT --tasks winogrande_local --limit 40                     (kvlm.cli.eval calls run_lm_eval)
    kvlm export-hf CKPT OUT; lm_eval --model hf --model_args pretrained=OUT,trust_remote_code=True ...
        (plain lm_eval, no kvlm import needed: the exported folder carries its code)

Local tasks: kvlm/interop/lm_eval_tasks/ (e.g. winogrande_local: a WinoGrande-format JSONL you name) are found
with ``--include_path`` on that folder (added by default by ``run_lm_eval`` and ``python -m``).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM

from kvlm.interop.hf import hf_tokenizer, to_hf

EXAMPLE_TASKS = Path(__file__).resolve().parent / "lm_eval_tasks"  # shipped in the wheel (package data)


@register_model("kvlm")
class KVLMEvalLM(HFLM):
    """``--model kvlm --model_args checkpoint=CKPT[,device=cpu,dtype=float32,max_length=N]``; from Python also
    ``KVLMEvalLM(model=kvlm_model, tokenizer=kvlm_tokenizer)``."""

    def __init__(
        self,
        checkpoint: str | None = None,
        model=None,
        tokenizer=None,
        device: str | None = None,
        dtype: str | torch.dtype | None = None,
        batch_size: int | str = 8,
        max_length: int | None = None,
        **kwargs,
    ):
        if (checkpoint is None) == (model is None):
            raise ValueError("kvlm lm-eval model: give checkpoint=PATH or model=KVLM (one of them)")
        if device and device.startswith("cuda") and not torch.cuda.is_available():
            device = "cpu"  # lm_eval's CLI passes its default device, cuda, on machines without one
        if isinstance(dtype, str):
            dtype = None if dtype == "auto" else getattr(torch, dtype)
        if checkpoint is not None:
            from kvlm.checkpoint import load_checkpoint

            model, tokenizer, _ = load_checkpoint(checkpoint, device=device or "cpu", dtype=dtype)
        elif device is not None or dtype is not None:
            model = model.to(device=device, dtype=dtype)
        if tokenizer is None:
            raise ValueError("kvlm lm-eval model: the checkpoint has no tokenizer.json (lm-eval needs one)")
        hf = to_hf(model)
        tok = hf_tokenizer(tokenizer)
        super().__init__(
            pretrained=hf,
            tokenizer=tok,
            batch_size=int(batch_size) if str(batch_size).isdigit() else batch_size,
            max_length=int(max_length) if max_length else model.cfg.max_seq_len,
            add_bos_token=False,
            **kwargs,
        )


def run_lm_eval(
    model,
    tokenizer_or_tasks=None,
    tasks: list[str] | str | None = None,
    *,
    limit: int | float | None = None,
    include_path: str | Path | list | None = None,
    batch_size: int = 8,
    num_fewshot: int | None = None,
    device: str | None = None,
    seed: int = 0,
) -> dict:
    """Run lm-eval ``tasks`` on a checkpoint folder or a kvlm model.

    Call as ``run_lm_eval(checkpoint, tasks)`` or ``run_lm_eval(model, tokenizer, tasks)``. ``include_path``:
    extra task folders (kvlm/interop/lm_eval_tasks is always added when present). Returns
    ``{task: {metric: value}}`` (numbers only, JSON-ready), e.g. ``{"winogrande_local": {"acc": 0.5,
    "acc_stderr": 0.08}}``; the number of scored examples per task is under "samples"."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    if tasks is None and isinstance(tokenizer_or_tasks, (str, list, tuple)):
        tokenizer, tasks = None, tokenizer_or_tasks
    else:
        tokenizer = tokenizer_or_tasks
    if not tasks:
        raise ValueError("run_lm_eval: no tasks given")
    tasks = [tasks] if isinstance(tasks, str) else list(tasks)
    if isinstance(model, (str, Path)):
        lm = KVLMEvalLM(checkpoint=str(model), device=device, batch_size=batch_size)
    else:
        lm = KVLMEvalLM(model=model, tokenizer=tokenizer, device=device, batch_size=batch_size)
    paths = [str(p) for p in _as_list(include_path)]
    if EXAMPLE_TASKS.is_dir():
        paths.append(str(EXAMPLE_TASKS))
    # indexing lm-eval's ~15k built-in task files takes ~20 s: skip it when the local folders have every task
    manager = TaskManager(include_path=paths, include_defaults=False) if paths else None
    if manager is None or not all(t in manager.all_tasks for t in tasks):
        manager = TaskManager(include_path=paths or None)
    results = simple_evaluate(
        model=lm,
        tasks=tasks,
        limit=limit,
        num_fewshot=num_fewshot,
        task_manager=manager,
        log_samples=False,
        random_seed=seed,
        numpy_random_seed=seed,
        torch_random_seed=seed,
        fewshot_random_seed=seed,
    )
    return summarize(results)


def summarize(results: dict) -> dict:
    """lm-eval's result dict -> {task: {metric: value}} with plain metric names ("acc", "acc_stderr")."""
    out: dict = {}
    for task, metrics in results.get("results", {}).items():
        row = {}
        for key, value in metrics.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and key != "sample_len":
                name = key.split(",")[0]  # "acc,none" -> "acc"
                row[name] = None if isinstance(value, float) and math.isnan(value) else value
        n = results.get("n-samples", {}).get(task, {})
        if n:
            row["samples"] = n.get("effective", n.get("original"))
        out[task] = row
    return out


def _as_list(x) -> list:
    if x is None:
        return []
    return list(x) if isinstance(x, (list, tuple)) else [x]


def cli(argv: list[str] | None = None) -> None:
    """lm_eval's command line with the "kvlm" model registered and kvlm's example tasks included."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if EXAMPLE_TASKS.is_dir() and "--include_path" not in argv:
        argv += ["--include_path", str(EXAMPLE_TASKS)]
    from lm_eval.__main__ import cli_evaluate

    sys.argv = ["lm_eval", *argv]
    cli_evaluate()


if __name__ == "__main__":
    cli()
