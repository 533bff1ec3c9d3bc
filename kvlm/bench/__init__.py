"""kvlm.bench: the measurements behind `kvlm bench`: prefill and decode latency, decode tokens/s, peak
memory and KV-cache bytes of kvlm models, side by side with the Hugging Face transformers implementation of
the same model, and against the machine's roofline.

Decoding one token reads every streamed weight once and every cached tensor of every layer, so its time is
bounded below by ``(weight bytes + KV bytes) / memory bandwidth``, the *bandwidth floor*, and by its FLOPs
(counted on the first step) / matmul throughput, the *compute floor*. Each decode row reports both and the
ratios measured / floor; ``operations`` splits the step into weight GEMMs, attention over the cache (from the
mechanism's ``decode_cost`` for the route taken) and the LM head. Weights are random (speed does not depend
on training); decode starts from a cache holding ``context`` random tokens.

Modules, one job each:

- ``suites``: the named benchmarks and defaults (data). ``plan``: ``make_plan`` -> ``Plan`` of ``Variant``s,
  ``BenchError``. ``routes``: which decode modes a mechanism runs and the route each takes
  (``Attention.decode_routes``).
- ``timing``: the timed loops (``time_prefill``, ``time_decode``), ``summarize``, ``fit_to_budget``.
  ``memory``: ``PeakMemory`` and ``process_peak_memory``, the one home of peak-memory measurement.
  ``flops``: ``CountFlops``. ``hardware``: ``machine_info``, ``measure_hardware`` (bandwidth, matmul peak).
- ``measure``: ``bench_prefill`` / ``bench_decode`` of a kvlm model (also used by `kvlm compare` and the
  tensor-parallel bench) and of a transformers peer. ``peers``: the peers (``build_peer``, by ``hf_peer``).
- ``roofline``: ``streamed_weight_bytes``, ``roofline``, the operation classes. ``opstime``: the measured
  time per operation class (attention = step - step at 1 cached token). ``costmodel``: ``project_decode`` of a
  config on a ``Hardware`` (published specs in ``HARDWARE``, or ``measured_cpu``), for `kvlm kv-table
  --hardware`. ``runner``: ``run(plan)`` -> the result dict. ``report``: markdown tables and derived
  comparisons (``peer_ratios``, ``route_table``). ``plots``: the decode plot. ``parallel``: tensor-parallel
  and embedding-parallel benchmarks.

The command line (argument parsing, files written) is ``kvlm.cli.bench``.
"""

from kvlm.bench.hardware import machine_info, measure_hardware
from kvlm.bench.measure import bench_decode, bench_prefill
from kvlm.bench.memory import PeakMemory, process_peak_memory
from kvlm.bench.plan import BenchError, Plan, Variant, make_plan, parse_variant
from kvlm.bench.plots import plot
from kvlm.bench.report import markdown, peer_ratios, route_table
from kvlm.bench.roofline import roofline, streamed_weight_bytes
from kvlm.bench.runner import run
from kvlm.bench.suites import SHAPE_FIELDS, SUITES
from kvlm.bench.timing import fit_to_budget, summarize

__all__ = [
    "SHAPE_FIELDS",
    "SUITES",
    "BenchError",
    "PeakMemory",
    "Plan",
    "Variant",
    "bench_decode",
    "bench_prefill",
    "fit_to_budget",
    "machine_info",
    "make_plan",
    "markdown",
    "measure_hardware",
    "parse_variant",
    "peer_ratios",
    "plot",
    "process_peak_memory",
    "roofline",
    "route_table",
    "run",
    "streamed_weight_bytes",
    "summarize",
]
