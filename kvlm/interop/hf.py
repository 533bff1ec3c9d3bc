"""`kvlm export-hf CHECKPOINT OUT`: a kvlm checkpoint as a Hugging Face transformers folder.

The folder holds config.json (model_type "kvlm"), model.safetensors, generation_config.json and the tokenizer
(tokenizer.json + tokenizer_config.json). Two ways to load it, both offline:

    import kvlm                                   # registers "kvlm" with AutoConfig / AutoModelForCausalLM
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(OUT)

    # without kvlm installed: the folder carries its own code (modeling_kvlm.py + kvlm_*.py)
    model = AutoModelForCausalLM.from_pretrained(OUT, trust_remote_code=True)

The remote code is kvlm's own source, copied: ``kvlm/hf_modeling.py`` becomes ``modeling_kvlm.py`` and each
kvlm module it needs (config, model, cache, the attention registry and the model's mechanism) becomes a flat
``kvlm_<dotted_name>.py`` with its ``from kvlm.x import`` lines made relative, because transformers copies
only files beside the module that it reaches through relative imports (no sub-packages).

Registration is cheap: ``import kvlm`` never imports transformers. It installs an import hook that registers
the config class when transformers' ``configuration_auto`` is imported and the model class when
``modeling_auto`` is (immediately if they already are), so ``Auto*`` see "kvlm" whatever the import order.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.abc
import importlib.util
import json
import os
import re
import shutil
import sys
import tempfile
import threading
import warnings
from pathlib import Path

MODEL_TYPE = "kvlm"
REMOTE_MODULE = "modeling_kvlm"
AUTO_MAP = {
    "AutoConfig": f"{REMOTE_MODULE}.KVLMConfig",  # one module for both: one copy in the modules cache
    "AutoModelForCausalLM": f"{REMOTE_MODULE}.KVLMForCausalLM",
}


class ExportError(ValueError):
    """A checkpoint that cannot be exported, or an output path that cannot be written."""


# --- registration with transformers' Auto classes ----------------------------------------------------
_CONFIG_AUTO = "transformers.models.auto.configuration_auto"
_MODELING_AUTO = "transformers.models.auto.modeling_auto"
_registered: set[str] = set()
_lock = threading.RLock()


def register_config() -> None:
    with _lock:
        if "config" in _registered:
            return
        from transformers import AutoConfig

        from kvlm.interop.hf_config import KVLMConfig

        AutoConfig.register(MODEL_TYPE, KVLMConfig, exist_ok=True)
        _registered.add("config")


def register_model() -> None:
    with _lock:
        if "model" in _registered:
            return
        register_config()
        from transformers import AutoModelForCausalLM

        from kvlm.interop.hf_modeling import KVLMConfig, KVLMForCausalLM

        AutoModelForCausalLM.register(KVLMConfig, KVLMForCausalLM, exist_ok=True)
        _registered.add("model")


def register_auto_classes() -> None:
    """Register "kvlm" with AutoConfig and AutoModelForCausalLM now (imports transformers)."""
    register_model()


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs a hook right after a watched module has been executed (a post-import hook)."""

    def __init__(self, hooks: dict):
        self.hooks = hooks

    def find_spec(self, name, path=None, target=None):
        if name not in self.hooks:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        # the hook stays pending until the module really runs (find_spec alone imports nothing)
        spec.loader = _HookedLoader(spec.loader, self.hooks, name)
        return spec


class _HookedLoader(importlib.abc.Loader):
    def __init__(self, loader, hooks: dict, name: str):
        self.loader, self.hooks, self.name = loader, hooks, name

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        module.__loader__ = self.loader
        self.loader.exec_module(module)
        hook = self.hooks.pop(self.name, None)
        if hook is None:
            return
        try:
            hook()
        except Exception as e:  # registration must never break the user's import of transformers
            warnings.warn(f"kvlm: could not register with transformers' Auto classes: {e}", stacklevel=2)

    def __getattr__(self, name):
        return getattr(self.loader, name)


def install_auto_registration() -> None:
    """Called by ``import kvlm``: register now where transformers' auto modules are loaded, else on import."""
    hooks = {}
    for module, hook in ((_CONFIG_AUTO, register_config), (_MODELING_AUTO, register_model)):
        if module in sys.modules:
            try:
                hook()
            except Exception as e:
                warnings.warn(f"kvlm: could not register with transformers' Auto classes: {e}", stacklevel=2)
        else:
            hooks[module] = hook
    if hooks and not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(hooks))


# --- export ----------------------------------------------------------------------------------------------
def to_hf(model):
    """A kvlm ``KVLM`` -> ``KVLMForCausalLM`` sharing nothing with it (weights copied)."""
    from kvlm.interop.hf_modeling import KVLMConfig, KVLMForCausalLM

    hf = KVLMForCausalLM(KVLMConfig(kvlm_config=model.cfg.to_dict()))
    hf.model.load_state_dict(model.state_dict())
    p = next(model.parameters())
    return hf.to(device=p.device, dtype=p.dtype).eval()


def hf_tokenizer(tokenizer):
    """kvlm Tokenizer (or tokenizers.Tokenizer) -> transformers fast tokenizer with eos = pad = <|endoftext|>."""
    from transformers import PreTrainedTokenizerFast

    backend = getattr(tokenizer, "backend", tokenizer)
    eos = getattr(tokenizer, "eos_token", "<|endoftext|>")
    if backend.token_to_id(eos) is None:
        raise ExportError(f"tokenizer has no end-of-text token {eos!r}")
    # left padding: kvlm's cache takes left-padded batches
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token=eos, pad_token=eos, bos_token=eos, padding_side="left"
    )


