"""Folders written as a whole: built in a temporary sibling folder, then swapped in by ``replace_folder``.

Checkpoints, prepared data and Hugging Face exports use this one swap, so a reader sees the old folder or the
new one, never half of either.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def replace_folder(tmp: Path, dest: Path) -> None:
    """Move the finished folder ``tmp`` to ``dest`` (same parent folder), replacing whatever is there; the old
    contents are deleted only after the new folder is in place."""
    if dest.exists():
        old = dest.with_name(f".{dest.name}.old-{os.getpid()}")
        os.replace(dest, old)
        os.replace(tmp, dest)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, dest)
