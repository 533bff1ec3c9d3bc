#!/usr/bin/env python3
"""Render docs/api.md from the public API's docstrings, so the page stays in sync with the code.

    python tools/api_docs.py           # rewrite docs/api.md
    python tools/api_docs.py --check   # exit 1 if docs/api.md is out of date (tests/test_cli_help.py runs it)

Functions and classes get their signature and docstring; a class also its public methods listed in API;
dataclasses (ModelConfig, TrainConfig) a table of their fields with type, default and the comment that
follows the field in the source.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "api.md"

# (import path, methods to document); in page order
API: list[tuple[str, tuple[str, ...]]] = [
    ("kvlm.ModelConfig", ()),
    ("kvlm.build_model", ()),
    ("kvlm.KVLM", ("forward", "new_cache", "prepare_for_inference", "cache_specs", "parameter_counts")),
    ("kvlm.KVCache", ()),
    ("kvlm.generate", ()),
    ("kvlm.save_checkpoint", ()),
    ("kvlm.load_checkpoint", ()),
    ("kvlm.count_parameters", ()),
    ("kvlm.training.TrainConfig", ()),
    ("kvlm.training.train", ()),
    ("kvlm.serve.engine.Engine", ("add_request", "step", "has_unfinished", "abort", "stats", "generate")),
    ("kvlm.progress.Progress", ()),
]

HEADER = """# kvlm API

The Python API in one page, generated from the docstrings by `tools/api_docs.py` (do not edit by hand: run
`python tools/api_docs.py` after changing a docstring; a test fails while this page is out of date).

```python
import kvlm
model = kvlm.build_model(kvlm.ModelConfig(attention="mla", n_layer=4, d_model=256, n_head=8))
ids = kvlm.generate(model, [1, 2, 3], max_new_tokens=20)
kvlm.save_checkpoint("ckpt", model)
model, tokenizer, meta = kvlm.load_checkpoint("ckpt")
```
"""


def resolve(path: str):
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


class _Text:
    """An annotation string shown as written (``from __future__ import annotations`` makes them strings)."""

    def __init__(self, text: str):
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _plain(annotation):
    return _Text(annotation) if isinstance(annotation, str) else annotation


def signature(obj) -> str:
    if dataclasses.is_dataclass(obj):
        return "(**fields)"  # the field table below lists them
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return "(...)"
    params = [p.replace(annotation=_plain(p.annotation)) for p in sig.parameters.values()]
    return str(sig.replace(parameters=params, return_annotation=_plain(sig.return_annotation)))


def docstring(obj) -> str:
    doc = inspect.getdoc(obj) or ""
    if dataclasses.is_dataclass(obj) and doc.startswith(obj.__name__ + "("):
        return ""  # the generated "Name(field, ...)": the field table says it better
    return doc


def field_comments(cls) -> dict[str, str]:
    """{field: the comment after it (and on the comment lines just above it)} from the class source."""
    out, above = {}, []
    for line in inspect.getsource(cls).splitlines():
        stripped = line.strip()
        if stripped.startswith("# ---"):  # a section rule of the source, not about the next field
            above = []
            continue
        if stripped.startswith("#"):
            above.append(stripped.lstrip("# "))
            continue
        m = re.match(r"\s+(\w+): [^=]+?(?:=\s*(.+?))?\s*(?:#\s*(.*))?$", line)
        if m and m.group(1) in {f.name for f in dataclasses.fields(cls)}:
            out[m.group(1)] = " ".join(x for x in [*above, m.group(3) or ""] if x)
        above = []
    return out


def field_table(cls) -> list[str]:
    comments = field_comments(cls)
    rows = ["| field | type | default | meaning |", "|---|---|---|---|"]
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            default = repr(f.default)
        elif f.default_factory is not dataclasses.MISSING:
            default = f"{f.default_factory.__name__}()"
        else:
            default = "required"
        cell = comments.get(f.name, "").replace("|", "\\|")
        rows.append(f"| `{f.name}` | `{str(f.type).replace('|', '&#124;')}` | `{default}` | {cell} |")
    return rows


def section(path: str, methods: tuple[str, ...]) -> list[str]:
    obj = resolve(path)
    kind = "class" if inspect.isclass(obj) else "function"
    lines = [f"## `{path}`", "", f"```python\n{kind} {obj.__name__}{signature(obj)}\n```", ""]
    doc = docstring(obj)
    if doc:
        lines += [doc, ""]
    if dataclasses.is_dataclass(obj):
        lines += [*field_table(obj), ""]
    for name in methods:
        meth = getattr(obj, name)
        lines += [f"### `{obj.__name__}.{name}{signature(meth)}`", ""]
        if inspect.getdoc(meth):
            lines += [inspect.getdoc(meth), ""]
    return lines


def render() -> str:
    lines = [HEADER]
    for path, methods in API:
        lines += section(path, methods)
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="exit 1 if docs/api.md is out of date")
    args = p.parse_args(argv)
    text = render()
    if args.check:
        if not OUT.is_file() or OUT.read_text() != text:
            print(f"{OUT} is out of date: run python tools/api_docs.py", file=sys.stderr)
            return 1
        return 0
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
