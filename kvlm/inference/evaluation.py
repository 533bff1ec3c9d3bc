"""Evaluation: perplexity on held-out tokens, repetition of sampled continuations, lm-eval tasks.

Perplexity windows. The token stream is cut into windows of ``seq_len`` inputs; window i starts at
``i * stride`` and scores only the targets the previous windows did not score, so every token after the
first is predicted exactly once. ``stride = seq_len`` (default) gives non-overlapping windows (each
token sees the context back to its window's start: cheap, slightly pessimistic); a smaller stride gives
sliding windows (every scored token sees at least seq_len - stride tokens of context: closer to the
model's true perplexity, seq_len / stride times the compute).

Repetition. mla-small-lm.md (Sec. 5, Table 5) finds that over-compressed latent attention "produce[s]
semicoherent but highly repetitive text" and then random tokens. Two cheap signals of that, computed per
sampled continuation and averaged: distinct-n = unique n-grams / n-grams (Li et al. 2016; low = repetitive)
and rep-n = fraction of n-grams that already occurred earlier in the same continuation (Welleck et al.
2019's seq-rep-n; high = loops).

lm-evaluation-harness tasks run through the adapter in ``kvlm.interop.lm_eval`` (``kvlm eval --tasks``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from kvlm.data.prepared import load_prepared
from kvlm.data.sources import check_text, read_jsonl, read_text_file
from kvlm.inference.generation import generate, packed_for_rows
from kvlm.progress import Progress

DEFAULT_PROMPTS = (
    "Once upon a time",
    "The little girl looked at the sky and",
    "In the morning, the city was",
    "He opened the door and saw",
)


class EvalError(ValueError):
    """Evaluation input that cannot be used: no data, too few tokens, a missing optional dependency."""


# --- perplexity -----------------------------------------------------------------------------------------
def perplexity(
    model,
    token_ids,
    seq_len: int | None = None,
    batch_size: int = 4,
    stride: int | None = None,
    *,
    progress: bool = False,
) -> dict:
    """Mean next-token cross-entropy over ``token_ids`` (1-D numpy array, memmap, tensor or list).

    Returns {"loss" (nats/token), "perplexity" (exp(loss)), "tokens" (targets scored = len - 1),
    "stderr" (of the loss, windows as units; None for one window), "seq_len", "stride", "windows"}.
    See the module docstring for the windows. progress: kvlm.progress over the windows (a bar on a terminal,
    else log lines)."""
    # None means the default; 0 is refused below (it used to mean the default too, silently)
    seq_len = model.cfg.max_seq_len if seq_len is None else seq_len
    stride = seq_len if stride is None else stride
    if not isinstance(batch_size, int) or batch_size < 1:
        raise EvalError(f"batch_size must be a positive integer, got {batch_size!r}")
    if not 0 < seq_len <= model.cfg.max_seq_len:
        raise EvalError(f"seq_len={seq_len} must be in [1, max_seq_len={model.cfg.max_seq_len}]")
    if not 0 < stride <= seq_len:
        raise EvalError(f"stride={stride} must be in [1, seq_len={seq_len}]")
    ids = (
        torch.as_tensor(np.asarray(token_ids, dtype=np.int64))
        if not torch.is_tensor(token_ids)
        else token_ids
    )
    ids = ids.reshape(-1).long()
    N = ids.numel()
    if N < 2:
        raise EvalError(f"perplexity needs at least 2 tokens, got {N}")
    lo, hi = int(ids.min()), int(ids.max())
    if hi >= model.cfg.vocab_size or lo < 0:
        bad = hi if hi >= model.cfg.vocab_size else lo
        raise EvalError(
            f"token id {bad} is outside the model's vocabulary [0, {model.cfg.vocab_size}) "
            "(data tokenized with another tokenizer?)"
        )

    # window = (begin, end, scored_from): inputs ids[begin:end], targets ids[begin+1:end+1], of which
    # those at target index >= scored_from are new
    windows, done, begin = [], 0, 0
    while done < N - 1:
        end = min(begin + seq_len, N - 1)
        windows.append((begin, end, done))
        done, begin = end, begin + stride

    device = model.embed.weight.device
    sums, counts = [], []  # per window: summed loss and scored tokens
    was_training = model.training
    model.eval()
    bar = Progress(len(windows), "perplexity", "window", enabled=progress)
    try:
        # long forwards: the weights in oneDNN's layout where it measured faster (on AMD CPUs torch's own
        # product runs MKL off its AVX-512 paths; generation.prefill_packs)
        with torch.inference_mode(), bar, packed_for_rows(model, min(batch_size, len(windows)) * seq_len):
            for i in range(0, len(windows), batch_size):
                chunk = windows[i : i + batch_size]
                L = max(e - b for b, e, _ in chunk)
                x = torch.zeros(len(chunk), L, dtype=torch.long)
                y = torch.full((len(chunk), L), -100, dtype=torch.long)  # -100: not scored
                for j, (b, e, s) in enumerate(chunk):
                    x[j, : e - b] = ids[b:e]
                    keep = slice(s - b, e - b)  # target index t = b + 1 + position; scored if t > s
                    y[j, keep] = ids[b + 1 + keep.start : e + 1]
                logits = model(x.to(device))  # right padding: causal, so it changes no scored logit
                y = y.to(device)
                wide = torch.promote_types(logits.dtype, torch.float32)  # bf16 logits: loss in float32
                for j, (_, e, s) in enumerate(chunk):  # row by row bounds the widened copy of the logits
                    loss_j = F.cross_entropy(logits[j].to(wide), y[j], ignore_index=-100, reduction="sum")
                    sums.append(loss_j.item())
                    counts.append(e - s)
                bar.update(len(chunk))
    finally:
        model.train(was_training)
    count = sum(counts)
    loss = sum(sums) / count
    return {
        "loss": loss,
        "perplexity": math.exp(loss),
        "tokens": count,
        "stderr": _ratio_stderr(sums, counts, loss),
        "seq_len": seq_len,
        "stride": stride,
        "windows": len(windows),
    }


def _ratio_stderr(sums: list[float], counts: list[int], mean: float) -> float | None:
    """Standard error of the mean token loss with windows as the independent units (token losses inside a
    window are correlated, so a per-token formula would be too small): the ratio-estimator formula
    sqrt(n / (n - 1) * sum_i (S_i - mean * c_i)^2) / sum_i c_i. None with fewer than 2 windows."""
    n = len(sums)
    if n < 2:
        return None
    resid = sum((s - mean * c) ** 2 for s, c in zip(sums, counts))
    return math.sqrt(n / (n - 1) * resid) / sum(counts)


# --- repetition -----------------------------------------------------------------------------------------
def repetition_metrics(sequences: Sequence[Sequence[int]], orders=(1, 2, 3), rep_order: int = 4) -> dict:
    """distinct-n for n in ``orders`` and rep-``rep_order``, each the mean over the sequences long enough
    to hold one n-gram (None if none is). Also: sequences, tokens, mean_length."""
    seqs = [list(s) for s in sequences]
    out: dict = {}
    for n in orders:
        vals = [len(set(g)) / len(g) for g in (_ngrams(s, n) for s in seqs) if g]
        out[f"distinct_{n}"] = sum(vals) / len(vals) if vals else None
    vals = []
    for s in seqs:
        grams = _ngrams(s, rep_order)
        if grams:
            seen, repeats = set(), 0
            for g in grams:
                repeats += g in seen
                seen.add(g)
            vals.append(repeats / len(grams))
    out[f"rep_{rep_order}"] = sum(vals) / len(vals) if vals else None
    out["sequences"] = len(seqs)
    out["tokens"] = sum(len(s) for s in seqs)
    out["mean_length"] = out["tokens"] / len(seqs) if seqs else 0.0
    return out


def _ngrams(seq: list[int], n: int) -> list[tuple[int, ...]]:
    return [tuple(seq[i : i + n]) for i in range(len(seq) - n + 1)]


def sample_continuations(
    model,
    tokenizer,
    prompts: Sequence[str] = DEFAULT_PROMPTS,
    n_samples: int = 8,
    max_new_tokens: int = 64,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int = 0,
) -> tuple[list[str], list[list[int]]]:
    """n_samples continuations, prompts taken in turn, sampled in one batch with a fixed seed; they run
    to max_new_tokens (no stop at end-of-text) so that every sample has the same length."""
    chosen = [prompts[i % len(prompts)] for i in range(n_samples)]
    ids = [tokenizer.encode(p) or [tokenizer.eos_id] for p in chosen]
    limit = model.cfg.max_seq_len - max(len(i) for i in ids)
    out = generate(
        model,
        ids,
        min(max_new_tokens, limit),
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seed=seed,
    )
    return chosen, out


# --- data -----------------------------------------------------------------------------------------------
def load_eval_tokens(path: str | Path, tokenizer=None, max_tokens: int | None = None, split: str = "val"):
    """Tokens to score from a prepared data folder (kvlm prepare) or a raw .txt / .jsonl file (encoded
    with ``tokenizer``; .jsonl documents are read from their "text" field and joined by end-of-text)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no evaluation data at {path}")
    if path.is_dir():
        return _prepared_tokens(path, split, max_tokens, tokenizer)
    if tokenizer is None:
        raise EvalError(f"{path} is raw text but the checkpoint has no tokenizer to encode it")
    if max_tokens is not None and max_tokens < 1:
        raise EvalError(f"max_tokens must be a positive integer, got {max_tokens}")
    if path.suffix == ".jsonl":
        ids: list[int] = []
        for line_no, row in read_jsonl(path):  # DataError naming the file and line: not UTF-8, not JSON
            if not isinstance(row, dict) or "text" not in row:
                raise EvalError(f"{path}:{line_no}: expected a JSON object with a 'text' field")
            ids += tokenizer.encode(check_text(row["text"], f"{path}:{line_no}: field 'text'")) + [
                tokenizer.eos_id
            ]
            if max_tokens and len(ids) >= max_tokens:
                break
    else:
        ids = tokenizer.encode(read_text_file(path))  # DataError naming the file when it is not UTF-8 text
    if max_tokens:
        ids = ids[:max_tokens]
    return np.asarray(ids, dtype=np.int64)


