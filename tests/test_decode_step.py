"""The decode step's fast paths against the plain path (issue 15, "the rest of the step"): weights packed into
MKL's GEMM layout (``Linear.pack_for_decode``, ``KVLM.pack_for_decode``, ``generate(pack_weights=...)``) and
the route of multi-token decode (``LatentAttention.prefers_absorbed``)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import kvlm.attention.linear as linear_module
from kvlm.attention.base import Linear
from kvlm.attention.linear import ANY_ROWS, packing_available
from kvlm.config import ModelConfig
from kvlm.inference.generation import generate
from kvlm.model import build_model

# these tests are about the packed products, which the few-row kernel would take first up to 8 rows
# (tests/test_few_rows.py tests that kernel and its place in the step)
pytestmark = pytest.mark.usefixtures("no_few_rows")

needs_mkl = pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="torch built without MKL")


def _linear(bias: bool, d_in=48, d_out=40) -> Linear:
    torch.manual_seed(0)
    lin = Linear(d_in, d_out, bias=bias)
    if bias:
        torch.nn.init.normal_(lin.bias)
    return lin.eval()


def _cfg(attention: str, **kw) -> ModelConfig:
    base = dict(
        attention=attention, n_layer=2, d_model=64, n_head=4, vocab_size=97, ffn_dim=96, max_seq_len=64
    )
    base.update(kw)
    return ModelConfig(**base)


@needs_mkl
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_packed_linear_matches_plain(bias, rows):
    lin = _linear(bias)
    x = torch.randn(rows, 1, 48)
    want = F.linear(x, lin.weight, lin.bias)
    assert lin.pack_for_decode(rows)
    with torch.inference_mode():
        fast = lin._packed_for(x, rows)  # the packed product itself, not a fallback
        got = lin(x)
    assert fast is not None
    torch.testing.assert_close(fast, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert got.shape == (rows, 1, 40)


@needs_mkl
def test_packed_linear_falls_back_when_stale_or_other_rows():
    lin = _linear(True)
    lin.pack_for_decode(4)
    x = torch.randn(4, 48)
    assert lin._packed_for(x, 4) is None  # autograd records (the weight requires grad): the plain path
    torch.set_grad_enabled(False)
    try:
        _stale_or_other_rows(lin, x)
    finally:
        torch.set_grad_enabled(True)


def _stale_or_other_rows(lin, x):
    assert lin._packed_for(torch.randn(3, 48), 3) is None  # packed for 4 rows only
    assert lin._packed_for(x.double(), 4) is None
    with torch.no_grad():
        lin.weight.mul_(2.0)  # a write to the weight makes the packed copy stale
    assert lin._packed_for(x, 4) is None
    torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias))
    lin.pack_for_decode(4)
    assert lin._packed_for(x, 4) is not None
    lin.train()
    assert lin._packed is None
    lin.pack_for_decode(4)
    lin.double()
    assert lin._packed is None
    assert not lin.pack_for_decode(4)  # float64 weights stay on the plain (reference) path


@needs_mkl
def test_packed_linear_of_inference_tensors():
    """A model built under inference_mode has weights without a version counter: packing still works."""
    with torch.inference_mode():
        lin = _linear(True)
        x = torch.randn(2, 48)
        assert lin.pack_for_decode(2)
        assert lin._packed_for(x, 2) is not None
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)


@needs_mkl
def test_packed_linear_keeps_gradients():
    lin = _linear(True).train(False)
    lin.pack_for_decode(4)
    x = torch.randn(4, 48, requires_grad=True)
    assert lin._packed_for(x, 4) is None  # autograd recording: the plain path, which has a backward
    lin(x).sum().backward()
    assert lin.weight.grad is not None and x.grad is not None


@needs_mkl
@pytest.mark.parametrize("attention", ["mla", "gqa"])
@pytest.mark.parametrize("n_new", [1, 4])
def test_packed_model_decode_matches_plain(attention, n_new):
    torch.manual_seed(0)
    extra = dict(n_kv_head=2) if attention == "gqa" else dict(kv_lora_rank=32, rope_head_dim=8)
    model = build_model(_cfg(attention, **extra)).eval().prepare_for_inference()
    B = 3
    prompt = torch.randint(0, 97, (B, 9))
    step = torch.randint(0, 97, (B, n_new))
    outs = []
    for packed in (False, True):
        n_linear = sum(isinstance(m, Linear) for m in model.modules())
        assert model.pack_for_decode(B * n_new if packed else None) == (n_linear if packed else 0)
        cache = model.new_cache(B, 32)
        with torch.inference_mode():
            model(prompt, cache=cache)
            outs.append(model(step, cache=cache))
    assert model.lm_head._packed is not None
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-4, atol=1e-5)
    model.pack_for_decode(None)
    assert all(m._packed is None for m in model.modules() if isinstance(m, Linear))


@needs_mkl
def test_generate_packs_for_its_batch_and_drops_after():
    torch.manual_seed(0)
    model = build_model(_cfg("mla", kv_lora_rank=32, rope_head_dim=8))
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    seen = []
    orig = Linear._packed_for

    def spy(self, x, rows):
        y = orig(self, x, rows)
        seen.append(y is not None)
        return y

    Linear._packed_for = spy
    try:
        packed = generate(model, prompts, 20, pack_weights=True)
        n_packed = sum(seen)
    finally:
        Linear._packed_for = orig
    plain = generate(model, prompts, 20, pack_weights=False)
    assert n_packed > 0  # the decode steps ran the packed products
    assert packed == plain  # greedy: the same tokens
    assert all(m._packed is None for m in model.modules() if isinstance(m, Linear))
    # packed beforehand by the caller for this batch: used and kept (in eval mode; train(True) drops it)
    model.eval().pack_for_decode(3)
    assert generate(model, prompts, 20) == plain
    assert model.lm_head._packed is not None


def test_generate_float64_never_packs():
    torch.manual_seed(0)
    model = build_model(_cfg("mla", kv_lora_rank=32, rope_head_dim=8), dtype=torch.float64)
    generate(model, [[1, 2], [3, 4]], 20, pack_weights=True)
    assert all(m._packed is None for m in model.modules() if isinstance(m, Linear))


@pytest.mark.parametrize("n_new", [1, 2, 4, 8, 16])
def test_multi_token_decode_takes_absorbed_route(n_new):
    """Speculative verification (T = 2..16 against a long cache) stays on the absorbed route for MLA, where its
    cost per new token is lowest (prefers_absorbed), and agrees with the expand route."""
    torch.manual_seed(0)
    model = build_model(_cfg("mla", kv_lora_rank=32, rope_head_dim=8, max_seq_len=160)).eval()
    model.prepare_for_inference()
    prompt = torch.randint(0, 97, (2, 80))  # absorbed needs 4 T <= cached tokens (absorb_ratio)
    step = torch.randint(0, 97, (2, n_new))
    outs = {}
    for mode in ("auto", "expand"):
        cache = model.new_cache(2, 100)
        trace: list = []
        with torch.inference_mode():
            model(prompt, cache=cache)
            outs[mode] = model(step, cache=cache, mode=mode, trace=trace)
        if mode == "auto":
            assert {r for _, r in trace} == {"absorbed"}
    torch.testing.assert_close(outs["auto"], outs["expand"], rtol=1e-4, atol=1e-5)


@needs_mkl
@pytest.mark.parametrize("rows", [4, ANY_ROWS])
def test_packed_step_counts_the_same_flops(rows):
    """kvlm bench counts a step's FLOPs with torch's counter, which must see the packed products too (MKL's
    for a row count, oneDNN's for any)."""
    from kvlm.bench.flops import CountFlops

    if not packing_available(rows):
        pytest.skip(f"torch built without the library for rows={rows!r}")
    torch.manual_seed(0)
    model = build_model(_cfg("gqa", n_kv_head=2)).eval().prepare_for_inference()
    tok = torch.randint(0, 97, (4, 1))
    totals = []
    for packed in (False, True):
        model.pack_for_decode(rows if packed else None)
        cache = model.new_cache(4, 16)
        with torch.inference_mode(), CountFlops() as c:
            model(tok, cache=cache)
        totals.append(c.total)
    assert totals[0] > 0 and totals[1] == totals[0]


@needs_mkl
def test_generate_packs_by_default_only_where_it_pays(monkeypatch):
    """Default: packed for 16+ steps on CPU float32 from batch 2 where the few-row kernel is (its panels, by
    measurement; at batch 1 they are no faster), from batch 4 where it is not (below 4 rows F.linear streams as
    fast), then dropped; beyond the kernel's 16 rows too (on AMD CPUs torch's unpacked product runs at half
    oneDNN's speed)."""
    from kvlm.inference import generation
    from kvlm.model import KVLM

    torch.manual_seed(0)
    model = build_model(_cfg("gqa", n_kv_head=2)).eval()
    calls = []
    orig = KVLM.pack_for_decode
    monkeypatch.setattr(KVLM, "pack_for_decode", lambda self, rows: calls.append(rows) or orig(self, rows))
    # packing follows the measurement (MKL's layout taken as the fastest here; the tests below take the other
    # outcomes)
    monkeypatch.setattr(generation, "fastest_packing", lambda weight, rows: rows)
    for available, lowest in ((True, 2), (False, 4)):
        monkeypatch.setattr(generation, "few_rows_available", lambda available=available: available)
        calls.clear()
        generate(model, [[1, 2]] * lowest, 16)
        generate(model, [[1, 2]] * 16, 16)
        generate(model, [[1, 2]] * 40, 16)
        assert calls == [lowest, None, 16, None, 40, None]
        calls.clear()
        generate(model, [[1, 2]] * lowest, 8)  # too few steps to repay packing
        generate(model, [[1, 2]] * (lowest - 1), 16)  # too few rows
        assert calls == []


@needs_mkl
def test_generate_does_not_pack_where_the_few_row_kernel_measured_faster(monkeypatch):
    from kvlm.inference import generation
    from kvlm.model import KVLM

    model = build_model(_cfg("gqa", n_kv_head=2)).eval()
    calls, measured = [], []
    orig = KVLM.pack_for_decode
    monkeypatch.setattr(KVLM, "pack_for_decode", lambda self, rows: calls.append(rows) or orig(self, rows))
    monkeypatch.setattr(generation, "few_rows_available", lambda: True)
    monkeypatch.setattr(generation, "fastest_packing", lambda w, rows: measured.append((w, rows)) and None)
    generate(model, [[1, 2]] * 12, 16)
    assert calls == [] and measured == [(model.lm_head.weight, 12)]


def test_generate_packs_in_onednn_layout_where_it_measured_fastest(monkeypatch):
    """At batch 9-16 the layout ``fastest_packing`` names is the one packed: oneDNN's (ANY_ROWS) serves the
    decode steps' products, and the tokens equal the unpacked run's."""
    from kvlm.inference import generation
    from kvlm.model import KVLM

    if not packing_available(ANY_ROWS):
        pytest.skip("this torch build has no oneDNN packed GEMM")
    torch.manual_seed(0)
    model = build_model(_cfg("gqa", n_kv_head=2)).eval()
    prompts = [[1 + i, 2] for i in range(12)]
    plain = generate(model, prompts, 16, pack_weights=False)
    calls, products = [], []
    orig = KVLM.pack_for_decode
    monkeypatch.setattr(KVLM, "pack_for_decode", lambda self, rows: calls.append(rows) or orig(self, rows))
    monkeypatch.setattr(generation, "few_rows_available", lambda: True)
    monkeypatch.setattr(generation, "fastest_packing", lambda w, rows: ANY_ROWS)
    real = linear_module._packed_product
    monkeypatch.setattr(
        linear_module, "_packed_product", lambda x, p, w, b, rows, count=True: products.append(rows) or real(x, p, w, b, rows, count)
    )
    assert generate(model, prompts, 16) == plain
    assert calls == [ANY_ROWS, None] and products and set(products) == {ANY_ROWS}


@pytest.mark.parametrize("onednn_fastest", [True, False])
def test_generate_packs_a_long_prompts_prefill_then_repacks_for_decode(monkeypatch, onednn_fastest):
    """A prefill of ``PACK_MIN_PREFILL_ROWS`` rows or more runs on oneDNN's layout where it measured fastest at
    ``PREFILL_PROBE_ROWS`` rows; after it the weights are repacked as the decode steps need (unpacked at batch 1),
    and dropped at the end; the tokens equal the unpacked run's. Where it did not measure fastest, or the prompt
    is shorter, nothing is packed."""
    from kvlm.inference import generation
    from kvlm.model import KVLM

    if not packing_available(ANY_ROWS):
        pytest.skip("this torch build has no oneDNN packed GEMM")
    torch.manual_seed(0)
    model = build_model(_cfg("gqa", n_kv_head=2)).eval()
    prompt = [1 + i % 50 for i in range(24)]
    plain = generate(model, prompt, 6, pack_weights=False)
    calls, products, probed = [], [], []
    orig = KVLM.pack_for_decode
    monkeypatch.setattr(KVLM, "pack_for_decode", lambda self, rows: calls.append(rows) or orig(self, rows))
    monkeypatch.setattr(generation, "PACK_MIN_PREFILL_ROWS", 24)

    def fastest(w, rows):
        probed.append(rows)
        return ANY_ROWS if onednn_fastest and rows == generation.PREFILL_PROBE_ROWS else None

    monkeypatch.setattr(generation, "fastest_packing", fastest)
    real = linear_module._packed_product
    monkeypatch.setattr(
        linear_module, "_packed_product", lambda x, p, w, b, rows, count=True: products.append(x.shape[:-1]) or real(x, p, w, b, rows, count)
    )
    assert generate(model, prompt, 6) == plain
    assert probed == [generation.PREFILL_PROBE_ROWS]  # batch 1 decodes unpacked: only the prefill asked
    if onednn_fastest:
        assert calls == [ANY_ROWS, None, None]  # packed, unpacked for decode after the prefill, dropped at the end
        assert products and all(shape == (1, 24) for shape in products)  # only the prefill ran packed
    else:
        assert calls == [] and products == []
    calls.clear()
    generate(model, prompt[:23], 6)  # one row short
    assert calls == []
    assert all(m._packed is None for m in model.modules() if isinstance(m, Linear))


def _spy_groups(monkeypatch) -> list[bool]:
    """Record, for each call of a packed group, whether it ran the fused product (True) or declined (False)."""
    from kvlm.attention.base import PackedGroup

    seen: list[bool] = []
    orig = PackedGroup.outputs

    def spy(self, linears, x):
        y = orig(self, linears, x)
        seen.append(y is not None)
        return y

    monkeypatch.setattr(PackedGroup, "outputs", spy)
    return seen


@needs_mkl
@pytest.mark.parametrize("attention", ["mha", "gqa", "mla"])
def test_fused_projections_match_unfused(attention, monkeypatch):
    """With packed weights, SwiGLU's W1/W2 and MHA/GQA's W^Q/W^K/W^V run as one GEMM each (one weight stream);
    the step gives what the unfused unpacked path gives, in float32 and with the unfused float64 path."""
    torch.manual_seed(0)
    extra = {"gqa": dict(n_kv_head=2), "mla": dict(kv_lora_rank=32, rope_head_dim=8)}.get(attention, {})
    model = build_model(_cfg(attention, **extra)).eval().prepare_for_inference()
    B = 4
    prompt, step = torch.randint(0, 97, (B, 9)), torch.randint(0, 97, (B, 1))
    seen = _spy_groups(monkeypatch)

    def decode(m):
        cache = m.new_cache(B, 32)
        with torch.inference_mode():
            m(prompt, cache=cache)
            return m(step, cache=cache)

    plain = decode(model)
    assert not any(seen)  # not packed: no group ran
    model.pack_for_decode(B)
    fused = decode(model)
    groups_per_layer = 2 if attention in ("mha", "gqa") else 1
    assert seen.count(True) == groups_per_layer * model.cfg.n_layer  # the decode step (the prefill declines)
    torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-5)
    model.pack_for_decode(None)
    reference = decode(copy.deepcopy(model).double().prepare_for_inference())  # float64 never packs
    assert seen.count(True) == groups_per_layer * model.cfg.n_layer
    torch.testing.assert_close(fused.double(), reference, rtol=1e-4, atol=1e-5)


