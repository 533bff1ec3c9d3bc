"""`kvlm bench`: prefill and decode latency, decode tokens/s, peak memory and KV-cache bytes, measured
side by side with the Hugging Face transformers implementation of the same model (``kvlm.bench.peers``) and
against the machine's memory-bandwidth roofline.

Decoding one token reads every weight once and every cached K/V (or latent) of every layer, so its time
is bounded below by ``(weight bytes + KV bytes) / memory bandwidth``: the bandwidth *floor*; and by its
FLOPs (counted on the first step) / matmul throughput: the compute floor. Each decode row reports both and
the ratios measured / floor. The bandwidth (a large tensor copy and a large reduction, best of a few) and
fp32 matmul throughput are measured at the start and the end of a run; the floors use the best.

Weights are random: speed does not depend on training. Decode runs start from a cache holding
``context`` random cached tokens (exactly what a prefill would leave, minus the long prefill), so long
contexts cost seconds, not minutes; prefill is timed separately at ``--prompt`` lengths.
"""

from __future__ import annotations

import datetime
import gc
import json
import os
import platform
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvlm.config import ConfigError, ModelConfig, load_yaml_or_json
from kvlm.model import KVLM, build_model

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# decode modes: the model's attention modes, plus "table": eg-mla's precomputed gate table (EG-MLA-A)
MODES = ("auto", "naive", "absorbed", "expand", "table")
# what each (mechanism, mode) does at decode time, for the tables
ROUTES = {
    ("mla", "auto"): "absorbed",
    ("eg-mla", "naive"): "materialised",
    ("eg-mla", "auto"): "rebuild",
    ("eg-mla", "expand"): "rebuild",
    ("eg-mla", "table"): "gate table",
}

# the lead's reference model: fp32, 6 layers, d = 768, 12 heads (GPT-2 small width, half its depth)
REFERENCE_SHAPE = dict(n_layer=6, d_model=768, n_head=12, vocab_size=32000)

# named benchmarks; explicit command-line options override a suite's values
SUITES: dict[str, dict[str, Any]] = {
    # a few seconds: the tests' size
    "toy": dict(
        shape=dict(n_layer=2, d_model=64, n_head=4, vocab_size=256),
        variants="mha,gqa,mla,eg-mla",
        modes="naive,absorbed,table",
        batch="1,2",
        context="16,32",
        prompt="8",
        steps=3,
        warmup=1,
        repeats=2,
        bandwidth_mib=16,
    ),
    # the lead's reference point: batch 8, 4096 cached tokens
    "reference": dict(
        shape=REFERENCE_SHAPE,
        variants="mha,gqa,mla,eg-mla",
        modes="naive,absorbed,table",
        batch="8",
        context="4096",
        prompt="128",
        steps=6,
        warmup=2,
        repeats=3,
    ),
    # decode latency against context length (MLRA Figs. 5-6, EG-MLA Fig. 4), batch 1 and batch 8
    "sweep-b1": dict(
        shape=REFERENCE_SHAPE,
        variants="mha,gqa,mla,eg-mla",
        modes="naive,absorbed,table",
        batch="1",
        context="512,1024,2048,4096,8192",
        prompt="128,1024",
        steps=8,
        warmup=2,
        repeats=3,
    ),
    "sweep-b8": dict(  # eg-mla's batch-8 routes are in "reference": rebuilding 8 x 8192 keys takes ~10 s a step
        shape=REFERENCE_SHAPE,
        variants="mha,gqa,mla",
        modes="naive,absorbed,table",
        batch="8",
        context="512,1024,2048,4096,8192",
        prompt="128",
        steps=4,
        warmup=1,
        repeats=2,
    ),
    # mla-small-lm.md Sec. 5.4: MLA+RoPE with r = d/2 against full rank r = d (9L-512d, GPT-2 blocks)
    "small-lm": dict(
        shape={},
        variants="small-lm/9L-512d/mha,small-lm/9L-512d/mla-rope-r512,small-lm/9L-512d/mla-rope-r256,"
        "small-lm/9L-512d/mla-rope-r128",
        modes="naive,absorbed",
        batch="1,8",
        context="512,2048",
        prompt="128",
        steps=6,
        warmup=2,
        repeats=3,
    ),
    # the MLRA paper's mechanisms next to MHA / GQA / MLA (mlra.md Figs. 5-6), batch 1
    "mlra": dict(
        shape=REFERENCE_SHAPE,
        variants="mha,gqa,mla,gla-2,mlra-2,mlra-4,gta,mfa,tpa",
        modes="absorbed",
        batch="1",
        context="1024,4096,8192",
        prompt="512",
        steps=5,
        warmup=1,
        repeats=3,
    ),
}
DEFAULTS = dict(
    shape=dict(n_layer=4, d_model=256, n_head=8, vocab_size=4096),
    variants="mha,mla",
    modes="auto",
    batch="1",
    context="512,1024",
    prompt="128",
    steps=8,
    warmup=2,
    repeats=3,
    bandwidth_mib=512,
)
SHAPE_FIELDS = (
    "n_layer",
    "d_model",
    "n_head",
    "head_dim",
    "n_kv_head",
    "vocab_size",
    "ffn_dim",
    "kv_lora_rank",
    "q_lora_rank",
    "rope_head_dim",
)


class BenchError(ValueError):
    """Bad benchmark options (unknown variant, suite or mode, empty lists, ...)."""


