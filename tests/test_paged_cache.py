"""The paged cache (kvlm.cache.PagedKVCache) against the contiguous cache, whose equality with the full forward
and the float64 references is tested elsewhere: every mechanism, every decode route, page sizes 1, 3, 16,
sequences of different lengths in one batch; prefix reuse, copy on write, quantized storage, the BlockView."""

import math

import pytest
import torch
from conftest import all_variants, decode_route, decode_route_keys, tiny_config, twin_paged_caches

from kvlm import build_model
from kvlm.cache import BlockView, CacheError, OutOfPages, PagedKVCache
from kvlm.cache.quantized import fp8_dtype

LENGTHS = (5, 11, 2)  # prompts of different lengths decoded in one batch
N_DECODE = 3
CHUNK = 3  # a multi-token step after cached tokens, for all sequences at once (ragged lengths, T > 1)


def _model(attention, overrides):
    cfg = tiny_config(attention, **overrides)
    return build_model(cfg).double().eval().prepare_for_inference().requires_grad_(False)


def _script(vocab):
    """Prompts, then per step the new token(s) of each sequence: decodes, one 3-token chunk, decodes."""
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, vocab, (n,), generator=g) for n in LENGTHS]
    steps = [torch.randint(0, vocab, (len(LENGTHS), 1), generator=g) for _ in range(N_DECODE)]
    steps.insert(1, torch.randint(0, vocab, (len(LENGTHS), CHUNK), generator=g))
    return prompts, steps


def _contiguous(model, prompts, steps, mode):
    """Each sequence alone through the contiguous cache: per step, the logits (T, vocab) of each sequence."""
    out = []
    for i, p in enumerate(prompts):
        cache = model.new_cache(1, 32, naive=mode == "naive")
        logits = [model(p[None], cache=cache, mode=mode)[0]]
        logits += [model(s[i : i + 1], cache=cache, mode=mode)[0] for s in steps]
        out.append(logits)
    return out


def _paged(model, prompts, steps, mode, page_size):
    cache = PagedKVCache.for_model(model, cache_tokens=128, page_size=page_size, naive=mode == "naive")
    ids = list(range(len(prompts)))
    out = [[] for _ in ids]
    for i, p in enumerate(prompts):
        cache.add_sequence(i)
        out[i].append(model(p[None], cache=cache.batch([i]), mode=mode)[0])
    for s in steps:
        logits = model(s, cache=cache.batch(ids), mode=mode)
        for i in ids:
            out[i].append(logits[i])
    return out, cache


PAGE_SIZES = (1, 3, 16)


def _check_paged_equals_contiguous(attention, overrides, page_sizes_of_route):
    model = _model(attention, overrides)
    prompts, steps = _script(model.cfg.vocab_size)
    with torch.inference_mode():
        for r, key in enumerate(decode_route_keys(model)):
            with decode_route(model, key) as mode:
                want = _contiguous(model, prompts, steps, mode)
                for page_size in page_sizes_of_route(r):
                    got, cache = _paged(model, prompts, steps, mode, page_size)
                    for g_seq, w_seq in zip(got, want):
                        for g, w in zip(g_seq, w_seq):
                            assert g.shape == w.shape
                            torch.testing.assert_close(
                                g, w, rtol=1e-10, atol=1e-10, msg=f"{key} P={page_size}"
                            )
                    total = sum(LENGTHS) + len(LENGTHS) * (N_DECODE + CHUNK)
                    assert cache.num_used_pages == sum(
                        math.ceil((n + N_DECODE + CHUNK) / page_size) for n in LENGTHS
                    ), total
                    for i in range(len(prompts)):
                        cache.free(i)
                    assert cache.num_used_pages == 0


@pytest.mark.parametrize("attention,overrides", all_variants())
def test_paged_equals_contiguous_every_route(attention, overrides):
    """Every variant and route; each mechanism's default configuration with page sizes 1, 3 and 16, the other
    variants with one page size each, in turn (the full product is the slow test below)."""
    if overrides:
        n = len(str(overrides))
        _check_paged_equals_contiguous(attention, overrides, lambda r: (PAGE_SIZES[(n + r) % 3],))
    else:
        _check_paged_equals_contiguous(attention, overrides, lambda r: PAGE_SIZES)


