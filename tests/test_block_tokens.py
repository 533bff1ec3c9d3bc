"""A few new tokens a sequence in the block kernels and the stack of them (csrc/decode_block.h, x (B, T, d) with
B T <= MAX_ROWS: speculative verification, a short prompt), in float32, against the same model with the block
plans off (the modules one by one, the plain path tested against float64 elsewhere) and against the full
forward: each sequence's new tokens written at its last T slots and causal among themselves, on the contiguous
cache (a left-padded prompt's padding queries included) and across the pages of a paged one; and a paged call
whose rows are left-padded to T (their padding never stored) gives way to the modules."""

from __future__ import annotations

import pytest
import torch
from conftest import require_kernels, tiny_config, twin_paged_caches

from kvlm import build_model, kernels
from kvlm.kernels import cpu as kcpu
from kvlm.kernels import few_rows
from kvlm.model import Block

MLA = dict(kv_lora_rank=64, rope_head_dim=16)
VARIANTS = [("mha", {}), ("gqa", dict(n_kv_head=2)), ("mla", MLA)]


@pytest.fixture(autouse=True)
def built():
    require_kernels()
    if not hasattr(kcpu.extension(), "BlockStack"):
        pytest.skip("neither AVX-512 nor AVX2: the stack is built on the block kernels")


def _model(attention, extra):
    torch.manual_seed(0)
    cfg = tiny_config(attention, d_model=128, n_head=4, ffn_dim=192, vocab_size=101, n_layer=2, **extra)
    return build_model(cfg).eval().prepare_for_inference()


def _mode(model):
    return "absorbed" if model.cfg.attention == "mla" else "auto"  # MLA's "auto" expands at short caches


def _chunks(model, tokens, widths, pad=None):
    """Logits of consecutive calls of ``widths`` new tokens each on one contiguous cache (B, sum, vocab) and the
    stack calls each made."""
    cache = model.new_cache(tokens.shape[0], max(32, tokens.shape[1]))
    if pad is not None:
        cache.set_left_padding(pad)
    out, stacks, i = [], [], 0
    with torch.inference_mode():
        for T in widths:
            kernels.CALLS.clear()
            out.append(model(tokens[:, i : i + T], cache, mode=_mode(model)))
            stacks.append(kernels.CALLS.get("block_stack", 0))
            i += T
    return torch.cat(out, 1), stacks