# --- small helpers ---------------------------------------------------------------------------------
def _ints(text: str | list[int], what: str) -> list[int]:
    if isinstance(text, list):
        return text
    try:
        vals = [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError as e:
        raise BenchError(f"--{what} must be a comma-separated list of integers, got {text!r}") from e
    if not vals or any(v <= 0 for v in vals):
        raise BenchError(f"--{what} needs positive integers, got {text!r}")
    return vals


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def summarize(seconds: list[float]) -> dict[str, float]:
    """Median and spread (ms) of repeated timings."""
    ms = sorted(1e3 * s for s in seconds)
    q = statistics.quantiles(ms, n=4, method="inclusive") if len(ms) > 1 else [ms[0]] * 3
    return {
        "median_ms": statistics.median(ms),
        "min_ms": ms[0],
        "max_ms": ms[-1],
        "iqr_ms": q[2] - q[0],
        "n": len(ms),
    }


def _malloc_trim() -> None:
    """Hand freed heap memory back to the OS (glibc), so that RSS growth shows new allocations instead of
    being absorbed by memory an earlier measurement freed."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


class PeakMemory:
    """Peak memory while the block runs: max allocated on CUDA; on CPU the process RSS, sampled from
    /proc/self/statm by a thread every ``interval`` s (torch kernels release the GIL, so it keeps sampling
    during long ops). ``peak`` is absolute, ``extra`` is the peak minus the usage when the block began."""

    def __init__(self, device: torch.device, interval: float = 0.002):
        self.device = device
        self.interval = interval
        self.peak = 0
        self.start = 0
        self._stop = threading.Event()

    @staticmethod
    def rss() -> int:
        try:
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except OSError:  # not Linux: the high-water mark of the process, the best portable number
            import resource

            scale = 1 if sys.platform == "darwin" else 1024
            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale

    def _sample(self) -> None:
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, self.rss())

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.start = torch.cuda.memory_allocated(self.device)
        else:
            gc.collect()
            _malloc_trim()
            self.start = self.peak = self.rss()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device)
        else:
            self._stop.set()
            self._thread.join()
            self.peak = max(self.peak, self.rss())

    @property
    def extra(self) -> int:
        return max(0, self.peak - self.start)


# --- the machine ------------------------------------------------------------------------------------
def machine_info(device: torch.device) -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    from kvlm.bench.peers import transformers_version

    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers_version(),
        "python": platform.python_version(),
        "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }


def _best_time(fn, device: torch.device, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return min(times)


def measure_hardware(device: torch.device, mib: int = 512, repeats: int = 5) -> dict[str, float]:
    """Memory bandwidth (GB/s) and fp32 matmul throughput (GFLOP/s), best of ``repeats``.

    copy: dst.copy_(src) of ``mib`` MiB moves 2x that (read + write). read: src.sum() reads it once.
    ``bandwidth_gbs`` is the larger: the floor uses the best this machine has shown."""
    n = mib * 2**20 // 4
    src = torch.rand(n, device=device)
    dst = torch.empty_like(src)
    copy_gbs = 2 * n * 4 / _best_time(lambda: dst.copy_(src), device, repeats) / 1e9
    read_gbs = n * 4 / _best_time(lambda: src.sum(), device, repeats) / 1e9
    src = dst = None  # free 2 x mib before the matmul
    m = 8192 if device.type == "cuda" else (2048 if mib >= 256 else 512)  # small buffers: a quick run
    a = torch.randn(m, m, device=device)
    b = torch.randn(m, m, device=device)
    a @ b  # warm-up
    gflops = 2 * m**3 / _best_time(lambda: a @ b, device, repeats) / 1e9
    return {
        "copy_gbs": copy_gbs,
        "read_gbs": read_gbs,
        "bandwidth_gbs": max(copy_gbs, read_gbs),
        "matmul_fp32_gflops": gflops,
        "bandwidth_buffer_mib": mib,
    }


# --- variants -------------------------------------------------------------------------------------------
@dataclass
class Variant:
    label: str
    cfg: ModelConfig
    modes: list[str] = field(default_factory=lambda: ["auto"])


def parse_variant(
    spec: str, shape: dict[str, Any], explicit: dict[str, Any] | None = None
) -> tuple[str, ModelConfig]:
    """``name`` or ``name:key=value:key=value``; name is an attention (built at ``shape``) or a preset
    (its own shape; the ``explicit`` shape fields given on the command line still override)."""
    from kvlm.attention import registry

    name, *pairs = spec.strip().split(":")
    overrides: dict[str, Any] = {}
    for pair in pairs:
        if "=" not in pair:
            raise BenchError(f"variant {spec!r}: expected key=value after ':', got {pair!r}")
        key, value = pair.split("=", 1)
        overrides[key.strip()] = load_yaml_or_json(f"v: {value}")["v"]
    if name in registry():
        cfg = ModelConfig(attention=name, **{**shape, **overrides})
    else:
        try:
            cfg = ModelConfig.from_preset(name)
        except (ImportError, ModuleNotFoundError, KeyError, ConfigError) as e:
            known = ", ".join(sorted(registry()))
            raise BenchError(
                f"unknown variant {name!r}: not an attention ({known}) nor a preset ({e})"
            ) from e
        changes = {**(explicit or {}), **overrides}
        cfg = cfg.replace(**changes) if changes else cfg
    return spec.strip(), cfg


def decode_modes(cfg: ModelConfig, requested: list[str]) -> list[str]:
    """The requested modes this mechanism distinguishes: without a naive cache every mode is "auto", without
    absorption "absorbed" is "auto", and "table" only exists where a gate table can be precomputed."""
    from kvlm.attention import get_attention_class

    cls = get_attention_class(cfg.attention)
    out = []
    for mode in requested:
        if mode == "table":
            if not hasattr(cls, "precompute_gate_table"):
                continue
        elif not getattr(cls, "has_naive_cache", False):
            mode = "auto"
        elif mode == "absorbed" and not getattr(cls, "supports_absorption", True):
            mode = "auto"
        if mode not in out:
            out.append(mode)
    return out or ["auto"]


def route_name(attention: str, mode: str) -> str:
    return ROUTES.get((attention, mode), mode)


def set_gate_tables(model: KVLM, enable: bool) -> int:
    """EG-MLA-A on or off for every layer that has a gate table; returns the tables' bytes."""
    if not any(hasattr(m, "precompute_gate_table") for m in model.modules()):
        return 0
    from kvlm.attention.eg_mla import precompute_gate_tables

    return precompute_gate_tables(model, enable)


# --- accounting -------------------------------------------------------------------------------------------
def streamed_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of weights a decode step reads in full: every unique parameter, except tables that are only
    gathered a few rows at a time (an untied input embedding, learned positions, eg-mla gate tables)."""
    seen: set[int] = set()
    tied = getattr(model, "cfg", None) is not None and model.cfg.tie_embeddings
    total = 0
    for name, p in model.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        gathered = getattr(p, "is_gate_embedding", False) or name.startswith("pos_embed.")
        if name == "embed.weight" and not tied:
            gathered = True
        if not gathered:
            total += p.numel() * p.element_size()
    return total


def roofline(
    weight_bytes: int, kv_bytes: int, hw: dict[str, float], median_ms: float, flops: int = 0
) -> dict[str, float]:
    """The decode step against the hardware: ``floor_ms`` = bytes that must be read / bandwidth (the
    bandwidth roofline), ``compute_floor_ms`` = counted FLOPs / fp32 matmul throughput; a step cannot be
    faster than either."""
    bytes_per_step = weight_bytes + kv_bytes
    floor_ms = bytes_per_step / (hw["bandwidth_gbs"] * 1e9) * 1e3
    compute_ms = flops / (hw["matmul_fp32_gflops"] * 1e9) * 1e3
    return {
        "bytes_per_step": bytes_per_step,
        "floor_ms": floor_ms,
        "roofline_ratio": median_ms / floor_ms,
        "achieved_gbs": bytes_per_step / (median_ms * 1e-3) / 1e9,
        "flops_per_step": flops,
        "compute_floor_ms": compute_ms,
        "compute_ratio": median_ms / compute_ms if compute_ms else None,
        "roofline_floor_ms": max(floor_ms, compute_ms),  # the hardware limit: the larger of the two floors
        "x_roofline": median_ms / max(floor_ms, compute_ms),
    }


def _sdpa_flops(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    from torch.utils.flop_counter import sdpa_flop_count

    return sdpa_flop_count(query_shape, key_shape, value_shape)


class CountFlops:
    """FLOPs of the ops run inside the block (torch's FlopCounterMode: matmuls and attention; elementwise
    work is not counted), with the fused CPU attention kernel, which torch's table lacks, counted as SDPA."""

    def __enter__(self) -> CountFlops:
        from torch.utils.flop_counter import FlopCounterMode

        extra = {}
        cpu_flash = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
        if cpu_flash is not None:
            extra[cpu_flash] = _sdpa_flops  # keyed by overload packet, as torch's own table
        self._mode = FlopCounterMode(display=False, custom_mapping=extra)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)
        self.total = self._mode.get_total_flops()


