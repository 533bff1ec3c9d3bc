"""Argument helpers shared by the verbs of the `kvlm` command.

- ``parse_overrides(["n_layer=4", "gated=true"])`` -> ``{"n_layer": 4, "gated": True}``: the repeatable
  ``--set KEY=VALUE`` option. Each value is read as YAML (numbers, booleans, null, lists); ``-`` in a key
  becomes ``_`` so ``--set kv-lora-rank=64`` names the field ``kv_lora_rank``.
- ``parse_int_list("1,2,4", "tp")`` -> ``[1, 2, 4]``: comma-separated integer options (``--tp``, ``--batch``,
  ``--seeds``, ...), with one error message that names the option.

- ``positive_int`` / ``nonnegative_int`` / ``finite_float``: argparse ``type=`` checks, so ``--seq-len 0`` or
  ``--temperature nan`` is a usage error (exit 2) naming the option, never a silent "0 means the default".
- ``resolve_device("tpu")``: ``--device`` text -> torch.device, with one error for an unknown device or a CUDA
  device on a machine without CUDA.
- ``check_utf8(text, what)``: a command-line string with bytes that are not UTF-8 (Python keeps them as lone
  surrogates) is refused, naming the option, instead of failing deep inside the tokenizer.

These raise ``kvlm.config.ConfigError`` (a ValueError, which the dispatcher reports as one error line).
"""

from __future__ import annotations

import argparse
import math
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


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    return _int_at_least(text, 1, "a positive integer")


def nonnegative_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    return _int_at_least(text, 0, "an integer >= 0")


def _int_at_least(text: str, minimum: int, words: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {words}, got {text!r}") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"expected {words}, got {text!r}")
    return value


def finite_float(text: str) -> float:
    """argparse type: a finite number (no nan / inf)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def resolve_device(text: str | None):
    """``--device`` -> torch.device (None: cuda when available, else cpu). ConfigError for a name torch does not
    know (``tpu``) or a CUDA device on a machine without one."""
    import torch  # on use: argument parsing must not import torch

    if text is None or text == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(text)
    except (RuntimeError, TypeError, ValueError):
        raise ConfigError(f"--device {text!r} is not a device (use cpu, cuda, cuda:N or mps)") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"--device {text}: CUDA is not available on this machine (use --device cpu)")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ConfigError(f"--device {text}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    elif device.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(f"--device {text}: MPS is not available on this machine")
    elif device.type not in ("cpu", "cuda", "mps"):
        raise ConfigError(f"--device {text!r}: kvlm runs on cpu, cuda or mps")
    return device


def check_utf8(text: str, what: str) -> str:
    """``text`` unchanged, or ConfigError naming ``what`` when it holds bytes that are not UTF-8 (lone surrogates
    from the command line's surrogateescape decoding)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ConfigError(
            f"{what} is not valid UTF-8 text (an undecodable byte at character {e.start}): {text[:40]!r}"
        ) from None
    return text


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` for every verb: each option's help ends with "(default: X)", unless its help already speaks of
    the default or there is nothing to show (None, a switch's False, an empty list: the help says what then)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        value = action.default
        nothing = value is None or value is False or value == [] or value is argparse.SUPPRESS
        if nothing or "default" in text.lower():
            return text
        if action.option_strings or action.nargs in (argparse.OPTIONAL, argparse.ZERO_OR_MORE):
            return text + " (default: %(default)s)"
        return text
