"""Plain reference implementations, straight from the papers' equations (einsum, explicit softmax).

Kept apart from the fast paths in kvlm.attention and used only by the tests to check them. Each reference
module registers, with ``@register(*names)``, a function for the mechanism names it covers; every module of this
package is imported on first use (``pkgutil``), as the attention registry does. A function takes a fast-path
module, the input x (B, T, d) and positions (B, T) (and token ids for ``needs_token_ids`` mechanisms) and
returns the attention sublayer's output (B, T, d) for the full causal sequence. Its structure (which
projections, norms, biases and gates exist) comes from ``module.cfg`` alone; only the weights are read from the
module, so a fast path that ignores a config option fails the comparison. Float64 friendly.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from pathlib import Path

_REFERENCES: dict[str, Callable] = {}
_DISCOVERED = False


def register(*names: str):
    """Decorator: the reference function for the mechanisms ``names`` (a plugin outside kvlm may use it too)."""

    def deco(fn):
        for n in names:
            _REFERENCES[n] = fn
        return fn

    return deco


def references() -> dict[str, Callable]:
    """Every registered reference; the first call imports each module of this package."""
    global _DISCOVERED
    if not _DISCOVERED:
        _DISCOVERED = True
        try:
            for info in pkgutil.iter_modules([str(Path(__file__).parent)]):
                importlib.import_module(f"{__package__}.{info.name}")
        except BaseException:
            _DISCOVERED = False
            raise
    return _REFERENCES


def reference_attention(module, x, positions, token_ids=None):
    """token_ids (B, T): for mechanisms that read the tokens themselves (``needs_token_ids``, eg-mla)."""
    name = module.cfg.attention
    refs = references()
    if name not in refs:
        raise KeyError(f"no reference implementation registered for attention {name!r}")
    if module.needs_token_ids:
        if token_ids is None:
            raise ValueError(f"the {name} reference needs token_ids")
        return refs[name](module, x, positions, token_ids)
    return refs[name](module, x, positions)
