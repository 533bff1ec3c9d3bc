"""The named benchmarks of `kvlm bench` (data only): model shapes, variants, routes and sizes of each suite,
and the defaults every option falls back to. ``kvlm.bench.plan`` turns a suite plus explicit options into a
``Plan``; explicit options override a suite's values, a suite overrides ``DEFAULTS``."""

from __future__ import annotations

from typing import Any

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# decode modes: the model's attention modes, plus "table": eg-mla's precomputed gate table (EG-MLA-A)
MODES = ("auto", "naive", "absorbed", "expand", "table")

# the lead's reference model: fp32, 6 layers, d = 768, 12 heads (GPT-2 small width, half its depth)
REFERENCE_SHAPE = dict(n_layer=6, d_model=768, n_head=12, vocab_size=32000)

# the model fields a suite's ``shape`` (or the command line) may set
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

# what a suite sets besides its ``shape``, and the options a plan takes. ``baseline``: the variant every
# decode row is compared with in the route table (None: the first variant)
OPTIONS = (
    "variants",
    "modes",
    "batch",
    "context",
    "prompt",
    "steps",
    "warmup",
    "repeats",
    "bandwidth_mib",
    "baseline",
)

SUITES: dict[str, dict[str, Any]] = {
    # a few seconds: the tests' size
    "toy": dict(
        shape=dict(n_layer=2, d_model=64, n_head=4, vocab_size=256),
        variants=["mha", "gqa", "mla", "eg-mla"],
        modes=["naive", "absorbed", "table"],
        batch=[1, 2],
        context=[16, 32],
        prompt=[8],
        steps=3,
        warmup=1,
        repeats=2,
        bandwidth_mib=16,
    ),
    # the lead's reference point: batch 8, 4096 cached tokens
    "reference": dict(
        shape=REFERENCE_SHAPE,
        variants=["mha", "gqa", "mla", "eg-mla"],
        modes=["naive", "absorbed", "table"],
        batch=[8],
        context=[4096],
        prompt=[128],
        steps=6,
        warmup=2,
        repeats=3,
        baseline="mla",
    ),
    # decode latency against context length (MLRA Figs. 5-6, EG-MLA Fig. 4), batch 1 and batch 8
    "sweep-b1": dict(
        shape=REFERENCE_SHAPE,
        variants=["mha", "gqa", "mla", "eg-mla"],
        modes=["naive", "absorbed", "table"],
        batch=[1],
        context=[512, 1024, 2048, 4096, 8192],
        prompt=[128, 1024],
        steps=8,
        warmup=2,
        repeats=3,
        baseline="mla",
    ),
    "sweep-b8": dict(  # eg-mla's batch-8 routes are in "reference": rebuilding 8 x 8192 keys takes ~10 s a step
        shape=REFERENCE_SHAPE,
        variants=["mha", "gqa", "mla"],
        modes=["naive", "absorbed", "table"],
        batch=[8],
        context=[512, 1024, 2048, 4096, 8192],
        prompt=[128],
        steps=4,
        warmup=1,
        repeats=2,
        baseline="mla",
    ),
    # mla-small-lm.md Sec. 5.4: MLA+RoPE with r = d/2 against full rank r = d (9L-512d, GPT-2 blocks)
    "small-lm": dict(
        shape={},
        variants=[
            "small-lm/9L-512d/mha",
            "small-lm/9L-512d/mla-rope-r512",
            "small-lm/9L-512d/mla-rope-r256",
            "small-lm/9L-512d/mla-rope-r128",
        ],
        modes=["naive", "absorbed"],
        batch=[1, 8],
        context=[512, 2048],
        prompt=[128],
        steps=6,
        warmup=2,
        repeats=3,
        baseline="small-lm/9L-512d/mla-rope-r512",
    ),
    # the MLRA paper's mechanisms next to MHA / GQA / MLA (mlra.md Figs. 5-6), batch 1
    "mlra": dict(
        shape=REFERENCE_SHAPE,
        variants=["mha", "gqa", "mla", "gla-2", "mlra-2", "mlra-4", "gta", "mfa", "tpa"],
        modes=["absorbed"],
        batch=[1],
        context=[1024, 4096, 8192],
        prompt=[512],
        steps=5,
        warmup=1,
        repeats=3,
        baseline="mla",
    ),
}

DEFAULTS: dict[str, Any] = dict(
    shape=dict(n_layer=4, d_model=256, n_head=8, vocab_size=4096),
    variants=["mha", "mla"],
    modes=["auto"],
    batch=[1],
    context=[512, 1024],
    prompt=[128],
    steps=8,
    warmup=2,
    repeats=3,
    bandwidth_mib=512,
    baseline=None,
)
