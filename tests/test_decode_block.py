"""The whole MHA / GQA / MQA decoder block, and absorbed MLA's, in one kernel call at decode
(kvlm.kernels.gqa_block_call, mla_block_call; csrc/decode_block.h) against the same block run module by module (the plain path), in float32: logits of
consecutive decode steps (each reads the K and V the step before wrote), on the contiguous cache with and
without left padding and on the paged cache; and the cases it must decline."""

from __future__ import annotations

import pytest
import torch
from conftest import require_kernels, tiny_config

from kvlm import build_model, kernels
from kvlm.cache import PagedKVCache
from kvlm.kernels import cpu as kcpu
from kvlm.kernels import few_rows
from kvlm.model import Block


@pytest.fixture(autouse=True)
def built():
    require_kernels()
    if not hasattr(kcpu.extension(), "gqa_block") or not hasattr(kcpu.extension(), "mla_block"):
        pytest.skip("neither AVX-512 nor AVX2: the block kernel is built on the few-row products")


def _model(attention="gqa", **overrides):
    torch.manual_seed(0)
    cfg = tiny_config(attention, d_model=128, n_head=4, ffn_dim=192, vocab_size=101, **overrides)
    return build_model(cfg).eval().prepare_for_inference()


def _unfused(monkeypatch):
    monkeypatch.setattr(Block, "kept_plan", lambda self: None)


MLA = dict(kv_lora_rank=64, rope_head_dim=16)  # d_c 2 d_h: no weight folds (MLA.fold_choice)


def _decode(model, tokens, prompt_len, mode="auto"):
    """Prefill tokens[:, :prompt_len] into a contiguous cache, then decode the rest one token a call: the
    logits of every decode call (B, n, vocab) and how many blocks ran as one call."""
    B, T = tokens.shape
    cache = model.new_cache(B, 64)
    with torch.inference_mode():
        model(tokens[:, :prompt_len], cache, mode=mode)
        kernels.CALLS.clear()  # the decode calls' (a prefill of at most FEW_ROWS rows takes the blocks too)
        out = [model(tokens[:, t : t + 1], cache, mode=mode) for t in range(prompt_len, T)]
    return torch.cat(out, 1), kernels.CALLS["gqa_block"] + kernels.CALLS["mla_block"]


