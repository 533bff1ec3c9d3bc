"""Per-step training time of the tiny compare preset's models (16 x 128 tokens, float32), to choose the
default `kvlm compare --preset tiny` budget: python benchmarks/compare-tiny/step_time.py [--threads 2] [--steps 12]
Prints one JSON line per variant (mean optimizer-step ms after a warm-up, from the trainer's own clock)."""

import argparse
import json
import tempfile
import time

import torch

from kvlm.compare.variants import load_variants
from kvlm.data import load_or_prepare
from kvlm.training import TrainConfig, train

p = argparse.ArgumentParser()
p.add_argument("--threads", type=int, default=2)
p.add_argument("--steps", type=int, default=12)
p.add_argument("--data", default=None, help="a prepared folder (default: prepare the synthetic stories)")
a = p.parse_args()
torch.set_num_threads(a.threads)
data = load_or_prepare(a.data or "synthetic", a.data or tempfile.mkdtemp())
variants, _ = load_variants("tiny", None)
for v in variants:
    cfg = v.cfg.replace(vocab_size=data.vocab_size)
    t = TrainConfig(batch_size=16, seq_len=128, max_steps=a.steps, eval_interval=a.steps, eval_iters=4,
                    log_interval=2, lr=2e-3, warmup_steps=2)  # fmt: skip
    t0 = time.perf_counter()
    r = train(cfg, t, data=data, progress=False)
    wall = time.perf_counter() - t0
    print(
        json.dumps({"variant": v.label, "threads": a.threads, "step_ms": r.step_time_ms, "wall_s": wall}),
        flush=True,
    )
