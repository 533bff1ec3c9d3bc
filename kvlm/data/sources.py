"""Where documents come from: built-in synthetic stories, local .txt / .jsonl / .parquet files or folders, and
Hugging Face datasets (hf:NAME[@CONFIG]; ``tinystories`` = hf:roneneldan/TinyStories).

In a folder, files named val* / valid* / validation* / dev* form the validation split and test* files are left
out; a file named on its own is what it was given as (``resolve_source(spec, role="val")`` for ``--val``), whatever
its name. ``resolve_source(spec)`` -> a ``Source`` whose ``docs(split)`` yields texts.

Text is read strictly: a .txt that is not UTF-8 (or holds NUL bytes: a binary file), a .jsonl line that is not
UTF-8 or not JSON, a text field that is a number, list or mapping: each is a DataError naming the file (and line),
never text silently made of replacement characters or of ``str(5)``.
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvlm.data.format import DataError
from kvlm.data.synthetic import LABEL as SYNTHETIC_LABEL
from kvlm.data.synthetic import stories
from kvlm.data.tokenizer import EOS_TOKEN

TEXT_SUFFIXES = (".txt", ".jsonl", ".parquet")
VAL_PREFIXES = ("val", "valid", "validation", "dev")
ALIASES = {"tinystories": "hf:roneneldan/TinyStories"}


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


def resolve_source(spec: str | Path, text_field: str = "text", seed: int = 0, role: str = "train") -> Source:
    """role: "train" or "val", what the caller uses the source for; it decides the split of a single file."""
    spec = str(spec)
    spec = ALIASES.get(spec.lower(), spec)
    if spec == "synthetic":
        # the validation stories come from a far-away part of the same stream: never a training story
        return Source(
            spec,
            "synthetic",
            SYNTHETIC_LABEL,
            True,
            lambda split: stories(seed, 0 if split == "train" else 1 << 40),
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
    split_of = (lambda f: role) if path.is_file() else _split_of  # noqa: E731  a named file is what it was given as
    train_files = [f for f in files if split_of(f) == "train"]
    val_files = [f for f in files if split_of(f) == "val"]
    if not train_files and not val_files:
        raise DataError(f"no {'/'.join(TEXT_SUFFIXES)} files in {path}")
    if not train_files and role != "val":
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
                "split": split_of(f),
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
        yield from _txt_documents(path)
    elif suffix == ".jsonl":
        for n, row in read_jsonl(path):
            if not isinstance(row, dict) or text_field not in row:
                raise DataError(f"{path}:{n}: no {text_field!r} field")
            text = check_text(row[text_field], f"{path}:{n}: field {text_field!r}")
            if text:
                yield text
    elif suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError as e:
            raise DataError(f"reading {path} needs pyarrow: pip install 'kvlm[data]'") from e
        pf = pq.ParquetFile(path)
        if text_field not in pf.schema_arrow.names:
            raise DataError(f"{path}: no {text_field!r} column (columns: {', '.join(pf.schema_arrow.names)})")
        row = 0
        for batch in pf.iter_batches(columns=[text_field], batch_size=1024):
            for text in batch.column(0).to_pylist():
                row += 1
                text = check_text(text, f"{path}: row {row}, column {text_field!r}")
                if text:
                    yield text
    else:
        raise DataError(f"{path}: unsupported file type {suffix!r}")


def read_text_file(path: Path) -> str:
    """The text of a file that must be UTF-8; DataError naming the file and the first bad byte otherwise."""
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(
            f"{path}: not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}); convert it to UTF-8 or "
            "leave it out of the sources"
        ) from None
    if "\x00" in text:
        raise DataError(f"{path}: holds NUL bytes at offset {text.index(chr(0))}: a binary file, not text")
    return text


def _txt_documents(path: Path, chunk_bytes: int = 1 << 24) -> Iterator[str]:
    """The documents of a .txt file as it is read (chunks of ``chunk_bytes``), so that a caller that has enough
    (``kvlm prepare --max-tokens``) stops reading a huge file early; strict UTF-8 and no NUL, as read_text_file."""
    decoder = codecs.getincrementaldecoder("utf-8")("strict")
    parts: list[str] = []  # the document being read (a list: no quadratic concatenation of one huge document)
    offset = 0
    with open(path, "rb") as f:
        while True:
            chunk = f.read(chunk_bytes)
            try:
                text = decoder.decode(chunk, final=not chunk)
            except UnicodeDecodeError as e:
                raise DataError(
                    f"{path}: not UTF-8 text (byte 0x{e.object[e.start]:02x} near offset {offset + e.start}); "
                    "convert it to UTF-8 or leave it out of the sources"
                ) from None
            if "\x00" in text:
                raise DataError(f"{path}: holds NUL bytes near offset {offset}: a binary file, not text")
            offset += len(chunk)
            # a marker may straddle two chunks: search it in the tail of the document so far plus the new text
            tail = parts.pop() if parts else ""
            pieces = (tail + text).split(EOS_TOKEN)
            for i, piece in enumerate(pieces[:-1]):
                doc = ("".join(parts) + piece if i == 0 else piece).strip()
                if i == 0:
                    parts = []
                if doc:
                    yield doc
            # keep the last len(EOS_TOKEN) - 1 characters apart: the start of a marker the next chunk completes
            rest = pieces[-1]
            keep = len(EOS_TOKEN) - 1
            if len(rest) > keep:
                parts.append(rest[:-keep])
                rest = rest[-keep:]
            parts.append(rest)
            if not chunk:
                break
    doc = "".join(parts).strip()
    if doc:
        yield doc


def read_jsonl(path: Path) -> Iterator[tuple[int, Any]]:
    """(line number, parsed JSON) for each non-blank line; DataError naming the file and line for a line that
    is not UTF-8 or not JSON (a binary file fails on its first line)."""
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(
                    f"{path}:{n}: not UTF-8 text (byte 0x{raw[e.start]:02x} at column {e.start + 1}); "
                    "is this a binary file?"
                ) from None
            if not line.strip():
                continue
            try:
                yield n, json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{n}: not valid JSON: {e}") from None


def check_text(value: Any, where: str) -> str:
    """A document's text: a string ("" and null give ""), or DataError naming ``where`` for a number, list,
    mapping or bool (which ``str()`` would silently turn into text)."""
    if value is None:
        return ""
    if not isinstance(value, str):
        raise DataError(f"{where} is {type(value).__name__} {value!r:.60}, expected a string of text")
    return value


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
            text = check_text(row[text_field], f"dataset {name!r}: field {text_field!r}")
            if text:
                yield text

    info = {"dataset": name, "config": config or None, "train_split": train_split, "val_split": val_split}
    return Source(f"hf:{name}", "hf", f"hf:{name}", val_split is not None, docs, info)