@needs_mkl
def test_fused_group_equals_its_packed_parts_and_goes_stale():
    """One packed GEMM [W1; W2] gives each part's own packed product; a weight written after packing (training,
    a load) makes the group decline, so the unfused path runs with the new weight."""
    from kvlm.model import SwiGLU

    torch.manual_seed(0)
    mlp = SwiGLU(_cfg("mha", bias=True)).eval()
    for m in (mlp.w1, mlp.w2):
        torch.nn.init.normal_(m.bias)
    x = torch.randn(8, 1, 64)
    assert mlp.pack_for_decode(8) == [mlp.w1, mlp.w2]
    with torch.no_grad():
        a, b = mlp.group_outputs(("w1", "w2"), x)
        for part, lin in ((a, mlp.w1), (b, mlp.w2)):
            lin.pack_for_decode(8)
            torch.testing.assert_close(part, lin(x), rtol=1e-6, atol=1e-6)  # packed alone
            torch.testing.assert_close(part, F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)
            lin.unpack()
        assert mlp.group_outputs(("w1", "w2"), x[:4]) is None  # other rows: unfused
        mlp.w1.weight.mul_(2)
        assert mlp.group_outputs(("w1", "w2"), x) is None  # stale
        want = F.linear(F.silu(F.linear(x, mlp.w1.weight, mlp.w1.bias)) * F.linear(x, mlp.w2.weight, mlp.w2.bias),
                        mlp.wo.weight, mlp.wo.bias)  # fmt: skip
        torch.testing.assert_close(mlp(x), want, rtol=1e-5, atol=1e-5)
    mlp.pack_for_decode(8)
    mlp.train()
    assert mlp.group_outputs(("w1", "w2"), x) is None  # train(True) drops the packed copy
    assert SwiGLU(_cfg("mha")).double().pack_for_decode(8) == []  # float64: never packed