@pytest.mark.parametrize("attention,extra", VARIANTS)
@pytest.mark.parametrize("batch", [1, 2])
def test_calls_of_a_few_tokens_equal_the_modules_and_the_full_forward(monkeypatch, attention, extra, batch):
    model = _model(attention, extra)
    widths = (3, 4, 1, 2, 4, 3)  # B T up to 8 rows at batch 2
    tokens = torch.randint(0, 101, (batch, sum(widths)), generator=torch.Generator().manual_seed(1))
    got, stacks = _chunks(model, tokens, widths)
    # every call of at most FEW_ROWS rows ran as one stack, the prompt (from an empty cache) too
    assert stacks == [1] * len(widths)
    with torch.inference_mode():
        torch.testing.assert_close(got, model(tokens), rtol=2e-5, atol=2e-5)
    monkeypatch.setattr(Block, "kept_plan", lambda self: None)
    modules, stacks = _chunks(model, tokens, widths)
    assert stacks == [0] * len(widths)
    torch.testing.assert_close(got, modules, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("attention,extra", VARIANTS)
def test_calls_of_up_to_max_rows_run_as_one_stack(attention, extra):
    """Past FEW_ROWS, to MAX_ROWS rows (16; 64 on AVX2), the blocks run in one stack where no library layout holds
    their weights: a prompt of MAX_ROWS // 2 tokens at batch 2 (T new tokens a sequence, causal among themselves),
    then calls of 5 tokens and 1, equal to the full forward."""
    half = few_rows.MAX_ROWS // 2
    model = _model(attention, dict(extra, max_seq_len=half + 16))
    widths = (half, 5, 1)
    tokens = torch.randint(0, 101, (2, sum(widths)), generator=torch.Generator().manual_seed(4))
    got, stacks = _chunks(model, tokens, widths)
    assert stacks == [1, 1, 1]
    with torch.inference_mode():
        torch.testing.assert_close(got, model(tokens), rtol=2e-5, atol=2e-5)


def test_more_rows_than_the_kernels_take_run_module_by_module():
    wide = few_rows.MAX_ROWS // 3 + 1  # 3 sequences x wide tokens: past MAX_ROWS rows
    model = _model("gqa", dict(n_kv_head=2, max_seq_len=max(32, 2 * wide + 3)))
    tokens = torch.randint(0, 101, (3, 2 * wide + 3), generator=torch.Generator().manual_seed(2))
    got, stacks = _chunks(model, tokens, (wide, wide, 2, 1))  # 3 wide, 3 wide, 6 and 3 rows
    assert stacks == [0, 0, 1, 1]
    with torch.inference_mode():
        torch.testing.assert_close(got, model(tokens), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("attention,extra", VARIANTS)
def test_a_left_padded_prompt_in_the_block(monkeypatch, attention, extra):
    """generate's left padding: the prompt call's padding queries (slots before their row's first key) see their
    own slot, as the plain mask lets them; the padded row's logits are its unpadded sequence's alone."""
    model = _model(attention, extra)
    g = torch.Generator().manual_seed(3)
    short, long = torch.randint(0, 101, (2,), generator=g), torch.randint(0, 101, (4,), generator=g)
    new = torch.randint(0, 101, (2, 3), generator=g)
    tokens = torch.cat([torch.stack([torch.cat([torch.zeros(2, dtype=torch.long), short]), long]), new], 1)
    got, stacks = _chunks(model, tokens, (4, 2, 1), pad=[2, 0])
    assert stacks == [1, 1, 1]
    assert torch.isfinite(got).all()
    monkeypatch.setattr(Block, "kept_plan", lambda self: None)
    modules, _ = _chunks(model, tokens, (4, 2, 1), pad=[2, 0])
    torch.testing.assert_close(got, modules, rtol=1e-5, atol=1e-5)
    with torch.inference_mode():
        alone = model(torch.cat([short, new[0]])[None])[0]
    torch.testing.assert_close(got[0, 2:], alone, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("attention,extra", [("gqa", dict(n_kv_head=2)), ("mla", MLA)])
def test_paged_calls_across_pages_and_rows_padded_to_the_call(attention, extra):
    """Pages of 4 slots: a call of 3 tokens a sequence crosses pages (each token at its own slot), as each
    sequence alone computes; a call whose rows hold 2 and 1 new tokens (left-padded to 2) declines the block
    (its padding must not be written) and still computes each sequence's logits."""
    model = _model(attention, extra)
    mode = _mode(model)
    g = torch.Generator().manual_seed(4)
    cached = [torch.randint(0, 101, (n,), generator=g) for n in (5, 7)]
    with torch.inference_mode():
        alone, batched = twin_paged_caches(model, cached)
        new = torch.randint(0, 101, (2, 3), generator=g)
        kernels.CALLS.clear()
        got = model(new, cache=batched.batch([0, 1]), mode=mode)
        assert kernels.CALLS["block_stack"] == 1
        for i in range(2):
            want = model(new[i : i + 1], cache=alone.batch([i]), mode=mode)[0]
            torch.testing.assert_close(got[i], want, rtol=2e-5, atol=2e-5)
        rows = torch.randint(0, 101, (2, 2), generator=g)  # sequence 1's first column is padding
        kernels.CALLS.clear()
        got = model(rows, cache=batched.batch([0, 1], n_new=[2, 1]), mode=mode)
        padded_calls = dict(kernels.CALLS)
        want = [model(rows[:1], cache=alone.batch([0]), mode=mode)[0], model(rows[1:, 1:], cache=alone.batch([1]), mode=mode)[0]]
        torch.testing.assert_close(got[0], want[0], rtol=2e-5, atol=2e-5)
        torch.testing.assert_close(got[1, -1], want[1][-1], rtol=2e-5, atol=2e-5)
        # both caches hold the same tokens now (the padding written nowhere): a block call agrees again
        last = torch.randint(0, 101, (2, 2), generator=g)
        got = model(last, cache=batched.batch([0, 1]), mode=mode)
        for i in range(2):
            want = model(last[i : i + 1], cache=alone.batch([i]), mode=mode)[0]
            torch.testing.assert_close(got[i], want, rtol=2e-5, atol=2e-5)
    assert padded_calls.get("gqa_block", 0) + padded_calls.get("mla_block", 0) == 0


def test_the_engines_verification_call_takes_the_stack():
    """``forward_parts`` with one call of T = 3 tokens a sequence (a speculative verification step): the stack,
    with the logits at every position of each sequence alone."""
    model = _model("mla", MLA)
    g = torch.Generator().manual_seed(5)
    cached = [torch.randint(0, 101, (n,), generator=g) for n in (12, 14)]  # "auto" absorbs at 3 new tokens
    with torch.inference_mode():
        alone, batched = twin_paged_caches(model, cached)
        new = torch.randint(0, 101, (2, 3), generator=g)
        want = torch.cat([model(new[i : i + 1], cache=alone.batch([i]))[0] for i in range(2)])
        kernels.CALLS.clear()
        got = model.forward_parts([(new, batched.batch([0, 1]))], list(range(6)))
        assert kernels.CALLS["block_stack"] == 1
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)
