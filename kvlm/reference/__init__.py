"""Plain reference implementations, straight from the papers' equations (einsum, explicit softmax).

Kept apart from the fast paths in kvlm.attention and used only by the tests to check them. Each function
takes a fast-path module (for its weights), the input x (B, T, d) and positions (B, T), and returns the
attention sublayer's output (B, T, d) for the full causal sequence. Float64 friendly.
"""

from __future__ import annotations

import importlib

_MODULES = ("mha", "mla", "eg_mla", "mlra", "gta", "mfa", "tpa")
_REFERENCES = {}


def register(*names):
    def deco(fn):
        for n in names:
            _REFERENCES[n] = fn
        return fn

    return deco


def reference_attention(module, x, positions, token_ids=None):
    """token_ids (B, T): for mechanisms that read the tokens themselves (``needs_token_ids``, eg-mla)."""
    if not _REFERENCES:
        for mod in _MODULES:
            try:
                importlib.import_module(f"kvlm.reference.{mod}")
            except ModuleNotFoundError as e:
                if e.name != f"kvlm.reference.{mod}":
                    raise
    fn = _REFERENCES[module.cfg.attention]
    if getattr(module, "needs_token_ids", False):
        if token_ids is None:
            raise ValueError(f"the {module.cfg.attention} reference needs token_ids")
        return fn(module, x, positions, token_ids)
    return fn(module, x, positions)