@needs_mkl
def test_lm_head_timing_runs_the_packed_head_where_the_step_does(monkeypatch):
    """kvlm bench's per-operation LM head time runs the product the decode step runs: packed where bench_decode
    packs (``packs_for``: batch 12 on CPU float32), unpacked at batch 2; the head's own packing is left as it was."""
    from kvlm.bench.opstime import lm_head_ms
    from kvlm.inference import generation

    # the layout measured fastest, pinned (on this small head the timing is a near-tie that flips between runs):
    # MKL's for 12 rows, no copy at 2
    monkeypatch.setattr(generation, "fastest_packing", lambda weight, rows: rows if rows >= 9 else None)

    torch.manual_seed(0)
    model = build_model(_cfg("gqa", n_kv_head=2)).eval()
    seen = []
    orig = Linear._packed_for

    def spy(self, x, rows):
        y = orig(self, x, rows)
        seen.append(y is not None)
        return y

    Linear._packed_for = spy
    try:
        assert lm_head_ms(model, 12, repeats=2) > 0
        packed_calls = sum(seen)
        seen.clear()
        lm_head_ms(model, 2, repeats=2)
    finally:
        Linear._packed_for = orig
    assert packed_calls == 3  # warm-up + 2 timed calls, all packed
    assert not any(seen)  # batch 2: the step does not pack, nor does its timing
    assert model.lm_head._packed is None  # restored