@pytest.mark.parametrize("attention,extra", [("gqa", dict(n_kv_head=2)), ("mla", MLA)])
def test_swiglu_half_over_wide_activations_and_a_ragged_width(monkeypatch, attention, extra):
    """The block's SiLU (vectorised, csrc/decode_block.h silu_gate) over gate pre-activations of both signs far
    from 0 (W_1 scaled up: |a| up to hundreds, where exp(-a) overflows a float) and an MLP width of 16 k + 12
    (AVX-512's masked tail; AVX2's vectors of 8, then 4 one by one): as the modules' F.silu."""
    torch.manual_seed(0)
    cfg = tiny_config(attention, d_model=128, n_head=4, ffn_dim=204, vocab_size=101, **extra)
    model = build_model(cfg).eval()
    with torch.no_grad():
        for block in model.layers:
            block.mlp.w1.weight.mul_(60.0)
    model.prepare_for_inference()
    tokens = torch.randint(0, 101, (3, 10), generator=torch.Generator().manual_seed(2))
    mode = "absorbed" if attention == "mla" else "auto"
    got, fused = _decode(model, tokens, 6, mode)
    assert fused == 4 * cfg.n_layer
    _unfused(monkeypatch)
    want, fused = _decode(model, tokens, 6, mode)
    assert fused == 0
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize(
    "attention,extra",
    [
        ("mha", {}),
        ("gqa", dict(n_kv_head=2)),
        ("mqa", {}),
        ("mla", MLA),
        ("mla", dict(MLA, latent_scaling=True)),
    ],  # fmt: skip
)
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_block_kernel_equals_the_modules(monkeypatch, attention, extra, batch):
    model = _model(attention, **extra)
    tokens = torch.randint(0, 101, (batch, 12), generator=torch.Generator().manual_seed(1))
    mode = "absorbed" if attention == "mla" else "auto"
    got, fused = _decode(model, tokens, 7, mode)
    assert fused == 5 * model.cfg.n_layer  # every decode call, every layer
    with torch.inference_mode():
        full = model(tokens)[:, 7:]
    torch.testing.assert_close(got, full, rtol=2e-5, atol=2e-5)
    _unfused(monkeypatch)
    want, fused = _decode(model, tokens, 7, mode)
    assert fused == 0
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("attention,extra", [("gqa", dict(n_kv_head=2)), ("mla", MLA)])
def test_block_kernel_on_the_paged_cache_and_across_pages(attention, extra):
    """Sequences of other lengths in one paged batch, pages of 3 slots: each new token lands at its own slot of
    its own page (those the next steps read), the logits as each sequence alone through the full forward."""
    model = _model(attention, **extra)
    mode = "absorbed" if attention == "mla" else "auto"
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 101, (n,), generator=g) for n in (4, 9, 2)]
    steps = torch.randint(0, 101, (3, 6), generator=g)
    cache = PagedKVCache.for_model(model, cache_tokens=96, page_size=3)
    with torch.inference_mode():
        for i, p in enumerate(prompts):
            cache.add_sequence(i)
            model(p[None], cache=cache.batch([i]), mode=mode)
        kernels.CALLS.clear()  # the decode calls' (the 2- and 4-token prefills take the blocks too)
        got = torch.cat(
            [model(steps[:, t : t + 1], cache=cache.batch([0, 1, 2]), mode=mode) for t in range(6)], 1
        )
        assert kernels.CALLS["gqa_block"] + kernels.CALLS["mla_block"] == 6 * model.cfg.n_layer
        for i, p in enumerate(prompts):
            full = model(torch.cat([p, steps[i]])[None])[0, len(p) :]
            torch.testing.assert_close(got[i], full, rtol=2e-5, atol=2e-5)


