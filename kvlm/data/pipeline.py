"""``prepare``: sources -> tokenizer + token shards in a folder that is complete or absent; ``load_or_prepare``.

A source without its own validation split gives every N-th document (N = 1 / val_fraction) to validation;
``val=`` names validation sources instead (each one's own validation part if it has one, else all of it). A single
document too few to share is split by tokens: validation is the tail of training. The folder is written under a
temporary name and renamed at the end. Progress (``progress=True``) is kvlm.progress: a bar on a terminal, else log lines.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from kvlm.data.format import DEFAULT_SHARD_TOKENS, FORMAT, VERSION, DataError, content_hash, token_dtype
from kvlm.data.prepared import PreparedData, load_prepared
from kvlm.data.shards import ShardWriter
from kvlm.data.sources import Source, resolve_source
from kvlm.data.tokenizer import PIECE_CHARS, Tokenizer, describe, tokenizer_from_spec
from kvlm.files import replace_folder
from kvlm.logs import get_logger
from kvlm.progress import Progress

logger = get_logger(__name__)
SYNTHETIC_DEFAULT_TOKENS = 1_000_000


def prepare(
    source: str | Path | list[str | Path] = "synthetic",
    out_dir: str | Path | None = None,
    *,
    val: str | Path | list[str | Path] | None = None,
    tokenizer: str | Path | Tokenizer = "bpe",
    vocab_size: int = 4096,
    max_tokens: int | None = None,
    val_tokens: int | None = None,
    val_fraction: float = 0.05,
    seed: int = 0,
    text_field: str = "text",
    bpe_sample_chars: int = 20_000_000,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    force: bool = False,
    progress: bool = False,
) -> PreparedData:
    """Tokenize `source` into `out_dir` (a new temporary folder when None) and open the result.

    tokenizer: "bpe" (train a byte-level BPE of `vocab_size` on the training text), "gpt2", a path
    (tokenizer.json, or a folder with GPT-2's vocab.json + merges.txt), or a Tokenizer.
    max_tokens / val_tokens: caps on the split sizes (the synthetic source defaults to 1 M training
    tokens; a cap on training alone caps validation at val_fraction of it).
    An existing out_dir prepared with the same arguments is reused; a different one needs force=True.
    """
    specs = [source] if isinstance(source, (str, Path)) else list(source)
    val_specs = [] if val is None else [val] if isinstance(val, (str, Path)) else list(val)
    if not specs:
        raise DataError("no data source given")
    if not 0.0 <= val_fraction < 1.0:
        raise DataError(f"val_fraction must be in [0, 1), got {val_fraction}")
    sources = [resolve_source(s, text_field, seed) for s in specs]
    val_sources = [resolve_source(s, text_field, seed, role="val") for s in val_specs]
    if max_tokens is None and not all(s.finite for s in sources):
        max_tokens = SYNTHETIC_DEFAULT_TOKENS
    if val_tokens is None:
        if not all(s.finite for s in val_sources):
            val_tokens = SYNTHETIC_DEFAULT_TOKENS // 20
        elif max_tokens is not None and not val_specs:
            # a capped training split gets a proportionate validation split
            val_tokens = max(1, int(max_tokens * (val_fraction or 0.05)))
    for name, v in (("max_tokens", max_tokens), ("val_tokens", val_tokens)):
        if v is not None and v < 0:
            raise DataError(f"{name} must be >= 0, got {v}")

    tok_spec = tokenizer if not isinstance(tokenizer, Tokenizer) else f"given:{tokenizer.sha256()}"
    request = {
        "sources": [{"spec": s.spec, "kind": s.kind, **s.info} for s in sources],
        "val_sources": [{"spec": s.spec, "kind": s.kind, **s.info} for s in val_sources],
        "tokenizer": str(tok_spec),
        "vocab_size": vocab_size if str(tok_spec) == "bpe" else None,
        "max_tokens": max_tokens,
        "val_tokens": val_tokens,
        "val_fraction": val_fraction,
        "seed": seed,
        "text_field": text_field,
        "bpe_sample_chars": bpe_sample_chars,
    }
    if out_dir is not None:
        out_dir = Path(out_dir)
        if (out_dir / "meta.json").is_file():
            try:
                existing = load_prepared(out_dir)
            except DataError:
                existing = None
            if existing is not None and existing.meta.get("request") == request and not force:
                logger.info(f"{out_dir}: already prepared with the same arguments; reusing it")
                return existing
        if out_dir.exists() and any(out_dir.iterdir()) and not force:
            raise DataError(
                f"{out_dir} exists and holds something else; pass force=True (--force) to replace it"
            )
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    else:
        tmp = Path(tempfile.mkdtemp(prefix="kvlm-data-"))
    try:
        meta = _prepare_into(
            tmp,
            sources,
            val_sources,
            tokenizer,
            vocab_size,
            max_tokens,
            val_tokens,
            val_fraction,
            bpe_sample_chars,
            shard_tokens,
            progress,
        )
        meta["request"] = request
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the result is an ordinary folder
        if out_dir is None:
            out_dir = tmp
        else:
            replace_folder(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return load_prepared(out_dir)


def _prepare_into(
    folder: Path,
    sources: list[Source],
    val_sources: list[Source],
    tokenizer,
    vocab_size: int,
    max_tokens: int | None,
    val_tokens: int | None,
    val_fraction: float,
    bpe_sample_chars: int,
    shard_tokens: int,
    progress: bool,
) -> dict[str, Any]:
    t0 = time.time()
    every = round(1 / val_fraction) if val_fraction > 0 else 0
    route_val = not val_sources  # without explicit val sources, sources lacking a val split donate docs
    counts = {i: {"train": 0, "val": 0} for i in range(len(sources) + len(val_sources))}

    def train_side() -> Iterator[tuple[str, int, str]]:
        """Training documents (and, for sources without a val split, every N-th one routed to val)."""
        for i, src in enumerate(sources):
            for n, text in enumerate(src.docs("train")):
                donate = route_val and not src.has_val and every and n % every == every // 2
                yield ("val" if donate else "train"), i, text

    def val_side() -> Iterator[tuple[str, int, str]]:
        if val_sources:
            for j, src in enumerate(val_sources):  # its own validation part if it has one, else all of it
                for text in src.docs("val" if src.has_val else "train"):
                    yield "val", len(sources) + j, text
        else:
            for i, src in enumerate(sources):
                if src.has_val:
                    for text in src.docs("val"):
                        yield "val", i, text

    # 1. the tokenizer (a BPE learns from the first training documents, kept in memory for step 2)
    stream = train_side()
    head: list[tuple[str, int, str]] = []
    if isinstance(tokenizer, Tokenizer):
        tok = tokenizer
    elif str(tokenizer) == "bpe":
        # ~4 characters a token: past 4 * max_tokens the sample would hold text that is never encoded
        sample_cap = bpe_sample_chars if max_tokens is None else min(bpe_sample_chars, 4 * max_tokens + 1)
        chars = 0
        for item in stream:
            head.append(item)
            if item[0] == "train":
                chars += len(item[2])
                if chars >= sample_cap:
                    break
        texts = [t for split, _, t in head if split == "train"]
        if texts and chars > sample_cap and len(texts[-1]) > PIECE_CHARS:  # not all of one huge document
            texts[-1] = texts[-1][: max(1, len(texts[-1]) - (chars - sample_cap))]
        if not texts:
            raise DataError(f"no training text in {', '.join(s.spec for s in sources)} (empty data)")
        logger.info(f"training a byte-level BPE (vocab {vocab_size}) on {chars:,} characters")
        tok = tokenizer_from_spec("bpe", texts, vocab_size)
    else:
        tok = tokenizer_from_spec(tokenizer)
    dtype = token_dtype(tok.vocab_size)
    tok.save(folder / "tokenizer.json")

    # 2. encode documents in batches (the Rust tokenizer is parallel) and append eos to each
    writers = {
        "train": ShardWriter(folder, "train", dtype, max_tokens, shard_tokens),
        "val": ShardWriter(folder, "val", dtype, val_tokens, shard_tokens),
    }
    # kvlm.progress: a bar on a terminal, else periodic log lines with rate and ETA. With a token cap the bar
    # counts tokens; without one, text bytes against the input files' size (.txt / .jsonl: within the JSON
    # syntax of a .jsonl, a few per cent, the bar ends short of 100 %), so an uncapped run has an ETA too
    input_bytes = None if max_tokens is not None else _text_file_bytes(sources + val_sources)
    by_bytes = input_bytes is not None
    total = input_bytes if by_bytes else None if max_tokens is None else max_tokens + (val_tokens or 0)
    bar = Progress(total, "prepare", "B" if by_bytes else "tok", unit_scale=True, enabled=progress)
    tokens_done = [0]
    eos = np.array([tok.eos_id], dtype=np.int64)

    def advance(text: str, n_tokens: int) -> None:
        """One document read (``n_tokens`` of it kept) on the bar."""
        if not by_bytes:
            if n_tokens:
                bar.update(n_tokens)
            return
        tokens_done[0] += n_tokens
        bar.set_postfix({"tokens": f"{tokens_done[0]:,}"})
        bar.update(len(text.encode("utf-8", "surrogatepass")))

    def batch_chars() -> int:
        """Characters to encode at once: big batches keep the parallel encoder busy, but near a cap
        (a few characters a token) they would encode text that is thrown away."""
        need = sum(w.cap - w.tokens for w in writers.values() if w.cap is not None and not w.full)
        open_ended = any(w.cap is None for w in writers.values())
        return 4_000_000 if open_ended else max(20_000, min(4_000_000, 6 * need))

    def add_long(item: tuple[str, int, str]) -> None:
        """A document longer than a tokenizer piece, into a capped split: encoded piece by piece, stopping
        once the cap is reached (an 8.9 MB line no longer encodes whole for --max-tokens 1000)."""
        split, i, text = item
        writer = writers[split]
        need = writer.cap - writer.tokens
        ids: list[int] = []
        for piece_ids in tok.encode_pieces(text):
            ids.extend(piece_ids)
            if len(ids) >= need:
                break
        n = writer.add(np.concatenate([np.asarray(ids, dtype=np.int64), eos]))
        if n:
            counts[i][split] += 1
        advance(text, n)

    def consume(items: Iterable[tuple[str, int, str]], done: Callable[[], bool]) -> None:
        batch: list[tuple[str, int, str]] = []
        chars = 0

        def flush() -> None:
            for (split, i, text), ids in zip(batch, tok.encode_batch([t for _, _, t in batch])):
                n = writers[split].add(np.concatenate([np.asarray(ids, dtype=np.int64), eos]))
                if n:
                    counts[i][split] += 1
                advance(text, n)
            batch.clear()

        for item in items:
            if writers[item[0]].full:
                if done():
                    break
                advance(item[2], 0)  # read past a full split: still read
                continue
            if writers[item[0]].cap is not None and len(item[2]) > PIECE_CHARS:
                flush()  # keep the documents' order
                add_long(item)
                if done():
                    break
                continue
            batch.append(item)
            chars += len(item[2])
            if len(batch) >= 1024 or chars >= batch_chars():
                flush()
                chars = 0
                if done():
                    break
        flush()

    routes_val = route_val and every and any(not s.has_val for s in sources)
    consume(head, lambda: False)
    consume(stream, lambda: writers["train"].full and (not routes_val or writers["val"].full))
    if val_tokens != 0 and not writers["val"].full:
        consume(val_side(), lambda: writers["val"].full)
    bar.close()
    if writers["train"].tokens == 0:
        raise DataError(f"no training text in {', '.join(s.spec for s in sources)} (empty data)")
    if writers["val"].tokens == 0 and val_fraction > 0 and val_tokens != 0:
        # too few documents to give one away (e.g. a single .txt file): cut the training tail instead
        n = max(1, int(writers["train"].tokens * val_fraction))
        if writers["train"].tokens - n <= 0:
            raise DataError("too little text to split off a validation set")
        tail = writers["train"].pop_tail(n)
        writers["val"].add(tail.astype(np.int64))
        logger.info(f"validation split: the last {n:,} training tokens (the sources have too few documents)")
    for w in writers.values():
        w.close()

    sources_meta = []
    for i, src in enumerate(sources + val_sources):
        sources_meta.append(
            {"spec": src.spec, "kind": src.kind, "label": src.label, "documents": counts[i], **src.info}
        )
    labels = list(dict.fromkeys(s.label for s in sources + val_sources))
    meta = {
        "format": FORMAT,
        "version": VERSION,
        "source": " + ".join(labels),
        "synthetic": any(s.kind == "synthetic" for s in sources + val_sources),
        "tokenizer": {**describe(tok), "file": "tokenizer.json"},
        "dtype": dtype.name,
        "eos_id": tok.eos_id,
        "splits": {
            split: {"tokens": w.tokens, "documents": w.documents, "shards": w.shards}
            for split, w in writers.items()
        },
        "sources": sources_meta,
        "seconds": round(time.time() - t0, 2),
    }
    meta["content_hash"] = content_hash(folder, meta)
    logger.info(
        f"prepared {writers['train'].tokens:,} train + {writers['val'].tokens:,} val tokens "
        f"({meta['source']}; tokenizer {tok.kind}, vocab {tok.vocab_size}) in {meta['seconds']} s"
    )
    return meta


def load_or_prepare(
    source: str | Path | PreparedData,
    out_dir: str | Path | None = None,
    **kw,
) -> PreparedData:
    """A prepared data folder is opened; anything else ('synthetic', text files, hf:NAME) is prepared
    into out_dir with `prepare` (reused when it was prepared with the same arguments)."""
    if isinstance(source, PreparedData):
        return source
    path = Path(str(source))
    if path.is_dir() and (path / "meta.json").is_file():
        return load_prepared(path)
    return prepare(source, out_dir, **kw)


def _text_file_bytes(sources: list[Source]) -> int | None:
    """Total size of the sources' files when all are local .txt / .jsonl files (whose text is about their size),
    else None (a generator, a Hugging Face dataset, compressed parquet)."""
    total = 0
    for src in sources:
        files = src.info.get("files") if src.kind == "local" else None
        if not files or any(not name.lower().endswith((".txt", ".jsonl")) for name in files):
            return None
        total += sum(int(f.get("bytes", 0)) for f in files.values())
    return total or None