# --- weights packed for any row count (oneDNN; the serving engine) -----------------------------------------------
needs_onednn = pytest.mark.skipif(not packing_available(ANY_ROWS), reason="torch built without oneDNN")


@needs_onednn
@pytest.mark.parametrize("bias", [False, True])
def test_any_rows_packed_linear_matches_plain(bias):
    """One packing serves every row count from min_rows on (decode batches, packed prompt rows, prefill chunks);
    fewer rows take F.linear."""
    lin = _linear(bias)
    assert lin.pack_for_decode(ANY_ROWS)
    with torch.inference_mode():
        for rows in (1, 3, 4, 5, 13, 64, 300):
            x = torch.randn(rows, 1, 48)
            want = F.linear(x.double(), lin.weight.double(), None if lin.bias is None else lin.bias.double())
            fast = lin._packed_for(x, rows)
            assert (fast is not None) == (rows >= Linear.min_rows)
            if fast is not None:
                torch.testing.assert_close(fast.double(), want, rtol=1e-5, atol=1e-5)
            got = lin(x)
            assert got.shape == (rows, 1, 40)
            torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


@needs_onednn
def test_any_rows_packing_falls_back_when_stale():
    lin = _linear(True)
    lin.pack_for_decode(ANY_ROWS)
    x = torch.randn(6, 48)
    assert lin._packed_for(x, 6) is None  # autograd records: the plain path
    with torch.no_grad():
        assert lin._packed_for(x, 6) is not None
        lin.weight.mul_(2.0)
        assert lin._packed_for(x, 6) is None  # written since packing: stale
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias))
    lin.train()
    assert lin._packed is None
    with pytest.raises(ValueError, match="rows must be"):
        lin.pack_for_decode("some")


