"""The error boundary of the `kvlm` command: every exception a verb raises becomes one line on stderr.

``describe(exc)`` -> (message, expected). kvlm's own errors (ConfigError, CacheError, DataError, ... all
ValueErrors) and the usual failures of the environment (a path that is a file or a folder, permission denied, a
read-only file system, a full disk, also as torch's ``enforce fail at inline_container.cc``, text that is not
UTF-8, a pickle that holds more than weights, out of memory) are *expected*: their message names the problem and
nothing else is printed. Anything else is a bug or a case not yet named here: one line with the exception's type,
and ``kvlm.cli.main`` adds "run with --debug for the traceback".
"""

from __future__ import annotations

import errno
import os
import pickle

# errno -> words; os.strerror's wording differs between platforms
_OS_WORDS = {
    errno.ENOSPC: "no space left on device (the disk is full)",
    errno.EDQUOT: "disk quota exceeded",
    errno.EROFS: "read-only file system",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.ENOENT: "no such file or folder",
    errno.EISDIR: "is a folder, expected a file",
    errno.ENOTDIR: "a part of the path is a file, not a folder",
    errno.EEXIST: "already exists",
    errno.ENAMETOOLONG: "file name too long",
}

# fragments of messages that torch / safetensors / the Rust tokenizers give for a failed write
_DISK_FULL = ("No space left", "code: 28", "StorageFull", "errno 28")
_TORCH_WRITE = ("enforce fail at inline_container.cc", "PytorchStreamWriter failed", "unexpected pos")
_PICKLE = ("Weights only load failed", "weights_only")
_NO_CUDA = ("Torch not compiled with CUDA enabled", "Found no NVIDIA driver", "no CUDA GPUs are available")


def one_line(text: str, limit: int = 600) -> str:
    """Collapse a message onto one line (torch and pydantic write several) and bound its length."""
    text = " ".join(part.strip() for part in str(text).splitlines() if part.strip())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _os_message(e: OSError) -> str:
    words = _OS_WORDS.get(e.errno) or e.strerror or type(e).__name__
    names = [n for n in (e.filename, e.filename2) if n]
    if names:
        return f"{words}: {' -> '.join(os.fsdecode(n) for n in names)}"
    return f"{words}" + (f" ({e})" if str(e) and e.strerror is None else "")


def describe(exc: BaseException) -> tuple[str, bool]:
    """(one-line message, whether the failure is an expected one whose message says it all)."""
    text = one_line(str(exc))
    if isinstance(exc, pickle.UnpicklingError) or (
        isinstance(exc, (RuntimeError, OSError, ValueError)) and any(s in text for s in _PICKLE)
    ):
        # torch's own message ends by suggesting weights_only=False, i.e. running the file's code: never say that
        return (
            "refusing to load a pickle that holds more than plain weights: kvlm never unpickles code "
            "(a .bin / .pt from an untrusted source can run anything). Convert the weights to .safetensors "
            "with a tool you trust",
            True,
        )
    if isinstance(exc, UnicodeError):
        return f"text is not valid UTF-8: {text}", True
    if isinstance(exc, OSError) and exc.errno is not None:
        return _os_message(exc), True
    if any(s in text for s in _DISK_FULL):
        return f"no space left on device (the disk is full): {text}", True
    if isinstance(exc, RuntimeError) and any(s in text for s in _TORCH_WRITE):
        return (
            f"writing a file failed (is the disk full, or the output read-only?): {text}",
            True,
        )
    if isinstance(exc, RuntimeError) and "device type at start of device string" in text:
        name = text.rsplit(":", 1)[-1].strip()
        return f"unknown device {name!r} (use cpu, cuda, cuda:N or mps)", True
    if any(s in text for s in _NO_CUDA):
        return f"CUDA is not available on this machine (use --device cpu): {text}", True
    if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError":
        return f"out of memory: {text or 'allocation failed'} (try a smaller batch, model or sequence)", True
    if isinstance(exc, (ValueError, FileNotFoundError)):
        # ConfigError, CacheError, DataError, TokenizerError, EvalError, CheckpointError: all ValueErrors
        return text or type(exc).__name__, True
    if isinstance(exc, OSError):
        return _os_message(exc), True
    return f"unexpected {type(exc).__name__}: {text}", False


__all__ = ["describe", "one_line"]