def _prepared_tokens(folder: Path, split: str, max_tokens: int | None, tokenizer=None):
    data = load_prepared(folder)
    if split not in ("train", "val"):
        raise EvalError(f"unknown split {split!r}; a prepared data folder has 'train' and 'val'")
    stream = getattr(data, split)
    if len(stream) == 0:
        raise EvalError(f"{folder}: the {split} split is empty")
    if (
        tokenizer is not None
        and hasattr(tokenizer, "sha256")
        and tokenizer.sha256() != data.tokenizer.sha256()
    ):
        raise EvalError(f"{folder} was tokenized with a different tokenizer than the checkpoint's")
    return stream[: min(max_tokens or len(stream), len(stream))]


def default_data(meta: dict, checkpoint: str | Path | None = None) -> str | None:
    """The prepared data folder that training recorded in the checkpoint's meta.json ("data": {"path"}),
    if it still exists (a relative path is tried from the working directory, then beside the checkpoint)."""
    value = meta.get("data")
    if isinstance(value, dict):
        value = value.get("path")
    if not isinstance(value, str):
        return None
    candidates = [Path(value)]
    if checkpoint is not None and not Path(value).is_absolute():
        candidates += [Path(checkpoint) / value, Path(checkpoint).parent / value]
    return next((str(c) for c in candidates if (c / "meta.json").is_file()), None)


__all__ = [
    "DEFAULT_PROMPTS",
    "EvalError",
    "default_data",
    "load_eval_tokens",
    "perplexity",
    "repetition_metrics",
    "sample_continuations",
]
