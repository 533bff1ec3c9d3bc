"""`kvlm prepare`: text -> tokenizer + token shards, and the handle that reads them back.

Sources (one or more):
    synthetic                 built-in generated children's stories (kvlm.data.synthetic; NOT real text)
    PATH                      a .txt / .jsonl / .parquet file, or a folder of them. In a folder, files
                              named val* / valid* / validation* / dev* form the validation split and
                              test* files are left out.
    hf:NAME[@CONFIG]          a Hugging Face dataset (needs `pip install 'kvlm[data]'` and a network);
    tinystories               = hf:roneneldan/TinyStories
A source without its own validation split gives every N-th document (N = 1 / val_fraction) to it;
`val=` (--val) names validation sources instead (each one's own validation part if it has one, else all
of it). A single document too few to share is split by tokens: validation is the tail of training.

Output folder:
    tokenizer.json            the tokenizer (also copied into every checkpoint trained on this data)
    train-00000.bin ...       token ids, uint16 when the vocabulary fits, else uint32; documents end
    val-00000.bin ...         with the end-of-text token
    meta.json                 {"format": "kvlm-data", tokenizer, dtype, splits (tokens, documents,
                              shards), sources, source label, content_hash (sha256 of tokenizer +
                              shards), request (the arguments, to reuse an identical preparation)}
The folder is written under a temporary name and renamed at the end: it is complete or absent.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvlm.data import synthetic
from kvlm.data.tokenizer import (
    EOS_TOKEN,
    Tokenizer,
    TokenizerError,
    describe,
    load_tokenizer,
    tokenizer_from_spec,
)

FORMAT = "kvlm-data"
VERSION = 1
SPLITS = ("train", "val")
TEXT_SUFFIXES = (".txt", ".jsonl", ".parquet")
VAL_PREFIXES = ("val", "valid", "validation", "dev")
ALIASES = {"tinystories": "hf:roneneldan/TinyStories"}
SYNTHETIC_DEFAULT_TOKENS = 1_000_000
DEFAULT_SHARD_TOKENS = 1 << 28  # 256 M tokens: 512 MB of uint16 per file


class DataError(ValueError):
    """Missing, empty, partial or malformed data (the message names the file or source)."""


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 holds ids 0..65535, so a vocabulary of up to 65,536 tokens fits."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


# ------------------------------------------------------------------------------------------------
# reading back
# ------------------------------------------------------------------------------------------------
class TokenStream:
    """One split: a sequence of token ids over one or more memory-mapped shard files."""

    def __init__(self, shards: list[np.ndarray]):
        self.shards = shards
        self.offsets = np.cumsum([0] + [len(s) for s in shards])

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def window(self, start: int, length: int) -> np.ndarray:
        """tokens[start : start + length] as int64 (crossing shard boundaries if needed)."""
        if start < 0 or start + length > len(self):
            raise IndexError(f"window [{start}, {start + length}) outside a stream of {len(self)} tokens")
        if length <= 0:
            return np.zeros(0, dtype=np.int64)
        parts, pos, end = [], start, start + length
        while pos < end:
            i = int(np.searchsorted(self.offsets, pos, side="right")) - 1
            lo = pos - int(self.offsets[i])
            take = min(end - pos, len(self.shards[i]) - lo)
            parts.append(self.shards[i][lo : lo + take])
            pos += take
        return np.concatenate(parts).astype(np.int64) if len(parts) > 1 else parts[0].astype(np.int64)

    def windows(self, starts: Iterable[int], length: int) -> np.ndarray:
        """(len(starts), length) int64."""
        return np.stack([self.window(int(s), length) for s in starts])

    def __getitem__(self, item):
        if isinstance(item, slice):
            start, stop, step = item.indices(len(self))
            if step != 1:
                raise IndexError("TokenStream slices must have step 1")
            return self.window(start, max(0, stop - start))
        if item < 0:
            item += len(self)
        return int(self.window(int(item), 1)[0])


@dataclass
class PreparedData:
    """A prepared data folder: train / val token streams (numpy memmaps), tokenizer and metadata."""

    path: Path
    meta: dict[str, Any]
    tokenizer: Tokenizer
    train: TokenStream
    val: TokenStream
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    @property
    def eos_id(self) -> int:
        return self.tokenizer.eos_id

    @property
    def source(self) -> str:
        return self.meta["source"]

    @property
    def content_hash(self) -> str:
        return self.meta["content_hash"]

    def val_tokens(self, max_tokens: int | None = None) -> np.ndarray:
        """The validation split (or its first max_tokens) as int64."""
        n = len(self.val) if max_tokens is None else min(max_tokens, len(self.val))
        return self.val[:n]

    def train_tokens(self, max_tokens: int | None = None) -> np.ndarray:
        n = len(self.train) if max_tokens is None else min(max_tokens, len(self.train))
        return self.train[:n]

    def describe(self) -> str:
        t = self.meta["tokenizer"]
        return (
            f"{self.source}: {len(self.train):,} train + {len(self.val):,} val tokens, "
            f"{t['kind']} tokenizer of {t['vocab_size']:,} tokens ({self.path})"
        )

    def summary(self) -> dict[str, Any]:
        return {
            "path": str(self.path),
            "source": self.source,
            "tokenizer": self.meta["tokenizer"],
            "train_tokens": len(self.train),
            "val_tokens": len(self.val),
            "dtype": self.meta["dtype"],
            "content_hash": self.content_hash,
        }

    @classmethod
    def load(cls, path: str | Path, verify: bool = False) -> PreparedData:
        return load_prepared(path, verify=verify)

    def __repr__(self) -> str:
        return (
            f"PreparedData({str(self.path)!r}, source={self.source!r}, train={len(self.train):,} tokens, "
            f"val={len(self.val):,} tokens, vocab={self.vocab_size})"
        )


def load_prepared(path: str | Path, verify: bool = False) -> PreparedData:
    """Open a folder written by `prepare`; DataError names what is missing, partial or corrupt.
    verify=True also recomputes the content hash."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"no prepared data at {path} (run `kvlm prepare` first)")
    meta_file = path / "meta.json"
    if not meta_file.is_file():
        raise DataError(f"{path} is not a prepared data folder: meta.json is missing")
    try:
        meta = json.loads(meta_file.read_text())
    except json.JSONDecodeError as e:
        raise DataError(f"{meta_file} is corrupt: {e}") from e
    if meta.get("format") != FORMAT:
        raise DataError(f"{path} is not kvlm prepared data (format={meta.get('format')!r})")
    try:
        tokenizer = load_tokenizer(path / "tokenizer.json")
    except TokenizerError as e:
        raise DataError(f"{path}: {e}") from e
    dtype = np.dtype(meta["dtype"])
    streams = {}
    for split in SPLITS:
        shards = []
        for shard in meta["splits"][split]["shards"]:
            f = path / shard["file"]
            if not f.is_file():
                raise DataError(f"{path}: shard {shard['file']} is missing")
            expected = shard["tokens"] * dtype.itemsize
            if f.stat().st_size != expected:
                raise DataError(
                    f"{path}: shard {shard['file']} is partial or corrupt "
                    f"({f.stat().st_size} bytes, expected {expected})"
                )
            if shard["tokens"]:
                shards.append(np.memmap(f, dtype=dtype, mode="r"))
        streams[split] = TokenStream(shards)
    if len(streams["train"]) == 0:
        raise DataError(f"{path}: the training split is empty")
    if verify:
        digest = _content_hash(path, meta)
        if digest != meta["content_hash"]:
            raise DataError(f"{path}: content hash mismatch (files changed since they were prepared)")
    return PreparedData(path, meta, tokenizer, streams["train"], streams["val"])


