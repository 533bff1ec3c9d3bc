"""Misuse of the decode engine gets one clear error naming the problem, never a shape error from deep inside
an attention kernel: capacity, batch, dtype, device, mode, naive vs compact cache, a cache of another model; the
serving engine's packed view (one-token rows) and its mixing setting likewise."""

import pytest
import torch
from conftest import all_variants, tiny_config

from kvlm import CacheError, build_model
from kvlm.attention import registry
from kvlm.inference.generation import generate


def _model(attention="mha", **overrides):
    torch.manual_seed(0)
    return build_model(tiny_config(attention, **overrides)).eval()


def _tokens(B=2, T=5):
    return torch.randint(0, 97, (B, T))


def _latent_variants():
    """One configuration of every registered mechanism whose naive cache differs from its compact one."""
    seen, out = set(), []
    for param in all_variants():
        attention, overrides = param.values
        if attention in seen or attention not in registry():
            continue
        seen.add(attention)
        if registry()[attention].has_naive_cache:
            out.append(pytest.param(attention, overrides, id=attention))
    return out


def test_prompt_plus_new_tokens_beyond_capacity():
    model = _model()  # max_seq_len 64
    with pytest.raises(CacheError, match=r"= 70 exceeds the model's max_seq_len=64 by 6"):
        generate(model, list(range(1, 51)), 20)
    cache = model.new_cache(2, 8)
    model(_tokens(2, 6), cache=cache)
    with pytest.raises(CacheError, match="6 cached \\+ 3 new tokens exceed max_seq_len=8"):
        model(_tokens(2, 3), cache=cache)
    assert cache.length == 6  # the failed call wrote nothing
    model(_tokens(2, 2), cache=cache)  # what still fits, fits
    with pytest.raises(ValueError, match="exceeds the model's max_seq_len=64"):
        model.new_cache(1, 65)
    with pytest.raises(ValueError, match="exceeds max_seq_len=64"):
        model(_tokens(1, 65))


def test_batch_differs_from_cache():
    model = _model()
    with pytest.raises(CacheError, match="batch of 3 sequences does not match the cache's batch_size=2"):
        model(_tokens(3, 4), cache=model.new_cache(2, 16))
    with pytest.raises(CacheError, match="batch of 1"):
        model(_tokens(1, 4), cache=model.new_cache(2, 16))
    with pytest.raises(CacheError, match="pad must have shape"):
        model.new_cache(2, 16).set_left_padding([0, 1, 2])
    with pytest.raises(CacheError, match="pad values"):
        model.new_cache(2, 16).set_left_padding([0, -1])
    with pytest.raises(CacheError, match="positive"):
        model.new_cache(0, 16)


def test_dtype_mismatch():
    model = _model()
    with pytest.raises(
        CacheError, match="model computes in torch.float32 but the cache holds torch.bfloat16"
    ):
        model(_tokens(), cache=model.new_cache(2, 16, dtype=torch.bfloat16))
    # generate builds its cache in the model's dtype, whatever the model was converted to
    model64 = _model().double()
    assert len(generate(model64, [1, 2, 3], 3)) == 3


def test_device_mismatch_on_cpu():
    model = _model()
    cache = model.new_cache(2, 16, device="meta")  # a cache on another device than the inputs
    with pytest.raises(CacheError, match="inputs on cpu but the cache is on meta"):
        model(_tokens(), cache=cache)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_device_mismatch_cuda():
    model = _model()
    with pytest.raises(CacheError, match="inputs on cpu but the cache is on cuda"):
        model(_tokens(), cache=model.new_cache(2, 16, device="cuda"))
    model = model.cuda()
    with pytest.raises(CacheError, match="inputs on cuda"):
        model(_tokens().cuda(), cache=model.new_cache(2, 16, device="cpu"))
    out = generate(model, [[1, 2, 3], [4]], 5)  # the cache follows the model's device
    assert [len(o) for o in out] == [5, 5]