# --- kvlm measurements ------------------------------------------------------------------------------
def fill_cache(cache, length: int, vocab_size: int) -> None:
    """Make the cache hold ``length`` random tokens, as a prefill would have left it."""
    for layer in cache.layers:
        for buf in layer.values():
            buf[..., :length, :].normal_()
    if cache.token_ids is not None:
        cache.token_ids[:, :length].random_(0, vocab_size)
    cache.length = length


def fit_to_budget(
    first_s: float, warmup: int, steps: int, budget_s: float | None, minimum: int = 3
) -> tuple[int, int]:
    """Fewer timed steps for slow measurements, so that each stays near ``budget_s`` seconds: when the first
    (untimed) step says warm-up + steps would overrun, skip the warm-up (that first step was one) and time
    max(minimum, budget / first) steps."""
    if budget_s and first_s * (warmup + steps) > budget_s:
        return 0, max(minimum, min(steps, int(budget_s / first_s)))
    return warmup, steps


@torch.inference_mode()
def time_prefill(new_cache, forward, cache_bytes, device, warmup: int, repeats: int, budget_s=None) -> dict:
    """Median latency of ``forward(cache)`` on fresh caches from ``new_cache()`` (allocation untimed)."""
    times = []
    n = warmup + repeats
    with PeakMemory(device) as mem:
        i = 0
        while i < n:
            cache = new_cache()
            _sync(device)
            t0 = time.perf_counter()
            forward(cache).argmax(-1)
            _sync(device)
            dt = time.perf_counter() - t0
            if i == 0 and budget_s and dt * n > budget_s:  # slow: fewer repeats (at least 2)
                n = warmup + max(2, min(repeats, int(budget_s / dt)))
            if i >= warmup:
                times.append(dt)
            kv_bytes = cache_bytes(cache)
            del cache
            i += 1
    row = summarize(times)
    row.update(kv_cache_bytes=kv_bytes, peak_mem_bytes=mem.peak, peak_extra_bytes=mem.extra)
    return row


@torch.inference_mode()
def time_decode(new_cache, step, device, warmup: int, steps: int, budget_s=None) -> dict:
    """Per-step latency of ``tok = step(tok, cache)`` on the cache ``new_cache()`` returns (with its KV bytes).
    The first step is untimed (the first warm-up step; an extra one when ``warmup`` is 0) and its FLOPs are
    counted: the cache needs room for ``max(warmup, 1) + steps`` new tokens."""
    with PeakMemory(device) as mem:
        cache, kv_bytes, tok = new_cache()
        _sync(device)
        t0 = time.perf_counter()
        with CountFlops() as flops:
            tok = step(tok, cache)
        _sync(device)
        warmup, steps = fit_to_budget(time.perf_counter() - t0, max(warmup - 1, 0), steps, budget_s)
        times = []
        for i in range(warmup + steps):
            _sync(device)
            t0 = time.perf_counter()
            tok = step(tok, cache)
            _sync(device)
            if i >= warmup:
                times.append(time.perf_counter() - t0)
        del cache
    row = summarize(times)
    row.update(
        kv_cache_bytes=kv_bytes,
        peak_mem_bytes=mem.peak,
        peak_extra_bytes=mem.extra,
        flops_per_step=flops.total,
    )
    return row


def bench_prefill(
    model: KVLM, batch: int, prompt: int, mode: str, warmup: int, repeats: int, budget_s=None
) -> dict:
    """Latency of one prefill of ``batch`` x ``prompt`` tokens into a preallocated cache."""
    device = model.embed.weight.device
    tokens = torch.randint(0, model.cfg.vocab_size, (batch, prompt), device=device)
    row = time_prefill(
        lambda: model.new_cache(batch, prompt, naive=(mode == "naive")),
        lambda cache: model(tokens, cache=cache, mode=mode, last_only=True),
        lambda cache: cache.nbytes_used,
        device,
        warmup,
        repeats,
        budget_s,
    )
    row["tokens_per_s"] = batch * prompt / (row["median_ms"] * 1e-3)
    return row