def _content_hash(path: Path, meta: dict) -> str:
    h = hashlib.sha256((path / "tokenizer.json").read_bytes())
    for split in SPLITS:
        for shard in meta["splits"][split]["shards"]:
            with open(path / shard["file"], "rb") as f:
                while chunk := f.read(1 << 24):
                    h.update(chunk)
    return h.hexdigest()


# ------------------------------------------------------------------------------------------------
# sources
# ------------------------------------------------------------------------------------------------
@dataclass
class Source:
    """Where documents come from. `docs(split)` yields texts; `has_val` says whether the source has
    its own validation split (else prepare routes every N-th training document to validation)."""

    spec: str
    kind: str  # "synthetic" | "local" | "hf"
    label: str
    has_val: bool
    docs: Callable[[str], Iterator[str]]
    info: dict[str, Any] = field(default_factory=dict)
    finite: bool = True


def resolve_source(spec: str | Path, text_field: str = "text", seed: int = 0) -> Source:
    spec = str(spec)
    spec = ALIASES.get(spec.lower(), spec)
    if spec == "synthetic":
        # the validation stories come from a far-away part of the same stream: never a training story
        return Source(
            spec,
            "synthetic",
            synthetic.LABEL,
            True,
            lambda split: synthetic.stories(seed, 0 if split == "train" else 1 << 40),
            {"generator": "kvlm.data.synthetic", "seed": seed},
            finite=False,
        )
    if spec.startswith("hf:"):
        return _hf_source(spec[3:], text_field)
    path = Path(spec).expanduser()
    if not path.exists():
        raise DataError(
            f"data source {spec!r} not found (give a file or folder, 'synthetic', or hf:NAME for a "
            "Hugging Face dataset)"
        )
    files = _text_files(path)
    train_files = [f for f in files if _split_of(f) == "train"]
    val_files = [f for f in files if _split_of(f) == "val"]
    if not train_files and not val_files:
        raise DataError(f"no {'/'.join(TEXT_SUFFIXES)} files in {path}")
    if not train_files:
        raise DataError(f"{path} holds only validation files ({', '.join(f.name for f in val_files)})")

    def docs(split: str) -> Iterator[str]:
        for f in train_files if split == "train" else val_files:
            yield from read_documents(f, text_field)

    info = {
        "path": str(path.resolve()),
        "files": {
            str(f.relative_to(path) if path.is_dir() else f.name): {
                "bytes": f.stat().st_size,
                "mtime": int(f.stat().st_mtime),
                "split": _split_of(f),
            }
            for f in files
        },
    }
    return Source(spec, "local", f"local:{path}", bool(val_files), docs, info)


