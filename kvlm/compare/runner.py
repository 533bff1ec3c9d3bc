"""Running a comparison: train each (variant, seed), measure it, aggregate, write the files.

Every run trains with the same ``TrainConfig`` (``default_train_config()``: 300 steps of 16 x 128 tokens at peak
lr 2e-3 unless changed), with its seed, the model's max_seq_len as a cap on seq_len, and evaluation / log
intervals scaled to the step budget. Each (variant, seed) stores runs/<label>/seed<seed>/result.json when it
finishes, keyed by a hash of the model, training, seed and data; re-running skips runs whose key matches, so an
interrupted comparison resumes where it stopped.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import time
from pathlib import Path
from typing import Any

import torch

from kvlm import __version__
from kvlm.bench import bench_decode, bench_prefill, machine_info
from kvlm.compare.aggregate import KV_DTYPE_BYTES, aggregate
from kvlm.compare.report import atomic_write, write_outputs
from kvlm.compare.variants import Variant, load_variants
from kvlm.config import ModelConfig
from kvlm.data import PreparedData, load_or_prepare
from kvlm.inference.evaluation import perplexity, repetition_metrics
from kvlm.inference.generation import generate
from kvlm.logs import get_logger
from kvlm.model import count_parameters
from kvlm.training import TrainConfig, train

logger = get_logger(__name__)

PROMPTS = ("Once upon a time", "The little dog", "One day, Lily")
DEFAULT_EVAL_TOKENS = 65536  # validation tokens of each run's final perplexity
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
    """The training of every run unless changed: 300 steps of 16 x 128 tokens, peak lr 2e-3, 20 warm-up steps.
    ``changes``: TrainConfig fields; giving any budget field replaces the 300-step default."""
    budget = {k: changes.pop(k) for k in ("max_steps", "max_tokens", "max_minutes") if k in changes}
    if not any(v is not None for v in budget.values()):
        budget["max_steps"] = 300
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
    defaults = default_train_config().to_dict()
    changed = {k: v for k, v in tcfg.to_dict().items() if k not in _KEY_FIELDS.values() and v != defaults[k]}
    if changed:  # other training fields enter the key only when they differ from the defaults
        budget["train"] = changed
    blob = json.dumps({"cfg": cfg.to_dict(), "budget": budget, "seed": seed, "data": data_id}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


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
    out_dir: Path,
    contexts: list[int] | None,
    eval_tokens: int = DEFAULT_EVAL_TOKENS,
) -> dict:
    """Train one variant, then measure it. Returns the result dict (the caller stores it as result.json)."""
    cfg = (
        variant.cfg.replace(vocab_size=data.vocab_size)
        if variant.cfg.vocab_size != data.vocab_size
        else variant.cfg
    )
    run_dir = out_dir / "runs" / variant.label / f"seed{seed}"
    run_dir.mkdir(parents=True, exist_ok=True)
    steps = train_cfg.max_steps or 200
    tcfg = train_cfg.replace(
        seq_len=min(train_cfg.seq_len, cfg.max_seq_len),
        seed=seed,
        eval_interval=max(1, steps // 8),
        eval_iters=4,
        log_interval=max(1, steps // 20),
    )
    logger.info(
        f"[{variant.label} seed {seed}] training {count_parameters(cfg)['total'] / 1e6:.2f} M parameters"
    )
    t0 = time.perf_counter()
    with _quiet_training():
        trained = train(cfg, tcfg, data=data, out_dir=run_dir, progress=False)
    train_s = time.perf_counter() - t0
    model = trained.model.eval()
    val = perplexity(model, data.val_tokens()[:eval_tokens], seq_len=tcfg.seq_len, batch_size=8)
    speed = measure_speed(model, contexts or default_contexts(cfg.max_seq_len))
    samples = _samples(model, data.tokenizer, seed)
    rep = repetition_metrics([s["ids"] for s in samples])
    counts = count_parameters(cfg)
    return {
        "label": variant.label,
        "note": variant.note,
        "seed": seed,
        "config": cfg.to_dict(),
        "attention": cfg.attention,
        "params": counts,
        "kv_elements_per_token": cfg.kv_cache_elements_per_token(),
        "kv_elements_per_token_per_layer": cfg.kv_cache_elements_per_layer(),
        "kv_bytes_per_token": cfg.kv_cache_bytes_per_token(KV_DTYPE_BYTES),
        "val_loss": val["loss"],
        "val_loss_stderr": val.get("stderr"),
        "val_perplexity": val["perplexity"],
        "val_tokens": val["tokens"],
        "train_seconds": train_s,
        "train_tokens": trained.tokens,
        "train_tokens_per_s": trained.tokens / max(train_s, 1e-9),
        "history": trained.history,
        **speed,
        "samples": [{"prompt": s["prompt"], "text": s["text"]} for s in samples],
        "repetition": rep,
    }


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
) -> dict:
    """Train and measure every variant of ``preset`` (or ``variants_file``) for each seed, write results.json,
    results.csv, report.md and plots into ``out``; -> a summary (report path, best loss, Pareto front, rows).

    train_cfg: the training of every run (default ``default_train_config()``); its seed is replaced by each
    of ``seeds``. contexts: decode-speed context lengths (default: 1/8, 1/2 and nearly all of max_seq_len)."""
    train_cfg = train_cfg or default_train_config()
    seeds = seeds or [0]
    variants, models_note = load_variants(preset, variants_file, paper_sizes)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    data = load_or_prepare(data_source, out / "data")
    logger.info(f"data: {data.describe()}")
    results = []
    for v in variants:
        for seed in seeds:
            rdir = out / "runs" / v.label / f"seed{seed}"
            key = run_key(
                v.cfg.replace(vocab_size=data.vocab_size), train_cfg, eval_tokens, seed, data.content_hash
            )
            done = rdir / "result.json"
            if done.is_file():
                prev = json.loads(done.read_text())
                if prev.get("key") == key:
                    logger.info(f"[{v.label} seed {seed}] done earlier, reusing {done}")
                    results.append(prev)
                    continue
            res = run_variant(v, data, train_cfg, seed, out, contexts, eval_tokens)
            res["key"] = key
            rdir.mkdir(parents=True, exist_ok=True)
            atomic_write(done, json.dumps(res, indent=2, default=str))
            logger.info(
                f"[{v.label} seed {seed}] val loss {res['val_loss']:.4f}, KV {res['kv_bytes_per_token']} B/token"
            )
            results.append(res)
    rows = aggregate(results)
    meta = {
        "preset": variants_file or preset,
        "models_note": models_note,
        "data": data.describe(),
        "budget": describe_budget(train_cfg),
        "seeds": seeds,
        "machine": machine_info(torch.device("cuda" if torch.cuda.is_available() else "cpu")),
        "kvlm": __version__,
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
        "command": command,
    }
    paths = write_outputs(out, rows, results, meta)
    best = min(rows, key=lambda r: r["val_loss"])
    summary_fields = (
        "label",
        "val_loss",
        "val_loss_std",
        "kv_bytes_per_token",
        "params_total",
        "within_noise_of_best",
    )
    return {
        "out": str(out),
        "report": str(paths["report"]),
        "best_val_loss": best["label"],
        "pareto": [r["label"] for r in rows if r["pareto"]],
        "variants": [{k: r[k] for k in summary_fields} for r in rows],
    }
