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


class OutputError(ValueError):
    """An output path that cannot be written, or whose writing would replace files kvlm did not write."""


class TrainingError(ValueError):
    """A run that cannot go on: its loss or weights became NaN or infinite (diverged), its run folder holds another
    run or is in use by another trainer."""


class TrainingInterrupted(KeyboardInterrupt):
    """Ctrl-C during training, after the checkpoint of the current step was saved (``step``, ``checkpoint``:
    its folder, or None without a run folder)."""

    def __init__(self, step: int, checkpoint=None):
        super().__init__(step, checkpoint)
        self.step, self.checkpoint = step, checkpoint


__all__ = ["CacheError", "ConfigError", "OutputError", "TrainingError", "TrainingInterrupted"]