@needs_onednn
@pytest.mark.parametrize("attention", ["mla", "gqa", "mha"])
def test_any_rows_packed_model_decode_matches_plain(attention, monkeypatch):
    """The whole model packed once for any rows (grouped projections included) decodes batches of different
    sizes and multi-token steps as the unpacked model does."""
    torch.manual_seed(0)
    extra = dict(n_kv_head=2) if attention == "gqa" else dict(kv_lora_rank=32, rope_head_dim=8)
    extra = {} if attention == "mha" else extra
    model = build_model(_cfg(attention, **extra)).eval().prepare_for_inference()
    seen = _spy_groups(monkeypatch)
    for B, n_new in ((5, 1), (2, 3), (8, 2)):
        prompt = torch.randint(0, 97, (B, 9))
        step = torch.randint(0, 97, (B, n_new))
        outs = []
        for packed in (False, True):
            model.pack_for_decode(ANY_ROWS if packed else None)
            cache = model.new_cache(B, 32)
            with torch.inference_mode():
                model(prompt, cache=cache)
                outs.append(model(step, cache=cache))
        torch.testing.assert_close(outs[1], outs[0], rtol=1e-4, atol=1e-5)
    assert any(seen)  # the grouped projections ran packed
    model.pack_for_decode(None)


@needs_onednn
def test_serving_engine_packs_for_any_rows_and_generate_leaves_it():
    from kvlm.serve import Engine, SamplingParams

    torch.manual_seed(0)
    model = build_model(_cfg("mla", kv_lora_rank=32, rope_head_dim=8))
    engine = Engine(model, cache_tokens=256, page_size=4)
    assert engine.packed_weights > 0
    assert model.lm_head._packed[0][2] == ANY_ROWS
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [3, 3], [9]]
    got = engine.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    want = generate(model, prompts, 6, pack_weights=False)
    assert got == want
    assert model.lm_head._packed[0][2] == ANY_ROWS  # generate did not repack or drop the engine's weights
    assert not Engine(model, cache_tokens=256, page_size=4, pack_weights=False).packed_weights
