"""The remote code of an exported folder: what ``from_pretrained(folder, trust_remote_code=True)`` runs where
kvlm is not installed.

transformers copies a folder's remote code into its modules cache as a flat set of files: the module named in
``auto_map`` and, recursively, the files it imports as ``from .name import ...`` (no sub-packages). So the
folder gets:

- two small entry files written here, ``configuration_kvlm.py`` (``KVLMConfig``) and ``modeling_kvlm.py``
  (``KVLMForCausalLM``, ``KVLMCache``); the configuration imports the model's attention mechanism by name, so
  that it is registered (and copied) before a config is validated;
- kvlm's own modules that those need, each as ``kvlm_<dotted_name>.py`` (``kvlm.cache.layer`` ->
  ``kvlm_cache_layer.py``), copied verbatim except for their import statements of other kvlm modules: the
  parser locates each statement (``ast``, not text patterns) and it is written again as the same import from
  the flat sibling, e.g. ``from kvlm.config import ModelConfig`` -> ``from .kvlm_config import ModelConfig``.
  Nothing else in a file changes, and no kvlm module is edited to make this work.

The modules are those reachable from ``kvlm.interop.hf_modeling`` and the mechanism's module through static
imports (also inside functions and ``TYPE_CHECKING`` blocks: transformers copies every file named by a
relative import). Import forms that a flat folder cannot express (``import kvlm.x``, ``from kvlm import x``,
importing a module object with ``from kvlm.a import b``) raise ``RemoteCodeError`` at export time rather than
fail where the folder is loaded.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
from pathlib import Path
from types import ModuleType

from kvlm import __version__
from kvlm.attention import get_attention_class

PACKAGE = "kvlm"
ROOT_MODULES = ("kvlm.interop.hf_config", "kvlm.interop.hf_modeling")
CONFIG_FILE = "configuration_kvlm"
MODELING_FILE = "modeling_kvlm"
AUTO_MAP = {
    "AutoConfig": f"{CONFIG_FILE}.KVLMConfig",
    "AutoModelForCausalLM": f"{MODELING_FILE}.KVLMForCausalLM",
}


class RemoteCodeError(ValueError):
    """A kvlm module that cannot be copied into an exported folder as remote code."""


def flat_name(module: str) -> str:
    """``kvlm.cache.layer`` -> ``kvlm_cache_layer`` (its file name in the folder, without .py)."""
    return module.replace(".", "_")


def module_source(module: str) -> str:
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
        raise RemoteCodeError(f"cannot find the Python source of {module}")
    return Path(spec.origin).read_text(encoding="utf-8")


def _is_package(module: str) -> bool:
    spec = importlib.util.find_spec(module)
    return spec is not None and spec.submodule_search_locations is not None


def _is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


def _absolute(module: str, node: ast.ImportFrom) -> str | None:
    """The absolute module an ImportFrom names (relative imports resolved against ``module``)."""
    if not node.level:
        return node.module
    package = module.split(".") if _is_package(module) else module.split(".")[:-1]
    base = package[: len(package) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def _kvlm_imports(module: str, tree: ast.Module) -> list[tuple[ast.stmt, str | None]]:
    """Every import statement of ``tree`` that names a kvlm module, with the absolute module it imports from
    (None for ``import kvlm...``)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            target = _absolute(module, node)
            if target and (target == PACKAGE or target.startswith(PACKAGE + ".")):
                found.append((node, target))
        elif isinstance(node, ast.Import):
            if any(a.name == PACKAGE or a.name.startswith(PACKAGE + ".") for a in node.names):
                found.append((node, None))
    return found


