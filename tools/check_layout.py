#!/usr/bin/env python3
"""Layout check for the kvlm package: import cycles among kvlm modules, source files over the line limit,
argument parsing outside kvlm/cli.

    python tools/check_layout.py [--root PATH] [--max-lines 500]

Imports count wherever they are (module top, inside functions), except under ``if TYPE_CHECKING:``, which
never runs. A module that names ``argparse`` outside ``kvlm/cli`` (and ``__main__`` modules) is a library
module parsing arguments. Prints one line per violation and a summary; exits 1 if there is any, else 0.
Standard library only, and it imports nothing from kvlm, so it runs on a tree that does not import.
"""

from __future__ import annotations

import argparse
import ast
import sys
from dataclasses import dataclass, field
from pathlib import Path

PACKAGE = "kvlm"
CLI_PACKAGE = "kvlm.cli"
MAX_LINES = 500


@dataclass
class Report:
    cycles: list[list[str]] = field(default_factory=list)
    long_files: list[tuple[str, int]] = field(default_factory=list)  # (path, lines)
    argparse_outside_cli: list[str] = field(default_factory=list)
    max_lines: int = MAX_LINES

    @property
    def ok(self) -> bool:
        return not (self.cycles or self.long_files or self.argparse_outside_cli)

    def lines(self) -> list[str]:
        out = [f"cycle: {' <-> '.join(c)}" for c in self.cycles]
        out += [f"over {self.max_lines} lines: {path} ({n})" for path, n in self.long_files]
        out += [f"argparse outside the CLI: {path}" for path in self.argparse_outside_cli]
        out.append(
            f"{len(self.cycles)} import cycles, {len(self.long_files)} files over {self.max_lines} lines, "
            f"{len(self.argparse_outside_cli)} library modules parsing arguments"
        )
        return out


def find_modules(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file of the package under ``root`` (the project folder)."""
    modules = {}
    for path in sorted((root / PACKAGE).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for n in ast.walk(node))
    return skip


def imported_modules(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that module ``name`` imports (``from a import b`` counts a, and a.b when that is
    a module)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    skip = _type_checking_nodes(tree)
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = name.split(".") if is_package else name.split(".")[:-1]
                package = package[: len(package) - node.level + 1]
                base = ".".join(package + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)
    found.discard(name)
    return {m for m in found if m in modules}


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative: the components with more than one module, each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            v, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[v] = min(low[v], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.append(w)
                    if w == v:
                        break
                if len(component) > 1:
                    components.append(sorted(component))
    return sorted(components)


def check(root: Path, max_lines: int = MAX_LINES) -> Report:
    modules = find_modules(root)
    if not modules:
        raise SystemExit(f"no {PACKAGE}/ package under {root}")
    graph = {name: imported_modules(name, path, modules) for name, path in modules.items()}
    report = Report(cycles=strongly_connected(graph), max_lines=max_lines)
    for name, path in modules.items():
        text = path.read_text(encoding="utf-8")
        rel = str(path.relative_to(root))
        n = len(text.splitlines())
        if n > max_lines:
            report.long_files.append((rel, n))
        in_cli = name == CLI_PACKAGE or name.startswith(CLI_PACKAGE + ".")
        if "argparse" in text and not in_cli and not name.endswith("__main__"):
            report.argparse_outside_cli.append(rel)
    report.long_files.sort(key=lambda item: -item[1])
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1],
                        help="project folder holding kvlm/ (default: this repository)")  # fmt: skip
    parser.add_argument("--max-lines", type=int, default=MAX_LINES, help=f"default {MAX_LINES}")
    args = parser.parse_args(argv)
    report = check(args.root, args.max_lines)
    print("\n".join(report.lines()))
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
