"""The Triton absorbed-latent decode kernel (kvlm.kernels.triton_decode) against a float64 reference.

On CPU the kernel runs in Triton's interpreter (TRITON_INTERPRET=1, set before triton is imported), so CI checks
the kernel's indexing, paging, masking, quantisation and split merge without a GPU. Shapes stay small because
interpretation is slow (if triton was already imported without the interpreter, they run in a fresh process).
The GPU tests (marked ``gpu``) use real sizes (128 heads, 512 + 64, 9K tokens) with the default launch configs,
in bf16, fp16 and fp32, and int8 / fp8 pools.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from dataclasses import astuple

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    # triton decorates its own helpers (tl.zeros, tl.cdiv) for the interpreter only if this is set when triton is
    # first imported, and a kernel when it is decorated: so before both imports
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")

import kvlm.kernels.triton_decode as triton_decode  # noqa: E402
from kvlm.attention.latent_ops import latent_attention  # noqa: E402
from kvlm.attention.step import Step  # noqa: E402
from kvlm.cache.layer import BlockView, ContiguousLayer  # noqa: E402
from kvlm.kernels.triton_decode import Config, choose_splits, latent_decode_paged, latent_decode_triton  # noqa: E402

# Something in this process imported triton before us without the interpreter (torch.compile does): its
# compiled kernels cannot take CPU tensors and it cannot be re-imported, so the CPU tests run in a fresh process.
IN_PROCESS = DEVICE == "cuda" or all(
    type(f).__name__ == "InterpretedFunction"
    for f in (triton.language.zeros, triton_decode._latent_decode_kernel)
)
needs_interpreter = pytest.mark.skipif(
    not IN_PROCESS,
    reason="triton was imported without TRITON_INTERPRET: run by test_cpu_tests_in_a_fresh_process",
)


@pytest.mark.skipif(IN_PROCESS, reason="the tests below run in this process")
def test_cpu_tests_in_a_fresh_process():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "-p", "no:cacheprovider", __file__]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]


def make_case(B, H, T, D, DR, page_size, lengths, dtype=torch.float32, quant=None, seed=0, pad=None):
    """A paged cache holding `lengths[b]` keys for sequence b (new tokens included), its pages shuffled in the
    pool so that logical and physical order differ, plus queries. ``pad[b]`` slots of left padding before the
    keys (start_b = pad[b]) as the contiguous cache has them. Returns a dict of everything the kernel and the
    reference need, on DEVICE."""
    g = torch.Generator().manual_seed(seed)
    pad = pad or [0] * B
    ends = [p + n for p, n in zip(pad, lengths)]
    n_blocks = max(math.ceil(e / page_size) for e in ends)
    n_pages = B * n_blocks + 3  # spare pages that no sequence owns: the kernel must not read them
    perm = torch.randperm(n_pages, generator=g)
    block_table = perm[: B * n_blocks].view(B, n_blocks).to(torch.int32)
    c_kv = torch.randn(n_pages, page_size, D, generator=g, dtype=torch.float64)
    k_rope = torch.randn(n_pages, page_size, DR, generator=g, dtype=torch.float64) if DR else None
    case = dict(block_table=block_table, page_size=page_size, c_kv_scale=None, k_rope_scale=None)
    if quant == "int8":
        # per-token scale = absmax / 127, the values rounded: the reference uses the dequantised values exactly
        def q8(x):
            s = x.abs().amax(-1, keepdim=True).clamp_min(1e-6) / 127
            return (x / s).round().clamp(-127, 127).to(torch.int8), s.float()

        c_kv, case["c_kv_scale"] = q8(c_kv)
        if DR:
            k_rope, case["k_rope_scale"] = q8(k_rope)
    elif quant == "fp8":

        def q8(x):
            s = x.abs().amax(-1, keepdim=True).clamp_min(1e-6) / 448
            return (x / s).to(torch.float8_e4m3fn), s.float()

        c_kv, case["c_kv_scale"] = q8(c_kv)
        if DR:
            k_rope, case["k_rope_scale"] = q8(k_rope)
    else:
        c_kv = c_kv.to(dtype)
        k_rope = k_rope.to(dtype) if DR else None
    case.update(
        q_lat=torch.randn(B, H, T, D, generator=g).to(dtype),
        q_rope=torch.randn(B, H, T, DR, generator=g).to(dtype) if DR else None,
        c_kv_pool=c_kv,
        k_rope_pool=k_rope,
        start=torch.tensor(pad, dtype=torch.int32),
        end=torch.tensor(ends, dtype=torch.int32),
        softmax_scale=1.0 / math.sqrt(D + DR),
    )
    return {k: (v.to(DEVICE) if isinstance(v, torch.Tensor) else v) for k, v in case.items()}


def dequant(pool, scale):
    x = pool.double()
    return x * scale.double() if scale is not None else x


def reference(case):
    """Float64, written from the definition: gather sequence b's keys slot by slot through the block table,
    scores scale (q . c + q_r . k_r), causal among the T new tokens, softmax, weighted sum of the latents."""
    q = case["q_lat"].double().cpu()
    B, H, T, D = q.shape
    c_pool = dequant(case["c_kv_pool"], case["c_kv_scale"]).cpu()
    r_pool = None
    if case["k_rope_pool"] is not None:
        r_pool = dequant(case["k_rope_pool"], case["k_rope_scale"]).cpu()
    bt, P = case["block_table"].cpu(), case["page_size"]
    out = torch.zeros(B, H, T, D, dtype=torch.float64)
    for b in range(B):
        s0, e0 = int(case["start"][b]), int(case["end"][b])
        slots = [(int(bt[b, j // P]), j % P) for j in range(s0, e0)]
        c = torch.stack([c_pool[p, o] for p, o in slots])  # (S, D)
        scores = torch.einsum("htd,sd->hts", q[b], c)
        if r_pool is not None:
            kr = torch.stack([r_pool[p, o] for p, o in slots])
            scores = scores + torch.einsum("htd,sd->hts", case["q_rope"][b].double().cpu(), kr)
        j = torch.arange(s0, e0)
        visible = j[None, :] < (e0 - T + torch.arange(T) + 1)[:, None]  # (T, S)
        scores = (scores * case["softmax_scale"]).masked_fill(~visible, float("-inf"))
        out[b] = torch.softmax(scores, -1) @ c
    return out


def run(case, **config):
    args = {k: v for k, v in case.items()}
    return latent_decode_paged(**args, config=Config(**config) if config else None)


# (B, H, T, D_c, d_R, page size, lengths, left pads, config): every width class of the issue, pages spanning
# tiles and tiles spanning pages, ragged lengths, several splits (the merge kernel), causal T > 1
SHAPES = [
    (2, 4, 1, 64, 32, 16, [37, 20], None, dict(block_m=16, block_n=16, num_splits=1)),
    (2, 3, 2, 96, 0, 1, [19, 26], None, dict(block_m=16, block_n=16, num_splits=2)),
    (1, 16, 1, 200, 64, 64, [90], None, dict(block_m=16, block_n=32, num_splits=3)),
    (3, 1, 4, 512, 64, 16, [23, 9, 40], None, dict(block_m=16, block_n=16, num_splits=2)),
    (2, 5, 3, 64, 64, 7, [31, 17], [4, 0], dict(block_m=16, block_n=16, num_splits=4)),
    (2, 2, 4, 96, 32, 64, [12, 33], [9, 1], dict(block_m=16, block_n=16, num_splits=1)),
    # 18 query rows over blocks of 16: a second, mostly masked row block per sequence
    (2, 6, 3, 64, 32, 16, [30, 21], None, dict(block_m=16, block_n=16, num_splits=2)),
]


@needs_interpreter
@pytest.mark.parametrize("B,H,T,D,DR,P,lengths,pad,config", SHAPES)
def test_kernel_matches_float64_reference(B, H, T, D, DR, P, lengths, pad, config):
    case = make_case(B, H, T, D, DR, P, lengths, pad=pad)
    got = run(case, **config)
    assert got.shape == (B, H, T, D) and got.dtype == torch.float32
    torch.testing.assert_close(got.double().cpu(), reference(case), rtol=1e-4, atol=1e-5)


@needs_interpreter
@pytest.mark.parametrize("quant", ["int8", "fp8"])
def test_quantized_pool_with_per_token_scale(quant):
    case = make_case(2, 4, 2, 96, 32, 16, [29, 18], quant=quant, seed=1)
    got = run(case, block_m=16, block_n=16, num_splits=2)
    torch.testing.assert_close(got.double().cpu(), reference(case), rtol=1e-4, atol=1e-5)


@needs_interpreter
@pytest.mark.parametrize(
    "dtype,quant", [(torch.float16, None), (torch.bfloat16, None), (torch.float16, "int8")]
)
def test_half_inputs_accumulate_in_float32(dtype, quant):
    case = make_case(2, 4, 1, 64, 32, 16, [40, 25], dtype=dtype, quant=quant, seed=2)
    got = run(case, block_m=16, block_n=16, num_splits=2)
    assert got.dtype == dtype
    # inputs are exactly representable; what remains is p rounded to 16 bits for the value product and the
    # output rounding: well inside 1e-2 (a float16 accumulator over 40 keys would not be)
    torch.testing.assert_close(got.double().cpu(), reference(case), rtol=2e-2, atol=1e-2)


@needs_interpreter
def test_splits_merge_to_the_unsplit_result():
    case = make_case(1, 8, 1, 64, 32, 16, [100], seed=3)
    one = run(case, block_m=16, block_n=16, num_splits=1)
    many = run(case, block_m=16, block_n=16, num_splits=5)  # 7 tiles over 5 splits: some splits are empty
    torch.testing.assert_close(many, one, rtol=1e-5, atol=1e-6)


@needs_interpreter
def test_block_view_wrapper_with_default_config():
    """The entry point the dispatch calls: BlockViews (kvlm.cache.layer), default config and splits, default
    softmax scale 1/sqrt(D_c + d_R)."""
    case = make_case(2, 3, 2, 96, 32, 16, [21, 34], seed=4)
    views = [
        BlockView(pool, case["block_table"], case["start"], case["end"], case["page_size"])
        for pool in (case["c_kv_pool"], case["k_rope_pool"])
    ]
    got = latent_decode_triton(case["q_lat"], case["q_rope"], *views)
    torch.testing.assert_close(got.double().cpu(), reference(case), rtol=1e-4, atol=1e-5)


@needs_interpreter
def test_contiguous_layer_block_view_matches_plain_latent_attention():
    """A real contiguous cache layer with left padding, read through its block_view by the kernel, equals
    kvlm's plain path (latent_attention over layer.read with the step's mask) in float32."""
    B, H, T, D, DR, S_max, end = 3, 4, 3, 64, 32, 48, 41
    pad = torch.tensor([0, 5, 17])
    g = torch.Generator().manual_seed(5)
    layer = ContiguousLayer({"c_kv": (D,), "k_rope": (DR,)}, B, S_max, torch.float32, naive=False, pad=pad)
    for buf in layer.buffers.values():
        buf.copy_(torch.randn(buf.shape, generator=g))
    q, q_rope = torch.randn(B, H, T, D, generator=g), torch.randn(B, H, T, DR, generator=g)
    scale = 1.0 / math.sqrt(D + DR)
    step = Step.build(torch.zeros(B, T, dtype=torch.long), start=end - T, pad=pad)
    c_kv, k_rope = layer.read("c_kv", end), layer.read("k_rope", end)
    want = latent_attention(q, q_rope, c_kv, k_rope, c_kv, step, scale)
    views = [layer.block_view(name, step) for name in ("c_kv", "k_rope")]
    views = [
        BlockView(*(x.to(DEVICE) if isinstance(x, torch.Tensor) else x for x in astuple(v))) for v in views
    ]
    got = latent_decode_triton(
        q.to(DEVICE), q_rope.to(DEVICE), *views, scale, config=Config(block_m=16, block_n=16, num_splits=2)
    )
    torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-5)


def test_bad_input_names_the_problem():
    case = make_case(1, 2, 1, 64, 32, 16, [10])
    with pytest.raises(ValueError, match="page_size"):
        run({**case, "page_size": 8})
    with pytest.raises(ValueError, match="d_R"):
        run({**case, "q_rope": case["q_rope"][..., :16]})
    with pytest.raises(ValueError, match="per-token scale"):
        run({**case, "c_kv_pool": case["c_kv_pool"].to(torch.int8)})
    with pytest.raises(ValueError, match="block_table"):
        run({**case, "block_table": case["block_table"][:, :, None]})
    with pytest.raises(ValueError, match="together"):
        run({**case, "q_rope": None})


def test_split_choice_fills_the_gpu_and_keeps_splits_long():
    # 132 SMs, programs of 16 query rows: split until ~8 programs per SM (1056) are in flight ...
    assert choose_splits(1, 1, 1 << 20, 64, 132) == 256  # capped
    assert choose_splits(8, 1, 1 << 20, 64, 132) == 132
    assert choose_splits(512, 1, 1 << 20, 64, 132) == 3
    # ... programs of 64 rows (4x the work per key): ~1 per SM
    assert choose_splits(8, 2, 1 << 20, 64, 132, block_m=64) == 9
    assert choose_splits(132, 1, 1 << 20, 64, 132, block_m=64) == 1
    # ... but never below four tiles (256 keys) per split, and no split once the batch fills the GPU
    assert choose_splits(1, 1, 1024, 64, 132) == 4
    assert choose_splits(1, 1, 100, 64, 132) == 1
    assert choose_splits(2048, 1, 32768, 64, 132) == 1


GPU_SHAPES = [
    (4, 128, 1, 512, 64, 64, [4096, 1000, 17, 2500]),
    (8, 16, 2, 256, 32, 16, [1200, 33, 4000, 777, 64, 5, 2048, 3000]),
    (3, 16, 4, 200, 0, 1, [300, 129, 4]),
    (2, 12, 1, 96, 64, 256, [9000, 77]),
]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("B,H,T,D,DR,P,lengths", GPU_SHAPES)
def test_gpu_default_config(B, H, T, D, DR, P, lengths, dtype):
    case = make_case(B, H, T, D, DR, P, lengths, dtype=dtype, seed=6)
    got = latent_decode_paged(**case)
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got.double().cpu(), reference(case), **tol)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("quant", ["int8", "fp8"])
def test_gpu_quantized(quant):
    case = make_case(4, 128, 1, 512, 64, 64, [4096, 100, 3000, 9], quant=quant, dtype=torch.bfloat16, seed=7)
    got = latent_decode_paged(**case)
    torch.testing.assert_close(got.double().cpu(), reference(case), rtol=2e-2, atol=2e-2)