def _text_files(path: Path) -> list[Path]:
    if path.is_file():
        if path.suffix.lower() not in TEXT_SUFFIXES:
            raise DataError(f"{path}: unsupported file type {path.suffix!r} (use {', '.join(TEXT_SUFFIXES)})")
        return [path]
    return sorted(
        f
        for f in path.rglob("*")
        if f.is_file()
        and f.suffix.lower() in TEXT_SUFFIXES
        and not any(p.startswith(".") for p in f.relative_to(path).parts)
        and not f.stem.lower().startswith("test")
    )


def _split_of(f: Path) -> str:
    return "val" if f.stem.lower().startswith(VAL_PREFIXES) else "train"


def read_documents(path: Path, text_field: str = "text") -> Iterator[str]:
    """Documents of one file. .txt: the whole file, or its parts between <|endoftext|> markers
    (TinyStories' text release); .jsonl: the `text_field` of each line; .parquet: that column."""
    suffix = path.suffix.lower()
    if suffix == ".txt":
        text = path.read_text(encoding="utf-8", errors="replace")
        for doc in text.split(EOS_TOKEN):
            doc = doc.strip()
            if doc:
                yield doc
    elif suffix == ".jsonl":
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{path}:{n}: not valid JSON: {e}") from e
                if not isinstance(row, dict) or text_field not in row:
                    raise DataError(f"{path}:{n}: no {text_field!r} field")
                if row[text_field]:
                    yield str(row[text_field])
    elif suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError as e:
            raise DataError(f"reading {path} needs pyarrow: pip install 'kvlm[data]'") from e
        pf = pq.ParquetFile(path)
        if text_field not in pf.schema_arrow.names:
            raise DataError(f"{path}: no {text_field!r} column (columns: {', '.join(pf.schema_arrow.names)})")
        for batch in pf.iter_batches(columns=[text_field], batch_size=1024):
            for text in batch.column(0).to_pylist():
                if text:
                    yield text
    else:
        raise DataError(f"{path}: unsupported file type {suffix!r}")


def _hf_source(name: str, text_field: str) -> Source:
    try:
        import datasets
    except ImportError as e:
        raise DataError(
            f"loading the Hugging Face dataset {name!r} needs the `datasets` package: pip install 'kvlm[data]'"
        ) from e
    name, _, config = name.partition("@")
    try:
        splits = datasets.get_dataset_split_names(name, config or None)
    except Exception as e:  # offline, unknown name, ...: the library raises many kinds
        raise DataError(f"cannot open Hugging Face dataset {name!r}: {e}") from e
    train_split = "train" if "train" in splits else splits[0]
    val_split = next((s for s in ("validation", "valid", "val", "dev") if s in splits), None)

    def docs(split: str) -> Iterator[str]:
        ds = datasets.load_dataset(
            name, config or None, split=train_split if split == "train" else val_split, streaming=True
        )
        for row in ds:
            if text_field not in row:
                raise DataError(f"dataset {name!r} has no {text_field!r} field (fields: {', '.join(row)})")
            if row[text_field]:
                yield row[text_field]

    info = {"dataset": name, "config": config or None, "train_split": train_split, "val_split": val_split}
    return Source(f"hf:{name}", "hf", f"hf:{name}", val_split is not None, docs, info)


