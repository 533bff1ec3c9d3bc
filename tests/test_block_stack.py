"""A model's decoder blocks in one kernel call at decode (kvlm.model.KVLM.decode_stack, kvlm.kernels.block_stack,
csrc/decode_stack.h) against each block in one call (the stack off) and against the modules one by one, in
float32: logits of consecutive decode steps on the contiguous cache (the paged cache, the engine's step:
tests/test_decode_block.py); the stack built once and built again when a block's plan is; the cases where it
gives way to the blocks; and no decoded model kept alive by the plans kept beside it."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from conftest import require_kernels, tiny_config, twin_paged_caches

import kvlm.decode_plans as decode_plans
from kvlm import build_model, kernels
from kvlm.kernels import cpu as kcpu
from kvlm.model import KVLM, Block

MLA = dict(kv_lora_rank=64, rope_head_dim=16)
VARIANTS = [("mha", {}), ("gqa", dict(n_kv_head=2)), ("mqa", {}), ("mla", MLA)]


@pytest.fixture(autouse=True)
def built():
    require_kernels()
    if not hasattr(kcpu.extension(), "BlockStack"):
        pytest.skip("neither AVX-512 nor AVX2: the stack is built on the block kernels")


def _model(attention, extra, n_layer=3):
    torch.manual_seed(0)
    cfg = tiny_config(attention, d_model=128, n_head=4, ffn_dim=192, vocab_size=101, n_layer=n_layer, **extra)
    return build_model(cfg).eval().prepare_for_inference()


def _decode(model, tokens, prompt_len, trace=None):
    """Logits of each one-token decode call after a prefill (B, n, vocab), and the kernel counters; trace: a
    list that takes the decode calls' routes (``Step.trace``)."""
    mode = "absorbed" if model.cfg.attention == "mla" else "auto"
    cache = model.new_cache(tokens.shape[0], 32)
    with torch.inference_mode():
        model(tokens[:, :prompt_len], cache, mode=mode)
        kernels.CALLS.clear()  # the decode calls' (a prefill of at most FEW_ROWS rows takes the blocks too)
        out = [
            model(tokens[:, t : t + 1], cache, mode=mode, trace=trace) for t in range(prompt_len, tokens.shape[1])
        ]
    return torch.cat(out, 1), dict(kernels.CALLS)


@pytest.mark.parametrize("attention,extra", VARIANTS)
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_the_stack_equals_the_blocks_and_the_modules(monkeypatch, attention, extra, batch):
    model = _model(attention, extra)
    tokens = torch.randint(0, 101, (batch, 11), generator=torch.Generator().manual_seed(1))
    routes, block_routes = [], []
    got, calls = _decode(model, tokens, 6, routes)
    assert calls["block_stack"] == 5  # every decode call, all layers in one
    with torch.inference_mode():
        torch.testing.assert_close(got, model(tokens)[:, 6:], rtol=2e-5, atol=2e-5)
    monkeypatch.setattr(KVLM, "decode_stack", lambda self, x, step, cache: None)
    blocks, calls = _decode(model, tokens, 6, block_routes)
    assert calls.get("block_stack", 0) == 0 and calls.get("gqa_block", 0) + calls.get("mla_block", 0) == 5 * 3
    torch.testing.assert_close(got, blocks, rtol=1e-5, atol=1e-5)
    assert routes == block_routes and len(routes) == 5 * 3  # each layer's route, as the blocks record it
    monkeypatch.setattr(Block, "kept_plan", lambda self: None)
    modules, calls = _decode(model, tokens, 6)
    assert calls.get("gqa_block", 0) + calls.get("mla_block", 0) == 0
    torch.testing.assert_close(got, modules, rtol=1e-5, atol=1e-5)


def test_the_stack_is_built_once_and_again_when_a_plan_is(monkeypatch):
    model = _model("gqa", dict(n_kv_head=2))
    built = []
    stack = kernels.block_stack
    monkeypatch.setattr(decode_plans, "block_stack", lambda calls: built.append(len(calls)) or stack(calls))
    tokens = torch.randint(0, 101, (3, 9), generator=torch.Generator().manual_seed(2))
    before, calls = _decode(model, tokens, 4)
    _decode(model, tokens, 4)
    assert built == [3] and calls["block_stack"] == 5  # once for both decodes
    with torch.no_grad():
        model.layers[1].mlp.w2.weight.mul_(1.5)  # layer 1's plan rebuilt, so the stack
    got, calls = _decode(model, tokens, 4)
    assert built == [3, 3] and calls["block_stack"] == 5
    with torch.inference_mode():
        want = model(tokens)[:, 4:]
    assert not torch.allclose(want, before, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)


