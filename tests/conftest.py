import contextlib
import importlib
import os
import pathlib
import sys

import pytest
import torch

TESTS = pathlib.Path(__file__).parent
sys.path.insert(0, str(TESTS))
# ../shared beside the repository: data/english-mix, tokenizers/gpt2, eval/winogrande-bb (not in git)
SHARED = TESTS.resolve().parent.parent / "shared"
REQUIRE_SHARED_ENV = "KVLM_REQUIRE_SHARED"

# One thread per test process: the suite runs under xdist (-n 2) on 2 cores, and oversubscribed OpenMP
# threads stall each other at barriers (a matmul of 8 rows went from 0.7 ms to 24 ms in a measurement).
torch.set_num_threads(1)


def require_kernels():
    """Skip unless the CPU decode kernels are built (building them once, minutes the first time on a machine):
    disabled or no compiler skips (the plain path is what the rest of the suite runs); a compiler present but a
    failed build fails."""
    import shutil

    from kvlm.kernels import cpu as kcpu

    if not kcpu.enabled():
        pytest.skip(f"kernels disabled by {kcpu.ENV}=0")
    if kcpu.extension() is None:
        if shutil.which("c++") or shutil.which("g++"):
            pytest.fail(f"a C++ compiler is present but the kernel did not build: {kcpu.build_error()}")
        pytest.skip("no C++ compiler: the CPU kernels cannot be built here")


def tiny_config(attention="mha", **overrides):
    """A model small enough for float64 tests in milliseconds."""
    from kvlm import ModelConfig

    base = dict(attention=attention, n_layer=2, d_model=64, n_head=4, vocab_size=97, max_seq_len=64)
    base.update(overrides)
    return ModelConfig(**base)


def shared_path(*parts: str) -> pathlib.Path:
    """The path ../shared/<parts> for a test that reads the shared data, tokenizers or eval sets.

    One rule for every such test: when the path is absent the test is skipped with the path in the reason,
    unless KVLM_REQUIRE_SHARED=1 is set (CI with the shared folder mounted), where absence is a failure."""
    path = SHARED.joinpath(*parts)
    if not path.exists():
        message = f"needs {path} (the shared folder ../shared beside the repository)"
        if os.environ.get(REQUIRE_SHARED_ENV, "") not in ("", "0"):
            pytest.fail(f"{message}; {REQUIRE_SHARED_ENV} is set, so its absence is an error", pytrace=False)
        pytest.skip(f"{message}; set {REQUIRE_SHARED_ENV}=1 to make this a failure")
    return path


def decode_route_keys(model) -> list[str]:
    """The keys of the model's ``decode_routes``: the modes it accepts and states such as EG-MLA-A's "table"."""
    return list(type(model.layers[0].attn).decode_routes(model.cfg))


@contextlib.contextmanager
def decode_route(model, key: str):
    """Run the route listed under `key` in ``decode_routes``: yields the Step mode to pass. Every key is a mode
    except EG-MLA's "table", a state of the model (the precomputed gate tables, looked up in mode "auto")."""
    from kvlm.attention import MODES
    from kvlm.attention.eg_mla import precompute_gate_tables

    if key != "table":
        assert key in MODES, f"decode_routes lists {key!r}, which is not a Step mode"
        yield key
        return
    assert precompute_gate_tables(model) > 0
    try:
        yield "auto"
    finally:
        precompute_gate_tables(model, enable=False)


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


@pytest.fixture
def no_few_rows(monkeypatch):
    """The few-row weight kernel off (kvlm.kernels.few_rows): up to 8 rows it takes a product before any packed
    copy, and up to 16 where none applies, so a test of the packed or library products turns it off."""
    from kvlm.kernels import few_rows

    monkeypatch.setattr(few_rows, "FEW_ROWS", 0)
    monkeypatch.setattr(few_rows, "MAX_ROWS", 0)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def twin_paged_caches(model, cached, kv_dtype=None):
    """Two paged caches holding the same sequences (sequence i: the tokens cached[i]), one to run each sequence
    alone, one for the batched call under test."""
    from kvlm.cache import PagedKVCache

    caches = []
    for _ in range(2):
        cache = PagedKVCache.for_model(model, cache_tokens=256, page_size=4, kv_dtype=kv_dtype)
        for i, c in enumerate(cached):
            cache.add_sequence(i)
            if len(c):
                model(c[None], cache=cache.batch([i]))
        caches.append(cache)
    return caches
