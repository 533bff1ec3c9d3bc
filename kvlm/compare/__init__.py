"""Compare: the main job. Which attention gives the best quality for its KV cache, at what cost?

``compare(preset, out)`` trains several attention variants on the same data with the same ``TrainConfig``, then
measures each: validation loss and perplexity, parameters (total, activated, embedding), KV elements and bytes
per token (from each mechanism's ``cache_spec()``, at 2 bytes an element), prefill latency, decode speed at a few
context lengths, and sampled continuations with their repetition. Files: results.json, results.csv, report.md,
pareto.png, loss_curves.png, decode_speed.png.

    variants.py   ``Variant`` and the comparison presets (tiny, small-lm, eg-mla, mlra) or a YAML list
    runner.py     ``compare``, ``run_variant`` (train + measure one), ``default_train_config``, resumable runs
    aggregate.py  ``aggregate``: runs -> one row per variant (means over seeds, KV reduction and loss change vs
                  MHA, within noise of the best, Pareto front of loss against KV bytes)
    report.py     ``write_outputs`` and ``render_report`` (report.md)
    plots.py      the three plots
"""

from kvlm.compare.aggregate import KV_DTYPE_BYTES, aggregate
from kvlm.compare.report import render_report, write_outputs
from kvlm.compare.runner import compare, default_contexts, default_train_config, measure_speed, run_variant
from kvlm.compare.variants import COMPARE_PRESETS, Variant, load_variants

__all__ = [
    "COMPARE_PRESETS",
    "KV_DTYPE_BYTES",
    "Variant",
    "aggregate",
    "compare",
    "default_contexts",
    "default_train_config",
    "load_variants",
    "measure_speed",
    "render_report",
    "run_variant",
    "write_outputs",
]
