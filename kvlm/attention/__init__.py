"""The attention registry: name -> class. One file per mechanism; each registers itself here."""

from __future__ import annotations

import importlib

from kvlm.attention.base import MODES, Attention, Step, attend

_MODULES = ("mha", "mla", "eg_mla", "mlra", "gta", "mfa", "tpa")
_REGISTRY: dict[str, type[Attention]] = {}
_LOADED = False


def register(*names: str):
    def deco(cls: type[Attention]) -> type[Attention]:
        for n in names:
            _REGISTRY[n] = cls
        return cls

    return deco


def registry() -> dict[str, type[Attention]]:
    global _LOADED
    if not _LOADED:
        _LOADED = True
        for mod in _MODULES:
            try:
                importlib.import_module(f"kvlm.attention.{mod}")
            except ModuleNotFoundError as e:  # a mechanism file not written yet
                if e.name != f"kvlm.attention.{mod}":
                    raise
    return _REGISTRY


def get_attention_class(name: str) -> type[Attention]:
    reg = registry()
    if name not in reg:
        from kvlm.config import ConfigError

        raise ConfigError(f"unknown attention {name!r}; known: {', '.join(sorted(reg))}")
    return reg[name]


__all__ = ["Attention", "MODES", "Step", "attend", "register", "registry", "get_attention_class"]
