"""The exceptions kvlm raises for bad input, defined below every other module so that each layer (config,
attention, cache, model) can raise them without importing the layers above it.

- ``ConfigError``: an invalid model or training configuration; the message names the offending field.
- ``CacheError``: misuse of a KV cache (out of capacity, wrong batch, dtype, device or layout).

Both are ``ValueError`` subclasses; ``kvlm.config`` and ``kvlm.cache`` re-export them where users expect them.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """An invalid model or training configuration; the message names the offending field."""


class CacheError(ValueError):
    """Misuse of a KV cache: out of capacity, wrong batch, dtype, device or layout."""


__all__ = ["CacheError", "ConfigError"]
