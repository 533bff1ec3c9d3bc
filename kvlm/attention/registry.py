"""The attention registry: mechanism name -> class.

Each mechanism module in this package registers its class(es) with ``@register("name", ...)``; the registry
finds them by importing every module of the package (``pkgutil``), so adding a mechanism is adding a file.
A mechanism defined outside kvlm registers the same way (``from kvlm.attention import register``) and is then
known to every verb: configs, the model, accounting, benchmarks.
"""

from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path
from typing import TYPE_CHECKING

from kvlm.errors import ConfigError

if TYPE_CHECKING:
    from kvlm.attention.base import Attention

_REGISTRY: dict[str, type[Attention]] = {}
_DISCOVERED = False


def register(*names: str):
    """Class decorator: make the class the mechanism for each of ``names`` (lower case, as configs spell them)."""

    def deco(cls: type[Attention]) -> type[Attention]:
        for n in names:
            _REGISTRY[n] = cls
        return cls

    return deco


def registry() -> dict[str, type[Attention]]:
    """Every registered mechanism; the first call imports each module of this package."""
    global _DISCOVERED
    if not _DISCOVERED:
        _DISCOVERED = True  # before importing: a module that builds a config at import time must not recurse
        try:
            for info in pkgutil.iter_modules([str(Path(__file__).parent)]):
                importlib.import_module(f"{__package__}.{info.name}")
        except BaseException:
            _DISCOVERED = (
                False  # a broken module: fail again on the next call rather than run half-registered
            )
            raise
    return _REGISTRY


def get_attention_class(name: str) -> type[Attention]:
    reg = registry()
    if name not in reg:
        raise ConfigError(f"unknown attention {name!r}; known: {', '.join(sorted(reg))}")
    return reg[name]


__all__ = ["get_attention_class", "register", "registry"]
