"""The CPU decode kernels (kvlm.kernels) against the plain path: a float64 reference written here from the
definition (softmax over each sequence's visible slots), kvlm's own plain routes, and whole-model decoding with
kernels on and off; and the dispatch: decode routes do call the kernels, and fall back when they cannot."""

import math

import pytest
import torch
from conftest import require_kernels, tiny_config

from kvlm import build_model, kernels
from kvlm.attention.latent_ops import latent_attention
from kvlm.attention.step import Step, attend
from kvlm.cache.layer import BlockView
from kvlm.cache.quantized import dequantize, fp8_dtype, quantize
from kvlm.kernels import KernelUnavailable
from kvlm.kernels import cpu as kcpu

# 1-byte cache codes with a per-token scale: int8, and fp8 e4m3 where this torch has it (the kernel decodes the
# e4m3 bits itself, normal, subnormal and zero codes alike)
QUANT = {"int8": torch.int8, **({"fp8": fp8_dtype()} if fp8_dtype() is not None else {})}
FP8 = [] if fp8_dtype() is None else ["fp8"]


@pytest.fixture(scope="module", autouse=True)
def built():
    require_kernels()


def paged(x: torch.Tensor, page_size: int, gen: torch.Generator, lead: bool = False):
    """x (B, [G,] S, D) -> a pool (N, [G,] P, D) of shuffled pages with one spare, and the block table."""
    B, S = x.shape[0], x.shape[-2]
    nb = math.ceil(S / page_size)
    perm = torch.randperm(B * nb + 1, generator=gen)[: B * nb]
    table = perm.view(B, nb).to(torch.int32)
    pool = torch.zeros(B * nb + 1, *x.shape[1:-2], page_size, x.shape[-1], dtype=x.dtype)
    for b in range(B):
        for j in range(S):
            pool[table[b, j // page_size], ..., j % page_size, :] = x[b, ..., j, :]
    return pool, table


def reference(q, k, v, start, end, T, scale, q_rope=None, k_rope=None):
    """float64 attention from the definition: q (B, G, R, D) rows r = (head, t), t = r % T; k (B, G, S, D),
    v (B, G, S, Dv); row t of sequence b sees slots [start_b, end_b - T + t], or only its own slot if that
    range is empty (a left-padding query)."""
    B, G, R, _ = q.shape
    out = torch.zeros(B, G, R, v.shape[-1], dtype=torch.float64)
    for b in range(B):
        s0, e = int(start[b]), int(end[b])
        for r in range(R):
            own = e - T + r % T
            keys = torch.arange(s0 if own >= s0 else own, own + 1)
            sc = k[b, :, keys].double() @ q[b, :, r, :, None].double()  # (G, n, 1)
            if q_rope is not None:
                sc = sc + (k_rope[b, keys].double() @ q_rope[b, :, r].double().T).T[:, :, None]
            p = torch.softmax(sc[..., 0] * scale, dim=-1)  # (G, n)
            out[b, :, r] = torch.einsum("gn,gnd->gd", p, v[b, :, keys].double())
    return out


LATENT_CASES = [  # (B, H, T, D_c, d_R, page size (None: one page per sequence), cache dtype)
    (2, 3, 1, 96, 16, 1, "fp32"),
    (3, 5, 4, 200, 0, 16, "fp32"),
    (1, 16, 8, 64, 32, None, "fp32"),
    (2, 12, 4, 256, 32, 16, "fp32"),  # 48 rows of wide latents: the float32 tile widened (copied) once
    (2, 1, 2, 512, 32, 7, "fp32"),
    (2, 12, 1, 256, 32, 16, "int8"),
    (3, 4, 3, 200, 16, None, "int8"),
    (2, 6, 1, 96, 32, 16, "bf16"),
    *[(2, 12, 1, 256, 32, 16, f) for f in FP8],
    *[(3, 4, 3, 200, 16, None, f) for f in FP8],
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("B,H,T,Dc,dR,P,store", LATENT_CASES)
def test_latent_decode_matches_reference(B, H, T, Dc, dR, P, store, dtype):
    bf16_f64 = dtype == torch.float64 and store == "bf16"  # declined: bf16 pools serve float32 queries only
    gen = torch.Generator().manual_seed(B * 1000 + H * 10 + T)
    S = 70
    c = torch.randn(B, S, Dc, generator=gen, dtype=dtype)
    kr = torch.randn(B, S, dR, generator=gen, dtype=dtype) if dR else None
    q = torch.randn(B, H, T, Dc, generator=gen, dtype=dtype)
    qr = torch.randn(B, H, T, dR, generator=gen, dtype=dtype) if dR else None
    start = torch.tensor([3 * b for b in range(B)], dtype=torch.int32)  # ragged: own start and end each
    end = torch.tensor([S - 5 * b for b in range(B)], dtype=torch.int32)
    scale = 1 / math.sqrt(Dc + dR)
    pool, table = paged(c, P or S, gen)
    s = None
    if store in QUANT:
        pool, s = quantize(pool, QUANT[store])
        c = dequantize(*quantize(c, QUANT[store]), dtype)  # the values the quantized cache holds
    elif store == "bf16":
        pool = pool.to(torch.bfloat16)
        c = c.to(torch.bfloat16).to(dtype)
    view = BlockView(pool, table, start, end, P or S, s)
    rview = None
    if dR:  # same pages as c_kv: rebuild the RoPE pool with c's block table
        rpool = torch.zeros(pool.shape[0], P or S, dR, dtype=dtype)
        for b in range(B):
            for j in range(S):
                rpool[table[b, j // (P or S)], j % (P or S)] = kr[b, j]
        rview = BlockView(rpool, table, start, end, P or S)
    if bf16_f64:
        with pytest.raises(KernelUnavailable, match="bfloat16"):
            kernels.latent_decode(q, qr, view, rview, T, scale, strict=True)
        return
    before = kernels.CALLS["latent_cpu"]
    out = kernels.latent_decode(q, qr, view, rview, T, scale, strict=True)
    assert kernels.CALLS["latent_cpu"] == before + 1 and out.dtype == dtype and out.shape == (B, H, T, Dc)
    ref = reference(q.reshape(B, 1, H * T, Dc), c[:, None], c[:, None], start, end, T, scale,
                    None if qr is None else qr.reshape(B, 1, H * T, dR), kr).view(B, H, T, Dc)  # fmt: skip
    tol = 1e-12 if dtype == torch.float64 else 2e-5
    assert (out.double() - ref).abs().max().item() < tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_latent_decode_matches_kvlm_plain_route(dtype):
    """The contiguous cache (one page per sequence, zero copy) against kvlm's plain latent_attention."""
    gen = torch.Generator().manual_seed(3)
    B, H, T, Dc, dR, S = 2, 8, 3, 128, 32, 50
    c, kr = (
        torch.randn(B, S, Dc, generator=gen, dtype=dtype),
        torch.randn(B, S, dR, generator=gen, dtype=dtype),
    )
    q, qr = (
        torch.randn(B, H, T, Dc, generator=gen, dtype=dtype),
        torch.randn(B, H, T, dR, generator=gen, dtype=dtype),
    )
    step = Step.build(torch.zeros(B, T, dtype=torch.long), S - T)
    plain = latent_attention(q, qr, c, kr, c, step, 0.1)
    table = torch.arange(B, dtype=torch.int32)[:, None]
    start, end = torch.zeros(B, dtype=torch.int32), torch.full((B,), S, dtype=torch.int32)
    got = kernels.latent_decode(q, qr, BlockView(c, table, start, end, S), BlockView(kr, table, start, end, S),
                                T, 0.1, strict=True)  # fmt: skip
    assert (got - plain).abs().max().item() < (1e-12 if dtype == torch.float64 else 1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("B,Hq,G,T,D,P,store", [
    (2, 4, 4, 1, 64, 16, "fp32"),   # MHA
    (3, 12, 3, 2, 64, 1, "fp32"),   # GQA-3
    (1, 8, 1, 5, 96, None, "fp32"),  # MQA
    (2, 6, 2, 1, 40, 7, "int8"),
    (2, 4, 2, 8, 72, 16, "bf16"),
    *[(2, 6, 2, 1, 40, 7, f) for f in FP8],
])  # fmt: skip
def test_gqa_decode_matches_reference_and_attend(B, Hq, G, T, D, P, store, dtype):
    gen = torch.Generator().manual_seed(Hq * 100 + G * 10 + T)
    S = 45
    k = torch.randn(B, G, S, D, generator=gen, dtype=dtype)
    v = torch.randn(B, G, S, D, generator=gen, dtype=dtype)
    q = torch.randn(B, Hq, T, D, generator=gen, dtype=dtype)
    start = torch.tensor([2 * b for b in range(B)], dtype=torch.int32)
    end = torch.tensor([S - 3 * b for b in range(B)], dtype=torch.int32)
    kp, table = paged(k, P or S, gen)
    vp = torch.zeros_like(kp)
    for b in range(B):
        for j in range(S):
            vp[table[b, j // (P or S)], :, j % (P or S)] = v[b, :, j]
    ks = vs = None
    if store in QUANT:
        (kp, ks), (vp, vs) = quantize(kp, QUANT[store]), quantize(vp, QUANT[store])
        k, v = dequantize(*quantize(k, QUANT[store]), dtype), dequantize(*quantize(v, QUANT[store]), dtype)
    elif store == "bf16":
        kp, vp = kp.to(torch.bfloat16), vp.to(torch.bfloat16)
        k, v = k.to(torch.bfloat16).to(dtype), v.to(torch.bfloat16).to(dtype)
    kv = BlockView(kp, table, start, end, P or S, ks)
    vv = BlockView(vp, table, start, end, P or S, vs)
    if dtype == torch.float64 and store == "bf16":  # declined: bf16 pools serve float32 queries only
        with pytest.raises(KernelUnavailable, match="bfloat16"):
            kernels.gqa_decode(q, kv, vv, T, 0.125, strict=True)
        return
    out = kernels.gqa_decode(q, kv, vv, T, 0.125, strict=True)
    r = Hq // G
    ref = reference(q.reshape(B, G, r * T, D), k, v, start, end, T, 0.125).view(B, Hq, T, D)
    tol = 1e-12 if dtype == torch.float64 else 2e-5
    assert (out.double() - ref).abs().max().item() < tol
    if B == 1 or store != "fp32":
        return
    # kvlm's plain attend on the same keys, for the sequences without ragged ends (b = 0: all slots visible)
    step = Step.build(torch.zeros(1, T, dtype=torch.long), S - T)
    plain = attend(q[:1], k[:1], v[:1], step, 0.125)
    assert (out[:1] - plain).abs().max().item() < (1e-12 if dtype == torch.float64 else 1e-5)


def test_dispatch_declines_and_strict_raises():
    B, H, T, D = 1, 2, 1, 16
    q = torch.randn(B, H, T, D, dtype=torch.float16)
    pool = torch.randn(1, 8, D)
    view = BlockView(pool, torch.zeros(1, 1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32),
                     torch.full((1,), 8, dtype=torch.int32), 8)  # fmt: skip
    assert kernels.latent_decode(q, None, view, None, T, 0.25) is None
    with pytest.raises(KernelUnavailable, match="float16"):
        kernels.latent_decode(q, None, view, None, T, 0.25, strict=True)
    q = torch.randn(B, H, 17, D)  # prefill-sized
    with pytest.raises(KernelUnavailable, match="17 new tokens"):
        kernels.latent_decode(q, None, view, None, 17, 0.25, strict=True)
    q = torch.randn(B, H, T, D, requires_grad=True)
    with pytest.raises(KernelUnavailable, match="autograd"):
        kernels.latent_decode(q, None, view, None, T, 0.25, strict=True)
    with torch.no_grad():
        assert kernels.latent_decode(q, None, view, None, T, 0.25) is not None
    fp16_pool = BlockView(pool.half(), view.block_table, view.start, view.end, 8)
    with pytest.raises(KernelUnavailable, match="c_kv pool of torch.float16"):
        kernels.latent_decode(q.detach(), None, fp16_pool, None, T, 0.25, strict=True)


def _decode(model, prompt, steps, mode="auto"):
    cache = model.new_cache(batch_size=prompt.shape[0], max_seq_len=prompt.shape[1] + steps)
    out = [model(prompt, cache=cache, mode=mode)]
    tok = out[-1][:, -1:].argmax(-1)
    for _ in range(steps):
        out.append(model(tok, cache=cache, mode=mode))
        tok = out[-1][:, -1:].argmax(-1)
    return torch.cat(out, dim=1)


@pytest.mark.parametrize("attention,extra,counter", [
    ("mla", dict(kv_lora_rank=48, rope_head_dim=8), "latent_cpu"),
    ("mla", dict(kv_lora_rank=40, rope_head_dim=0), "latent_cpu"),
    ("gqa", dict(n_kv_head=2), "gqa_cpu"),
    ("mha", {}, "gqa_cpu"),
])  # fmt: skip
def test_model_decode_kernels_on_equals_off(attention, extra, counter, monkeypatch):
    """Whole-model decoding (prompt of 6 new tokens, then 5 single steps) with the kernels equals the plain path,
    and the decode layers do call the kernel: n_layer calls per model call (the counter fails if the dispatch
    silently stops using it), a single step's either the attention kernel's or, where the whole block runs as
    one call (kvlm.kernels.gqa_block_call / mla_block_call, whose attention is that kernel), the block's."""
    torch.manual_seed(0)
    cfg = tiny_config(attention, **extra)
    model = build_model(cfg).eval()
    prompt = torch.randint(0, cfg.vocab_size, (2, 6))
    block = {"gqa_cpu": "gqa_block", "latent_cpu": "mla_block"}[counter]
    with torch.no_grad():
        before = kernels.CALLS[counter] + kernels.CALLS[block]
        on = _decode(model, prompt, 5)
        # 5 steps; the 6-token prefill too for MHA/GQA (6 <= MAX_NEW), while MLA's "auto" rule sends a prefill
        # into an empty cache down the expand route
        calls = 5 + (counter == "gqa_cpu")
        assert kernels.CALLS[counter] + kernels.CALLS[block] - before == cfg.n_layer * calls
        monkeypatch.setenv(kcpu.ENV, "0")
        before = sum(kernels.CALLS.values())
        off = _decode(model, prompt, 5)
        assert sum(kernels.CALLS.values()) == before  # disabled: not one call
    assert (on - off).abs().max().item() < 1e-4


def test_model_decode_float64_and_padded_batch(monkeypatch):
    """float64 (the exactness check) with left padding: the kernel starts each sequence at its padding and lets
    a padding query see its own slot, as the plain mask does."""
    torch.manual_seed(1)
    cfg = tiny_config("mla", kv_lora_rank=32, rope_head_dim=8)
    model = build_model(cfg).to(torch.float64).eval()
    prompt = torch.randint(0, cfg.vocab_size, (2, 5))
    outs = []
    for flag in ("1", "0"):
        monkeypatch.setenv(kcpu.ENV, flag)
        cache = model.new_cache(batch_size=2, max_seq_len=12)
        cache.set_left_padding([0, 2])
        before = kernels.CALLS["latent_cpu"]
        with torch.no_grad():
            a = model(prompt, cache=cache, mode="absorbed")  # the padded prefill too
            b = model(prompt[:, -1:], cache=cache, mode="absorbed")
        outs.append((torch.cat([a, b], dim=1), kernels.CALLS["latent_cpu"] - before))
    (on, calls), (off, _) = outs
    assert calls == 2 * cfg.n_layer
    assert (on - off).abs().max().item() < 1e-10


@pytest.mark.parametrize("kv_dtype", ["int8", *FP8])
@pytest.mark.parametrize("attention", ["mla", "gqa"])
def test_paged_quantized_cache_decode_uses_kernel(monkeypatch, kv_dtype, attention):
    """The paged int8 / fp8 serving cache: the kernel reads the pages and scales in place and equals the plain
    path (which gathers and dequantizes)."""
    paged_mod = pytest.importorskip("kvlm.cache.paged")
    torch.manual_seed(2)
    overrides = dict(kv_lora_rank=48, rope_head_dim=8) if attention == "mla" else dict(n_kv_head=2)
    cfg = tiny_config(attention, **overrides)
    model = build_model(cfg).eval()
    mode = "absorbed" if attention == "mla" else "auto"
    name = "latent_cpu" if attention == "mla" else "gqa_cpu"
    prompts = [torch.randint(0, cfg.vocab_size, (1, n)) for n in (5, 9)]
    results = []
    for flag in ("1", "0"):
        monkeypatch.setenv(kcpu.ENV, flag)
        cache = paged_mod.PagedKVCache.for_model(model, cache_tokens=64, page_size=4, kv_dtype=kv_dtype)
        before = kernels.CALLS[name]
        with torch.no_grad():
            for i, p in enumerate(prompts):
                cache.add_sequence(i)
                model(p, cache=cache.batch([i]), mode=mode)
            tok = torch.tensor([[1], [2]])
            out = model(tok, cache=cache.batch([0, 1]), mode=mode)  # ragged: 5 and 9 cached tokens
        calls = kernels.CALLS[name] - before
        results.append((out, calls))
    (on, calls_on), (off, calls_off) = results
    assert calls_on == 3 * cfg.n_layer and calls_off == 0
    assert (on - off).abs().max().item() < 1e-4


def test_build_failure_falls_back(monkeypatch):
    """No compiler / a failed build: ready() is False and decoding runs the plain path."""
    monkeypatch.setattr(kcpu, "_state", {"error": "CalledProcessError: no compiler"})
    q = torch.randn(1, 2, 1, 16)
    assert not kernels.ready(q, 1)
    with pytest.raises(KernelUnavailable, match="did not build.*no compiler"):
        kernels.gqa_decode(q, *[BlockView(torch.randn(1, 2, 4, 16), torch.zeros(1, 1, dtype=torch.int32),
                                          torch.zeros(1, dtype=torch.int32), torch.full((1,), 4, dtype=torch.int32),
                                          4)] * 2, 1, 0.25, strict=True)  # fmt: skip
    cfg = tiny_config("gqa", n_kv_head=2)
    model = build_model(cfg).eval()
    before = sum(kernels.CALLS.values())
    with torch.no_grad():
        _decode(model, torch.randint(0, cfg.vocab_size, (1, 4)), 2)
    assert sum(kernels.CALLS.values()) == before


def test_prefetch_target_follows_the_l1_size(monkeypatch, tmp_path):
    """The kernels prefetch into L2 where L1d is under 48 KiB (a Zen 4's 32 KiB), into L1 where it is larger (a
    Zen 5's 48 KiB) or unknown; the build's module name changes with the flags, so the two never share a build."""
    hint = "-DKVLM_PF_HINT=_MM_HINT_T1"
    real = kcpu.Path
    for size, l2 in (("32K", True), ("48K", False), ("1M", False)):
        cache = tmp_path / size / "index0"
        cache.mkdir(parents=True)
        for name, text in (("level", "1"), ("type", "Data"), ("size", size)):
            (cache / name).write_text(text + "\n")
        monkeypatch.setattr(
            kcpu, "Path", lambda p, d=cache.parent, real=real: d if "cpu0/cache" in str(p) else real(p)
        )
        assert (hint in kcpu.build_flags()) is l2, size
        assert kcpu.build_flags()[: len(kcpu.CFLAGS)] == kcpu.CFLAGS
    monkeypatch.setattr(kcpu, "l1d_bytes", lambda: None)
    assert kcpu.build_flags() == kcpu.CFLAGS


@pytest.mark.parametrize("attention,extra", [("mla", dict(kv_lora_rank=48, rope_head_dim=8)), ("gqa", {})])
def test_flop_count_sees_the_kernels(attention, extra, monkeypatch):
    """kvlm bench's FLOP count (torch's counter, blind to the extension) includes the kernels' FLOPs: a decode
    step counts the same with kernels on as with the plain path (T = 1: every cached key is visible)."""
    from kvlm.bench.flops import CountFlops

    cfg = tiny_config(attention, **extra)
    model = build_model(cfg).eval()
    counts = []
    for flag in ("1", "0"):
        monkeypatch.setenv(kcpu.ENV, flag)
        cache = model.new_cache(batch_size=2, max_seq_len=16)
        with torch.no_grad():
            model(torch.randint(0, cfg.vocab_size, (2, 9)), cache=cache)
            with CountFlops() as f:
                model(torch.randint(0, cfg.vocab_size, (2, 1)), cache=cache)
        counts.append(f.total)
    assert counts[0] == counts[1] > 0


def test_out_of_range_slots_or_pages_are_an_error():
    """A block table or end past the pool is one clear error, never a read outside the pool."""
    pool = torch.randn(2, 4, 16)
    q = torch.randn(1, 2, 1, 16)
    ok = dict(block_table=torch.tensor([[0, 1]], dtype=torch.int32), start=torch.zeros(1, dtype=torch.int32))
    too_long = BlockView(pool, end=torch.tensor([9], dtype=torch.int32), page_size=4, **ok)
    with pytest.raises(RuntimeError, match="do not fit its block table"):
        kernels.latent_decode(q, None, too_long, None, 1, 0.25)
    bad_page = BlockView(pool, torch.tensor([[0, 5]], dtype=torch.int32), ok["start"],
                         torch.tensor([8], dtype=torch.int32), 4)  # fmt: skip
    with pytest.raises(RuntimeError, match="entry 1 = 5 is not a page"):
        kernels.latent_decode(q, None, bad_page, None, 1, 0.25)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_sequence_splits_merge_exactly(threads):
    """Batch 1 splits the key axis over the threads and merges by log-sum-exp: the same result, float64."""
    gen = torch.Generator().manual_seed(5)
    S, D = 3000, 64
    c = torch.randn(1, S, D, generator=gen, dtype=torch.float64)
    q = torch.randn(1, 4, 2, D, generator=gen, dtype=torch.float64)
    view = BlockView(c, torch.zeros(1, 1, dtype=torch.int32), torch.tensor([7], dtype=torch.int32),
                     torch.tensor([S], dtype=torch.int32), S)  # fmt: skip
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert kernels._splits(1, view) == threads  # 3000 keys: at least 512 per split
        out = kernels.latent_decode(q, None, view, None, 2, 0.125, strict=True)
    finally:
        torch.set_num_threads(before)
    ref = reference(q.reshape(1, 1, 8, D), c[:, None], c[:, None], view.start, view.end, 2, 0.125)
    assert (out.reshape(1, 1, 8, D) - ref).abs().max().item() < 1e-12


# The AVX-512 micro-kernels (csrc/decode_avx512.h: float32 queries) block rows by 4 / 2 / 1 and keys by tiles of
# 16 or 32, mask the tail of the feature axes, and read bf16 / int8 rows either widened in registers (fewer than
# 8 rows, int8 scales folded into scores and probabilities) or widened once into a float tile (8 rows or more):
# shapes aimed at each of those edges, float32 against the float64 definition. (float64 queries take the
# portable path, tested above.)
EDGE_CASES = [  # (B, H, T, D_c, d_R, S, page size, cache dtype, start offset)
    (2, 1, 1, 8, 0, 37, 5, "fp32", 0),  # one masked vector, single row, page size not dividing a tile
    (2, 3, 3, 33, 5, 100, 7, "fp32", 11),  # odd widths, 9 rows = 4 + 4 + 1, start inside a tile
    (1, 7, 2, 17, 1, 260, 16, "int8", 0),  # 14 rows = 4 x 3 + 2, width 16 + 1, int8 widened into a tile
    (3, 5, 1, 300, 24, 81, 9, "int8", 4),  # wide: tiles of 16, 5 rows = 4 + 1, int8 in registers, both tails
    (2, 6, 4, 250, 7, 90, 32, "bf16", 2),  # 24 rows, bf16 widened into a tile with a masked tail
    (2, 3, 2, 250, 7, 90, 32, "bf16", 2),  # 6 rows = 4 + 2, bf16 widened in registers with a masked tail
    (1, 12, 1, 256, 32, 1000, 64, "int8", 0),  # the bench's MLA shape, int8, many tiles
    # float32, 8 to 31 rows: later tiles' lines prefetched spread over each tile's micro-kernel steps
    (2, 12, 1, 256, 32, 300, 5, "fp32", 3),  # the MLA shape, pages of 5 across tiles, partial last tile
    (1, 4, 4, 72, 8, 97, 3, "fp32", 0),  # 16 rows of 64 + 8 (narrow: tiles of 32), RoPE 8, pages of 3
    (2, 9, 1, 130, 3, 45, 45, "fp32", 20),  # 9 rows = 4 + 4 + 1, widths 128 + 2 and 3, under two tiles
    # fp8 e4m3 codes decoded in registers: widened into a tile (8 rows or more) and in registers (fewer), tails
    *[(1, 7, 2, 17, 1, 260, 16, f, 0) for f in FP8],
    *[(3, 5, 1, 300, 24, 81, 9, f, 4) for f in FP8],
    *[(1, 12, 1, 256, 32, 1000, 64, f, 0) for f in FP8],
]


def _latent_setup(B, H, T, Dc, dR, S, P, store, s0, gen, scores_scale=1.0):
    c = torch.randn(B, S, Dc, generator=gen) * scores_scale
    kr = torch.randn(B, S, dR, generator=gen) if dR else None
    q = torch.randn(B, H, T, Dc, generator=gen)
    qr = torch.randn(B, H, T, dR, generator=gen) if dR else None
    start = torch.tensor([s0 + b for b in range(B)], dtype=torch.int32)
    end = torch.tensor([S - 2 * b for b in range(B)], dtype=torch.int32)
    pool, table = paged(c, P, gen)
    s = None
    if store in QUANT:
        pool, s = quantize(pool, QUANT[store])
        c = dequantize(*quantize(c, QUANT[store]), torch.float32)
    elif store == "bf16":
        pool = pool.to(torch.bfloat16)
        c = c.to(torch.bfloat16).float()
    rview = None
    if dR:
        rpool = torch.zeros(pool.shape[0], P, dR)
        for b in range(B):
            for j in range(S):
                rpool[table[b, j // P], j % P] = kr[b, j]
        rview = BlockView(rpool, table, start, end, P)
    return c, kr, q, qr, BlockView(pool, table, start, end, P, s), rview


@pytest.mark.parametrize("B,H,T,Dc,dR,S,P,store,s0", EDGE_CASES)
def test_latent_micro_kernel_edges(B, H, T, Dc, dR, S, P, store, s0):
    gen = torch.Generator().manual_seed(Dc * 7 + H)
    c, kr, q, qr, view, rview = _latent_setup(B, H, T, Dc, dR, S, P, store, s0, gen)
    scale = 1 / math.sqrt(Dc + dR)
    out = kernels.latent_decode(q, qr, view, rview, T, scale, strict=True)
    ref = reference(q.reshape(B, 1, H * T, Dc), c[:, None], c[:, None], view.start, view.end, T, scale,
                    None if qr is None else qr.reshape(B, 1, H * T, dR), kr).view(B, H, T, Dc)  # fmt: skip
    assert (out.double() - ref).abs().max().item() < 2e-5


@pytest.mark.parametrize("rows", range(6, 14))
@pytest.mark.parametrize("dR", [32, 0])
def test_latent_decode_any_row_count_on_wide_latents(rows, dR):
    """Wide latents (256 features and more) at 6 to 13 query rows (heads x new tokens): odd and even row counts
    of the AVX2 path's score blocks of 2 rows x 6 keys in tiles of 24 keys (decode_core.h, decode_avx2.h), with
    and without the RoPE part, ranges that start and end mid-tile and mid-page; the AVX-512 and portable paths
    take the same shapes."""
    gen = torch.Generator().manual_seed(rows * 10 + dR)
    H, T = (rows // 2, 2) if rows % 2 == 0 else (rows, 1)
    c, kr, q, qr, view, rview = _latent_setup(2, H, T, 256, dR, 45, 16, "fp32", 3, gen)
    scale = 1 / math.sqrt(256 + dR)
    out = kernels.latent_decode(q, qr, view, rview, T, scale, strict=True)
    ref = reference(q.reshape(2, 1, H * T, 256), c[:, None], c[:, None], view.start, view.end, T, scale,
                    None if qr is None else qr.reshape(2, 1, H * T, dR), kr).view(2, H, T, 256)  # fmt: skip
    assert (out.double() - ref).abs().max().item() < 2e-5


@pytest.mark.parametrize("B,Hq,G,T,D,S,P,store", [
    (2, 2, 2, 1, 24, 70, 6, "fp32"),  # MHA rows (1 per group), 24 = 16 + 8: a masked second vector
    (1, 6, 2, 3, 100, 75, 10, "int8"),  # 9 rows per group, int8 K and V with their own scales
    (2, 3, 1, 5, 65, 64, 64, "bf16"),  # MQA, 15 rows = 4 x 3 + 2 + 1, one page per sequence
    (1, 1, 1, 16, 48, 40, 3, "int8"),  # 16 new tokens of one head: 4 x 4 rows, ragged pages of 3
    *[(1, 6, 2, 3, 100, 75, 10, f) for f in FP8],  # fp8 K and V with their own scales
    *[(2, 2, 2, 1, 24, 70, 6, f) for f in FP8],  # fp8, one row per group (in registers), a masked vector
])  # fmt: skip
def test_gqa_micro_kernel_edges(B, Hq, G, T, D, S, P, store):
    gen = torch.Generator().manual_seed(D * 3 + T)
    k = torch.randn(B, G, S, D, generator=gen)
    v = torch.randn(B, G, S, D, generator=gen)
    q = torch.randn(B, Hq, T, D, generator=gen)
    start = torch.tensor([3 * b for b in range(B)], dtype=torch.int32)
    end = torch.tensor([S - b for b in range(B)], dtype=torch.int32)
    kp, table = paged(k, P, gen)
    vp = torch.zeros_like(kp)
    for b in range(B):
        for j in range(S):
            vp[table[b, j // P], :, j % P] = v[b, :, j]
    ks = vs = None
    if store in QUANT:
        (kp, ks), (vp, vs) = quantize(kp, QUANT[store]), quantize(vp, QUANT[store])
        k, v = (
            dequantize(*quantize(k, QUANT[store]), torch.float32),
            dequantize(*quantize(v, QUANT[store]), torch.float32),
        )
    elif store == "bf16":
        kp, vp = kp.to(torch.bfloat16), vp.to(torch.bfloat16)
        k, v = k.to(torch.bfloat16).float(), v.to(torch.bfloat16).float()
    out = kernels.gqa_decode(q, BlockView(kp, table, start, end, P, ks), BlockView(vp, table, start, end, P, vs),
                             T, D**-0.5, strict=True)  # fmt: skip
    ref = reference(q.reshape(B, G, Hq // G * T, D), k, v, start, end, T, D**-0.5).view(B, Hq, T, D)
    assert (out.double() - ref).abs().max().item() < 2e-5


def test_micro_kernel_rising_max_peaky_scores_and_padding_rows():
    """Scores that grow along the sequence (the running max moves on every tile, so every tile rescales what
    the rows have summed), a scale that makes the softmax peaky (exp far below FLT_MIN for most keys), and a
    sequence whose start lies after its first new tokens' slots (left-padding rows that see only their own
    slot), float32 through the micro-kernels against float64."""
    gen = torch.Generator().manual_seed(11)
    B, H, T, Dc, dR, S, P = 2, 4, 3, 40, 8, 150, 16
    c, kr, q, qr, view, rview = _latent_setup(B, H, T, Dc, dR, S, P, "fp32", 0, gen)
    ramp = torch.linspace(0.1, 3.0, S)[None, :, None]
    c = c * ramp
    q = q.abs() + 0.5
    c = c.abs()  # q . c_j > 0 and rising with j: a new max on every tile
    pool, table = paged(c, P, gen)
    rpool = torch.zeros(pool.shape[0], P, dR)
    for b in range(B):
        for j in range(S):
            rpool[table[b, j // P], j % P] = kr[b, j]
    start = torch.tensor([0, S - 2], dtype=torch.int32)  # sequence 1: rows t = 0 see only their own slot
    end = torch.full((B,), S, dtype=torch.int32)
    view, rview = BlockView(pool, table, start, end, P), BlockView(rpool, table, start, end, P)
    for scale in (0.05, 3.0):  # mild, and peaky (scores differ by thousands)
        out = kernels.latent_decode(q, qr, view, rview, T, scale, strict=True)
        ref = reference(q.reshape(B, 1, H * T, Dc), c[:, None], c[:, None], start, end, T, scale,
                        qr.reshape(B, 1, H * T, dR), kr).view(B, H, T, Dc)  # fmt: skip
        assert torch.isfinite(out).all()
        assert (out.double() - ref).abs().max().item() < 2e-5 * max(1.0, ref.abs().max().item())


@pytest.mark.parametrize("store", ["fp32", "int8", *FP8])
def test_micro_kernel_sequence_splits_float32(store):
    """Batch 1 on 2 threads: the key axis split in two, each half through the micro-kernels, merged."""
    gen = torch.Generator().manual_seed(4)
    c, kr, q, qr, view, rview = _latent_setup(1, 12, 1, 256, 32, 1500, 16, store, 5, gen)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert kernels._splits(1, view) == 2
        out = kernels.latent_decode(q, qr, view, rview, 1, 0.06, strict=True)
    finally:
        torch.set_num_threads(before)
    ref = reference(q.reshape(1, 1, 12, 256), c[:, None], c[:, None], view.start, view.end, 1, 0.06,
                    qr.reshape(1, 1, 12, 32), kr).view(1, 12, 1, 256)  # fmt: skip
    assert (out.double() - ref).abs().max().item() < 2e-5


@pytest.mark.skipif(fp8_dtype() is None, reason="this torch has no float8_e4m3fn")
@pytest.mark.parametrize("H,dtype", [(12, torch.float32), (2, torch.float32), (3, torch.float64)])
def test_fp8_codes_decode_exactly(H, dtype):
    """Every non-NaN e4m3 code (zeros, subnormals, normals, both signs) as torch converts it: one cached key, so
    the output is its value row times its scale. 12 rows widen a tile, 2 decode in registers, float64 queries take
    the portable path."""
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)  # 254 codes
    pool = codes.view(fp8_dtype()).reshape(1, 1, -1)  # (N pages, P = 1, D)
    scale = torch.full((1, 1, 1), 0.75)
    one = torch.ones(1, dtype=torch.int32)
    view = BlockView(pool, one[:, None] * 0, one * 0, one, 1, scale)
    q = torch.randn(1, H, 1, pool.shape[-1], dtype=dtype)
    out = kernels.latent_decode(q, None, view, None, 1, 0.1, strict=True)
    want = (pool.to(torch.float32) * 0.75).to(dtype).expand(1, H, 1, -1)
    torch.testing.assert_close(out, want, rtol=0, atol=0)


def test_scratch_buffers_serve_calls_of_every_size_in_turn():
    """The kernel's work items reuse per-thread scratch (csrc/scratch.h): a call whose queries need more than the
    1 MiB a buffer keeps (128 heads x 16 new tokens of 576: 4.7 MB of interleaved queries), then small calls, then
    the large one again, each exact against the reference: no buffer is stale, short or left dirty."""
    gen = torch.Generator().manual_seed(11)
    large, small = (1, 128, 16, 512, 64), [(2, 3, 1, 40, 8), (1, 12, 1, 256, 32)]
    for B, H, T, Dc, dR in [large, *small, large]:
        c, kr, q, qr, view, rview = _latent_setup(B, H, T, Dc, dR, 40, 16, "fp32", 0, gen)
        scale = 1 / math.sqrt(Dc + dR)
        out = kernels.latent_decode(q, qr, view, rview, T, scale, strict=True)
        ref = reference(q.reshape(B, 1, H * T, Dc), c[:, None], c[:, None], view.start, view.end, T, scale,
                        qr.reshape(B, 1, H * T, dR), kr).view(B, H, T, Dc)  # fmt: skip
        assert (out.double() - ref).abs().max().item() < 2e-5, (B, H, T, Dc)


@pytest.mark.parametrize(
    "items, keys, threads, pieces",
    [
        (1, 8192, 2, 4),  # one item a thread would leave a slower core nothing to hand over: 4 of 2048 keys
        (2, 4096, 2, 2),  # 2 items already fill the threads; 4 pieces of 2048 keys balance them
        (1, 4096, 2, 2),  # halves: quarters would be shorter than 2048 keys
        (3, 8192, 2, 4),  # 3 KV heads: 6 items would do, 12 balance better at 2048 keys a piece
        (8, 4096, 2, 1),  # 4 items a thread already
        (12, 8192, 2, 1),
        (1, 1000, 2, 1),  # halves shorter than MIN_SPLIT_KEYS: not split
        (1, 8192, 1, 1),  # one thread: nothing to balance, a split only costs its merge
        (1, 8192, 3, 3),  # thirds: sixths would be shorter than 2048 keys
    ],
)
def test_split_count_balances_threads_with_long_pieces(items, keys, threads, pieces):
    """The key axis is split so that each thread has items to hand over (csrc/steal.h), never into pieces shorter
    than 2048 keys for that alone, and the items stay a multiple of the threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        zero = torch.zeros(1, dtype=torch.int32)
        got = kernels.split_count(items, keys, zero, zero)
    finally:
        torch.set_num_threads(before)
    assert got == pieces
    assert (items * got) % threads == 0 or got == 1


def test_pool_and_argument_shapes_are_checked_by_the_extension():
    """The extension's op itself (not only kvlm.kernels' views) refuses shapes it would read past: a page axis that
    is not the page size, short scales, a RoPE pool or value pool with fewer pages, q_rope rows unlike q's, no new
    tokens, a 1-D block table. One clear error each, never a read outside a tensor."""
    require_kernels()
    ext = kcpu.extension()
    B, N, P, D, dR = 2, 4, 8, 16, 8
    q, qr = torch.randn(B, 1, 3, D), torch.randn(B, 1, 3, dR)
    pool, kr = torch.randn(N, 1, P, D), torch.randn(N, P, dR)
    table = torch.arange(N, dtype=torch.int32).view(B, 2)
    start, end = torch.zeros(B, dtype=torch.int32), torch.full((B,), 2 * P, dtype=torch.int32)
    q8, s8 = quantize(pool, torch.int8)

    def call(**kw):
        a = dict(q=q, q_rope=qr, k_pool=pool, k_scale=None, v_pool=pool, v_scale=None, kr_pool=kr,
                 block_table=table, start=start, end=end, page_size=P, n_new=1, scale=0.1, n_split=1)  # fmt: skip
        a.update(kw)
        return ext.decode_attention(*a.values())

    ref = call()
    assert torch.allclose(call(k_pool=q8, k_scale=s8, v_pool=q8, v_scale=s8), ref, atol=0.05)
    bad = {
        "page axis .size 8. is not the page size 16": dict(page_size=2 * P, table=None),
        "cache scales must be": dict(k_pool=q8, k_scale=s8[:, :, :4], v_pool=q8, v_scale=s8[:, :, :4]),
        "kr_pool must have k_pool's 4 pages": dict(kr_pool=kr[:2]),
        "v_pool must have k_pool's 4 pages": dict(v_pool=pool[:2]),
        "q_rope must be": dict(q_rope=qr[:, :, :2]),
        "n_new must be >= 1": dict(n_new=0),
        "block_table must be": dict(block_table=table.flatten()),
    }
    for message, kw in bad.items():
        if kw.pop("table", 1) is None:  # the end fits pages of 2 P; the pool's are shorter
            kw["block_table"] = table[:, :1]
        with pytest.raises(RuntimeError, match=message):
            call(**kw)
