"""`kvlm compare`: which attention, at what cost?

Trains several attention variants at a matched parameter budget on the same data, then measures, for each:
validation loss and perplexity, parameters, KV elements and bytes per token, prefill latency, decode speed at
a few context lengths, and sampled continuations with their repetition. Writes results.json, results.csv,
report.md and plots (Pareto front of loss against KV bytes, loss curves, decode speed) to an output folder.

Each (variant, seed) run stores its result.json when it finishes; re-running the same command skips runs
whose result exists with the same configuration, so an interrupted comparison resumes where it stopped.
"""

from __future__ import annotations

import csv
import hashlib
import json
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvlm.config import ConfigError, ModelConfig

PROMPTS = ("Once upon a time", "The little dog", "One day, Lily")
KV_DTYPE_BYTES = 2  # bytes per cached element in the report: bf16, how the papers and deployments count


@dataclass
class Variant:
    label: str
    cfg: ModelConfig
    note: str = ""


@dataclass
class Budget:
    steps: int | None = None
    tokens: int | None = None
    minutes: float | None = None
    batch_size: int = 16
    seq_len: int = 128
    lr: float = 2e-3
    warmup: int = 20
    eval_tokens: int = 65536

    def describe(self) -> str:
        parts = []
        if self.steps:
            parts.append(f"{self.steps} steps")
        if self.tokens:
            parts.append(f"{self.tokens} tokens")
        if self.minutes:
            parts.append(f"{self.minutes} min")
        return " / ".join(parts) + f" of {self.batch_size}x{self.seq_len} tokens, peak lr {self.lr}"


# --- the comparison presets ----------------------------------------------------------------------------


def _tiny() -> tuple[list[Variant], str]:
    from kvlm.presets import get_preset

    names = ["mha", "gqa", "mla", "mla-norope", "eg-mla", "mlra-4"]
    return [
        Variant(n, get_preset(f"tiny/{n}")) for n in names
    ], "tiny models (kvlm presets tiny/*), FFN width matched to tiny/mha"


