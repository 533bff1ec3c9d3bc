"""One run of a comparison: train a (variant, seed), then measure it.

Every run trains with the same ``TrainConfig`` (``default_train_config()``: 150 steps of 16 x 128 tokens at
peak lr 2e-3 unless changed), with its seed, the model's max_seq_len as a cap on seq_len, and evaluation /
checkpoint intervals scaled to the step budget. A run's identity (``run_key``) hashes the model, training,
evaluation, seed and data; ``kvlm.compare.job`` uses it to keep finished runs and resume interrupted ones.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvlm.bench import bench_decode, bench_prefill
from kvlm.compare.costs import HEADLINE_DTYPE, KV_DTYPES, kv_bytes_by_dtype
from kvlm.compare.variants import Variant
from kvlm.config import ModelConfig
from kvlm.data import PreparedData
from kvlm.inference.evaluation import perplexity, repetition_metrics
from kvlm.inference.generation import generate
from kvlm.logs import get_logger
from kvlm.model import count_parameters
from kvlm.training import TrainConfig, train

logger = get_logger(__name__)

PROMPTS = ("Once upon a time", "The little dog", "One day, Lily")
DEFAULT_EVAL_TOKENS = 65536  # validation tokens of each run's final loss
# the tiny preset's 6 variants x 3 seeds: about 17 minutes of training on 2 cores of a quiet Xeon (0.37 s a
# step with evaluations) and about 23 on the slower 2-core machine where one seed of 300 steps took 15 minutes
DEFAULT_STEPS = 150
# the TrainConfig fields a run key has always hashed, under their names in the key (results stay reusable)
_KEY_FIELDS = {
    "steps": "max_steps",
    "tokens": "max_tokens",
    "minutes": "max_minutes",
    "batch_size": "batch_size",
    "seq_len": "seq_len",
    "lr": "lr",
    "warmup": "warmup_steps",
}


def default_train_config(**changes: Any) -> TrainConfig:
    """The training of every run unless changed: 150 steps of 16 x 128 tokens, peak lr 2e-3, 20 warm-up steps.
    ``changes``: TrainConfig fields; giving any budget field replaces the step default."""
    budget = {k: changes.pop(k) for k in ("max_steps", "max_tokens", "max_minutes") if k in changes}
    if not any(v is not None for v in budget.values()):
        budget["max_steps"] = DEFAULT_STEPS
    fields = {"batch_size": 16, "seq_len": 128, "lr": 2e-3, "warmup_steps": 20, "max_steps": None}
    return TrainConfig(**{**fields, **budget, **changes})


def describe_budget(tcfg: TrainConfig) -> str:
    """The report's budget line: "300 steps of 16x128 tokens, peak lr 0.002"."""
    parts = []
    if tcfg.max_steps:
        parts.append(f"{tcfg.max_steps} steps")
    if tcfg.max_tokens:
        parts.append(f"{tcfg.max_tokens} tokens")
    if tcfg.max_minutes:
        parts.append(f"{tcfg.max_minutes} min")
    return " / ".join(parts) + f" of {tcfg.batch_size}x{tcfg.seq_len} tokens, peak lr {tcfg.lr}"


