"""The decode kernel of GLA-2/4 and MLRA-2/4 (kvlm.kernels.latent_block_decode, wired into
LatentBlockAttention.forward_absorbed): each latent block attended by its r units plus the shared RoPE key, the
cache read in place (contiguous buffer, pages of any size, int8 codes with one scale per token and block). Also
GTA and MFA, whose decode runs kvlm.kernels.gqa_decode (GTA: keys tied to the cached values plus the shared RoPE
key).

Checked against a float64 reference written here from the definition, against kvlm's plain path (kernels off:
split_score_attention over the gathered cache) in float32 and float64, and against the full causal forward
without a cache; the call counters prove the kernel ran (a silent fallback to the plain path fails)."""

import math
import os
import subprocess
import sys

import pytest
import torch
from conftest import require_kernels, tiny_config

from kvlm import build_model, kernels
from kvlm.cache import PagedKVCache
from kvlm.cache.layer import BlockView
from kvlm.cache.quantized import fp8_dtype, quantize
from kvlm.kernels import KernelUnavailable
from kvlm.kernels import cpu as kcpu

LATENT = ["gla-2", "gla-4", "mlra-2", "mlra-4"]
COUNTER = "latent_block_cpu"


@pytest.fixture(scope="module", autouse=True)
def built():
    require_kernels()


# --- the kernel alone, against the definition ----------------------------------------------------------------


def reference(q, q_rope, c, k_rope, start, end, T, scale):
    """float64 from the definition: q (B, G, R, T, D), q_rope (B, G, R, T, d_R) or None, c (B, G, S, D) the
    logical latent blocks, k_rope (B, S, d_R); new token t of sequence b sees slots [start_b, end_b - T + t] (its
    own slot only if that range is empty)."""
    B, G, R, _, D = q.shape
    out = torch.zeros(B, G, R, T, D, dtype=torch.float64)
    for b in range(B):
        for t in range(T):
            own = int(end[b]) - T + t
            keys = torch.arange(min(int(start[b]), own), own + 1)
            for g in range(G):
                cb = c[b, g, keys].double()  # (n, D)
                s = q[b, g, :, t].double() @ cb.T  # (R, n)
                if q_rope is not None:
                    s = s + q_rope[b, g, :, t].double() @ k_rope[b, keys].double().T
                out[b, g, :, t] = torch.softmax(s * scale, dim=-1) @ cb
    return out


def shuffled_table(B, S, page_size, gen):
    """A block table of shuffled pages (B, ceil(S / P)) over a pool with one spare page, and the pool's size."""
    n = math.ceil(S / page_size)
    return torch.randperm(B * n + 1, generator=gen)[: B * n].view(B, n).to(torch.int32), B * n + 1


