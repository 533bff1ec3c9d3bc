"""Build and load of the C++/OpenMP decode kernel (csrc/decode.cpp), compiled on first use.

``torch.utils.cpp_extension.load`` compiles it with -O3 -march=native into its cache directory
(``TORCH_EXTENSIONS_DIR``, default ~/.cache/torch_extensions) and reuses the build while the source and flags
are unchanged. -march=native code only runs on CPUs with the same instruction sets, so the module name carries
a hash of this CPU's flags: a cache directory shared by different machines holds one build per kind of CPU. It
also carries a hash of every file in csrc/, since torch's own check hashes only the .cpp, not the headers, and
of the flags (``build_flags``: where the kernels prefetch to depends on this CPU's L1).

``extension()`` returns the loaded module, or None when kernels are disabled (``KVLM_KERNELS=0``) or the build
failed (no compiler, no headers): the failure is logged once and callers take the plain PyTorch path.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import threading
from pathlib import Path
from types import ModuleType

from kvlm.logs import get_logger

log = get_logger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "decode.cpp"
ENV = "KVLM_KERNELS"
# -falign-loops=64: every loop starts a cache line, so that a kernel's speed does not move with the size of code
# before it that it does not run (measured: MHA's kernel 0.92-0.98x after changes to MLA's paths only, 1.00x with
# both builds aligned)
CFLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp", "-fno-math-errno", "-falign-loops=64"]
# The attention kernels prefetch the key / value tiles ahead of the loop into L1 where L1 holds them beside the
# queries and accumulators, else into L2. Measured with benchmarks/kernel_micro.py, interleaved: on a Zen 5 EPYC
# (48 KiB L1d) L1 ran MLA 1.05-1.12x and MHA 1.02-1.04x faster than L2; on a Zen 4 EPYC (32 KiB L1d) L2 ran GQA-3
# and MHA 1.5x faster (0.60-0.66 L1 / L2), MLA and its T = 4 1.04-1.12x, int8 / fp8 latents level.
PREFETCH_L1_MIN_BYTES = 48 * 1024

_lock = threading.Lock()
_state: dict[str, object] = {}  # "module" once built, "error" once failed


# the environment variable's value -> enabled: read on every call (tests set it), parsed once per value
_parsed: dict[str | None, bool] = {}


def enabled() -> bool:
    """False when ``KVLM_KERNELS=0`` (or "false"/"off"): every kernel is skipped, the plain path runs."""
    raw = os.environ.get(ENV)
    on = _parsed.get(raw)
    if on is None:
        on = _parsed[raw] = (raw or "1").strip().lower() not in ("0", "false", "off", "no")
    return on


@functools.cache
def _cpuinfo() -> tuple[str, ...]:
    """The first CPU's "model name" and "flags" lines of /proc/cpuinfo (Linux; none where it cannot be read)."""
    lines = []
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "flags")):
                lines.append(line)
                if line.startswith("flags"):
                    break
    except OSError:
        pass
    return tuple(lines)


def _cpu_tag() -> str:
    """A short hash of this CPU's model and instruction-set flags (what -march=native compiles for)."""
    text = platform.machine() + "".join(_cpuinfo())
    return hashlib.sha1(text.encode()).hexdigest()[:10]


def cpu_flags() -> frozenset[str]:
    """This CPU's instruction-set flags (Linux /proc/cpuinfo; empty where it cannot be read)."""
    for line in _cpuinfo():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


def avx2_only() -> bool:
    """Whether the kernels build their AVX2 micro-kernels here: AVX2 and FMA without AVX-512 (csrc/decode_vec.h's
    ``KVLM_AVX2``; Zen 2 / 3, Intel's client CPUs)."""
    flags = cpu_flags()
    return {"avx2", "fma"} <= flags and "avx512f" not in flags


def l1d_bytes() -> int | None:
    """This CPU's level-1 data cache per core (Linux sysfs), or None where it cannot be read."""
    for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        try:
            if (index / "level").read_text().strip() == "1" and (index / "type").read_text().strip() == "Data":
                size = (index / "size").read_text().strip().upper()
                scale = {"K": 1024, "M": 1024 * 1024}.get(size[-1:], 1)
                return int(size.rstrip("KM")) * scale
        except (OSError, ValueError):
            return None
    return None


def build_flags() -> list[str]:
    """``CFLAGS``, plus ``KVLM_PF_HINT`` = L2 where this CPU's L1d is under ``PREFETCH_L1_MIN_BYTES``."""
    l1 = l1d_bytes()
    if l1 is not None and l1 < PREFETCH_L1_MIN_BYTES:
        return [*CFLAGS, "-DKVLM_PF_HINT=_MM_HINT_T1"]
    return list(CFLAGS)


def _source_tag() -> str:
    """A short hash of the kernel's sources, headers included."""
    h = hashlib.sha1()
    for f in sorted(SOURCE.parent.iterdir()):
        if f.suffix in (".cpp", ".h"):
            h.update(f.name.encode() + f.read_bytes())
    return h.hexdigest()[:8]


def extension() -> ModuleType | None:
    """The compiled kernel module (built on the first call, ~1 min), or None (disabled or unbuildable)."""
    if not enabled():
        return None
    if "module" in _state or "error" in _state:
        return _state.get("module")  # type: ignore[return-value]
    with _lock:
        if "module" in _state or "error" in _state:
            return _state.get("module")  # type: ignore[return-value]
        try:
            from torch.utils.cpp_extension import load

            log.info("building the CPU decode kernel (first use; cached afterwards)")
            flags = build_flags()
            flag_tag = hashlib.sha1(" ".join(flags).encode()).hexdigest()[:6]
            _state["module"] = load(
                name=f"kvlm_decode_cpu_{_cpu_tag()}_{_source_tag()}_{flag_tag}",
                sources=[str(SOURCE)],
                extra_cflags=flags,
                extra_ldflags=["-fopenmp"],
                verbose=False,
            )
        except Exception as e:  # no compiler, missing headers, a failed link: the plain path still works
            _state["error"] = (
                f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
            )
            log.warning(
                "CPU decode kernel unavailable (%s); decoding with the PyTorch path. Set %s=0 to skip the build.",
                _state["error"],
                ENV,
            )
            return None
    return _state.get("module")  # type: ignore[return-value]


def has(name: str) -> bool:
    """Whether the extension is built (kernels enabled) and binds ``name``: what it binds depends on the CPU's
    instruction sets (decode.cpp)."""
    ext = extension()
    return ext is not None and hasattr(ext, name)


def build_error() -> str | None:
    """Why the last build failed (None if it did not, or was not tried)."""
    return _state.get("error")  # type: ignore[return-value]