def export_hf(checkpoint, out: str | Path, *, remote_code: bool = True, dtype=None) -> Path:
    """Write a transformers folder for ``checkpoint`` (a kvlm checkpoint folder, or a ``(model, tokenizer)``
    pair) at ``out`` (replaced atomically if it exists). Returns the folder."""
    from kvlm.checkpoint import load_checkpoint

    if isinstance(checkpoint, tuple):
        model, tokenizer = checkpoint
    else:
        model, tokenizer, _ = load_checkpoint(checkpoint)
    if dtype is not None:
        model = model.to(dtype)
    hf = to_hf(model)
    if remote_code:
        hf.config.auto_map = dict(AUTO_MAP)
    if tokenizer is not None:
        eos = getattr(tokenizer, "eos_id", None) or getattr(tokenizer, "backend", tokenizer).token_to_id(
            "<|endoftext|>"
        )
        for name in ("eos_token_id", "pad_token_id", "bos_token_id"):
            setattr(hf.config, name, eos)
            setattr(hf.generation_config, name, eos)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        hf.save_pretrained(tmp, safe_serialization=True)
        if tokenizer is not None:
            hf_tokenizer(tokenizer).save_pretrained(tmp)
        if remote_code:
            write_remote_code(tmp, model.cfg.attention)
        if out.exists():
            old = out.with_name(f".{out.name}.old-{os.getpid()}")
            os.replace(out, old)
            os.replace(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


# --- remote code: kvlm's source, flattened ------------------------------------------------------------
_FROM_KVLM = re.compile(r"^(\s*)from (kvlm(?:\.\w+)+) import ", re.MULTILINE)
_ANY_KVLM_IMPORT = re.compile(r"^\s*(import kvlm\b|from kvlm import )", re.MULTILINE)


def _flat_name(module: str) -> str:
    special = {"kvlm.interop.hf_modeling": REMOTE_MODULE, "kvlm.interop.hf_config": "configuration_kvlm"}
    return special.get(module, module.replace(".", "_"))


def _module_file(module: str) -> Path:
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        raise ExportError(f"cannot find the source of {module}")
    return Path(spec.origin)


def _kvlm_imports(source: str) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.ImportFrom)
            and node.level == 0
            and node.module
            and node.module.startswith("kvlm.")
        ):
            found.add(node.module)
    return found


def remote_code_modules(attention: str) -> list[str]:
    """kvlm modules the remote code needs: hf_modeling, the mechanism's module, and what they import."""
    from kvlm.attention import get_attention_class

    todo = ["kvlm.interop.hf_modeling", get_attention_class(attention).__module__]
    seen: list[str] = []
    while todo:
        mod = todo.pop()
        if mod in seen:
            continue
        seen.append(mod)
        todo.extend(sorted(_kvlm_imports(_module_file(mod).read_text())))
    return sorted(seen)


def flatten_source(source: str, module: str) -> str:
    """Make kvlm imports relative to the flat folder; refuse forms transformers' copier would miss."""
    if _ANY_KVLM_IMPORT.search(source):
        raise ExportError(
            f"{module}: 'import kvlm...' / 'from kvlm import' cannot be bundled; use 'from kvlm.x import'"
        )
    source = _FROM_KVLM.sub(lambda m: f"{m.group(1)}from .{_flat_name(m.group(2))} import ", source)
    # the attention registry imports mechanism modules by name
    source = source.replace('f"kvlm.attention.{mod}"', 'f"{__package__}.kvlm_attention_{mod}"')
    if re.search(r"[\"']kvlm\.\w", source):
        raise ExportError(f"{module}: a module path string 'kvlm....' cannot be bundled")
    return source


def write_remote_code(folder: str | Path, attention: str) -> list[str]:
    folder = Path(folder)
    modules = remote_code_modules(attention)
    written = []
    mechanism = _flat_name(_attention_module(attention))
    for mod in modules:
        text = flatten_source(_module_file(mod).read_text(), mod)
        if mod == "kvlm.interop.hf_config":
            # a static import, so that transformers copies the mechanism's file (the registry loads it by name)
            text += f"\nfrom .{mechanism} import __name__ as _kvlm_mechanism  # noqa: E402,F401\n"
        name = f"{_flat_name(mod)}.py"
        (folder / name).write_text(text)
        written.append(name)
    return written


def _attention_module(attention: str) -> str:
    from kvlm.attention import get_attention_class

    return get_attention_class(attention).__module__


# --- command line --------------------------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", help="kvlm checkpoint folder")
    p.add_argument("out", help="output folder (replaced if it exists)")
    p.add_argument("--no-remote-code", action="store_true",
                   help="do not copy kvlm's source into the folder (loading then needs kvlm installed)")  # fmt: skip
    p.add_argument(
        "--dtype", choices=["float32", "bfloat16", "float16"], default=None, help="default: as saved"
    )
    p.add_argument("--json", action="store_true", help="the last stdout line is a JSON object")


def main(args) -> int:
    import torch

    if importlib.util.find_spec("transformers") is None:
        raise ExportError("export-hf needs transformers: pip install 'kvlm[hf]'")
    dtype = getattr(torch, args.dtype) if args.dtype else None
    out = export_hf(args.checkpoint, args.out, remote_code=not args.no_remote_code, dtype=dtype)
    files = sorted(p.name for p in out.iterdir())
    if args.json:
        print(json.dumps({"out": str(out), "files": files}))
    else:
        print(f"wrote {out}: {', '.join(files)}")
    return 0