def test_block_kernel_with_left_padding():
    """A padded batch (generate's left padding): the padded row's logits as its unpadded sequence alone."""
    model = _model("gqa", n_kv_head=2)
    g = torch.Generator().manual_seed(3)
    short, long = torch.randint(0, 101, (5,), generator=g), torch.randint(0, 101, (8,), generator=g)
    new = torch.randint(0, 101, (2, 4), generator=g)
    prompt = torch.stack([torch.cat([torch.zeros(3, dtype=torch.long), short]), long])
    cache = model.new_cache(2, 64)
    cache.set_left_padding([3, 0])
    with torch.inference_mode():
        model(prompt, cache)  # 16 rows: the blocks too, where no library layout holds the weights
        kernels.CALLS.clear()
        got = torch.cat([model(new[:, t : t + 1], cache) for t in range(4)], 1)
        assert kernels.CALLS["gqa_block"] == 4 * model.cfg.n_layer
        alone = model(torch.cat([short, new[0]])[None])[0, 5:]
    torch.testing.assert_close(got[0], alone, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize(
    "attention,overrides,mode,why",
    [
        ("gqa", dict(n_kv_head=2, bias=True), "auto", "biases"),
        ("gqa", dict(n_kv_head=2, gated=True), "auto", "an output gate"),
        ("gqa", dict(n_kv_head=2, rope=False), "auto", "no RoPE"),
        ("gqa", dict(n_kv_head=1, head_dim=520), "auto", "heads wider than the kernel's RoPE buffer"),
        ("mla", dict(MLA, q_lora_rank=32), "absorbed", "a compressed query"),
        ("mla", dict(MLA, rope_kv_heads=2), "absorbed", "two RoPE keys"),
    ],
)
def test_other_blocks_run_module_by_module(attention, overrides, mode, why):
    model = _model(attention, **overrides)
    tokens = torch.randint(0, 101, (2, 9), generator=torch.Generator().manual_seed(4))
    got, fused = _decode(model, tokens, 6, mode)
    assert fused == 0, why
    with torch.inference_mode():
        torch.testing.assert_close(got, model(tokens)[:, 6:], rtol=2e-5, atol=2e-5)


def test_declines_autograd_quantized_pools_and_many_rows():
    model = _model("gqa", n_kv_head=2)
    tokens = torch.randint(0, 101, (2, 8), generator=torch.Generator().manual_seed(5))
    kernels.CALLS.clear()
    cache = model.new_cache(2, 64)
    model(tokens[:, :7], cache)  # autograd on (the parameters require grad)
    model(tokens[:, 7:], cache)
    assert kernels.CALLS["gqa_block"] == 0
    paged = PagedKVCache.for_model(model, cache_tokens=64, page_size=4, kv_dtype="int8")
    with torch.inference_mode():
        for i in range(2):
            paged.add_sequence(i)
            model(tokens[i : i + 1, :7], cache=paged.batch([i]))
        model(tokens[:, 7:], cache=paged.batch([0, 1]))
        assert kernels.CALLS["gqa_block"] == 0  # int8 pools: the store quantizes
        many = few_rows.MAX_ROWS + 1
        big = model.new_cache(many, 64)
        model(torch.zeros(many, 3, dtype=torch.long), big)
        model(torch.zeros(many, 1, dtype=torch.long), big)
        assert kernels.CALLS["gqa_block"] == 0  # past the few-row kernel's rows (MAX_ROWS)


def test_a_slot_outside_the_pool_is_an_error_and_writes_nothing():
    model = _model("gqa", n_kv_head=2)
    cache = model.new_cache(1, 64)
    layer = cache.layers[0]
    with torch.inference_mode():
        model(torch.zeros(1, 3, dtype=torch.long), cache)
        step = cache.begin_step(torch.zeros(1, 1, dtype=torch.long), torch.float32)
        k, v = layer.block_view("k", step), layer.block_view("v", step)
        block, attn = model.layers[0], model.layers[0].attn
        before = [k.pool.clone(), v.pool.clone()]
        bad = k.block_table.clone().fill_(7)  # page 7 of a pool of 1
        with pytest.raises(RuntimeError, match="is not a page"):
            kcpu.extension().gqa_block(
                torch.zeros(1, 1, 128), block.attn_norm.weight, block.mlp_norm.weight, 1e-5,
                [attn.wq.weight, attn.wk.weight, attn.wv.weight], attn.wo.weight,
                [block.mlp.w1.weight, block.mlp.w2.weight], block.mlp.wo.weight,
                *step.cos_sin(attn.rope, torch.float32), k.pool, v.pool, bad, k.start, k.end, 4, 0.125, 1, [None] * 4,
            )  # fmt: skip
        assert torch.equal(k.pool, before[0]) and torch.equal(v.pool, before[1])


def test_hooks_on_a_module_of_the_block_still_fire():
    model = _model("gqa", n_kv_head=2)
    seen = []
    handle = model.layers[1].mlp.wo.register_forward_hook(lambda m, a, out: seen.append(out.shape))
    try:
        _, fused = _decode(model, torch.zeros(1, 5, dtype=torch.long), 3)
    finally:
        handle.remove()
    assert fused == 2 and len(seen) == 3  # layer 0 in one call; layer 1 module by module: prefill and 2 steps


@pytest.mark.parametrize("attention,extra", [("gqa", dict(n_kv_head=2)), ("mla", MLA)])
def test_the_engines_one_call_steps_take_the_block(attention, extra):
    """``forward_parts`` with one call (the serving engine's decode-only step, a ``PagedBatch``; and a
    ``PackedBatch`` of one-token rows, a prompt chunk's tokens each a row) runs the blocks in one call, with the
    logits of each sequence alone through its own cache."""
    from conftest import twin_paged_caches

    from kvlm.cache.paged_batch import PackedBatch

    model = _model(attention, **extra)
    g = torch.Generator().manual_seed(6)
    # at least 4 cached tokens a sequence: MLA's "auto" (what forward_parts runs) takes the absorbed route
    cached = [torch.randint(0, 101, (n,), generator=g) for n in (5, 9, 6)]
    with torch.inference_mode():
        alone, parts = twin_paged_caches(model, cached)
        new = torch.randint(0, 101, (3,), generator=g)
        want = torch.stack([model(new[i].view(1, 1), cache=alone.batch([i]))[0, -1] for i in range(3)])
        kernels.CALLS.clear()
        got = model.forward_parts([(new[:, None], parts.batch([0, 1, 2]))], [0, 1, 2])
        assert kernels.CALLS["gqa_block"] + kernels.CALLS["mla_block"] == model.cfg.n_layer
        assert kernels.CALLS["block_stack"] == 1  # all layers in one call (KVLM.decode_stack)
        torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)
        chunk = torch.randint(0, 101, (4,), generator=g)  # four tokens of sequence 0, one row each
        want = model(chunk[None], cache=alone.batch([0]))[0]
        kernels.CALLS.clear()
        got = model.forward_parts([(chunk[:, None], PackedBatch(parts, [0], [4]))], [0, 1, 2, 3])
        assert kernels.CALLS["gqa_block"] + kernels.CALLS["mla_block"] == model.cfg.n_layer
        torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("attention,extra", [("gqa", dict(n_kv_head=2)), ("mla", MLA)])