def test_a_block_without_a_plan_leaves_the_others_one_call_each():
    """A hook on one block's module: that block runs module by module (so the hook fires), the others each in
    one call, no stack."""
    model = _model("gqa", dict(n_kv_head=2))
    tokens = torch.randint(0, 101, (2, 8), generator=torch.Generator().manual_seed(3))
    seen = []
    handle = model.layers[1].mlp.w1.register_forward_hook(lambda m, a, out: seen.append(out.shape))
    try:
        got, calls = _decode(model, tokens, 5)
    finally:
        handle.remove()
    assert calls.get("block_stack", 0) == 0 and calls["gqa_block"] == 3 * 2 and len(seen) == 4  # prefill + 3
    with torch.inference_mode():
        torch.testing.assert_close(got, model(tokens)[:, 5:], rtol=2e-5, atol=2e-5)
    _, calls = _decode(model, tokens, 5)
    assert calls["block_stack"] == 3  # the hook removed: the stack again


def test_a_quantized_cache_gives_way_to_the_modules():
    """An int8 paged cache (the block kernels read float32 pools only): no stack, no block call, the modules'
    decode over the quantized cache instead, as the stack off computes it."""
    model = _model("gqa", dict(n_kv_head=2))
    g = torch.Generator().manual_seed(4)
    cached = [torch.randint(0, 101, (n,), generator=g) for n in (5, 7)]
    new = torch.randint(0, 101, (2, 1), generator=g)
    with torch.inference_mode():
        _, parts = twin_paged_caches(model, cached, kv_dtype="int8")
        kernels.CALLS.clear()
        model(new, cache=parts.batch([0, 1]))
    assert kernels.CALLS.get("block_stack", 0) == 0 and kernels.CALLS.get("gqa_block", 0) == 0


@pytest.mark.parametrize("attention,extra", [("gqa", dict(n_kv_head=2)), ("mla", MLA)])
def test_a_decoded_model_is_freed(attention, extra):
    """The plans and the stack are kept beside the model in weak dictionaries: what they hold must not hold the
    model, or every model a process ever decoded (and its weights) would stay in memory."""
    model = _model(attention, extra)
    tokens = torch.randint(0, 101, (2, 6), generator=torch.Generator().manual_seed(5))
    _, calls = _decode(model, tokens, 4)
    assert calls["block_stack"] == 2
    refs = [weakref.ref(model), weakref.ref(model.layers[0]), weakref.ref(model.layers[0].mlp.w1.weight)]
    del model
    gc.collect()
    assert [r() is None for r in refs] == [True, True, True]


@pytest.mark.parametrize("attention,extra", [("gqa", dict(n_kv_head=2)), ("mla", MLA)])
def test_nine_to_sixteen_rows_take_the_stack_unless_a_library_layout_holds_the_weights(attention, extra):
    """12 sequences: past FEW_ROWS the modules' products run the few-row kernel too (on the plain weights or its
    panels), and the stack takes the step; weights packed in MKL's layout for 12 rows, which the modules run
    there instead, leave the blocks module by module. Each against the full forward."""
    from kvlm.attention.linear import PANELS, packing_available

    model = _model(attention, extra)
    tokens = torch.randint(0, 101, (12, 8), generator=torch.Generator().manual_seed(6))
    with torch.inference_mode():
        want = model(tokens)[:, 4:]
    layouts = [None, PANELS] + ([12] if packing_available(12) else [])
    for layout in layouts:
        model.pack_for_decode(layout)
        got, calls = _decode(model, tokens, 4)
        layers = calls.get("gqa_block", 0) + calls.get("mla_block", 0)
        stacked = (calls.get("block_stack", 0), layers)
        assert stacked == ((0, 0) if layout == 12 else (4, 4 * model.cfg.n_layer)), layout
        torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)