# ------------------------------------------------------------------------------------------------
# writing
# ------------------------------------------------------------------------------------------------
class _ShardWriter:
    """Appends token ids to <split>-NNNNN.bin files of at most `shard_tokens` each, up to `cap`."""

    def __init__(self, folder: Path, split: str, dtype: np.dtype, cap: int | None, shard_tokens: int):
        self.folder, self.split, self.dtype = folder, split, dtype
        self.cap, self.shard_tokens = cap, shard_tokens
        self.shards: list[dict[str, Any]] = []
        self.tokens = 0
        self.documents = 0
        self._fh = None

    @property
    def full(self) -> bool:
        return self.cap is not None and self.tokens >= self.cap

    def add(self, ids: np.ndarray) -> int:
        """Write one document's ids (eos included); returns how many were written."""
        if self.full:
            return 0
        if self.cap is not None:
            ids = ids[: self.cap - self.tokens]
        self.documents += 1
        pos = 0
        while pos < len(ids):
            if self._fh is None or self.shards[-1]["tokens"] >= self.shard_tokens:
                self._open()
            take = min(len(ids) - pos, self.shard_tokens - self.shards[-1]["tokens"])
            self._fh.write(ids[pos : pos + take].astype(self.dtype).tobytes())
            self.shards[-1]["tokens"] += take
            pos += take
        self.tokens += len(ids)
        return len(ids)

    def _open(self) -> None:
        if self._fh is not None:
            self._fh.close()
        name = f"{self.split}-{len(self.shards):05d}.bin"
        self._fh = open(self.folder / name, "wb")
        self.shards.append({"file": name, "tokens": 0})

    def close(self) -> None:
        if self._fh is not None:
            self._fh.flush()
            os.fsync(self._fh.fileno())
            self._fh.close()
            self._fh = None

    def pop_tail(self, n: int) -> np.ndarray:
        """Remove and return the last n tokens (for a validation split cut from the training tail)."""
        self.close()
        out = []
        while n > 0 and self.shards:
            shard = self.shards[-1]
            f = self.folder / shard["file"]
            take = min(n, shard["tokens"])
            arr = np.fromfile(f, dtype=self.dtype)
            out.insert(0, arr[len(arr) - take :])
            shard["tokens"] -= take
            os.truncate(f, shard["tokens"] * self.dtype.itemsize)
            if shard["tokens"] == 0:
                f.unlink()
                self.shards.pop()
            n -= take
            self.tokens -= take
        return np.concatenate(out) if out else np.zeros(0, self.dtype)


# ------------------------------------------------------------------------------------------------
# prepare
# ------------------------------------------------------------------------------------------------
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
    log: Callable[[str], None] | None = None,
) -> PreparedData:
    """Tokenize `source` into `out_dir` (a new temporary folder when None) and open the result.

    tokenizer: "bpe" (train a byte-level BPE of `vocab_size` on the training text), "gpt2", a path
    (tokenizer.json, or a folder with GPT-2's vocab.json + merges.txt), or a Tokenizer.
    max_tokens / val_tokens: caps on the split sizes (the synthetic source defaults to 1 M training
    tokens; a cap on training alone caps validation at val_fraction of it).
    An existing out_dir prepared with the same arguments is reused; a different one needs force=True.
    """
    log = log or (lambda msg: None)
    specs = [source] if isinstance(source, (str, Path)) else list(source)
    val_specs = [] if val is None else [val] if isinstance(val, (str, Path)) else list(val)
    if not specs:
        raise DataError("no data source given")
    if not 0.0 <= val_fraction < 1.0:
        raise DataError(f"val_fraction must be in [0, 1), got {val_fraction}")
    sources = [resolve_source(s, text_field, seed) for s in specs]
    val_sources = [resolve_source(s, text_field, seed) for s in val_specs]
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
                log(f"{out_dir}: already prepared with the same arguments; reusing it")
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
            log,
        )
        meta["request"] = request
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the result is an ordinary folder
        if out_dir is None:
            out_dir = tmp
        else:
            if out_dir.exists():
                old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
                os.replace(out_dir, old)
                os.replace(tmp, out_dir)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(tmp, out_dir)
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
    log: Callable[[str], None],
) -> dict[str, Any]:
    from tqdm.auto import tqdm

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
        if not texts:
            raise DataError(f"no training text in {', '.join(s.spec for s in sources)} (empty data)")
        log(f"training a byte-level BPE (vocab {vocab_size}) on {chars:,} characters")
        tok = tokenizer_from_spec("bpe", texts, vocab_size)
    else:
        tok = tokenizer_from_spec(tokenizer)
    dtype = token_dtype(tok.vocab_size)
    tok.save(folder / "tokenizer.json")

    # 2. encode documents in batches (the Rust tokenizer is parallel) and append eos to each
    writers = {
        "train": _ShardWriter(folder, "train", dtype, max_tokens, shard_tokens),
        "val": _ShardWriter(folder, "val", dtype, val_tokens, shard_tokens),
    }
    total = None if max_tokens is None else max_tokens + (val_tokens or 0)
    bar = tqdm(total=total, unit="tok", unit_scale=True, desc="prepare", disable=not progress, leave=False)
    eos = np.array([tok.eos_id], dtype=np.int64)

    def batch_chars() -> int:
        """Characters to encode at once: big batches keep the parallel encoder busy, but near a cap
        (a few characters a token) they would encode text that is thrown away."""
        need = sum(w.cap - w.tokens for w in writers.values() if w.cap is not None and not w.full)
        open_ended = any(w.cap is None for w in writers.values())
        return 4_000_000 if open_ended else max(20_000, min(4_000_000, 6 * need))

    def consume(items: Iterable[tuple[str, int, str]], done: Callable[[], bool]) -> None:
        batch: list[tuple[str, int, str]] = []
        chars = 0

        def flush() -> None:
            for (split, i, _), ids in zip(batch, tok.encode_batch([t for _, _, t in batch])):
                n = writers[split].add(np.concatenate([np.asarray(ids, dtype=np.int64), eos]))
                if n:
                    counts[i][split] += 1
                    bar.update(n)
            batch.clear()

        for item in items:
            if writers[item[0]].full:
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
        log(f"validation split: the last {n:,} training tokens (the sources have too few documents)")
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
    meta["content_hash"] = _content_hash(folder, meta)
    log(
        f"prepared {writers['train'].tokens:,} train + {writers['val'].tokens:,} val tokens "
        f"({meta['source']}; tokenizer {tok.kind}, vocab {tok.vocab_size}) in {meta['seconds']} s"
    )
    return meta