def bench_decode(
    model: KVLM, batch: int, context: int, mode: str, warmup: int, steps: int, budget_s=None
) -> dict:
    """Per-token decode latency with ``context`` tokens cached (greedy next token, as generate does)."""
    device = model.embed.weight.device

    def new_cache():
        cache = model.new_cache(batch, context + max(warmup, 1) + steps, naive=(mode == "naive"))
        fill_cache(cache, context, model.cfg.vocab_size)
        return cache, cache.nbytes_used, torch.randint(0, model.cfg.vocab_size, (batch, 1), device=device)

    row = time_decode(
        new_cache,
        lambda tok, cache: model(tok, cache=cache, mode=mode, last_only=True).argmax(-1),
        device,
        warmup,
        steps,
        budget_s,
    )
    row["tokens_per_s"] = batch / (row["median_ms"] * 1e-3)
    return row


# --- peer measurements ------------------------------------------------------------------------------------
def bench_peer_prefill(
    peer, batch: int, prompt: int, vocab_size: int, device, warmup: int, repeats: int, budget_s=None
) -> dict:
    tokens = torch.randint(0, vocab_size, (batch, prompt), device=device)
    row = time_prefill(
        peer.new_cache,
        lambda cache: peer.forward(tokens, cache, last_only=True),
        peer.cache_nbytes,
        device,
        warmup,
        repeats,
        budget_s,
    )
    row["tokens_per_s"] = batch * prompt / (row["median_ms"] * 1e-3)
    return row


def bench_peer_decode(
    peer, batch: int, context: int, vocab_size: int, device, warmup: int, steps: int, budget_s=None
) -> dict:
    def new_cache():
        cache = peer.synthetic_cache(batch, context)
        return cache, peer.cache_nbytes(cache), torch.randint(0, vocab_size, (batch, 1), device=device)

    row = time_decode(
        new_cache,
        lambda tok, cache: peer.forward(tok, cache, last_only=True)[:, -1].argmax(-1, keepdim=True),
        device,
        warmup,
        steps,
        budget_s,
    )
    row["tokens_per_s"] = batch / (row["median_ms"] * 1e-3)
    return row


def agreement_tolerance(dtype: torch.dtype) -> float:
    """Largest |logit difference| / max(1, |logit|) accepted as 'the same function'. transformers rounds
    RoPE angles and RMSNorm through float32, so even float64 agrees only to ~1e-7."""
    return 1e-3 if dtype in (torch.float32, torch.float64) else 5e-2


# --- the run ----------------------------------------------------------------------------------------------
@dataclass
class Plan:
    variants: list[Variant]
    batch: list[int]
    context: list[int]
    prompt: list[int]
    steps: int
    warmup: int
    repeats: int
    dtype: torch.dtype
    device: torch.device
    peers: bool
    bandwidth_mib: int
    seed: int = 0
    suite: str | None = None
    budget_s: float | None = 30.0  # per measurement: slow ones time fewer steps (fit_to_budget)


