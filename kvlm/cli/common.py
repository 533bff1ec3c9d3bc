"""Argument helpers shared by the verbs of the `kvlm` command.

- ``parse_overrides(["n_layer=4", "gated=true"])`` -> ``{"n_layer": 4, "gated": True}``: the repeatable
  ``--set KEY=VALUE`` option. Each value is read as YAML (numbers, booleans, null, lists); ``-`` in a key
  becomes ``_`` so ``--set kv-lora-rank=64`` names the field ``kv_lora_rank``.
- ``parse_int_list("1,2,4", "tp")`` -> ``[1, 2, 4]``: comma-separated integer options (``--tp``, ``--batch``,
  ``--seeds``, ...), with one error message that names the option.

Both raise ``kvlm.config.ConfigError`` (a ValueError, which the dispatcher reports as one error line).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import yaml

from kvlm.config import ConfigError


def parse_overrides(items: Iterable[str], option: str = "--set") -> dict[str, Any]:
    """``KEY=VALUE`` strings -> {key: YAML-parsed value}; a later item overrides an earlier one."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = str(item).partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not key:
            raise ConfigError(f"{option} expects KEY=VALUE, got {item!r}")
        try:
            out[key] = yaml.safe_load(value)
        except yaml.YAMLError as e:
            raise ConfigError(f"{option} {key}: not a valid value: {value!r}") from e
    return out


def parse_int_list(text: str | Iterable[int], what: str, *, minimum: int | None = 1) -> list[int]:
    """``"1,2,4"`` -> ``[1, 2, 4]`` (order kept, blanks skipped); an int or a list of ints passes through.

    ``what`` is the option's name without dashes, for the error message. Every value must be at least
    ``minimum`` (None: any integer); an empty list is an error."""
    if isinstance(text, int):
        vals = [text]
    elif isinstance(text, str):
        try:
            vals = [int(x) for x in text.split(",") if x.strip()]
        except ValueError as e:
            raise ConfigError(f"--{what} must be a comma-separated list of integers, got {text!r}") from e
    else:
        vals = [int(x) for x in text]
    if not vals:
        raise ConfigError(f"--{what} needs at least one integer, got {text!r}")
    if minimum is not None and any(v < minimum for v in vals):
        raise ConfigError(f"--{what} needs integers >= {minimum}, got {text!r}")
    return vals