def on_pages(x, table, page_size, n_pages):
    """x (B, [G,] S, D) -> a pool (N, [G,] P, D) holding sequence b's slot j at page table[b, j // P]."""
    B, S = x.shape[0], x.shape[-2]
    pool = torch.zeros(n_pages, *x.shape[1:-2], page_size, x.shape[-1], dtype=x.dtype)
    for b in range(B):
        for j in range(S):
            pool[table[b, j // page_size], ..., j % page_size, :] = x[b, ..., j, :]
    return pool


CASES = [  # (B, G blocks, R units per block, T, D = d_lat, d_R, page size (None: contiguous), int8)
    (2, 2, 4, 1, 16, 8, None, False),  # GLA-2 shape
    (3, 4, 3, 2, 24, 8, 1, False),  # GLA-4, page size 1
    (2, 4, 12, 3, 64, 32, 3, False),  # MLRA-4 at the reference shape's block width, page size 3
    (3, 4, 6, 4, 20, 0, 16, False),  # MLRA-2, no RoPE
    (2, 4, 12, 1, 64, 32, 16, True),  # int8 pages
    (3, 2, 5, 4, 17, 8, None, True),  # int8, contiguous, odd width
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("B,G,R,T,D,dR,P,int8", CASES)
def test_block_kernel_matches_definition(B, G, R, T, D, dR, P, int8, dtype):
    """Ragged lengths (and left padding in the contiguous case), T = 1..4 new tokens, paged or not, int8."""
    gen = torch.Generator().manual_seed(B * 100 + G * 10 + T)
    S = 40
    ends = torch.tensor([S - 7 * b for b in range(B)], dtype=torch.int32)
    c = torch.randn(B, G, S, D, generator=gen, dtype=dtype)
    k_rope = torch.randn(B, S, dR, generator=gen, dtype=dtype) if dR else None
    q = torch.randn(B, G, R, T, D, generator=gen, dtype=dtype)
    q_rope = torch.randn(B, G, R, T, dR, generator=gen, dtype=dtype) if dR else None
    codes = scale = None
    if int8:
        codes, scale = quantize(c, torch.int8)  # one scale per token and block, as the paged cache stores
        c = (codes.double() * scale.double()).to(dtype)
    if P is None:  # one page per sequence, left padding 0, 3, 6, ...
        start = torch.tensor([3 * b for b in range(B)], dtype=torch.int32)
        table = torch.arange(B, dtype=torch.int32)[:, None]
        pool, spool, krpool, page = (codes if int8 else c), scale, k_rope, S
    else:
        start = torch.zeros(B, dtype=torch.int32)
        table, n_pages = shuffled_table(B, S, P, gen)
        pool = on_pages(codes if int8 else c, table, P, n_pages)
        spool = on_pages(scale, table, P, n_pages) if int8 else None
        krpool = on_pages(k_rope, table, P, n_pages) if dR else None
        page = P
    c_view = BlockView(pool, table, start, ends, page, spool)
    kr_view = BlockView(krpool, table, start, ends, page) if dR else None
    before = kernels.CALLS[COUNTER]
    z = kernels.latent_block_decode(q, q_rope, c_view, kr_view, T, 0.3, strict=True)
    assert kernels.CALLS[COUNTER] == before + 1
    ref = reference(q, q_rope, c, k_rope, start, ends, T, 0.3)
    tol = 1e-12 if dtype == torch.float64 else 2e-5
    assert (z.double() - ref).abs().max().item() < tol


def test_block_kernel_declines_with_a_reason():
    """What it cannot read is declined (None), with the reason under strict; the caller's plain path runs."""
    B, G, R, T, D = 1, 2, 3, 1, 8
    table, start = torch.zeros(1, 1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    end = torch.full((1,), 4, dtype=torch.int32)
    q = torch.randn(B, G, R, T, D)
    flat = BlockView(torch.randn(1, 4, D), table, start, end, 4)  # MLA's layout, no block axis
    assert kernels.latent_block_decode(q, None, flat, None, T, 0.5) is None
    with pytest.raises(KernelUnavailable, match="for 2 latent blocks of 8"):
        kernels.latent_block_decode(q, None, flat, None, T, 0.5, strict=True)
    grouped = BlockView(torch.randn(1, G, 4, D), table, start, end, 4)
    grouped_rope = BlockView(torch.randn(1, 2, 4, 4), table, start, end, 4)
    with pytest.raises(KernelUnavailable, match="grouped or quantized RoPE"):
        kernels.latent_block_decode(q, torch.randn(B, G, R, T, 4), grouped, grouped_rope, T, 0.5, strict=True)
    with pytest.raises(KernelUnavailable, match="17 new tokens"):
        kernels.latent_block_decode(torch.randn(B, G, R, 17, D), None, grouped, None, 17, 0.5, strict=True)
    assert kernels.latent_block_decode(q, None, grouped, None, T, 0.5, strict=True) is not None


# --- the model: kernel route against the plain path and the full forward ----------------------------------------


# (attention, config, kernel counter, mode): the latent-block family's absorbed route, and the two other
# mechanisms whose decode is MQA-style attention the same kernel runs: GTA (keys = the first d_h - d_h^R columns
# of the cached V heads plus the shared RoPE key) and MFA (one K and one V head)
MODELS = [
    *[(a, dict(kv_lora_rank=32, rope_head_dim=8, q_lora_rank=24), COUNTER, "absorbed") for a in LATENT],
    ("gta", dict(n_kv_head=2, rope_head_dim=8), "gqa_cpu", "auto"),
    ("mfa", dict(q_lora_rank=16), "gqa_cpu", "auto"),
]
MODEL_IDS = [m[0] for m in MODELS]


def _model(attention, dtype, extra=None):
    torch.manual_seed(0)
    extra = extra or dict(kv_lora_rank=32, rope_head_dim=8, q_lora_rank=24)
    cfg = tiny_config(attention, **extra)
    model = build_model(cfg).to(dtype).eval()
    with torch.no_grad():  # norms away from 1, so a wrong block's weight shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


# prefill of 5, then steps of T = 1, 2, 3, 4, 1 new tokens (the kernel takes every one of them)
CHUNKS = (1, 2, 3, 4, 1)


def _decode_contiguous(model, tokens, mode, pad=None):
    cache = model.new_cache(tokens.shape[0], tokens.shape[1])
    if pad is not None:
        cache.set_left_padding(pad)
    out, i = [model(tokens[:, :5], cache=cache, mode=mode)], 5
    for n in CHUNKS:
        out.append(model(tokens[:, i : i + n], cache=cache, mode=mode))
        i += n
    return torch.cat(out, dim=1)


@pytest.mark.parametrize("attention,extra,counter,mode", MODELS, ids=MODEL_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_contiguous_decode_kernel_equals_plain_and_full_forward(
    attention, extra, counter, mode, dtype, monkeypatch
):
    """Left-padded batch; decode with the kernel = the plain path (kernels off) = the full causal forward without
    a cache (float64: 1e-10). The kernel runs once per layer and call, and never with kernels off."""
    model = _model(attention, dtype, extra)
    tokens = torch.randint(1, 97, (2, 5 + sum(CHUNKS)))
    pad = [0, 2]
    runs = {}
    with torch.no_grad():
        for flag in ("1", "0"):
            monkeypatch.setenv(kcpu.ENV, flag)
            before = kernels.CALLS[counter]
            runs[flag] = _decode_contiguous(model, tokens, mode, pad), kernels.CALLS[counter] - before
        full = model(tokens[:1])  # sequence 0 has no padding: its full forward is the reference
    (on, calls_on), (off, calls_off) = runs["1"], runs["0"]
    # the 5-token prefill too (5 <= MAX_NEW new tokens), then every chunk
    assert calls_on == model.cfg.n_layer * (1 + len(CHUNKS)) and calls_off == 0
    tol = 1e-10 if dtype == torch.float64 else 2e-5
    torch.testing.assert_close(on, off, rtol=tol, atol=tol)
    torch.testing.assert_close(on[:1], full, rtol=tol, atol=tol)


@pytest.mark.parametrize("attention", LATENT)
def test_auto_decode_takes_the_kernel(attention, monkeypatch):
    """The default mode: a prefill into an empty cache expands (no kernel), every decode step absorbs through the
    kernel; the output equals kernels off."""
    model = _model(attention, torch.float32)
    prompt = torch.randint(1, 97, (3, 7))
    outs = []
    with torch.no_grad():
        for flag in ("1", "0"):
            monkeypatch.setenv(kcpu.ENV, flag)
            before = kernels.CALLS[COUNTER]
            cache = model.new_cache(3, 12)
            out = [model(prompt, cache=cache)]
            for t in range(4):
                out.append(model(prompt[:, t : t + 1], cache=cache))
            outs.append((torch.cat(out, 1), kernels.CALLS[COUNTER] - before))
    (on, calls), (off, _) = outs
    assert calls == 4 * model.cfg.n_layer
    torch.testing.assert_close(on, off, rtol=2e-5, atol=2e-5)


LENGTHS = (5, 11, 2)


def _paged_run(model, prompts, steps, page_size, kv_dtype, mode="absorbed"):
    cache = PagedKVCache.for_model(model, cache_tokens=160, page_size=page_size, kv_dtype=kv_dtype)
    ids = list(range(len(prompts)))
    out = [[] for _ in ids]
    for i, p in enumerate(prompts):
        cache.add_sequence(i)
        out[i].append(model(p[None], cache=cache.batch([i]), mode=mode)[0])
    for s, n_new in steps:
        logits = model(s, cache=cache.batch(ids, n_new), mode=mode)
        for i in ids:
            k = s.shape[1] if n_new is None else n_new[i]
            out[i].append(logits[i, s.shape[1] - k :])
    return [torch.cat(o) for o in out]


def _steps(vocab, gen):
    """Ragged decode script: T = 1, 2, 3, 4 for all sequences, then a padded step (1, 3, 2 real tokens)."""
    steps = [(torch.randint(1, vocab, (len(LENGTHS), n), generator=gen), None) for n in (1, 2, 3, 4)]
    steps.append((torch.randint(1, vocab, (len(LENGTHS), 3), generator=gen), [1, 3, 2]))
    return steps


@pytest.mark.parametrize("attention,extra,counter,mode", MODELS, ids=MODEL_IDS)
@pytest.mark.parametrize("page_size", [1, 3, 16])
@pytest.mark.parametrize("kv_dtype", [None, "int8"])
def test_paged_decode_kernel_equals_plain(attention, extra, counter, mode, page_size, kv_dtype, monkeypatch):
    """Paged cache, sequences of different lengths in one batch, T = 1..4 and a padded step: the kernel reading
    the pages (and int8 codes and scales) in place equals the plain path that gathers and dequantizes them, in
    float64 (1e-10) and float32 (page size 16); and without int8 both equal each sequence decoded alone (the full forward)."""
    gen = torch.Generator().manual_seed(page_size)
    # float64 everywhere (the exactness check), float32 (the serving dtype) once per model and cache dtype
    for dtype in (torch.float64, torch.float32) if page_size == 16 else (torch.float64,):
        model = _model(attention, dtype, extra)
        prompts = [torch.randint(1, 97, (n,), generator=gen) for n in LENGTHS]
        steps = _steps(97, gen)
        runs = {}
        with torch.no_grad():
            for flag in ("1", "0"):
                monkeypatch.setenv(kcpu.ENV, flag)
                before = kernels.CALLS[counter]
                out = _paged_run(model, prompts, steps, page_size, kv_dtype, mode)
                runs[flag] = out, kernels.CALLS[counter] - before
        (on, calls_on), (off, calls_off) = runs["1"], runs["0"]
        # every call goes to the kernel: 3 single-sequence prefills (<= MAX_NEW tokens) and 5 batched steps
        assert calls_on == model.cfg.n_layer * (len(LENGTHS) + len(steps)) and calls_off == 0
        tol = 1e-10 if dtype == torch.float64 else 3e-5
        for a, b in zip(on, off):
            torch.testing.assert_close(a, b, rtol=tol, atol=tol)
        if kv_dtype is None and dtype == torch.float64:
            with torch.no_grad():
                for i, got in enumerate(on):  # the reference: sequence i's whole text at once, no cache
                    text = torch.cat([prompts[i]] + [s[i, s.shape[1] - (n[i] if n else s.shape[1]) :]
                                                     for s, n in steps])  # fmt: skip
                    torch.testing.assert_close(got, model(text[None])[0], rtol=1e-10, atol=1e-10)


@pytest.mark.skipif(fp8_dtype() is None, reason="this torch has no float8_e4m3fn")
def test_fp8_pool_is_read_by_the_kernel_as_the_plain_path(monkeypatch):
    """fp8 (e4m3) latent blocks with their per-token scales: the CPU kernel reads the codes in place and gives
    what the plain path (gather, dequantize) gives."""
    model = _model("mlra-4", torch.float32)
    gen = torch.Generator().manual_seed(9)
    prompts = [torch.randint(1, 97, (n,), generator=gen) for n in LENGTHS]
    steps = _steps(97, gen)
    outs, calls = [], []
    with torch.no_grad():
        for flag in ("1", "0"):
            monkeypatch.setenv(kcpu.ENV, flag)
            before = kernels.CALLS[COUNTER]
            outs.append(_paged_run(model, prompts, steps, 4, "fp8"))
            calls.append(kernels.CALLS[COUNTER] - before)
    assert calls[0] > 0 and calls[1] == 0
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


# --- the CUDA branch's building block, on CPU in Triton's interpreter --------------------------------------------

_TRITON_SCRIPT = r"""
import torch
from kvlm.cache.layer import BlockView
from kvlm import kernels
from kvlm.cache.quantized import quantize
g = torch.Generator().manual_seed(3)
B, G, R, T, D, dR, P, S = 2, 4, 3, 2, 16, 8, 4, 10
c = torch.randn(B, G, S, D, generator=g)
codes, scale = quantize(c, torch.int8)
kr = torch.randn(B, S, dR, generator=g)
q = torch.randn(B, G, R, T, D, generator=g); qr = torch.randn(B, G, R, T, dR, generator=g)
n = -(-S // P)
table = torch.arange(B * n, dtype=torch.int32).flip(0).view(B, n).contiguous()
pool = torch.zeros(B * n, G, P, D, dtype=torch.int8); spool = torch.zeros(B * n, G, P, 1); krp = torch.zeros(B * n, P, dR)
for b in range(B):
    for j in range(S):
        pool[table[b, j // P], :, j % P] = codes[b, :, j]; spool[table[b, j // P], :, j % P] = scale[b, :, j]
        krp[table[b, j // P], j % P] = kr[b, j]
start = torch.zeros(B, dtype=torch.int32); end = torch.tensor([S, S - 3], dtype=torch.int32)
deq = codes.double() * scale.double()
worst = 0.0
# the CUDA branch of kernels.latent_block_decode, on CPU tensors (the interpreter runs them)
zz = kernels._latent_block_triton(q, qr, BlockView(pool, table, start, end, P, spool),
                                  BlockView(krp, table, start, end, P), 0.3, True)
assert kernels.CALLS["latent_triton"] == G, kernels.CALLS
for blk in range(G):
    z = zz[:, blk]
    for b in range(B):
        for t in range(T):
            own = int(end[b]) - T + t
            keys = torch.arange(0, own + 1)
            s = q[b, blk, :, t].double() @ deq[b, blk, keys].T + qr[b, blk, :, t].double() @ kr[b, keys].double().T
            ref = torch.softmax(0.3 * s, -1) @ deq[b, blk, keys]
            worst = max(worst, (z[b, :, t].double() - ref).abs().max().item())
print("WORST", worst)
"""


def test_triton_reads_a_latent_block_through_its_strided_view():
    """On CUDA latent_block_decode runs the Triton kernel once per block on pool[:, g] (a strided view, int8
    scales too): that branch checked in Triton's interpreter on CPU, in a fresh process (the interpreter must be
    chosen before triton is first imported). No GPU was available to run it on CUDA itself."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    res = subprocess.run([sys.executable, "-c", _TRITON_SCRIPT], env=env, capture_output=True, text=True,
                         timeout=300)  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    worst = float(res.stdout.split("WORST")[-1])
    assert worst < 1e-4
