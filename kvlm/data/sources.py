"""Where documents come from: built-in synthetic stories, local .txt / .jsonl / .parquet files or folders, and
Hugging Face datasets (hf:NAME[@CONFIG]; ``tinystories`` = hf:roneneldan/TinyStories).

In a folder, files named val* / valid* / validation* / dev* form the validation split and test* files are left
out. ``resolve_source(spec)`` -> a ``Source`` whose ``docs(split)`` yields texts.
"""

from __future__ import annotations

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


def resolve_source(spec: str | Path, text_field: str = "text", seed: int = 0) -> Source:
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
