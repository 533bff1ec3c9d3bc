"""GET /metrics: the server's Prometheus metrics (prometheus_client, one registry per server).

Counters and histograms are updated by the engine thread as tokens come out (``ServeMetrics.record_*``);
the gauges (running / waiting requests, cache pages used / free, preemptions, recent tokens/s) are read from
the engine's last stats snapshot when Prometheus scrapes, so a scrape never touches the engine itself.
Names follow vLLM's (``vllm:num_requests_running`` -> ``kvlm_num_requests_running``) so dashboards carry over.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable

# seconds; TTFT spans a 1 ms GPU decode to a multi-second CPU prefill
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
)
ITL_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.015,
    0.02,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    1.0,
    2.5,
)
E2E_BUCKETS = (0.1, 0.3, 0.5, 1.0, 1.5, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)
RATE_WINDOW_S = 10.0


def _prometheus():
    try:
        import prometheus_client
    except ImportError as e:  # pragma: no cover - an install without the serve extra
        raise ImportError("kvlm serve needs prometheus_client: pip install 'kvlm[serve]'") from e
    return prometheus_client


class ServeMetrics:
    """The metrics of one server. ``stats_fn()`` returns the engine's last stats dict (see Engine.stats)."""

    def __init__(self, stats_fn: Callable[[], dict], model_name: str = ""):
        pc = _prometheus()
        self.content_type = pc.CONTENT_TYPE_LATEST
        self._generate_latest = pc.generate_latest
        self.registry = pc.CollectorRegistry()
        kw = dict(registry=self.registry)
        self.ttft = pc.Histogram(
            "kvlm_time_to_first_token_seconds", "Time from request arrival to its first token.",
            buckets=TTFT_BUCKETS, **kw,
        )  # fmt: skip
        self.itl = pc.Histogram(
            "kvlm_inter_token_latency_seconds", "Time between consecutive tokens of a request.",
            buckets=ITL_BUCKETS, **kw,
        )  # fmt: skip
        self.e2e = pc.Histogram(
            "kvlm_e2e_request_latency_seconds", "Time from request arrival to its last token.",
            buckets=E2E_BUCKETS, **kw,
        )  # fmt: skip
        self.prompt_tokens = pc.Counter("kvlm_prompt_tokens", "Prompt tokens of admitted requests.", **kw)
        self.generation_tokens = pc.Counter("kvlm_generation_tokens", "Generated tokens.", **kw)
        self.finished = pc.Counter(
            "kvlm_requests_finished", "Finished requests by finish reason.", ["finish_reason"], **kw
        )
        self.rejected = pc.Counter(
            "kvlm_requests_rejected", "Requests refused before admission, by HTTP status.", ["status"], **kw
        )
        self._recent: collections.deque[tuple[float, int]] = collections.deque()
        self._lock = threading.Lock()
        self.registry.register(_EngineGauges(pc, stats_fn, self.tokens_per_s))

    # --- updates (engine thread) ---
    def record_tokens(self, n: int, now: float) -> None:
        if n <= 0:
            return
        self.generation_tokens.inc(n)
        with self._lock:
            self._recent.append((now, n))
            self._trim(now)

    def tokens_per_s(self) -> float:
        """Generated tokens per second over the last RATE_WINDOW_S seconds."""
        now = time.perf_counter()
        with self._lock:
            self._trim(now)
            return sum(n for _, n in self._recent) / RATE_WINDOW_S

    def _trim(self, now: float) -> None:
        while self._recent and self._recent[0][0] < now - RATE_WINDOW_S:
            self._recent.popleft()

    def render(self) -> bytes:
        return self._generate_latest(self.registry)


class _EngineGauges:
    """A custom collector: gauges read from the engine's stats snapshot at scrape time."""

    GAUGES = {
        "running": ("kvlm_num_requests_running", "Requests being decoded or prefilled."),
        "waiting": ("kvlm_num_requests_waiting", "Requests queued for admission."),
        "pages_used": ("kvlm_cache_pages_used", "KV cache pages in use."),
        "pages_free": ("kvlm_cache_pages_free", "KV cache pages free."),
        "pages_total": ("kvlm_cache_pages_total", "KV cache pages in the pool."),
        "page_size": ("kvlm_cache_page_size_tokens", "Tokens per KV cache page."),
        "bytes_per_token": ("kvlm_cache_bytes_per_token", "KV cache bytes per token (all layers)."),
        "preemptions": ("kvlm_num_preemptions", "Requests preempted (pages freed, recomputed later)."),
    }

    def __init__(self, pc, stats_fn, rate_fn):
        self._pc, self._stats_fn, self._rate_fn = pc, stats_fn, rate_fn

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily

        stats = self._stats_fn() or {}
        for key, (name, doc) in self.GAUGES.items():
            value = stats.get(key)
            if isinstance(value, (int, float)):
                yield GaugeMetricFamily(name, doc, value=float(value))
        if "pages_used" in stats and stats.get("pages_total"):
            yield GaugeMetricFamily(
                "kvlm_cache_usage_ratio", "Fraction of KV cache pages in use.",
                value=stats["pages_used"] / stats["pages_total"],
            )  # fmt: skip
        yield GaugeMetricFamily(
            "kvlm_generation_tokens_per_second",
            f"Generated tokens per second over the last {RATE_WINDOW_S:g} s.",
            value=self._rate_fn(),
        )
