"""The whole comparison: every (variant, seed) run, resumable, with one progress bar; then the statistics, the
costs and the files.

Each run lives in out/runs/<label>/seed<seed>/: key.json (its ``run_key``) is written when it starts, the
trainer's checkpoint/ while it trains, result.json when it is done. Re-running the same command keeps finished
runs (same key), resumes interrupted ones from their checkpoint (the trainer restores weights, optimizer,
RNG states and data position, so the result equals an uninterrupted run's) and starts the rest. A run folder
holding a different run (another key: the model, budget or data changed) is an error unless ``force``.

Progress: in a terminal, one tqdm bar over all runs' optimizer steps with its ETA; otherwise one log line per
run (kvlm.logs) with the runs done and the estimated time left.
"""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from kvlm import __version__
from kvlm.bench import machine_info
from kvlm.compare.aggregate import aggregate, choose_baseline
from kvlm.compare.costs import (
    DEFAULT_DEPLOY,
    DEFAULT_HARDWARE,
    at_reference_size,
    cache_bytes,
    hardware_list,
    project,
)
from kvlm.compare.report import atomic_write, write_outputs
from kvlm.compare.runner import (
    DEFAULT_EVAL_TOKENS,
    default_train_config,
    describe_budget,
    run_key,
    run_variant,
)
from kvlm.compare.variants import MATCH_MODES, Variant, load_variants, match_variants
from kvlm.config import ConfigError
from kvlm.data import load_or_prepare
from kvlm.logs import ROOT, get_logger
from kvlm.training import TrainConfig

logger = get_logger(__name__)

SYNTHETIC_LABEL = "synthetic stories (not real text)"
DEFAULT_SEEDS = (0, 1, 2)


def compare(
    preset: str = "tiny",
    out: str | Path = "runs/compare",
    data_source: str = "synthetic",
    train_cfg: TrainConfig | None = None,
    seeds: list[int] | None = None,
    variants_file: str | None = None,
    paper_sizes: bool = False,
    contexts: list[int] | None = None,
    command: str = "",
    eval_tokens: int = DEFAULT_EVAL_TOKENS,
    *,
    baseline: str | None = None,
    match: str = "preset",
    hardware: list[str] | None = None,
    deploy: tuple[int, int] = DEFAULT_DEPLOY,
    tokenizer: str = "bpe",
    vocab_size: int = 4096,
    force: bool = False,
    progress: bool | None = None,
) -> dict:
    """Train and measure every variant of ``preset`` (or ``variants_file``) for each seed (default 0, 1, 2),
    write results.json, results.csv, report.md and plots into ``out``; -> a summary (report path, Pareto front,
    verdicts, rows).

    data_source: 'synthetic', text files / a folder (tokenized with ``tokenizer``: "bpe" of ``vocab_size``
    trained on them, "gpt2" or a tokenizer path) or a prepared folder. baseline: the label every variant is
    compared with (default: the first MHA, else the first). match: "preset", "params" or "activated"
    (``match_variants``). hardware: names for the decode projection at the reference size (default
    cpu-measured, h100); deploy: (batch, context) of the cache-memory and projection columns. contexts: also
    time the tiny trained models' decode at these contexts (overhead-bound; an appendix). progress: a bar
    (default: when stderr is a terminal)."""
    t_start = time.perf_counter()
    if match not in MATCH_MODES:
        raise ConfigError(f"unknown match {match!r}; known: {', '.join(MATCH_MODES)}")
    if min(deploy) < 1:
        raise ConfigError(f"the deployment point needs batch >= 1 and context >= 1, got {deploy}")
    train_cfg = train_cfg or default_train_config()
    seeds = list(seeds) if seeds else list(DEFAULT_SEEDS)
    if len(set(seeds)) != len(seeds):
        raise ConfigError(f"seeds must be distinct, got {seeds}")
    variants, models_note = load_variants(preset, variants_file, paper_sizes)
    base_label = choose_baseline([(v.label, v.cfg.attention) for v in variants], baseline)
    hw = hardware_list(list(hardware or DEFAULT_HARDWARE))  # unknown names fail before any training
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    data = load_or_prepare(data_source, out / "data", tokenizer=tokenizer, vocab_size=vocab_size, force=force)
    synthetic = bool(data.meta.get("synthetic"))
    # describe() starts with the source's own name; the synthetic one is named the same way everywhere
    data_text = f"{SYNTHETIC_LABEL}: {data.describe().split(': ', 1)[-1]}" if synthetic else data.describe()
    logger.info(f"data: {data_text}")
    variants = [Variant(v.label, v.cfg.replace(vocab_size=data.vocab_size), v.note) for v in variants]
    variants = match_variants(variants, base_label, match)

    jobs = [(v, s) for v in variants for s in seeds]
    results = _run_all(jobs, data, train_cfg, out, eval_tokens, contexts, force, progress)

    rows = aggregate(results, base_label)
    by_label = {v.label: v for v in variants}
    batch, context = deploy
    for r in rows:
        ref = at_reference_size(by_label[r["label"]].cfg, context)
        r["deploy_cache_bytes"] = {
            d: cache_bytes(b, batch, context) for d, b in r["kv_bytes_per_token_by_dtype"].items()
        }
        r["reference"] = {
            "config": ref.to_dict(),
            "kv_bytes_per_token_bf16": ref.kv_cache_bytes_per_token(2),
            "cache_bytes_bf16": cache_bytes(ref.kv_cache_bytes_per_token(2), batch, context),
            "projection": project(ref, hw, batch, context),
        }
    meta = {
        "preset": variants_file or preset,
        "models_note": models_note,
        "data": data_text,
        "synthetic": synthetic,
        "budget": describe_budget(train_cfg),
        "train_tokens_per_run": sorted({t for r in rows for t in r["train_tokens"]}),
        "seeds": seeds,
        "baseline": base_label,
        "match": f"{match}: {MATCH_MODES[match]}",
        "deploy": {"batch": batch, "context": context},
        "hardware": [
            {
                "name": h.name,
                "bandwidth_bytes_per_s": h.bandwidth_bytes_per_s,
                "peak_flops": h.peak_flops,
                "dtype": h.dtype,
                "source": h.source,
            }
            for h in hw
        ],  # fmt: skip
        "machine": machine_info(torch.device("cuda" if torch.cuda.is_available() else "cpu")),
        "kvlm": __version__,
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
        "command": command,
        # training seconds of every run (resumed sessions included) and this invocation's wall time
        "train_minutes_all_runs": sum((r["history"] or [{}])[-1].get("elapsed", 0.0) for r in results) / 60,
        "wall_minutes": (time.perf_counter() - t_start) / 60,
    }
    paths = write_outputs(out, rows, results, meta)
    fields = (
        "label",
        "val_loss",
        "val_loss_std",
        "val_loss_ci95",
        "kv_bytes_per_token",
        "params_total",
        "pareto",
    )
    return {
        "out": str(out),
        "report": str(paths["report"]),
        "baseline": base_label,
        "best_val_loss": min(rows, key=lambda r: r["val_loss"])["label"],
        "pareto": [r["label"] for r in rows if r["pareto"]],
        "vs_baseline": {r["label"]: r["vs_baseline"]["verdict"] for r in rows},
        "variants": [{k: r[k] for k in fields} for r in rows],
    }


