"""Folders written as a whole, and output paths checked before long work.

Checkpoints, prepared data and Hugging Face exports are built in a temporary sibling folder
(``temp_folder(dest)``: ``.NAME.tmp-PID-XXXXXXXX``) and swapped in by ``replace_folder``, the one place that
replaces a folder. The swap is four renames, each atomic, so a crash (kill -9, power loss) at any instant
leaves a complete folder that ``recover_folder`` finds:

    1. fsync the finished files;       rename .NAME.tmp-PID-X -> .NAME.new-PID   (the name says "complete")
    2. if NAME exists:                 rename NAME            -> .NAME.old-PID
    3.                                 rename .NAME.new-PID   -> NAME
    4.                                 delete .NAME.old-PID

A crash before 1 leaves NAME as it was (plus an incomplete tmp folder, never used); between 2 and 3 NAME is
missing and both complete copies exist, and ``recover_folder`` (called by every loader) renames the newest back.
``clean_leftovers`` deletes what a crashed swap left once NAME is in place; the next save calls it.

The finished folder gets the user's umask (0755 / 0644 with the usual 022): ``mkdtemp`` and safetensors
create private 0700 / 0600 files, which nobody asked for.

``prepare_output_file`` / ``prepare_output_folder`` check (and create the parents of) an output path before a
command spends minutes measuring or training, so a typo fails at once instead of losing the work.
"""

from __future__ import annotations

import json
import math
import os
import re
import secrets
import shutil
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from kvlm.errors import OutputError
from kvlm.logs import get_logger

logger = get_logger(__name__)

# a legacy leftover (mkdtemp name, no process id) older than this is stale
LEGACY_STALE_S = 3600.0
# how long a loader waits for another live process's swap to finish before recovering anyway
SWAP_WAIT_S = 5.0


# --- the swap ------------------------------------------------------------------------------------------------
def temp_folder(dest: Path) -> Path:
    """A new empty folder beside ``dest`` to build it in (``.NAME.tmp-PID-XXXXXXXX``); creates dest's parent."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    while True:
        tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
        try:
            os.mkdir(tmp)  # unlike mkdtemp, honours the umask
            return tmp
        except FileExistsError:
            continue


def replace_folder(tmp: Path, dest: Path) -> None:
    """Move the finished folder ``tmp`` to ``dest`` (same parent folder), replacing whatever is there; the old
    contents are deleted only after the new folder is in place (the module docstring: the crash windows)."""
    tmp, dest = Path(tmp), Path(dest)
    _apply_umask(tmp)
    _fsync_tree(tmp)
    pid = os.getpid()
    new, old = _leftover(dest, "new", pid), _leftover(dest, "old", pid)
    if new.exists() or old.exists():  # a swap of this process failed earlier: its copy may be dest's only one
        recover_folder(dest)
        for stale in (new, old):
            _remove(stale)
    os.replace(tmp, new)
    _fsync_path(dest.parent)
    had_old = dest.exists() or dest.is_symlink()
    if had_old:
        os.replace(dest, old)
    os.replace(new, dest)
    _fsync_path(dest.parent)
    if had_old:
        _remove(old)


def recover_folder(dest: Path) -> bool:
    """If ``dest`` is missing because a swap was cut between its renames, put the newest complete copy back
    (a ``.NAME.new-*`` folder, else a ``.NAME.old-*`` one). Returns whether ``dest`` exists afterwards."""
    dest = Path(dest)
    if dest.exists():
        return True
    found = leftovers(dest)
    if any(kind != "tmp" and _alive(pid) for kind, pid, _ in found):
        # another live process is between renames 2 and 3: give it the moment it needs
        deadline = time.monotonic() + SWAP_WAIT_S
        while time.monotonic() < deadline and not dest.exists():
            time.sleep(0.05)
        if dest.exists():
            return True
        found = leftovers(dest)
    for kind in ("new", "old"):
        for _, _, path in sorted(
            (f for f in found if f[0] == kind), key=lambda f: f[2].stat().st_mtime, reverse=True
        ):
            try:
                os.replace(path, dest)
            except OSError:
                if dest.exists():  # another loader (another rank) recovered it first
                    return True
                continue
            _fsync_path(dest.parent)
            logger.warning(f"{dest} was missing after an interrupted save; recovered it from {path.name}")
            return True
    return False


def clean_leftovers(dest: Path) -> list[Path]:
    """Recover ``dest`` if needed, then delete the temporaries crashed swaps left beside it (those of live
    processes other than this one are kept: they may be mid-swap). Returns what was deleted."""
    dest = Path(dest)
    recover_folder(dest)  # first: a crashed swap's complete copy may be the only one
    removed = []
    for kind, pid, path in leftovers(dest):
        if pid is None:
            if time.time() - path.stat().st_mtime < LEGACY_STALE_S:
                continue
        elif pid != os.getpid() and _alive(pid):
            continue
        if kind != "tmp" and not dest.exists():
            continue  # never delete the last complete copy
        _remove(path)
        removed.append(path)
    if removed:
        logger.info(f"removed {len(removed)} leftover(s) of interrupted saves beside {dest}")
    return removed


def _leftover(dest: Path, kind: str, pid: int) -> Path:
    return dest.with_name(f".{dest.name}.{kind}-{pid}")


def leftovers(dest: Path) -> list[tuple[str, int | None, Path]]:
    """(kind, pid or None for a legacy mkdtemp name, path) of the swap temporaries beside dest: kind "tmp"
    (incomplete), "new" (complete, not yet swapped in) or "old" (the replaced folder, not yet deleted)."""
    pattern = re.compile(
        rf"^\.{re.escape(dest.name)}\.(?:(tmp)-(\d+)-[0-9a-f]{{8}}|(new|old)-(\d+)|(tmp)-[A-Za-z0-9_]{{8}})$"
    )
    out = []
    if not dest.parent.is_dir():
        return out
    for p in dest.parent.iterdir():
        m = pattern.match(p.name)
        if m is None or not p.is_dir():
            continue
        if m.group(1):
            out.append(("tmp", int(m.group(2)), p))
        elif m.group(3):
            out.append((m.group(3), int(m.group(4)), p))
        else:
            out.append(("tmp", None, p))
    return out


def _alive(pid: int | None) -> bool:
    if pid is None or pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    return True


def _remove(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def _umask() -> int:
    try:  # Linux: read it without changing it (os.umask would race with other threads)
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _apply_umask(folder: Path) -> None:
    """Ordinary permissions for what tempfile / safetensors created private (0700 folders, 0600 files)."""
    mask = _umask()
    for root, _dirs, files in os.walk(folder):
        os.chmod(root, 0o777 & ~mask)
        for name in files:
            f = os.path.join(root, name)
            if not os.path.islink(f):
                executable = os.stat(f).st_mode & 0o111
                os.chmod(f, (0o777 if executable else 0o666) & ~mask)


def _fsync_tree(folder: Path) -> None:
    for root, _dirs, files in os.walk(folder):
        for name in files:
            f = os.path.join(root, name)
            if not os.path.islink(f):
                _fsync_path(Path(f))
        _fsync_path(Path(root))


def _fsync_path(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems cannot fsync a folder
    finally:
        os.close(fd)


# --- output paths checked before the work --------------------------------------------------------------------
def prepare_output_file(path: str | Path | None, what: str = "output") -> Path | None:
    """Check that ``path`` can be written as a file (creating its parent folders) before the work that fills it;
    raise OutputError naming the problem. None passes through."""
    if path is None:
        return None
    path = Path(path)
    if path.is_dir():
        raise OutputError(f"{what} {path} is a folder; give a file name")
    parent = path.parent
    _make_parents(parent, what, path)
    if not os.access(parent, os.W_OK | os.X_OK):
        raise OutputError(f"{what} {path}: cannot write into {parent} (permission denied)")
    if path.exists() and not os.access(path, os.W_OK):
        raise OutputError(f"{what} {path} exists and is not writable")
    return path


def prepare_output_folder(path: str | Path, what: str = "output folder") -> Path:
    """Check that ``path`` is (or can become) a writable folder, creating it; raise OutputError if not."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise OutputError(f"{what} {path} is a file, not a folder")
    _make_parents(path, what, path)
    if not os.access(path, os.W_OK | os.X_OK):
        raise OutputError(f"{what} {path} is not writable (permission denied)")
    return path