def test_block_kernel_reads_the_panels_where_they_go_first(monkeypatch, attention, extra):
    """Weights packed in the few-row kernel's panels (``pack_for_decode(PANELS)``, what ``generate`` packs at 2-8
    rows where they measured faster): the block reads them, with the logits of the modules one by one."""
    from kvlm.attention.linear import PANELS
    from kvlm.kernels.few_rows import panels_available
    from kvlm.kernels.shared import LINEAR_CALLS

    if not panels_available():
        pytest.skip("no AVX-512: the panels are not built (the AVX2 block reads the plain weights)")
    model = _model(attention, **extra)
    assert model.pack_for_decode(PANELS) > 0
    tokens = torch.randint(0, 101, (3, 10), generator=torch.Generator().manual_seed(7))
    mode = "absorbed" if attention == "mla" else "auto"
    before = LINEAR_CALLS["panels"]
    got, fused = _decode(model, tokens, 7, mode)
    assert fused == 3 * model.cfg.n_layer
    assert LINEAR_CALLS["panels"] - before >= 3 * model.cfg.n_layer * 4  # every product of every block
    _unfused(monkeypatch)
    want, fused = _decode(model, tokens, 7, mode)
    assert fused == 0
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with torch.inference_mode():
        torch.testing.assert_close(got, model(tokens)[:, 7:], rtol=2e-5, atol=2e-5)
    monkeypatch.undo()
    for m in model.modules():  # the panels zeroed: a block that reads them now computes something else
        for group in m.__dict__.get("_decode_groups", {}).values():
            group.packed.zero_()
        if getattr(m, "_packed", None) is not None and m is not model.lm_head:
            m._packed[1].zero_()
    zeroed, fused = _decode(model, tokens, 7, mode)
    assert fused == 3 * model.cfg.n_layer and not torch.allclose(zeroed, got, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("attention,extra", [("gqa", dict(n_kv_head=2)), ("mla", MLA)])
def test_the_block_counts_the_flops_of_the_modules(monkeypatch, attention, extra):
    """The kernels' running FLOP count (what kvlm bench adds to torch's counter) grows by as much with the block
    as with its modules, whose products and attention all run on kernels here. (Under torch's FLOP counter
    itself the block declines: the counter's module hooks run module by module.)"""
    from kvlm.kernels.shared import FLOPS

    model = _model(attention, **extra)
    tokens = torch.randint(0, 101, (3, 7), generator=torch.Generator().manual_seed(8))
    mode = "absorbed" if attention == "mla" else "auto"
    totals = []
    for on in (True, False):
        if not on:
            _unfused(monkeypatch)
        cache = model.new_cache(3, 64)
        with torch.inference_mode():
            model(tokens[:, :6], cache, mode=mode)
            kernels.CALLS.clear()
            before = dict(FLOPS)
            model(tokens[:, 6:], cache, mode=mode)
        assert (kernels.CALLS["gqa_block"] + kernels.CALLS["mla_block"] > 0) == on
        totals.append({k: FLOPS[k] - before.get(k, 0) for k in ("total", "attention", "linear")})
    assert totals[0]["attention"] > 0 and totals[0] == totals[1]