def _relative_import(module: str, node: ast.stmt, target: str | None) -> str:
    """The statement that imports the same names from the flat sibling of ``target``."""
    where = f"{module} line {node.lineno}"
    if target is None:
        raise RemoteCodeError(f"{where}: 'import kvlm...' cannot be bundled; write 'from kvlm.x import name'")
    if target == PACKAGE:
        raise RemoteCodeError(
            f"{where}: 'from kvlm import ...' cannot be bundled; import from the defining module"
        )
    assert isinstance(node, ast.ImportFrom)
    imported = importlib.import_module(target)
    for alias in node.names:
        value = getattr(imported, alias.name, None)
        if (
            alias.name == "*"
            or isinstance(value, ModuleType)
            or (value is None and _is_module(f"{target}.{alias.name}"))
        ):
            raise RemoteCodeError(
                f"{where}: 'from {target} import {alias.name}' imports a module, which a flat folder cannot "
                "hold; import names from it instead"
            )
    names = ", ".join(a.name if a.asname is None else f"{a.name} as {a.asname}" for a in node.names)
    return f"from .{flat_name(target)} import {names}"


def rewrite_imports(module: str, source: str) -> tuple[str, list[str]]:
    """``source`` of ``module`` with each import of a kvlm module replaced by the relative import of its flat
    sibling; returns the new source and the kvlm modules it imports."""
    tree = ast.parse(source)
    lines = source.splitlines(keepends=True)
    starts = [0]
    for line in lines:
        starts.append(starts[-1] + len(line))

    def offset(lineno: int, col: int) -> int:  # ast columns count UTF-8 bytes
        line = lines[lineno - 1]
        return starts[lineno - 1] + len(line.encode("utf-8")[:col].decode("utf-8"))

    edits, deps = [], []
    for node, target in _kvlm_imports(module, tree):
        begin = offset(node.lineno, node.col_offset)
        if source[starts[node.lineno - 1] : begin].strip():
            # transformers finds the files to copy by "from .x import" at the start of a line
            raise RemoteCodeError(
                f"{module} line {node.lineno}: an import must start its own line to be bundled"
            )
        edits.append(
            (begin, offset(node.end_lineno, node.end_col_offset), _relative_import(module, node, target))
        )
        deps.append(target)
    for begin, end, text in sorted(edits, reverse=True):
        source = source[:begin] + text + source[end:]
    return source, deps


def bundle(roots: tuple[str, ...] | list[str]) -> dict[str, str]:
    """{flat file name: source} for ``roots`` and every kvlm module they import, transitively."""
    files: dict[str, str] = {}
    todo, seen = list(roots), set()
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        source, deps = rewrite_imports(module, module_source(module))
        files[f"{flat_name(module)}.py"] = source
        todo.extend(d for d in deps if d not in seen)
    return files


def entry_files(attention: str) -> dict[str, str]:
    """The two files transformers' ``auto_map`` names; the configuration imports the mechanism's module, which
    registers it (the registry looks a mechanism up by name when a config is validated)."""
    mechanism = flat_name(get_attention_class(attention).__module__)
    note = (
        f"Remote code of a kvlm model (attention {attention!r}), written by `kvlm export-hf`\n"
        f"(kvlm {__version__}). The kvlm_*.py files beside this one are kvlm's modules with their imports\n"
        "of each other made relative (kvlm.interop.remote_code): loading this folder does not need kvlm."
    )
    config = f'''"""{note}"""

from .{mechanism} import __name__ as _mechanism  # noqa: F401  (registers attention {attention!r})
from .{flat_name("kvlm.interop.hf_config")} import KVLMConfig

__all__ = ["KVLMConfig"]
'''
    modeling = f'''"""{note}"""

from .{CONFIG_FILE} import KVLMConfig
from .{flat_name("kvlm.interop.hf_modeling")} import KVLMCache, KVLMForCausalLM

__all__ = ["KVLMCache", "KVLMConfig", "KVLMForCausalLM"]
'''
    return {f"{CONFIG_FILE}.py": config, f"{MODELING_FILE}.py": modeling}


def write_remote_code(folder: str | Path, attention: str) -> list[str]:
    """Write the remote code of a model of mechanism ``attention`` into ``folder``; returns the file names."""
    folder = Path(folder)
    mechanism = get_attention_class(attention).__module__
    files = {**bundle([*ROOT_MODULES, mechanism]), **entry_files(attention)}
    for name, text in files.items():
        (folder / name).write_text(text, encoding="utf-8")
    return sorted(files)


__all__ = ["AUTO_MAP", "RemoteCodeError", "bundle", "entry_files", "rewrite_imports", "write_remote_code"]
