"""Compare: the main job. Which attention gives the best quality for its KV cache, at what cost?

``compare(preset, out)`` trains several attention variants on the same data with the same ``TrainConfig``,
for several seeds (default 0, 1, 2), then reports per variant the validation loss over seeds (mean, std, 95 %
t interval), a verdict against an explicit baseline (Welch's t-test), the Pareto front of loss against KV bytes
per token with seed noise, the budget (training tokens; total, non-embedding and gate-table parameters), and
the cost: KV bytes per token per dtype (from ``cache_spec()``), the cache at a deployment point, and decode
projected at the bench reference size on named hardware (``kvlm.bench.costmodel``). Files: results.json,
results.csv, report.md, pareto.png, loss_curves.png (+ decode_speed.png when the tiny models are timed).

    variants.py   ``Variant``, the comparison presets (tiny, small-lm, eg-mla, mlra) or a YAML list, ``match_variants``
    runner.py     one run: ``run_variant`` (train + measure), ``default_train_config``, ``run_key``
    job.py        ``compare``: all runs, resumable, one progress bar; then aggregate, costs, files
    stats.py      mean, std, t intervals, Welch's t-test (Student's t without scipy)
    aggregate.py  ``aggregate``: runs -> one row per variant (verdict vs the baseline, Pareto with noise)
    costs.py      KV bytes per dtype, deployment memory, reference-size scaling, decode projection
    findings.py   the report's one-sentence answers
    report.py     ``write_outputs`` and ``render_report`` (report.md)
    plots.py      the plots
"""

from kvlm.compare.aggregate import aggregate
from kvlm.compare.costs import KV_DTYPES
from kvlm.compare.job import compare
from kvlm.compare.report import render_report, write_outputs
from kvlm.compare.runner import default_contexts, default_train_config, measure_speed, run_variant
from kvlm.compare.variants import COMPARE_PRESETS, MATCH_MODES, Variant, load_variants, match_variants

KV_DTYPE_BYTES = KV_DTYPES["bf16"]  # bytes per cached element in the headline numbers

__all__ = [
    "COMPARE_PRESETS",
    "KV_DTYPES",
    "KV_DTYPE_BYTES",
    "MATCH_MODES",
    "Variant",
    "aggregate",
    "compare",
    "default_contexts",
    "default_train_config",
    "load_variants",
    "match_variants",
    "measure_speed",
    "render_report",
    "run_variant",
    "write_outputs",
]