def _state(rdir: Path, key: str, force: bool) -> str:
    """'done', 'resume' (a checkpoint of this run), 'fresh' (nothing there), or an error for another run."""
    done, key_file, ckpt = rdir / "result.json", rdir / "key.json", rdir / "checkpoint"
    if done.is_file() and json.loads(done.read_text()).get("key") == key:
        return "done"
    if key_file.is_file() and json.loads(key_file.read_text()).get("key") == key:
        return "resume" if (ckpt / "trainer_state.pt").is_file() else "fresh"
    if rdir.exists() and any(rdir.iterdir()):
        if not force:
            raise ConfigError(
                f"{rdir} holds a different run (its model, training budget, seed or data differ from this "
                "command's); pass --force to replace it, or choose another --out"
            )
        logger.warning(f"--force: replacing {rdir}")
        shutil.rmtree(rdir)
    return "fresh"


def _run_all(jobs, data, train_cfg, out: Path, eval_tokens, contexts, force, progress) -> list[dict]:
    steps_per_run = train_cfg.total_steps()
    plan = []
    for v, seed in jobs:
        rdir = out / "runs" / v.label / f"seed{seed}"
        key = run_key(v.cfg, train_cfg, eval_tokens, seed, data.content_hash)
        plan.append((v, seed, rdir, key, _state(rdir, key, force)))
    todo = [p for p in plan if p[4] != "done"]
    if progress is None:
        progress = sys.stderr.isatty()
    bar = tqdm(
        total=steps_per_run * len(todo) if steps_per_run else None,
        disable=not progress,
        unit="step",
        dynamic_ncols=True,
        file=sys.stderr,
        desc=f"{len(todo)} runs",
    )
    results, t_start, finished = [], time.perf_counter(), 0
    first_seed = {v.label: seed for v, seed in jobs[::-1]}
    try:
        with logging_redirect_tqdm([logging.getLogger(ROOT)]) if progress else contextlib.nullcontext():
            for v, seed, rdir, key, state in plan:
                name = f"[{v.label} seed {seed}]"
                if state == "done":
                    logger.info(f"{name} done earlier, reusing {rdir / 'result.json'}")
                    results.append(json.loads((rdir / "result.json").read_text()))
                    continue
                rdir.mkdir(parents=True, exist_ok=True)
                atomic_write(rdir / "key.json", json.dumps({"key": key, "label": v.label, "seed": seed}))
                seen = {"step": 0}

                def tick(rec, seen=seen):
                    bar.update(rec["step"] - seen["step"])
                    seen["step"] = rec["step"]

                if state == "resume":
                    logger.info(f"{name} resuming from {rdir / 'checkpoint'}")
                    seen["step"] = _checkpoint_step(rdir / "checkpoint")
                    bar.update(seen["step"])
                res = run_variant(
                    v, data, train_cfg, seed, rdir, eval_tokens=eval_tokens, resume=state == "resume",
                    callback=tick, contexts=contexts if first_seed[v.label] == seed else None,
                )  # fmt: skip
                if steps_per_run:
                    bar.update(steps_per_run - seen["step"])
                res["key"] = key
                atomic_write(rdir / "result.json", json.dumps(res, indent=2, default=str))
                results.append(res)
                finished += 1
                spent = time.perf_counter() - t_start
                left = spent / finished * (len(todo) - finished)
                logger.info(
                    f"{name} val loss {res['val_loss']:.4f}, KV {res['kv_bytes_per_token']:,} B/token; "
                    f"{finished}/{len(todo)} runs done, {spent / 60:.1f} min, about {left / 60:.1f} min left"
                )
    finally:
        bar.close()
    return results


def _checkpoint_step(ckpt: Path) -> int:
    try:
        return int(json.loads((ckpt / "meta.json").read_text()).get("step", 0))
    except (OSError, ValueError):
        return 0
