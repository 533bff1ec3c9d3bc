import importlib
import pathlib
import sys

import pytest
import torch

TESTS = pathlib.Path(__file__).parent
sys.path.insert(0, str(TESTS))

# One thread per test process: the suite runs under xdist (-n 2) on 2 cores, and oversubscribed OpenMP
# threads stall each other at barriers (a matmul of 8 rows went from 0.7 ms to 24 ms in a measurement).
torch.set_num_threads(1)


def tiny_config(attention="mha", **overrides):
    """A model small enough for float64 tests in milliseconds."""
    from kvlm import ModelConfig

    base = dict(attention=attention, n_layer=2, d_model=64, n_head=4, vocab_size=97, max_seq_len=64)
    base.update(overrides)
    return ModelConfig(**base)


def all_variants():
    """(id, attention, overrides) from every tests/variants_*.py: the configurations each mechanism's
    author wants run through the generic contract tests (reference, causality, cache, decode)."""
    out = []
    for path in sorted(TESTS.glob("variants_*.py")):
        mod = importlib.import_module(path.stem)
        for attention, overrides in mod.VARIANTS:
            tag = ",".join(f"{k}={v}" for k, v in overrides.items())
            out.append(pytest.param(attention, overrides, id=f"{attention}[{tag}]"))
    return out


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