def _small_lm(paper_sizes: bool) -> tuple[list[Variant], str]:
    """mla-small-lm.md Table 2: MHA, MLA and MLA+RoPE at r = d, d/2, d/4, d/8, d/16 (9L-512d in the paper).

    Reading of the paper: K and V have separate latents of rank r each (its Eqs. 2-3), so r = d caches as
    much as MHA (its Table 2 lists the same KV memory); kv_latent="separate". MLA+RoPE adds a decoupled RoPE
    key of d_h/2. Scaled: 4 layers, d = 128 (the same r/d ratios and heads-to-width ratio)."""
    from kvlm.presets import match_ffn_dim

    if paper_sizes:
        base = dict(n_layer=9, d_model=512, n_head=8, max_seq_len=512, vocab_size=50304)
        note = "paper sizes: 9L-512d (mla-small-lm.md Table 2)"
    else:
        base = dict(n_layer=4, d_model=128, n_head=4, max_seq_len=512)
        note = "scaled from the paper's 9L-512d to 4L-128d; r/d ratios and RoPE dims kept"
    base.update(arch="gpt2", tie_embeddings=True, dropout=0.0)
    ref = ModelConfig(attention="mha", **base)
    d = base["d_model"]
    out = [Variant("mha", ref)]
    for rope in (False, True):
        for div in (1, 2, 4, 8, 16):
            r = d // div
            cfg = ModelConfig(
                attention="mla",
                kv_lora_rank=r,
                kv_latent="separate",
                rope=rope,
                rope_head_dim=(d // base["n_head"]) // 2 if rope else 0,
                **base,
            )
            label = (
                f"mla{'+rope' if rope else ''}-r=d/{div}" if div > 1 else f"mla{'+rope' if rope else ''}-r=d"
            )
            out.append(Variant(label, match_ffn_dim(cfg, ref)))
    return out, note


def _eg_mla(paper_sizes: bool) -> tuple[list[Variant], str]:
    """eg-mla.md Tables 1 and 3: MLA-kv256 against EG-MLA kv256/128/64/16, and EG-MLA-kv64 without
    LayerNorm and with addition instead of the product. Paper: 12L-768d, kv_emb_dim 256.
    Scaled: 4L-192d, latent ranks and kv_emb_dim scaled by 192/768 = 1/4."""
    if paper_sizes:
        scale, base = 1, dict(n_layer=12, d_model=768, n_head=12, vocab_size=50304, max_seq_len=1024)
        note = "paper sizes: Base 12L-768d (eg-mla.md Appendix A)"
    else:
        scale, base = 4, dict(n_layer=4, d_model=192, n_head=3, max_seq_len=512)
        note = "scaled from the paper's 12L-768d to 4L-192d; kv_lora_rank and kv_emb_dim divided by 4"
    base.update(arch="gpt2", head_dim=64, rope_head_dim=64, q_lora_rank=0)
    emb = 256 // scale
    out = [Variant(f"mla-kv{256}", ModelConfig(attention="mla", kv_lora_rank=256 // scale, **base))]
    for kv in (256, 128, 64, 16):
        cfg = ModelConfig(attention="eg-mla", kv_lora_rank=max(1, kv // scale), kv_emb_dim=emb, **base)
        out.append(Variant(f"eg-mla-kv{kv}", cfg))
    kv64 = max(1, 64 // scale)
    out.append(
        Variant(
            "eg-mla-kv64-noLN",
            ModelConfig(attention="eg-mla", kv_lora_rank=kv64, kv_emb_dim=emb, eg_norm=False, **base),
        )
    )
    out.append(
        Variant(
            "eg-mla-kv64-add",
            ModelConfig(attention="eg-mla", kv_lora_rank=kv64, kv_emb_dim=emb, eg_op="add", **base),
        )
    )
    return out, note + " (labels keep the paper's kv sizes)"


def _mlra(paper_sizes: bool) -> tuple[list[Variant], str]:
    """mlra.md Table 3's variants at matched parameters (FFN width matched to MHA, as the paper does)."""
    from kvlm.presets import get_preset, match_ffn_dim

    names = ["mha", "mqa", "gqa", "mla", "mfa", "tpa", "gla-2", "gla-4", "gta", "mlra-2", "mlra-4"]
    if paper_sizes:
        return [
            Variant(n, get_preset(f"mlra-2.9b/{n}")) for n in names
        ], "paper sizes: 2.9B (mlra.md Tables 7-17)"
    ref = get_preset("tiny/mha")
    return [Variant(n, match_ffn_dim(get_preset(f"tiny/{n}"), ref)) for n in names], (
        "tiny models (kvlm presets tiny/*), FFN width matched to tiny/mha as mlra.md Appendix F does at 2.9B"
    )


COMPARE_PRESETS = {
    "tiny": lambda paper: _tiny(),
    "small-lm": _small_lm,
    "eg-mla": _eg_mla,
    "mlra": _mlra,
}


def load_variants(
    preset: str | None, variants_file: str | None, paper_sizes: bool = False
) -> tuple[list[Variant], str]:
    if variants_file:
        return _load_list(variants_file), f"variants from {variants_file}"
    if preset not in COMPARE_PRESETS:
        raise ConfigError(f"unknown compare preset {preset!r}; known: {', '.join(COMPARE_PRESETS)}")
    return COMPARE_PRESETS[preset](paper_sizes)


def _load_list(path: str) -> list[Variant]:
    """YAML: a list of {label, preset?, ...ModelConfig overrides}, or {variants: [...], base: {...}}."""
    import yaml

    raw = yaml.safe_load(Path(path).read_text())
    base: dict[str, Any] = {}
    if isinstance(raw, dict):
        base = raw.get("base", {}) or {}
        raw = raw.get("variants")
    if not isinstance(raw, list) or not raw:
        raise ConfigError(f"{path}: expected a non-empty list of variants (or a mapping with 'variants:')")
    out = []
    for i, item in enumerate(raw):
        if not isinstance(item, dict):
            raise ConfigError(f"{path}: variant {i} is not a mapping")
        item = dict(item)
        label = str(item.pop("label", item.get("attention", f"variant{i}")))
        preset = item.pop("preset", None)
        fields = {**base, **item}
        cfg = ModelConfig.from_preset(preset, **fields) if preset else ModelConfig.from_dict(fields)
        out.append(Variant(label, cfg))
    labels = [v.label for v in out]
    if len(set(labels)) != len(labels):
        raise ConfigError(f"{path}: variant labels must be unique, got {labels}")
    return out


# --- one run ---------------------------------------------------------------------------------------------


def _config_hash(cfg: ModelConfig, budget: Budget, seed: int, data_id: str) -> str:
    blob = json.dumps(
        {"cfg": cfg.to_dict(), "budget": budget.__dict__, "seed": seed, "data": data_id}, sort_keys=True
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def run_variant(
    variant: Variant, data, budget: Budget, seed: int, out_dir: Path, contexts: list[int], log
) -> dict:
    """Train one variant, then measure it. Returns the result dict (also stored as result.json)."""
    from kvlm.inference.evaluation import perplexity, repetition_metrics
    from kvlm.inference.generation import generate
    from kvlm.model import count_parameters
    from kvlm.training.train import TrainConfig, train

    cfg = (
        variant.cfg.replace(vocab_size=data.vocab_size)
        if variant.cfg.vocab_size != data.vocab_size
        else variant.cfg
    )
    run_dir = out_dir / "runs" / variant.label / f"seed{seed}"
    run_dir.mkdir(parents=True, exist_ok=True)
    tcfg = TrainConfig(
        batch_size=budget.batch_size,
        seq_len=min(budget.seq_len, cfg.max_seq_len),
        max_steps=budget.steps,
        max_tokens=budget.tokens,
        max_minutes=budget.minutes,
        lr=budget.lr,
        warmup_steps=budget.warmup,
        seed=seed,
        eval_interval=max(1, (budget.steps or 200) // 8),
        eval_iters=4,
        log_interval=max(1, (budget.steps or 200) // 20),
    )
    log(f"[{variant.label} seed {seed}] training {count_parameters(cfg)['total'] / 1e6:.2f} M parameters")
    t0 = time.perf_counter()
    trained = train(cfg, tcfg, data=data, out_dir=run_dir, progress=False, log=None)
    train_s = time.perf_counter() - t0
    model = trained.model.eval()
    val = perplexity(model, data.val_tokens()[: budget.eval_tokens], seq_len=tcfg.seq_len, batch_size=8)
    speed = measure_speed(model, contexts or default_contexts(cfg.max_seq_len))
    samples = _samples(model, data.tokenizer, generate, seed)
    rep = repetition_metrics([s["ids"] for s in samples])
    counts = count_parameters(cfg)
    result = {
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
    return result


def _samples(model, tokenizer, generate, seed: int) -> list[dict]:
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
    the model's own "auto" routes), medians over repeats, measured with kvlm.bench.run's timers."""
    from kvlm.bench.run import bench_decode, bench_prefill

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


# --- aggregation and report ------------------------------------------------------------------------------


def aggregate(results: list[dict]) -> list[dict]:
    """One row per variant: mean and std over seeds of the quality and speed numbers."""
    rows = []
    labels = list(dict.fromkeys(r["label"] for r in results))
    for label in labels:
        rs = [r for r in results if r["label"] == label]
        losses = [r["val_loss"] for r in rs]
        row = {
            "label": label,
            "attention": rs[0]["attention"],
            "seeds": [r["seed"] for r in rs],
            "params_total": rs[0]["params"]["total"],
            "params_activated": rs[0]["params"]["activated"],
            "params_embedding": rs[0]["params"]["embedding"] + rs[0]["params"]["gate_embedding"],
            "kv_elements_per_token": rs[0]["kv_elements_per_token"],
            "kv_bytes_per_token": rs[0]["kv_bytes_per_token"],
            "val_loss": statistics.fmean(losses),
            "val_loss_std": statistics.stdev(losses) if len(losses) > 1 else None,
            "val_loss_stderr": statistics.fmean([r["val_loss_stderr"] or 0.0 for r in rs]),
            "val_perplexity": statistics.fmean([r["val_perplexity"] for r in rs]),
            "prefill_ms": statistics.fmean([r["prefill_ms"] for r in rs]),
            "train_tokens_per_s": statistics.fmean([r["train_tokens_per_s"] for r in rs]),
            "decode_tokens_per_s": {
                ctx: statistics.fmean(
                    [r["decode_tokens_per_s"][ctx] for r in rs if ctx in r["decode_tokens_per_s"]]
                )
                for ctx in rs[0]["decode_tokens_per_s"]
            },
            "distinct_2": _mean_of(r["repetition"].get("distinct_2") for r in rs),
            "repeated_4gram_rate": _mean_of(r["repetition"].get("rep_4") for r in rs),
        }
        rows.append(row)
    mha = next((r for r in rows if r["attention"] == "mha"), rows[0])
    for r in rows:
        r["kv_reduction_vs_first_mha"] = 1 - r["kv_bytes_per_token"] / mha["kv_bytes_per_token"]
        r["val_loss_delta_pct"] = 100 * (r["val_loss"] / mha["val_loss"] - 1)
    _mark_noise(rows)
    _mark_pareto(rows)
    return rows


def _mean_of(values) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.fmean(vals) if vals else None


def _noise(row: dict) -> float:
    """One standard deviation of a variant's mean loss: across seeds when there are several, else the
    standard error of the validation estimate (which ignores seed-to-seed training noise)."""
    n = len(row["seeds"])
    if row["val_loss_std"] is not None:
        return row["val_loss_std"] / math.sqrt(n)
    return row["val_loss_stderr"] or 0.0


def _mark_noise(rows: list[dict]) -> None:
    best = min(rows, key=lambda r: r["val_loss"])
    for r in rows:
        gap = r["val_loss"] - best["val_loss"]
        sigma = math.hypot(_noise(r), _noise(best))
        r["within_noise_of_best"] = r is best or (sigma > 0 and gap <= 2 * sigma)


def _mark_pareto(rows: list[dict]) -> None:
    for r in rows:
        r["pareto"] = not any(
            o is not r
            and o["kv_bytes_per_token"] <= r["kv_bytes_per_token"]
            and o["val_loss"] <= r["val_loss"]
            and (o["kv_bytes_per_token"] < r["kv_bytes_per_token"] or o["val_loss"] < r["val_loss"])
            for o in rows
        )


def write_outputs(out: Path, rows: list[dict], results: list[dict], meta: dict) -> dict[str, Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = {
        k: out / v
        for k, v in {
            "results_json": "results.json",
            "results_csv": "results.csv",
            "report": "report.md",
            "pareto_png": "pareto.png",
            "loss_curves_png": "loss_curves.png",
            "decode_png": "decode_speed.png",
        }.items()
    }
    _atomic_write(
        paths["results_json"],
        json.dumps({"meta": meta, "variants": rows, "runs": results}, indent=2, default=str),
    )
    ctxs = sorted({c for r in rows for c in r["decode_tokens_per_s"]}, key=int)
    cols = [
        "label",
        "attention",
        "params_total",
        "params_activated",
        "params_embedding",
        "kv_elements_per_token",
        "kv_bytes_per_token",
        "kv_reduction_vs_first_mha",
        "val_loss",
        "val_loss_std",
        "val_perplexity",
        "val_loss_delta_pct",
        "within_noise_of_best",
        "pareto",
        "prefill_ms",
        "train_tokens_per_s",
        "distinct_2",
        "repeated_4gram_rate",
    ] + [f"decode_tok_s@{c}" for c in ctxs]
    tmp = paths["results_csv"].with_name(".results.csv.tmp")
    with open(tmp, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(cols)
        for r in rows:
            w.writerow(
                [
                    r.get(c)
                    if not c.startswith("decode_tok_s@")
                    else r["decode_tokens_per_s"].get(c.split("@")[1])
                    for c in cols
                ]
            )
    os.replace(tmp, paths["results_csv"])
    _plots(paths, rows, results, ctxs)
    _atomic_write(paths["report"], render_report(rows, results, meta, ctxs))
    return paths


def _plots(paths, rows, results, ctxs) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in rows:
        ax.errorbar(
            r["kv_bytes_per_token"],
            r["val_loss"],
            yerr=r["val_loss_std"] or 0,
            fmt="o" if r["pareto"] else "x",
        )
        ax.annotate(
            r["label"],
            (r["kv_bytes_per_token"], r["val_loss"]),
            fontsize=8,
            xytext=(4, 3),
            textcoords="offset points",
        )
    front = sorted((r for r in rows if r["pareto"]), key=lambda r: r["kv_bytes_per_token"])
    ax.plot(
        [r["kv_bytes_per_token"] for r in front],
        [r["val_loss"] for r in front],
        "-",
        alpha=0.5,
        label="Pareto front",
    )
    ax.set_xscale("log")
    ax.set_xlabel(f"KV cache bytes per token (all layers, {KV_DTYPE_BYTES}-byte elements)")
    ax.set_ylabel("validation loss")
    ax.set_title("quality against KV cache")
    ax.legend()
    fig.tight_layout()
    fig.savefig(paths["pareto_png"], dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in results:
        hist = [h for h in r["history"] if h.get("val_loss") is not None]
        if hist:
            ax.plot(
                [h["tokens"] for h in hist], [h["val_loss"] for h in hist], label=f"{r['label']} s{r['seed']}"
            )
    ax.set_xlabel("training tokens")
    ax.set_ylabel("validation loss")
    ax.set_title("loss curves")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(paths["loss_curves_png"], dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in rows:
        xs = [int(c) for c in ctxs if c in r["decode_tokens_per_s"]]
        ax.plot(xs, [r["decode_tokens_per_s"][str(c)] for c in xs], "o-", label=r["label"])
    ax.set_xlabel("cached tokens (context)")
    ax.set_ylabel("decode tokens/s (batch 1)")
    ax.set_title("decode speed")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(paths["decode_png"], dpi=120)
    plt.close(fig)


def _fmt(x, spec=".4f"):
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def render_report(rows: list[dict], results: list[dict], meta: dict, ctxs: list[str]) -> str:
    best_loss = min(r["val_loss"] for r in rows)
    best_kv = min(r["kv_bytes_per_token"] for r in rows)
    n_seeds = max(len(r["seeds"]) for r in rows)

    def b(text, cond):
        return f"**{text}**" if cond else text

    lines = [
        f"# kvlm compare: {meta['preset']}",
        "",
        f"- data: {meta['data']}",
        f"- budget per run: {meta['budget']}; seeds: {meta['seeds']}",
        f"- models: {meta['models_note']}",
        f"- machine: {meta['machine']['gpu'] or meta['machine']['cpu']} ({meta['machine']['threads']} threads), "
        f"torch {meta['machine']['torch']}, "
        f"kvlm {meta['kvlm']}, {meta['date']}",
        "",
        "Best values in **bold**. KV bytes count every layer at "
        f"{KV_DTYPE_BYTES} bytes per element (bf16) and come from each mechanism's `cache_spec()`.",
        "",
        "## Which attention gives the best quality for its KV cache?",
        "",
        "| variant | KV elements/token | KV bytes/token | vs MHA | val loss | ppl | Δ loss vs MHA | noise | Pareto |",
        "|---|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in sorted(rows, key=lambda r: r["kv_bytes_per_token"]):
        std = f" ± {r['val_loss_std']:.4f}" if r["val_loss_std"] is not None else ""
        noise = "within noise of best" if r["within_noise_of_best"] else "worse than best"
        kv = b(format(r["kv_bytes_per_token"], ","), r["kv_bytes_per_token"] == best_kv)
        loss = b(format(r["val_loss"], ".4f"), r["val_loss"] == best_loss)
        pareto = "yes" if r["pareto"] else ""
        lines.append(
            f"| {r['label']} | {r['kv_elements_per_token']:,} | {kv} | {-100 * r['kv_reduction_vs_first_mha'] + 0.0:+.1f} % "
            f"| {loss}{std} | {r['val_perplexity']:.2f} | {r['val_loss_delta_pct']:+.2f} % | {noise} | {pareto} |"
        )
    if n_seeds == 1:
        lines += [
            "",
            "One seed per variant: 'noise' uses only the standard error of the validation estimate, not "
            "seed-to-seed training variance; run with `--seeds 0,1,2` before trusting small differences.",
        ]
    else:
        lines += [
            "",
            f"Mean ± standard deviation over {n_seeds} seeds; 'within noise' = gap to the best below twice "
            "the combined standard error of the two means.",
        ]
    lines += [
        "",
        "![Pareto front](pareto.png)",
        "",
        "## What does each cost in parameters?",
        "",
        "| variant | total | activated | embedding (token + gate tables) |",
        "|---|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['label']} | {r['params_total'] / 1e6:.3f} M | {r['params_activated'] / 1e6:.3f} M | "
            f"{r['params_embedding'] / 1e6:.3f} M |"
        )
    best_dec = {c: max(r["decode_tokens_per_s"].get(c, 0) for r in rows) for c in ctxs}
    best_pre = min(r["prefill_ms"] for r in rows)
    lines += [
        "",
        "## How fast does each run? (batch 1, this machine, trained weights)",
        "",
        "| variant | prefill ms (128 tokens) | "
        + " | ".join(f"decode tok/s @ {c}" for c in ctxs)
        + " | train tok/s |",
        "|---|---:|" + "---:|" * len(ctxs) + "---:|",
    ]
    for r in rows:
        dec = " | ".join(
            b(format(r["decode_tokens_per_s"][c], ".1f"), r["decode_tokens_per_s"][c] == best_dec[c])
            if c in r["decode_tokens_per_s"]
            else "n/a"
            for c in ctxs
        )
        pre = b(format(r["prefill_ms"], ".1f"), r["prefill_ms"] == best_pre)
        lines.append(f"| {r['label']} | {pre} | {dec} | {r['train_tokens_per_s']:.0f} |")
    lines += [
        "",
        "Tiny models are compute-bound on a CPU: their decode speed reflects kernel overheads more than KV "
        "bytes. `kvlm bench` measures the memory-bound regime at realistic sizes (see benchmarks/).",
        "",
        "![decode speed](decode_speed.png)",
        "",
        "## Loss curves",
        "",
        "![loss curves](loss_curves.png)",
        "",
        "## Samples (temperature 0.8, top-k 50) and repetition",
        "",
        "| variant | distinct-2 | repeated 4-gram rate |",
        "|---|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['label']} | {_fmt(r['distinct_2'], '.3f')} | {_fmt(r['repeated_4gram_rate'], '.3f')} |"
        )
    lines.append("")
    for res in results:
        if res["seed"] != results[0]["seed"]:
            continue
        lines.append(f"**{res['label']}**")
        lines.append("")
        for s in res["samples"]:
            text = (s["prompt"] + s["text"]).replace("\n", " ").replace("|", "\\|")
            lines.append(f"> {text}")
            lines.append(">")
        lines.append("")
    lines += ["## Reproduce", "", "```bash", meta["command"], "```", ""]
    return "\n".join(lines)


# --- the command ------------------------------------------------------------------------------------------


def compare(
    preset: str = "tiny",
    out: str | Path = "runs/compare",
    data_source: str = "synthetic",
    budget: Budget | None = None,
    seeds: list[int] | None = None,
    variants_file: str | None = None,
    paper_sizes: bool = False,
    contexts: list[int] | None = None,
    command: str = "",
    log=print,
) -> dict:
    from kvlm import __version__
    from kvlm.bench.run import machine_info
    from kvlm.data.prepare import load_or_prepare

    budget = budget or Budget(steps=300)
    seeds = seeds or [0]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    variants, models_note = load_variants(preset, variants_file, paper_sizes)
    data = load_or_prepare(data_source, out / "data", log=log)
    log(f"data: {data.describe()}")
    results = []
    for v in variants:
        for seed in seeds:
            rdir = out / "runs" / v.label / f"seed{seed}"
            key = _config_hash(v.cfg.replace(vocab_size=data.vocab_size), budget, seed, data.content_hash)
            done = rdir / "result.json"
            if done.is_file():
                prev = json.loads(done.read_text())
                if prev.get("key") == key:
                    log(f"[{v.label} seed {seed}] done earlier, reusing {done}")
                    results.append(prev)
                    continue
            res = run_variant(v, data, budget, seed, out, contexts, log)
            res["key"] = key
            rdir.mkdir(parents=True, exist_ok=True)
            _atomic_write(done, json.dumps(res, indent=2, default=str))
            log(
                f"[{v.label} seed {seed}] val loss {res['val_loss']:.4f}, KV {res['kv_bytes_per_token']} B/token"
            )
            results.append(res)
    rows = aggregate(results)
    meta = {
        "preset": variants_file or preset,
        "models_note": models_note,
        "data": data.describe(),
        "budget": budget.describe(),
        "seeds": seeds,
        "machine": machine_info(torch.device("cuda" if torch.cuda.is_available() else "cpu")),
        "kvlm": __version__,
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
        "command": command,
    }
    paths = write_outputs(out, rows, results, meta)
    best = min(rows, key=lambda r: r["val_loss"])
    return {
        "out": str(out),
        "report": str(paths["report"]),
        "best_val_loss": best["label"],
        "pareto": [r["label"] for r in rows if r["pareto"]],
        "variants": [
            {
                k: r[k]
                for k in (
                    "label",
                    "val_loss",
                    "val_loss_std",
                    "kv_bytes_per_token",
                    "params_total",
                    "within_noise_of_best",
                )
            }
            for r in rows
        ],
    }


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
    budget = Budget(
        steps=args.steps,
        tokens=args.tokens,
        minutes=args.minutes,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        lr=args.lr,
    )
    if not (args.steps or args.tokens or args.minutes):
        budget.steps = 300
    for name in ("steps", "tokens", "minutes", "batch_size", "seq_len"):
        v = getattr(args, name)
        if v is not None and v <= 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be positive, got {v}")
    seeds = [int(s) for s in str(args.seeds).split(",") if s.strip()]
    contexts = [int(c) for c in str(args.contexts).split(",") if c.strip()] if args.contexts else None
    summary = compare(
        preset=args.preset,
        out=args.out,
        data_source=args.data,
        budget=budget,
        seeds=seeds,
        variants_file=args.variants,
        paper_sizes=args.paper_sizes,
        contexts=contexts,
        command="kvlm " + " ".join(sys.argv[1:])
        if sys.argv[0].endswith("kvlm")
        else "kvlm compare " + " ".join(sys.argv[2:]),
        log=(lambda *a: print(*a, file=sys.stderr)) if args.json else print,
    )
    print(f"report: {summary['report']}", file=sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json.dumps(summary))
    return 0