def run_key(cfg: ModelConfig, tcfg: TrainConfig, eval_tokens: int, seed: int, data_id: str) -> str:
    """The identity of one run's result: model, training, evaluation, seed and data."""
    budget: dict[str, Any] = {key: getattr(tcfg, name) for key, name in _KEY_FIELDS.items()}
    budget["eval_tokens"] = eval_tokens
    defaults = TrainConfig(batch_size=16, seq_len=128, lr=2e-3, warmup_steps=20, max_steps=300).to_dict()
    changed = {k: v for k, v in tcfg.to_dict().items() if k not in _KEY_FIELDS.values() and v != defaults[k]}
    if changed:  # other training fields enter the key only when they differ from the defaults
        budget["train"] = changed
    blob = json.dumps({"cfg": cfg.to_dict(), "budget": budget, "seed": seed, "data": data_id}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def run_train_config(train_cfg: TrainConfig, cfg: ModelConfig, seed: int) -> TrainConfig:
    """The TrainConfig of one run: the comparison's, with its seed and intervals scaled to the budget (8
    validation points for the loss curves, a checkpoint at each so an interruption loses little)."""
    steps = train_cfg.total_steps() or 200
    return train_cfg.replace(
        seq_len=min(train_cfg.seq_len, cfg.max_seq_len),
        seed=seed,
        eval_interval=max(1, steps // 8),
        eval_iters=4,
        log_interval=max(1, min(10, steps // 20)),
        checkpoint_interval=max(1, steps // 8),
    )


@contextlib.contextmanager
def _quiet_training():
    """The comparison logs one line per run; the training loop's per-interval lines would bury them."""
    lg = logging.getLogger("kvlm.training")
    level = lg.level
    lg.setLevel(logging.WARNING)
    try:
        yield
    finally:
        lg.setLevel(level)


def run_variant(
    variant: Variant,
    data: PreparedData,
    train_cfg: TrainConfig,
    seed: int,
    run_dir: Path,
    *,
    eval_tokens: int = DEFAULT_EVAL_TOKENS,
    resume: bool = False,
    callback: Callable[[dict], None] | None = None,
    contexts: list[int] | None = None,
) -> dict:
    """Train one variant (resuming run_dir/checkpoint when ``resume``), then measure it: validation loss on
    the first ``eval_tokens`` validation tokens, parameters, KV bytes per token per dtype, samples and their
    repetition, and (when ``contexts`` is given) its own decode speed on this machine (overhead-bound for tiny
    models: reported apart, never as a cost). Returns the result dict (the caller stores it as result.json)."""
    cfg = variant.cfg
    tcfg = run_train_config(train_cfg, cfg, seed)
    run_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with _quiet_training():
        trained = train(
            None if resume else cfg,
            tcfg,
            data=data,
            out_dir=run_dir,
            progress=False,
            resume=resume,
            callback=callback,
        )
    train_s = time.perf_counter() - t0
    model = trained.model.eval()
    t1 = time.perf_counter()
    val = perplexity(model, data.val_tokens()[:eval_tokens], seq_len=tcfg.seq_len, batch_size=8)
    samples = _samples(model, data.tokenizer, seed)
    by_dtype = kv_bytes_by_dtype(cfg)
    result = {
        "label": variant.label,
        "note": variant.note,
        "seed": seed,
        "config": cfg.to_dict(),
        "attention": cfg.attention,
        "params": count_parameters(cfg),
        "kv_elements_per_token": cfg.kv_cache_elements_per_token(),
        "kv_elements_per_token_per_layer": cfg.kv_cache_elements_per_layer(),
        "kv_bytes_per_token": cfg.kv_cache_bytes_per_token(KV_DTYPES[HEADLINE_DTYPE]),
        "kv_bytes_per_token_by_dtype": by_dtype,
        "val_loss": val["loss"],
        "val_loss_stderr": val.get("stderr"),
        "val_perplexity": val["perplexity"],
        "val_tokens": val["tokens"],
        "train_steps": trained.steps,
        "train_tokens": trained.tokens,
        "train_seconds_this_session": train_s,
        "train_tokens_per_s": trained.tokens_per_s,
        "step_time_ms": trained.step_time_ms,
        "history": trained.history,
        "samples": [{"prompt": s["prompt"], "text": s["text"]} for s in samples],
        "repetition": repetition_metrics([s["ids"] for s in samples]),
    }
    result["measure_seconds"] = time.perf_counter() - t1  # final loss and samples: part of the job's budget
    if contexts:
        result["tiny_speed"] = measure_speed(model, contexts)
    return result


def _samples(model, tokenizer, seed: int) -> list[dict]:
    out = []
    for i, prompt in enumerate(PROMPTS):
        ids = tokenizer.encode(prompt)
        gen = generate(
            model,
            ids,
            max_new_tokens=48,
            temperature=0.8,
            top_k=50,
            seed=seed * 1000 + i,
            stop_tokens=[tokenizer.eos_id],
        )
        new = gen[0] if gen and isinstance(gen[0], list) else gen
        out.append({"prompt": prompt, "ids": list(new), "text": tokenizer.decode(list(new))})
    return out


def default_contexts(max_seq_len: int) -> list[int]:
    """Short, half and nearly full context of the model: where decode cost is set by weights, then by the cache."""
    return sorted({max(1, max_seq_len // 8), max_seq_len // 2, max(1, max_seq_len - 32)})


def measure_speed(model, contexts: list[int], decode_steps: int = 16, repeats: int = 3) -> dict:
    """Prefill latency of a 128-token prompt and decode tokens/s after `context` cached tokens (batch 1,
    the model's own "auto" routes), medians over repeats, measured with kvlm bench's timers."""
    cfg = model.cfg
    prompt = min(128, cfg.max_seq_len)
    prefill = bench_prefill(model, 1, prompt, "auto", warmup=1, repeats=repeats)
    decode = {}
    for ctx in contexts:
        if ctx + decode_steps + 2 <= cfg.max_seq_len:
            decode[str(ctx)] = bench_decode(model, 1, ctx, "auto", warmup=2, steps=decode_steps)[
                "tokens_per_s"
            ]
    return {"prefill_ms": prefill["median_ms"], "prefill_tokens": prompt, "decode_tokens_per_s": decode}