def test_unknown_mode():
    model = _model()
    for call in (
        lambda: model(_tokens(), mode="fast"),
        lambda: model(_tokens(), cache=model.new_cache(2, 16), mode="fast"),
        lambda: generate(model, [1, 2], 3, mode="fast"),
    ):
        with pytest.raises(
            ValueError, match="unknown attention mode 'fast'; known: auto, naive, absorbed, expand"
        ):
            call()


@pytest.mark.parametrize("attention,overrides", _latent_variants())
def test_naive_mode_needs_naive_cache_and_back(attention, overrides):
    model = _model(attention, **overrides)
    with pytest.raises(CacheError, match="naive"):
        model(_tokens(), cache=model.new_cache(2, 16), mode="naive")
    for mode in ("absorbed", "expand"):  # routes that read the compact latent
        with pytest.raises(CacheError, match="compact"):
            model(_tokens(), cache=model.new_cache(2, 16, naive=True), mode=mode)
    # and the right pairings run
    model(_tokens(), cache=model.new_cache(2, 16, naive=True), mode="naive")
    for mode in ("auto", "absorbed", "expand"):
        model(_tokens(), cache=model.new_cache(2, 16), mode=mode)
    assert len(generate(model, [1, 2, 3], 4, mode="naive")) == 4  # generate builds the naive cache itself


def test_cache_of_another_model():
    model = _model()
    for other in (_model(n_layer=3), _model("gqa", n_kv_head=2), _model(d_model=32, n_head=2)):
        with pytest.raises(CacheError, match="not built for this model"):
            model(_tokens(), cache=other.new_cache(2, 16))


def test_generate_input_errors():
    model = _model()
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        generate(model, [[]], 3)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        generate(model, [[5, -1]], 3)
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(model, [5], -1)


def test_packed_batch_misuse_gets_clear_errors_and_changes_nothing():
    """The serving engine's packed view (one-token rows, kvlm.cache.paged_batch.PackedBatch): a sequence twice,
    counts that do not match, tokens of the wrong shape, a pool too small: one error each, nothing written."""
    from kvlm.cache import OutOfPages, PagedKVCache
    from kvlm.cache.paged_batch import PackedBatch

    model = _model()
    cache = PagedKVCache.for_model(model, cache_tokens=16, page_size=4)
    for s in ("a", "b"):
        cache.add_sequence(s)
    with pytest.raises(CacheError, match="appears twice"):
        PackedBatch(cache, ["a", "a"], [1, 2])
    with pytest.raises(CacheError, match="n_new"):
        PackedBatch(cache, ["a", "b"], [1, 0])
    with pytest.raises(CacheError, match="n_new"):
        PackedBatch(cache, ["a", "b"], [1])
    with pytest.raises(CacheError, match="unknown sequence 'c'"):
        PackedBatch(cache, ["a", "c"], [1, 1])
    with pytest.raises(CacheError, match=r"takes tokens of shape \(3, 1\), got \(1, 3\)"):
        model(_tokens(1, 3), cache=PackedBatch(cache, ["a", "b"], [1, 2]))
    with pytest.raises(OutOfPages, match="needs 5 new pages, 4 are free"):
        model(_tokens(17, 1), cache=PackedBatch(cache, ["a", "b"], [9, 8]))
    with pytest.raises(CacheError, match="exceed max_seq_len=64"):
        model(_tokens(65, 1), cache=PackedBatch(cache, ["a"], [65]))
    assert cache.seq_len("a") == cache.seq_len("b") == 0 and cache.num_used_pages == 0
    model(_tokens(3, 1), cache=PackedBatch(cache, ["a", "b"], [1, 2]))  # what fits, runs
    assert (cache.seq_len("a"), cache.seq_len("b")) == (1, 2)


@pytest.mark.parametrize("value", [-1, 1.5, True, "8"])
def test_engine_mix_tokens_must_be_a_count(value):
    from kvlm.serve import Engine

    with pytest.raises(ValueError, match="mix_tokens must be an integer >= 0"):
        Engine(_model(), cache_tokens=64, mix_tokens=value)
