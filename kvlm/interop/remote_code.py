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

One package is not copied but replaced: ``kvlm.kernels`` (fused decode kernels: a C++ source compiled on first
use, a Triton module) cannot live in a flat folder of .py files, and the plain PyTorch path it falls back to is
the reference it is tested against. Its imports (``from kvlm import kernels``, ``from kvlm.kernels import
ready``) become imports of ``kvlm_kernels_fallback.py`` (``FALLBACKS``), whose ``ready`` is always False, so an
exported folder decodes on the plain path. A bundled module that uses a kernels name the fallback does not
define is refused at export time.
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
}  # also kvlm.interop.hf_modeling.REMOTE_AUTO_MAP (a re-saved remote model restores it; test_hf_conventions)


# what a folder carries instead of a kvlm package that cannot be copied as flat .py files: {package: (flat
# file, source)}; the source defines the package's names the bundled modules use, and the package itself (for
# ``from kvlm import kernels``) as a namespace of them
_KERNELS_FALLBACK = '''"""Stand-in for kvlm.kernels in an exported folder (kvlm.interop.remote_code): the fused decode kernels are
not bundled, ``ready`` is always False, so attention takes its plain PyTorch path (the kernels' reference)."""

from collections import Counter
from types import SimpleNamespace

CALLS = Counter()
FLOPS = Counter()
MAX_NEW = 0


class KernelUnavailable(RuntimeError):
    pass


def ready(*args, **kwargs):
    return False


def latent_decode(*args, strict=False, **kwargs):
    if strict:
        raise KernelUnavailable("kvlm's kernels are not bundled in an exported folder")
    return None


def gqa_decode(*args, strict=False, **kwargs):
    if strict:
        raise KernelUnavailable("kvlm's kernels are not bundled in an exported folder")
    return None


def rms_norm(*args, **kwargs):
    return None


def gqa_block_call(*args, **kwargs):
    return None


def mla_block_call(*args, **kwargs):
    return None


def register_packed(*args, **kwargs):
    pass


MAX_ROWS = 0
FEW_ROWS = 0


def few_rows_available():
    return False


def panels_available():
    return False


def few_rows_fit(x, first=True):
    return False


def few_rows_linear(*args, **kwargs):
    return None


def few_rows_head_matmul(*args, **kwargs):
    return None


def block_stack(*args, **kwargs):
    return None


def pack_panels(*args, **kwargs):
    raise RuntimeError("kvlm's kernels are not bundled in an exported folder")


def panel_product(*args, **kwargs):
    raise RuntimeError("kvlm's kernels are not bundled in an exported folder")


def packed_linear(x, weights, biases):
    import torch
    import torch.nn.functional as F

    ys = [F.linear(x, w, b) for w, b in zip(weights, biases)]
    return ys[0] if len(ys) == 1 else torch.cat(ys, dim=-1)


kernels = SimpleNamespace(
    CALLS=CALLS, FLOPS=FLOPS, MAX_NEW=MAX_NEW, KernelUnavailable=KernelUnavailable, ready=ready,
    latent_decode=latent_decode, gqa_decode=gqa_decode, rms_norm=rms_norm, gqa_block_call=gqa_block_call,
    mla_block_call=mla_block_call, block_stack=block_stack,
)
'''
FALLBACKS = {"kvlm.kernels": ("kvlm_kernels_fallback", _KERNELS_FALLBACK)}


def _fallback_names(package: str) -> set[str]:
    return {
        n.targets[0].id if isinstance(n, ast.Assign) else n.name
        for n in ast.parse(FALLBACKS[package][1]).body
        if isinstance(n, (ast.FunctionDef, ast.ClassDef))
        or (isinstance(n, ast.Assign) and isinstance(n.targets[0], ast.Name))
    }


def _fallback_of(target: str | None) -> str | None:
    """The package of FALLBACKS that ``target`` (an imported module) lies in, or None."""
    for package in FALLBACKS:
        if target is not None and (target == package or target.startswith(package + ".")):
            return package
    return None


def _fallback_import(module: str, tree: ast.Module, node: ast.stmt, target: str | None) -> str | None:
    """The import of the fallback file that replaces ``node``, or None if ``node`` imports no replaced package.
    Raises RemoteCodeError if the module uses a name of the package that the fallback lacks."""
    if not isinstance(node, ast.ImportFrom):
        return None
    where = f"{module} line {node.lineno}"
    names = [(a.name, a.asname or a.name) for a in node.names]
    if target == PACKAGE:  # from kvlm import kernels
        packages = {name: _fallback_of(f"{PACKAGE}.{name}") for name, _ in names}
        if not any(packages.values()):
            return None
        if not all(packages.values()):
            raise RemoteCodeError(f"{where}: import replaced packages on a line of their own")
        package = next(iter(packages.values()))
        defined = _fallback_names(package)
        for _, local in names:
            # the attributes read from the module object must all exist in the stand-in
            used = {
                n.attr
                for n in ast.walk(tree)
                if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == local
            }
            if used - defined:
                raise RemoteCodeError(
                    f"{where}: uses {sorted(used - defined)} of {package}, which the folder's stand-in "
                    f"({FALLBACKS[package][0]}.py) does not define; add them to kvlm.interop.remote_code.FALLBACKS"
                )
    else:
        package = _fallback_of(target)
        if package is None:
            return None
        missing = {name for name, _ in names} - _fallback_names(package)
        if missing:
            raise RemoteCodeError(
                f"{where}: imports {sorted(missing)} of {package}, which the folder's stand-in "
                f"({FALLBACKS[package][0]}.py) does not define; add them to kvlm.interop.remote_code.FALLBACKS"
            )
    text = ", ".join(a.name if a.asname is None else f"{a.name} as {a.asname}" for a in node.names)
    return f"from .{FALLBACKS[package][0]} import {text}"


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
    sibling; returns the new source and the kvlm modules it imports (or the FALLBACKS files it uses)."""
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
        replaced = _fallback_import(module, tree, node, target)
        end = offset(node.end_lineno, node.end_col_offset)
        if replaced is not None:
            edits.append((begin, end, replaced))
            deps.append(FALLBACKS[_fallback_of(target) or _fallback_of(f"{PACKAGE}.{node.names[0].name}")][0])
            continue
        edits.append((begin, end, _relative_import(module, node, target)))
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
        fallback = {name: text for name, text in FALLBACKS.values()}
        if module in fallback:  # a stand-in file, written as is
            files[f"{module}.py"] = fallback[module]
            continue
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


__all__ = [
    "AUTO_MAP",
    "FALLBACKS",
    "RemoteCodeError",
    "bundle",
    "entry_files",
    "rewrite_imports",
    "write_remote_code",
]