def _make_parents(folder: Path, what: str, path: Path) -> None:
    for p in (folder, *folder.parents):
        if p.exists() and not p.is_dir():
            raise OutputError(f"{what} {path}: {p} is a file, not a folder")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OutputError(f"{what} {path}: cannot create {folder}: {e.strerror or e}") from e


# what kvlm writes into a run folder (kvlm.training, kvlm.cli.train): named last when a folder is refused
KVLM_OUTPUTS = (".lock", "checkpoint", "config.yaml", "metrics.jsonl", "result.json", "loss.png", "tensorboard", "data")


def check_replaceable(
    out: str | Path,
    *,
    force: bool,
    foreign: Callable[[Path], list[str]],
    kind: str,
    protect: Iterable[str | Path] = (),
    what: str = "output folder",
) -> None:
    """Before a folder is written whole at ``out`` (replacing what is there): refuse a file, a folder that is or
    holds a ``protect`` path (the source), a non-empty folder without ``force``, and, even with ``force``, a
    folder that holds anything ``foreign(out)`` names (what is not a previous ``kind``, kvlm's own output)."""
    out = Path(out)
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise OutputError(f"{what} {out} is a file, not a folder; nothing was written")
    here = out.resolve()
    for p in protect:
        src = Path(p).resolve()
        if here == src or here in src.parents:
            raise OutputError(
                f"{what} {out} is or holds the source {p}: writing there would delete it; choose another folder"
            )
    if not out.is_dir() or not any(out.iterdir()):
        return
    # the user's own files first: a run folder's kvlm outputs must not crowd them out of the message
    names = sorted(foreign(out), key=lambda n: (n.rstrip("/") in KVLM_OUTPUTS, n))
    if names:
        shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        raise OutputError(
            f"{what} {out} is not empty and holds what is not part of a {kind} kvlm wrote ({shown}); it is "
            f"not replaced even with --force: choose another folder or move those away"
        )
    if not force:
        raise OutputError(f"{what} {out} already holds a {kind}; pass --force (force=True) to replace it")


def finite_or_none(obj: Any) -> Any:
    """``obj`` with every NaN / infinite float (in dicts, lists, tuples) replaced by None."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite_or_none(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite_or_none(v) for v in obj]
    return obj


def json_text(obj: Any, **kwargs: Any) -> str:
    """Strict JSON: a NaN or infinite number is written as null (``json.dumps`` would write the bare ``NaN`` that
    JSON parsers other than Python's reject)."""
    return json.dumps(finite_or_none(obj), allow_nan=False, **kwargs)