def run(plan: Plan, log=print) -> dict[str, Any]:
    """Every measurement of the plan; returns the result dict that ``--json`` prints."""
    torch.manual_seed(plan.seed)
    device, dtype = plan.device, plan.dtype
    result: dict[str, Any] = {
        "kvlm_bench": 1,
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "suite": plan.suite,
        "machine": machine_info(device),
        "settings": {
            "batch": plan.batch,
            "context": plan.context,
            "prompt": plan.prompt,
            "steps": plan.steps,
            "warmup": plan.warmup,
            "repeats": plan.repeats,
            "dtype": str(dtype).removeprefix("torch."),
            "device": str(device),
            "peers": plan.peers,
            "seed": plan.seed,
            "budget_s": plan.budget_s,
        },
    }
    hw = _hardware(plan, log)  # again at the end: a busy machine at either end does not lower the floors
    models, prefill, decode, peers = {}, [], [], []
    for variant in plan.variants:
        cfg = variant.cfg
        need = max(max(plan.context) + max(plan.warmup, 1) + plan.steps, max(plan.prompt))
        if cfg.max_seq_len < need:
            cfg = cfg.replace(max_seq_len=need)
        model = build_model(cfg, device=device, dtype=dtype).eval()
        weight_bytes = streamed_weight_bytes(model)
        elt = torch.empty((), dtype=dtype).element_size()
        models[variant.label] = {
            "attention": cfg.attention,
            "config": {k: v for k, v in cfg.to_dict().items() if k not in ("note", "extra")},
            "parameters": model.parameter_counts(),
            "streamed_weight_bytes": weight_bytes,
            "kv_bytes_per_token": cfg.kv_cache_bytes_per_token(elt),
            "naive_kv_bytes_per_token": sum(_numel(s) for s in model.cache_specs(naive=True)) * elt,
            "modes": variant.modes,
        }
        log(
            f"{variant.label}: {model.parameter_counts()['total'] / 1e6:.1f}M parameters, "
            f"{models[variant.label]['kv_bytes_per_token']} KV bytes/token"
        )
        for mode in variant.modes:
            _run_mode(model, variant.label, mode, plan, hw, weight_bytes, prefill, decode, log)
        if plan.peers:
            peers.append(_run_peer(variant.label, model, plan, weight_bytes, hw, prefill, decode, log))
        del model
        gc.collect()
    result.update(models=models, prefill=prefill, decode=decode, peers=peers)
    result["load_average_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    end = _hardware(plan, log)
    best = {k: max(hw[k], end[k]) for k in ("copy_gbs", "read_gbs", "bandwidth_gbs", "matmul_fp32_gflops")}
    result["hardware"] = {**hw, **best, "start": hw, "end": end}
    for r in decode:  # the floors from the best measurements of the run
        weights = models[r["variant"]]["streamed_weight_bytes"]
        r.update(
            roofline(weights, r["kv_cache_bytes"], result["hardware"], r["median_ms"], r["flops_per_step"])
        )
    result["ratios"] = peer_ratios(decode, prefill)
    result["targets"] = targets(result)
    return result


def _hardware(plan: Plan, log) -> dict[str, float]:
    log(f"measuring memory bandwidth ({plan.bandwidth_mib} MiB buffers) and matmul throughput ...")
    hw = measure_hardware(plan.device, plan.bandwidth_mib)
    log(
        f"  copy {hw['copy_gbs']:.1f} GB/s, read {hw['read_gbs']:.1f} GB/s, fp32 matmul "
        f"{hw['matmul_fp32_gflops']:.0f} GFLOP/s"
    )
    return hw


def _run_mode(model, label, mode, plan: Plan, hw, weight_bytes, prefill, decode, log) -> None:
    """Prefill and decode rows of one kvlm variant in one decode mode."""
    attention = model.cfg.attention
    table_bytes = set_gate_tables(model, mode == "table")  # EG-MLA-A: built once, as at model loading
    run_mode = "auto" if mode == "table" else mode
    pmode = {"naive": "naive", "table": "table"}.get(mode, "auto")  # prefill takes its cache's fast route
    base = {
        "impl": "kvlm",
        "variant": label,
        "route": route_name(attention, mode),
        "extra_state_bytes": table_bytes,
    }
    for b in plan.batch:
        for p in plan.prompt:
            key = (label, pmode, b, p)
            if any((r["variant"], r["mode"], r["batch"], r["prompt"]) == key for r in prefill):
                continue
            row = bench_prefill(
                model, b, p, "auto" if pmode == "table" else pmode, 1, plan.repeats, plan.budget_s
            )
            proute = "auto" if pmode == "auto" else route_name(attention, pmode)  # auto prefill: expand
            prefill.append({**base, "route": proute, "mode": pmode, "batch": b, "prompt": p, **row})
            log(f"  prefill {proute:12s} B={b:<3d} T={p:<6d} {row['median_ms']:9.2f} ms")
        for c in plan.context:
            row = bench_decode(model, b, c, run_mode, plan.warmup, plan.steps, plan.budget_s)
            row.update(
                roofline(weight_bytes, row["kv_cache_bytes"], hw, row["median_ms"], row["flops_per_step"])
            )
            decode.append({**base, "mode": mode, "batch": b, "context": c, **row})
            log(
                f"  decode  {base['route']:12s} B={b:<3d} L={c:<6d} {row['median_ms']:9.2f} ms/token "
                f"(floor {row['floor_ms']:.2f} ms, x{row['roofline_ratio']:.2f}; compute floor "
                f"{row['compute_floor_ms']:.2f} ms), peak +{row['peak_extra_bytes'] / 2**20:.0f} MiB"
            )
    set_gate_tables(model, False)


def _numel(spec: dict[str, tuple[int, ...]]) -> int:
    from kvlm.config import _numel as n

    return n(spec)


def _run_peer(label, model, plan: Plan, weight_bytes, hw, prefill, decode, log) -> dict:
    from kvlm.bench.peers import PeerUnavailable, build_peer, max_logit_diff

    info: dict[str, Any] = {"variant": label}
    try:
        peer = build_peer(model)
    except PeerUnavailable as e:
        info.update(peer=None, skipped=str(e))
        log(f"  peer: none ({e})")
        return info
    info.update(peer=peer.name, attn_implementation=peer.attn_implementation)
    device = model.embed.weight.device
    tokens = torch.randint(0, model.cfg.vocab_size, (2, 16), device=device)
    with torch.inference_mode():
        scale = model(tokens).abs().max().item()
    diff = max_logit_diff(model, peer, tokens, decode_steps=2)
    tol = agreement_tolerance(plan.dtype)
    info.update(max_logit_diff=diff, logit_scale=scale, tolerance=tol, agree=diff <= tol * max(1.0, scale))
    log(
        f"  peer {peer.name} ({peer.attn_implementation}): max |logit diff| {diff:.2e} (logits up to {scale:.2f})"
    )
    if not info["agree"]:
        info["skipped"] = "logits disagree with kvlm: not timed"
        log("  peer logits disagree: not timed")
        return info
    impl = f"hf:{peer.name.split()[-1]}"
    for b in plan.batch:
        for p in plan.prompt:
            row = bench_peer_prefill(peer, b, p, model.cfg.vocab_size, device, 1, plan.repeats, plan.budget_s)
            prefill.append(
                {
                    "impl": impl,
                    "variant": label,
                    "mode": "hf",
                    "route": "hf",
                    "extra_state_bytes": 0,
                    "batch": b,
                    "prompt": p,
                    **row,
                }
            )
            log(f"  prefill {'peer':12s} B={b:<3d} T={p:<6d} {row['median_ms']:9.2f} ms")
        for c in plan.context:
            row = bench_peer_decode(
                peer, b, c, model.cfg.vocab_size, device, plan.warmup, plan.steps, plan.budget_s
            )
            row.update(
                roofline(weight_bytes, row["kv_cache_bytes"], hw, row["median_ms"], row["flops_per_step"])
            )
            decode.append(
                {
                    "impl": impl,
                    "variant": label,
                    "mode": "hf",
                    "route": "hf",
                    "extra_state_bytes": 0,
                    "batch": b,
                    "context": c,
                    **row,
                }
            )
            log(
                f"  decode  {'peer':12s} B={b:<3d} L={c:<6d} {row['median_ms']:9.2f} ms/token "
                f"(floor {row['floor_ms']:.2f} ms, x{row['roofline_ratio']:.2f}; compute floor "
                f"{row['compute_floor_ms']:.2f} ms), peak +{row['peak_extra_bytes'] / 2**20:.0f} MiB"
            )
    del peer
    gc.collect()
    return info


def peer_ratios(decode: list[dict], prefill: list[dict]) -> list[dict]:
    """kvlm's speed-up over its peer (peer time / kvlm time) for every kvlm row that has a peer row."""
    out = []
    for kind, rows, key in (("decode", decode, "context"), ("prefill", prefill, "prompt")):
        peer = {(r["variant"], r["batch"], r[key]): r for r in rows if r["impl"] != "kvlm"}
        for r in rows:
            p = peer.get((r["variant"], r["batch"], r[key]))
            if r["impl"] != "kvlm" or p is None:
                continue
            out.append(
                {
                    "kind": kind,
                    "variant": r["variant"],
                    "mode": r["mode"],
                    "route": r["route"],
                    "batch": r["batch"],
                    key: r[key],
                    "peer": p["impl"],
                    "kvlm_ms": r["median_ms"],
                    "peer_ms": p["median_ms"],
                    "speedup": p["median_ms"] / r["median_ms"],
                }
            )
    return out


def targets(result: dict) -> list[dict]:
    """The issue's claims, checked on this run's numbers (informative: timings are noisy)."""
    attn = {label: m["attention"] for label, m in result["models"].items()}
    kv = [r for r in result["decode"] if r["impl"] == "kvlm"]
    by_key = {
        (r["impl"] != "kvlm", r["variant"], r["route"], r["batch"], r["context"]): r for r in result["decode"]
    }
    out = []
    for r in kv:
        if attn[r["variant"]] != "mla" or r["route"] != "absorbed":
            continue
        naive = by_key.get((False, r["variant"], "naive", r["batch"], r["context"]))
        if naive and r["context"] >= 1024:  # 1. absorbed MLA decode faster than naive from 1K context up
            out.append(
                _target(
                    "absorbed MLA decode faster than naive (speed-up, >= 1K context)",
                    r,
                    naive["median_ms"] / r["median_ms"],
                    1.0,
                )
            )
        peer = by_key.get((True, r["variant"], "hf", r["batch"], r["context"]))
        if peer and r["context"] >= 2048:  # 2. kvlm MLA faster than transformers' DeepseekV3 from 2K context
            out.append(
                _target(
                    "kvlm MLA decode faster than transformers DeepseekV3 (speed-up, >= 2K context)",
                    r,
                    peer["median_ms"] / r["median_ms"],
                    1.0,
                )
            )
    longest = max((r["context"] for r in kv), default=0)
    for r in kv:  # 4. decode at long context within 2x of the bandwidth roofline
        if (
            attn[r["variant"]] in ("mha", "mqa", "gqa", "mla")
            and r["context"] == longest
            and r["route"] != "naive"
        ):
            out.append(
                _target(
                    "decode within 2x of the bandwidth floor (measured / floor, longest context)",
                    r,
                    r["roofline_ratio"],
                    2.0,
                    lower_is_better=True,
                )
            )
    return out


def _target(claim, r, value, bound, lower_is_better=False):
    met = value <= bound if lower_is_better else value > bound
    return {
        "claim": claim,
        "variant": r["variant"],
        "route": r["route"],
        "batch": r["batch"],
        "context": r["context"],
        "value": value,
        "bound": bound,
        "met": met,
    }


# --- report ------------------------------------------------------------------------------------------------
def _mib(x: float) -> str:
    return f"{x / 2**20:.1f}"


MIB = 2**20

# table columns: (header, key in the row, or a function of the row)
MODEL_COLUMNS = [
    ("variant", "label"),
    ("params M", lambda m: m["parameters"]["total"] / 1e6),
    ("streamed weights MiB", lambda m: m["streamed_weight_bytes"] / MIB),
    ("KV bytes/token", "kv_bytes_per_token"),
    ("naive KV bytes/token", "naive_kv_bytes_per_token"),
]
DECODE_COLUMNS = [
    ("variant", "variant"), ("impl", "impl"), ("route", "route"), ("batch", "batch"), ("context", "context"),
    ("ms/step", "median_ms"), ("IQR ms", "iqr_ms"), ("n", "n"), ("tokens/s", "tokens_per_s"),
    ("KV MiB", lambda r: r["kv_cache_bytes"] / MIB), ("+state MiB", lambda r: r["extra_state_bytes"] / MIB),
    ("peak +MiB", lambda r: r["peak_extra_bytes"] / MIB), ("bandwidth floor ms", "floor_ms"),
    ("x bw floor", "roofline_ratio"), ("GFLOP/step", lambda r: r["flops_per_step"] / 1e9),
    ("compute floor ms", "compute_floor_ms"), ("x roofline", "x_roofline"),
]  # fmt: skip
PREFILL_COLUMNS = [
    ("variant", "variant"), ("impl", "impl"), ("route", "route"), ("batch", "batch"), ("prompt", "prompt"),
    ("ms", "median_ms"), ("IQR ms", "iqr_ms"), ("n", "n"), ("tokens/s", "tokens_per_s"),
    ("peak +MiB", lambda r: r["peak_extra_bytes"] / MIB),
]  # fmt: skip
PEER_COLUMNS = [
    ("variant", "variant"), ("peer", "peer"), ("attention kernel", "attn_implementation"),
    ("max abs logit diff", "max_logit_diff"), ("max abs logit", "logit_scale"), ("agree", "agree"),
    ("note", lambda p: p.get("skipped", "")),
]  # fmt: skip
RATIO_COLUMNS = [
    ("kind", "kind"), ("variant", "variant"), ("kvlm route", "route"), ("batch", "batch"),
    ("length", lambda r: r.get("context", r.get("prompt"))), ("kvlm ms", "kvlm_ms"), ("peer ms", "peer_ms"),
    ("speed-up", lambda r: f"{r['speedup']:.2f}x"),
]  # fmt: skip
EG_COLUMNS = [
    ("batch", "batch"), ("context", "context"), ("MLA ms", "mla_ms"), ("EG-MLA route", "route"),
    ("EG-MLA ms", "ms"), ("x MLA", "x_mla"), ("KV MiB", "kv_mib"), ("+state MiB", "state_mib"),
    ("peak +MiB", "peak_mib"),
]  # fmt: skip
TARGET_COLUMNS = [
    ("claim", "claim"), ("variant", "variant"), ("route", "route"), ("batch", "batch"), ("context", "context"),
    ("value", "value"), ("met", "met"),
]  # fmt: skip


def _table(columns: list[tuple[str, Any]], rows: list[dict]) -> list[str]:
    """A GitHub markdown table; numbers right-aligned, booleans as yes / **NO**."""
    cells = [[col(r) if callable(col) else r.get(col) for _, col in columns] for r in rows]
    numeric = [isinstance(v, (int, float)) and not isinstance(v, bool) for v in cells[0]] if cells else []
    align = ["---:" if i and numeric and numeric[i] else "---" for i in range(len(columns))]
    out = ["| " + " | ".join(h for h, _ in columns) + " |", "|" + "|".join(align) + "|"]
    out += ["| " + " | ".join(_cell(v) for v in row) + " |" for row in cells]
    return out


def _cell(v: Any) -> str:
    if isinstance(v, bool) or v is None:
        return {True: "yes", False: "**NO**", None: "-"}[v]
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 10 else f"{v:.1f}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)


def markdown(result: dict) -> str:
    """Result tables (GitHub markdown): what benchmarks/README.md shows."""
    hw, mc, st = result["hardware"], result["machine"], result["settings"]
    lines = [
        f"{result['date']}; {mc['cpu']}, {mc['cores']} cores ({mc['threads']} torch threads), torch {mc['torch']}, "
        f"transformers {mc['transformers']}; {st['device']}, {st['dtype']}; load average at start "
        f"{_load(mc.get('load_average'))}, at end {_load(result.get('load_average_end'))}.",
        f"Bandwidth: copy {hw['copy_gbs']:.1f} GB/s, read {hw['read_gbs']:.1f} GB/s (floors use "
        f"{hw['bandwidth_gbs']:.1f}); fp32 matmul {hw['matmul_fp32_gflops']:.0f} GFLOP/s (best of the "
        f"measurements at start: {_hw(hw.get('start'))} and end: {_hw(hw.get('end'))}).",
        "",
    ]
    lines += _table(MODEL_COLUMNS, [{"label": k, **m} for k, m in result["models"].items()])
    if len(result["settings"]["context"]) > 1:
        for title, key in (
            ("ms per decode step", "median_ms"),
            ("measured / bandwidth floor", "roofline_ratio"),
        ):
            columns, rows = pivot(result["decode"], key)
            lines += ["", f"Decode against context length, {title}:", ""] + _table(columns, rows)
    lines += ["", "Decode, per step (median of the n timed steps, IQR = spread); floors: bytes that must be read "
              "/ bandwidth, and counted FLOPs / matmul throughput:", ""]  # fmt: skip
    lines += _table(DECODE_COLUMNS, sorted(result["decode"], key=lambda r: (r["batch"], r["context"])))
    lines += ["", "Prefill (median of n repeats):", ""]
    lines += _table(PREFILL_COLUMNS, sorted(result["prefill"], key=lambda r: (r["batch"], r["prompt"])))
    sections = [
        ("Peers (logits checked against kvlm before timing):", PEER_COLUMNS, result["peers"]),
        ("kvlm speed-up over transformers (peer time / kvlm time):", RATIO_COLUMNS, result["ratios"]),
        ("EG-MLA decode routes next to MLA (absorbed) at the same shape:", EG_COLUMNS, eg_mla_vs_mla(result)),
        ("The issue's targets on this run:", TARGET_COLUMNS, result["targets"]),
    ]
    for title, columns, rows in sections:
        if rows:
            lines += ["", title, ""] + _table(columns, rows)
    return "\n".join(lines)


def pivot(decode: list[dict], key: str) -> tuple[list, list[dict]]:
    """One row per (variant, impl, route, batch), one column per context: the value ``key``."""
    contexts = sorted({r["context"] for r in decode})
    rows: dict[tuple, dict] = {}
    for r in decode:
        ident = (r["batch"], r["variant"], r["impl"], r["route"])
        rows.setdefault(ident, dict(zip(("batch", "variant", "impl", "route"), ident)))[r["context"]] = r[key]
    columns = [("variant", "variant"), ("impl", "impl"), ("route", "route"), ("batch", "batch")]
    return columns + [(f"L={c}", c) for c in contexts], [rows[k] for k in sorted(rows, key=lambda k: k[0])]


def _hw(h: dict | None) -> str:
    return f"{h['bandwidth_gbs']:.1f} GB/s, {h['matmul_fp32_gflops']:.0f} GFLOP/s" if h else "?"


def _load(avg) -> str:
    return "/".join(f"{x:.1f}" for x in avg) if avg else "?"


def eg_mla_vs_mla(result: dict) -> list[dict]:
    """Each EG-MLA decode row next to the MLA absorbed row at the same batch and context."""
    attn = {label: m["attention"] for label, m in result["models"].items()}
    mla = {
        (r["batch"], r["context"]): r
        for r in result["decode"]
        if r["impl"] == "kvlm" and attn[r["variant"]] == "mla" and r["route"] == "absorbed"
    }
    out = []
    for r in result["decode"]:
        m = mla.get((r["batch"], r["context"]))
        if r["impl"] == "kvlm" and attn[r["variant"]] == "eg-mla" and m:
            out.append(
                {
                    "batch": r["batch"],
                    "context": r["context"],
                    "mla_ms": m["median_ms"],
                    "route": r["route"],
                    "ms": r["median_ms"],
                    "x_mla": r["median_ms"] / m["median_ms"],
                    "kv_mib": r["kv_cache_bytes"] / 2**20,
                    "state_mib": r["extra_state_bytes"] / 2**20,
                    "peak_mib": r["peak_extra_bytes"] / 2**20,
                }
            )
    return sorted(out, key=lambda r: (r["batch"], r["context"]))


def plot(result: dict, path: str | Path) -> None:
    """Decode latency (top) and tokens/s (bottom) against context length, one column per batch size, one
    line per (variant, route); transformers peers dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    decode = result["decode"]
    batches = sorted({r["batch"] for r in decode})
    contexts = sorted({r["context"] for r in decode})
    fig, axes = plt.subplots(2, len(batches), figsize=(6.5 * len(batches), 8), squeeze=False)
    groups: dict[str, dict[int, list[dict]]] = {}
    for r in decode:
        name = f"{r['variant']} {r['route']}" if r["impl"] == "kvlm" else f"{r['variant']} {r['impl']}"
        groups.setdefault(name, {}).setdefault(r["batch"], []).append(r)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    if len(contexts) == 1:  # one point per line: bars read better
        names = sorted(groups)
        for j, b in enumerate(batches):
            for ax, key, xlabel in ((axes[0][j], "median_ms", "decode latency (ms / step)"),
                                    (axes[1][j], "tokens_per_s", "decode tokens/s")):  # fmt: skip
                values = [groups[n][b][0][key] if b in groups[n] else 0 for n in names]
                ax.barh(names, values, color=[colors[i % len(colors)] for i in range(len(names))])
                for y, v in enumerate(values):
                    ax.text(v, y, f" {v:.0f}" if v >= 100 else f" {v:.3g}", va="center", fontsize=7)
                ax.set_xscale("log")
                ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
                ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
                ax.set_xlabel(xlabel)
                ax.set_title(f"batch {b}, {contexts[0]} cached tokens")
                ax.invert_yaxis()
        _title(fig, result)
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return
    for i, (name, by_batch) in enumerate(sorted(groups.items())):
        peer = " hf:" in name
        style = dict(
            color=colors[i % len(colors)], marker="s" if peer else "o", linestyle="--" if peer else "-"
        )
        for j, b in enumerate(batches):
            rows = sorted(by_batch.get(b, []), key=lambda r: r["context"])
            xs = [r["context"] for r in rows]
            axes[0][j].plot(xs, [r["median_ms"] for r in rows], label=name, **style)
            axes[1][j].plot(xs, [r["tokens_per_s"] for r in rows], label=name, **style)
    for j, b in enumerate(batches):
        for ax, ylabel in ((axes[0][j], "decode latency (ms / step)"), (axes[1][j], "decode tokens/s")):
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xticks(contexts, [str(c) for c in contexts])
            ax.set_xlabel("cached tokens (context)")
            ax.set_ylabel(ylabel)
            ax.set_title(f"batch {b}")
            ax.grid(True, which="both", alpha=0.3)
            plain = matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}")
            ax.yaxis.set_major_formatter(plain)
            low, high = ax.get_ylim()
            if high / low < 20:  # within about a decade: label the minor ticks too
                ax.yaxis.set_minor_formatter(plain)
                ax.tick_params(axis="y", which="minor", labelsize=7)
            else:
                ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    axes[0][-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    _title(fig, result)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _title(fig, result: dict) -> None:
    s, mc = result["settings"], result["machine"]
    threads = f"{mc['threads']} thread{'s' if mc['threads'] != 1 else ''}"
    fig.suptitle(
        f"kvlm bench {result.get('suite') or ''}: {s['dtype']}, {mc['cpu']} ({threads}), {result['date'][:10]}"
    )


# --- command line -------------------------------------------------------------------------------------------
def add_arguments(p) -> None:
    p.add_argument(
        "--suite", choices=sorted(SUITES), help="a named benchmark; other options override its values"
    )
    p.add_argument(
        "--variants",
        help="comma-separated attentions or presets, each optionally name:key=value:... "
        "(e.g. mha,gqa:n_kv_head=4,mla:kv_lora_rank=128)",
    )
    p.add_argument(
        "--modes",
        help="decode routes, comma-separated: auto, naive (materialised K/V), absorbed, expand, table (eg-mla's "
        "precomputed gate table); each mechanism runs those it has (MHA/GQA: auto only; eg-mla: absorbed = auto)",
    )
    p.add_argument("--batch", help="batch sizes, comma-separated")
    p.add_argument("--context", help="cached tokens before decoding, comma-separated")
    p.add_argument("--prompt", help="prefill prompt lengths, comma-separated")
    p.add_argument("--steps", type=int, help="timed decode steps per measurement")
    p.add_argument("--warmup", type=int, help="untimed decode steps before timing")
    p.add_argument("--repeats", type=int, help="timed prefills per measurement")
    for name in SHAPE_FIELDS:
        p.add_argument(
            f"--{name.replace('_', '-')}", type=int, dest=name, help=f"model {name} (overrides the suite)"
        )
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (cuda if available)")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--no-peers", action="store_true", help="skip the transformers peers")
    p.add_argument("--bandwidth-mib", type=int, help="buffer size of the bandwidth measurement (default 512)")
    p.add_argument(
        "--budget-s",
        type=float,
        default=30.0,
        help="seconds per measurement: slower ones time fewer steps (at least 3) or prefills (at least 2); 0 = off",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="write the result JSON here (and the plot next to it unless --plot)")
    p.add_argument("--plot", help="write the decode plot (PNG) here")
    p.add_argument("--markdown", help="write the result tables (markdown) here")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object on the last line")
    p.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel degree N, under `torchrun --nproc-per-node N -m kvlm.cli bench ...`: "
                   "every variant sharded N ways, per-rank KV bytes and timings (kvlm/distributed.py)")  # fmt: skip


def plan_from_args(args) -> Plan:
    suite = SUITES[args.suite] if args.suite else {}

    def get(key):  # the command line, else the suite, else the defaults
        value = getattr(args, key, None)
        return value if value is not None else suite.get(key, DEFAULTS.get(key))

    shape = dict(DEFAULTS["shape"]) if not args.suite else dict(suite["shape"])
    explicit = {name: getattr(args, name) for name in SHAPE_FIELDS if getattr(args, name, None) is not None}
    shape.update(explicit)
    modes = [m.strip() for m in str(get("modes")).split(",") if m.strip()]
    for m in modes:
        if m not in MODES:
            raise BenchError(f"unknown mode {m!r}; known: {', '.join(MODES)}")
    variants = []
    for spec in str(get("variants")).split(","):
        if not spec.strip():
            continue
        label, cfg = parse_variant(spec, shape, explicit)
        variants.append(Variant(label, cfg, decode_modes(cfg, modes)))
    if not variants:
        raise BenchError("no variants to benchmark")
    for what in ("steps", "repeats"):
        if get(what) <= 0:
            raise BenchError(f"--{what} must be positive, got {get(what)}")
    if get("warmup") < 0:
        raise BenchError(f"--warmup must be >= 0, got {get('warmup')}")
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise BenchError("--device cuda but CUDA is not available")
    return Plan(
        variants=variants,
        batch=_ints(get("batch"), "batch"),
        context=_ints(get("context"), "context"),
        prompt=_ints(get("prompt"), "prompt"),
        steps=get("steps"),
        warmup=get("warmup"),
        repeats=get("repeats"),
        dtype=DTYPES[args.dtype],
        device=device,
        peers=not args.no_peers,
        bandwidth_mib=get("bandwidth_mib"),
        seed=args.seed,
        suite=args.suite,
        budget_s=args.budget_s or None,
    )


def main(args) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    plan = plan_from_args(args)
    if getattr(args, "tp", 1) > 1:  # tensor-parallel decode bench across torchrun's ranks
        from kvlm.parallel.tensor_parallel import bench_main

        return bench_main(args, plan)
    log = (
        (lambda *a: print(*a, file=sys.stderr, flush=True))
        if args.json
        else (lambda *a: print(*a, flush=True))
    )
    result = run(plan, log)
    result["arguments"] = {k: v for k, v in vars(args).items() if not k.startswith("_") and k != "command"}
    table = markdown(result)
    print(table)
    if args.markdown:
        Path(args.markdown).write_text(table + "\n")
    plot_path = args.plot or (str(Path(args.out).with_suffix(".png")) if args.out else None)
    if plot_path:
        Path(plot_path).parent.mkdir(parents=True, exist_ok=True)
        plot(result, plot_path)
        result["plot"] = str(plot_path)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    if args.json:
        print(json.dumps(result))
    return 0