def load_or_prepare(
    source: str | Path | PreparedData,
    out_dir: str | Path | None = None,
    log: Callable[[str], None] | None = None,
    **kw,
) -> PreparedData:
    """A prepared data folder is opened; anything else ('synthetic', text files, hf:NAME) is prepared
    into out_dir with `prepare` (reused when it was prepared with the same arguments)."""
    if isinstance(source, PreparedData):
        return source
    path = Path(str(source))
    if path.is_dir() and (path / "meta.json").is_file():
        return load_prepared(path)
    return prepare(source, out_dir, log=log, **kw)


# ------------------------------------------------------------------------------------------------
# CLI: kvlm prepare
# ------------------------------------------------------------------------------------------------
def add_arguments(p) -> None:
    p.add_argument(
        "sources",
        nargs="*",
        default=["synthetic"],
        help="files/folders (.txt .jsonl .parquet), 'synthetic' (generated stories, not real text), "
        "hf:NAME or 'tinystories' (default: synthetic)",
    )
    p.add_argument("--out", "-o", required=True, help="output folder")
    p.add_argument(
        "--val", nargs="+", help="validation sources (default: the sources' val files or every N-th doc)"
    )
    p.add_argument(
        "--tokenizer",
        default="bpe",
        help="'bpe' (train one), 'gpt2', or a path to tokenizer.json / a folder with vocab.json + merges.txt",
    )
    p.add_argument("--vocab-size", type=int, default=4096, help="BPE vocabulary size (default 4096)")
    p.add_argument("--max-tokens", type=int, help="cap on training tokens (synthetic default 1,000,000)")
    p.add_argument("--val-tokens", type=int, help="cap on validation tokens")
    p.add_argument("--val-fraction", type=float, default=0.05, help="share of documents for validation")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--text-field", default="text", help="field of .jsonl / parquet / HF rows holding the text"
    )
    p.add_argument("--force", action="store_true", help="replace an existing output folder")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--json", action="store_true", help="print a JSON summary as the last line")


def main(args) -> int:
    data = prepare(
        args.sources,
        args.out,
        val=args.val,
        tokenizer=args.tokenizer,
        vocab_size=args.vocab_size,
        max_tokens=args.max_tokens,
        val_tokens=args.val_tokens,
        val_fraction=args.val_fraction,
        seed=args.seed,
        text_field=args.text_field,
        force=args.force,
        progress=not args.no_progress,
        log=print,
    )
    if args.json:
        print(json.dumps(data.summary()))
    return 0


__all__ = [
    "DataError",
    "PreparedData",
    "Source",
    "TokenStream",
    "load_or_prepare",
    "load_prepared",
    "prepare",
    "read_documents",
    "resolve_source",
    "token_dtype",
]