@pytest.mark.slow
@pytest.mark.parametrize("attention,overrides", all_variants())
def test_paged_equals_contiguous_every_route_and_page_size(attention, overrides):
    _check_paged_equals_contiguous(attention, overrides, lambda r: PAGE_SIZES)


def _gather_block_view(view: BlockView, dtype) -> list[torch.Tensor]:
    """What a kernel reading through the BlockView sees: per sequence b, (*lead, end_b - start_b, last)."""
    out = []
    P = view.page_size
    for b in range(view.block_table.shape[0]):
        slots = torch.arange(int(view.start[b]), int(view.end[b]))
        pages = view.block_table[b].long()[slots // P]
        vals = view.pool.movedim(-2, 0)[slots % P, pages]  # (n, *lead, last)
        if view.scale is not None:
            vals = vals.to(dtype) * view.scale.movedim(-2, 0)[slots % P, pages].to(dtype)
        out.append(vals.movedim(0, -2))
    return out


@pytest.mark.parametrize("kv_dtype", [None, "int8"])
@pytest.mark.parametrize("attention", ["mha", "mla"])
def test_block_view_reads_what_append_returns(attention, kv_dtype):
    """Paged: sequence b's keys are slots [0, len_b); contiguous: slots [left pad, end)."""
    model = _model(attention, {})
    captured = {}
    layer0 = model.layers[0].attn

    def grab(module, args):
        _, step, cache = args
        if cache is not None:
            captured["view"] = {n: (cache.block_view(n, step), step) for n in cache}
            captured["cache"] = cache

    handle = layer0.register_forward_pre_hook(grab)
    try:
        cache = PagedKVCache.for_model(model, cache_tokens=64, page_size=3, kv_dtype=kv_dtype)
        for i, n in enumerate((4, 7)):
            cache.add_sequence(i)
            model(torch.randint(0, 97, (1, n)), cache=cache.batch([i]))
        model(torch.randint(0, 97, (2, 1)), cache=cache.batch([0, 1]))
        layer = captured["cache"]
        for name, (view, step) in captured["view"].items():
            got = _gather_block_view(view, torch.float64)
            full = layer.read(name, step.end)  # gathered and dequantized by the layer
            assert [int(e) for e in view.end] == [5, 8] and view.page_size == 3
            assert (view.scale is not None) == (kv_dtype is not None and "rope" not in name)
            for b, g in enumerate(got):
                torch.testing.assert_close(g, full[b][..., : int(view.end[b]), :])
        contiguous = model.new_cache(2, 16)
        contiguous.set_left_padding([2, 0])
        model(torch.randint(0, 97, (2, 6)), cache=contiguous)
        layer = captured["cache"]
        for name, (view, _) in captured["view"].items():
            assert view.pool is layer[name] and view.start.tolist() == [2, 0] and view.end.tolist() == [6, 6]
            got = _gather_block_view(view, torch.float64)
            for b, g in enumerate(got):
                torch.testing.assert_close(g, layer.read(name, 6)[b][..., int(view.start[b]) :, :])
    finally:
        handle.remove()


def test_store_writes_without_returning():
    model = _model("mla", {})
    cache = PagedKVCache.for_model(model, cache_tokens=32, page_size=4)
    cache.add_sequence("a")
    step = cache.batch(["a"]).begin_step(torch.tensor([[1, 2, 3]]), torch.float64)
    layer = cache.layers[0]
    value = torch.randn(1, 3, layer.spec["c_kv"][-1], dtype=torch.float64)
    assert layer.store("c_kv", value, step) is None
    torch.testing.assert_close(layer.read("c_kv", 3), value)


def test_prefix_reuse_shares_pages_and_gives_the_same_outputs():
    model = _model("mla", {})
    P = 4
    g = torch.Generator().manual_seed(3)
    common = torch.randint(0, 97, (10,), generator=g).tolist()
    a = common + [1, 2]
    b = common + [5, 6, 7]
    shared = PagedKVCache.for_model(model, cache_tokens=64, page_size=P)
    alone = PagedKVCache.for_model(model, cache_tokens=64, page_size=P, enable_prefix_cache=False)
    outs = {}
    for cache in (shared, alone):
        cache.add_sequence("a")
        model(torch.tensor([a]), cache=cache.batch(["a"]))
        cache.add_sequence("b")
        reused = cache.match_prefix("b", b)
        logits = model(torch.tensor([b[reused:]]), cache=cache.batch(["b"]))[0, -1]
        nxt = model(torch.tensor([[9], [9]]), cache=cache.batch(["a", "b"]))[:, -1]
        outs[cache is shared] = (reused, cache.num_used_pages, logits, nxt)
    (reused, used, logits, nxt), (reused0, used0, logits0, nxt0) = outs[True], outs[False]
    assert reused == 8 and reused0 == 0  # two full pages of the common 10 tokens
    assert used == used0 - 2
    torch.testing.assert_close(logits, logits0, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(nxt, nxt0, rtol=1e-10, atol=1e-10)
    # a released page keeps its key: a later request with the prefix takes it back
    shared.free("a")
    shared.free("b")
    assert shared.num_used_pages == 0
    shared.add_sequence("c")
    assert shared.match_prefix("c", common + [4]) == 8


def test_copy_on_write_keeps_forked_sequences_apart():
    """fork shares a partly filled page; the first write of each sequence must copy it, not overwrite it."""
    model = _model("mha", {})
    P = 4
    prompt = torch.randint(0, 97, (1, 6))  # 1.5 pages: the second page is shared and partly filled
    cache = PagedKVCache.for_model(model, cache_tokens=64, page_size=P)
    cache.add_sequence("x")
    model(prompt, cache=cache.batch(["x"]))
    cache.fork("x", "y")
    assert cache.seq_pages("x") == cache.seq_pages("y") and cache.num_used_pages == 2
    assert cache.pages_needed("y", 1) == 1  # the copy of the shared partial page
    got = model(torch.tensor([[3], [8]]), cache=cache.batch(["x", "y"]))[:, -1]
    assert cache.seq_pages("x")[0] == cache.seq_pages("y")[0]  # the full page is still shared
    assert cache.seq_pages("x")[1] != cache.seq_pages("y")[1]
    got2 = model(torch.tensor([[4], [4]]), cache=cache.batch(["x", "y"]))[:, -1]
    for b, tok in enumerate((3, 8)):
        ref = model.new_cache(1, 16)
        model(prompt, cache=ref)
        want = model(torch.tensor([[tok]]), cache=ref)[0, -1]
        want2 = model(torch.tensor([[4]]), cache=ref)[0, -1]
        torch.testing.assert_close(got[b], want, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(got2[b], want2, rtol=1e-10, atol=1e-10)
    cache.free("x")
    cache.free("y")
    assert cache.num_used_pages == 0


def test_out_of_pages_takes_nothing_and_free_returns_pages():
    model = _model("mla", {})
    cache = PagedKVCache.for_model(model, cache_tokens=8, page_size=4)  # 2 pages
    cache.add_sequence(0)
    model(torch.randint(0, 97, (1, 6)), cache=cache.batch([0]))
    cache.add_sequence(1)
    with pytest.raises(OutOfPages, match="needs 2 new pages, 0 are free"):
        model(torch.randint(0, 97, (1, 5)), cache=cache.batch([1]))
    assert cache.seq_len(1) == 0 and cache.seq_pages(1) == []
    cache.free(0)
    assert cache.num_free_pages == 2
    model(torch.randint(0, 97, (1, 5)), cache=cache.batch([1]))
    assert cache.seq_len(1) == 5


def test_bad_use_gets_clear_errors():
    model = _model("mla", {})
    with pytest.raises(CacheError, match="page_size"):
        PagedKVCache.for_model(model, cache_tokens=8, page_size=0)
    with pytest.raises(CacheError, match="exactly one of cache_bytes or cache_tokens"):
        PagedKVCache.for_model(model, page_size=4)
    with pytest.raises(CacheError, match="less than one page"):
        PagedKVCache.for_model(model, cache_bytes=10, page_size=4)
    with pytest.raises(CacheError, match="unknown kv_dtype"):
        PagedKVCache.for_model(model, cache_tokens=8, kv_dtype="int4")
    cache = PagedKVCache.for_model(model, cache_tokens=128, page_size=4)
    with pytest.raises(CacheError, match="unknown sequence"):
        cache.batch(["nope"])
    cache.add_sequence(0)
    with pytest.raises(CacheError, match="already in the cache"):
        cache.add_sequence(0)
    with pytest.raises(CacheError, match="exceed max_seq_len=64"):
        model(torch.randint(0, 97, (1, 65)), cache=cache.batch([0]))
    with pytest.raises(CacheError, match="batch of 2 sequences"):
        model(torch.randint(0, 97, (2, 1)), cache=cache.batch([0]))
    other = _model("mha", {})
    with pytest.raises(CacheError, match="not built for this model"):
        other(torch.randint(0, 97, (1, 3)), cache=cache.batch([0]))


# --- quantized storage ----------------------------------------------------------------------------------
KV_DTYPES = ["int8"] + (["fp8"] if fp8_dtype() is not None else [])


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("attention", ["mha", "mla", "mlra-4", "gta", "tpa"])
def test_quantized_cache_bytes_and_error(attention, kv_dtype):
    """Bytes per token from the paper's shapes (codes of 1 byte, a float32 scale per token per row, the RoPE key
    in the model dtype) equal the allocated storage; the stored values are within the format's rounding bound;
    the logits stay close to the unquantized cache's."""
    model = (
        build_model(tiny_config(attention)).eval().prepare_for_inference().requires_grad_(False)
    )  # float32
    specs = model.cache_specs()
    want = 0
    for spec in specs:
        for name, shape in spec.items():
            if "rope" in name:
                want += math.prod(shape) * 4
            else:
                want += math.prod(shape) * 1 + math.prod(shape[:-1]) * 4
    cache = PagedKVCache.for_model(model, cache_tokens=64, page_size=4, kv_dtype=kv_dtype)
    stored = sum(
        t.numel() * t.element_size()
        for layer in cache.layers
        for t in (*layer.pools.values(), *layer.scales.values())
    )
    assert cache.bytes_per_token == want and cache.nbytes == stored == want * 64
    sized = PagedKVCache.for_model(model, cache_bytes=want * 4 * 10 + want, page_size=4, kv_dtype=kv_dtype)
    assert sized.num_pages == 10 and sized.page_nbytes == want * 4  # whole pages that fit in the bytes given
    for layer in cache.layers:
        for name, pool in layer.pools.items():
            assert pool.dtype == (torch.float32 if "rope" in name else cache.layers[0].pools[name].dtype)
            assert ("rope" in name) == (name not in layer.scales)
            if name in layer.scales:
                assert pool.element_size() == 1

    # the round trip of one tensor: int8 rounds to the nearest of 255 levels (error <= scale / 2); e4m3 keeps
    # 3 mantissa bits (relative error <= 2^-4, and <= 2^-10 * scale in the subnormal range)
    layer = cache.layers[0]
    name = next(n for n in layer.spec if n in layer.scales)
    cache.add_sequence(0)
    step = cache.batch([0]).begin_step(torch.zeros(1, 8, dtype=torch.long), torch.float32)
    x = torch.randn(1, *layer.spec[name][:-1], 8, layer.spec[name][-1]) * 3
    back = layer.append(name, x, step)
    scale = x.abs().amax(-1, keepdim=True) / (127 if kv_dtype == "int8" else 448)
    bound = scale / 2 if kv_dtype == "int8" else torch.maximum(x.abs() * 2**-4, scale * 2**-10)
    assert bool(((back - x).abs() <= bound * 1.001 + 1e-7).all())
    assert not torch.equal(back, x)
    cache.free(0)

    # logits: a 20-token prompt in two chunks. Measured relative errors (max |diff| / std of the logits) on these
    # tiny models: int8 <= 0.01, fp8 <= 0.05; the bounds leave a factor of 3-4 for other seeds
    tokens = torch.randint(0, 97, (1, 20))
    ref = PagedKVCache.for_model(model, cache_tokens=64, page_size=4)
    out = {}
    for c in (ref, cache):
        c.add_sequence(1)
        with torch.inference_mode():
            out[c is ref] = torch.cat(
                [model(tokens[:, :12], cache=c.batch([1])), model(tokens[:, 12:], cache=c.batch([1]))], 1
            )
    rel = float((out[False] - out[True]).abs().max() / out[True].std())
    assert 0 < rel < (0.03 if kv_dtype == "int8" else 0.2)


def test_prefix_keys_are_chained_over_the_pages_before():
    """A page's K/V depend on every token before it: equal tokens after a different prefix are not reused."""
    model = _model("mla", {})
    x, y = [1, 2, 3, 4], [5, 6, 7, 8]
    cache = PagedKVCache.for_model(model, cache_tokens=64, page_size=4)
    cache.add_sequence("a")
    model(torch.tensor([x + y + [9]]), cache=cache.batch(["a"]))
    cache.add_sequence("b")
    assert cache.match_prefix("b", y + x + [9]) == 0  # y is a keyed page of "a", but after x
    cache.add_sequence("c")
    assert cache.match_prefix("c", x + y + [2]) == 8


@pytest.mark.parametrize("kv_dtype", [None, "int8"])
def test_gather_workspace_works_in_every_autograd_mode(kv_dtype):
    """Gathered latents go to a reused workspace: it must follow inference mode, no_grad and autograd alike."""
    model = build_model(tiny_config("mla")).double().eval().prepare_for_inference()
    tokens = torch.randint(0, 97, (1, 7))
    cache = PagedKVCache.for_model(model, cache_tokens=64, page_size=4, kv_dtype=kv_dtype)
    outs = []
    for i, ctx in enumerate((torch.inference_mode, torch.no_grad, torch.enable_grad)):
        cache.add_sequence(i)
        with ctx():
            out = model(tokens, cache=cache.batch([i]))
            outs.append(torch.cat([out, model(tokens[:, :1], cache=cache.batch([i]))], 1).detach().clone())
    assert outs[2].shape == (1, 8, 97)
    for o in outs[1:]:
        torch.testing.assert_close(o, outs[0], rtol=1e-12, atol=1e-12)


PADDED_CACHED = (0, 5, 17)  # tokens each sequence holds before the padded call
PADDED_NEW = (20, 3, 9)  # its real new tokens in the call (left-padded to 20 columns)


def _written_slots(cache, before):
    """(layer, name, page, row) of every pool row that differs from the snapshot ``before``."""
    out = set()
    for li, layer in enumerate(cache.layers):
        for name, pool in (*layer.pools.items(), *((f"scale:{k}", v) for k, v in layer.scales.items())):
            old = before[li][name]
            diff = (pool != old).movedim(-2, 1).reshape(pool.shape[0], pool.shape[-2], -1).any(-1)
            out |= {(li, name, int(p), int(r)) for p, r in diff.nonzero().tolist()}
    return out


@pytest.mark.parametrize("attention,overrides", all_variants())
def test_padded_prefill_batch_equals_one_at_a_time_and_stores_no_padding(attention, overrides):
    """Chunks of several sequences in one call (``batch(ids, n_new)``, left padding) give in float64 the same
    last-token logits as each chunk alone, store exactly the real tokens (no pool row of a padding token is
    written) and leave caches from which the next decodes give the same logits."""
    _check_padded_batch(_model(attention, overrides), None)


@pytest.mark.parametrize("attention", ["mha", "mla"])
def test_padded_prefill_batch_quantized(attention):
    """The same with int8 storage: codes and scales of padding tokens are never written either."""
    _check_padded_batch(_model(attention, {}), "int8")


SHORT_CACHED = (0, 5, 17)  # a kernel-sized padded call (T = 3 <= kernels.MAX_NEW) ...
SHORT_NEW = (1, 3, 2)  # ... whose first row holds 1 slot, fewer than T: the kernels must decline, not fail


@pytest.mark.parametrize("attention,overrides", all_variants())
def test_padded_kernel_sized_call_with_a_short_row(attention, overrides):
    """A padded call of few columns in which a fresh sequence brings fewer tokens than the call's width: the
    decode kernels (which read each row's last T slots as its new tokens) decline and the plain path gives, in
    float64, each chunk alone's logits."""
    _check_padded_batch(_model(attention, overrides), None, SHORT_CACHED, SHORT_NEW)


def test_kernels_decline_a_short_padded_row_and_take_long_ones():
    from kvlm import kernels

    if not kernels.ready(torch.zeros(1, dtype=torch.float64), 1):
        pytest.skip("the CPU decode kernel is not available here")
    model = _model("mha", {})
    cache = PagedKVCache.for_model(model, cache_tokens=64, page_size=4)
    for name, n in (("long", 6), ("short", 1)):
        cache.add_sequence(name)
        if n:
            with torch.inference_mode():
                model(torch.arange(n)[None], cache=cache.batch([name]))
    rows = torch.tensor([[1, 2, 3], [0, 0, 4]])
    with torch.inference_mode():
        kernels.CALLS.clear()
        model(rows, cache=cache.batch(["long", "short"], [3, 2]))
        assert kernels.CALLS["gqa_cpu"] == model.cfg.n_layer  # padded, but every row holds >= 3 slots (1 + 2)
        cache.add_sequence("fresh")
        kernels.CALLS.clear()
        model(rows, cache=cache.batch(["long", "fresh"], [3, 1]))
        assert kernels.CALLS["gqa_cpu"] == 0  # a row of 1 slot in a 3-wide call: declined, plain path
        view = cache.layers[0].block_view("k", None)
        q = torch.zeros(2, model.cfg.n_head, 3, model.cfg.head_dim, dtype=torch.float64)
        with pytest.raises(kernels.KernelUnavailable, match="padded row"):
            kernels.gqa_decode(q, view, cache.layers[0].block_view("v", None), 3, 1.0, strict=True)


def _check_padded_batch(model, kv_dtype, cached_lens=PADDED_CACHED, new_lens=PADDED_NEW):
    g = torch.Generator().manual_seed(3)
    V, T = model.cfg.vocab_size, max(new_lens)
    cached = [torch.randint(0, V, (n,), generator=g) for n in cached_lens]
    new = [torch.randint(0, V, (n,), generator=g) for n in new_lens]
    decodes = torch.randint(0, V, (2, len(new), 1), generator=g)
    with torch.inference_mode():
        alone, batched = twin_paged_caches(model, cached, kv_dtype)
        want = [model(x[None], cache=alone.batch([i]), last_only=True)[0, -1] for i, x in enumerate(new)]
        before = [
            {**layer.pools, **{f"scale:{k}": v for k, v in layer.scales.items()}} for layer in batched.layers
        ]
        before = [{k: v.clone() for k, v in d.items()} for d in before]
        pad = 7  # any id: its rows must change nothing
        rows = torch.stack([torch.cat([torch.full((T - len(x),), pad), x]) for x in new])
        got = model(rows, cache=batched.batch([0, 1, 2], list(new_lens)), last_only=True)[:, -1]
        torch.testing.assert_close(got, torch.stack(want), rtol=1e-10, atol=1e-10)
        expect = set()
        for i, (c, n) in enumerate(zip(cached_lens, new_lens)):
            pages = batched.seq_pages(i)
            for j in range(c, c + n):
                expect |= {(li, name, pages[j // 4], j % 4) for li, d in enumerate(before) for name in d}
        assert _written_slots(batched, before) == expect
        for i, (c, n) in enumerate(zip(cached_lens, new_lens)):
            assert batched.seq_len(i) == alone.seq_len(i) == c + n
            assert batched.seqs[i].tokens == alone.seqs[i].tokens  # the prefix keys hash no padding
        for d in decodes:
            torch.testing.assert_close(
                model(d, cache=batched.batch([0, 1, 2]))[:, -1],
                model(d, cache=alone.batch([0, 1, 2]))[:, -1],
                rtol=1e-10,
                atol=1e-10,
            )


def test_padded_batch_bad_counts_get_clear_errors():
    model = _model("mha", {})
    cache = PagedKVCache.for_model(model, cache_tokens=64, page_size=4)
    cache.add_sequence("a")
    with pytest.raises(CacheError, match="n_new"):
        cache.batch(["a"], [0])
    with pytest.raises(CacheError, match="n_new"):
        model(torch.zeros(1, 3, dtype=torch.long), cache=cache.batch(["a"], [5]))
    assert cache.seq_len("a") == 0 and cache.num_used_pages == 0
