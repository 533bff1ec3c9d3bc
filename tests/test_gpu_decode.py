"""Whole-model decode on a GPU (marked ``gpu``: run with ``pytest -m gpu``; CI has no GPU).

The cached decode route on CUDA (MLA absorbed through the Triton kernel, MLRA's blocks, MHA / GQA through SDPA)
equals the full forward, and a decode step captured in a CUDA graph (what ``benchmarks/gpu_costmodel.py`` times,
and what a serving loop on a GPU replays) gives the eager step's logits: the step reads nothing back to the host.
"""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_config

from kvlm import build_model, kernels

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

CASES = {
    "mha": dict(),
    "gqa": dict(n_kv_head=2),
    "mla": dict(kv_lora_rank=32, rope_head_dim=16),
    "mlra-2": dict(kv_lora_rank=32, rope_head_dim=16),
}


def _model(attention: str, dtype: torch.dtype):
    torch.manual_seed(0)
    cfg = tiny_config(attention, n_layer=2, d_model=128, n_head=4, max_seq_len=256, **CASES[attention])
    return build_model(cfg, device="cuda", dtype=dtype).eval().prepare_for_inference()


@pytest.mark.parametrize("attention", list(CASES))
def test_cached_decode_equals_full_forward_on_cuda(attention):
    model = _model(attention, torch.float32)
    tokens = torch.randint(0, 97, (3, 150), device="cuda")
    before = kernels.CALLS.get("latent_triton", 0)
    with torch.inference_mode():
        full = model(tokens)
        cache = model.new_cache(3, 160)
        model(tokens[:, :140], cache=cache)
        steps = [model(tokens[:, t : t + 1], cache=cache)[:, -1] for t in range(140, 150)]
    torch.testing.assert_close(torch.stack(steps, 1), full[:, 140:], rtol=2e-3, atol=2e-3)
    if attention.startswith("ml"):
        assert kernels.CALLS.get("latent_triton", 0) > before  # the Triton kernel ran, not the plain path


@pytest.mark.parametrize("attention", list(CASES))
def test_decode_step_replays_from_a_cuda_graph(attention):
    model = _model(attention, torch.bfloat16)
    tokens = torch.randint(0, 97, (2, 1), device="cuda")
    with torch.inference_mode():
        cache = model.new_cache(2, 130)
        cache.set_left_padding([0, 5])
        model(torch.randint(0, 97, (2, 120), device="cuda"), cache=cache)
        eager = model(tokens, cache=cache)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            cache.length = 120
            model(tokens, cache=cache)  # warm-up (Triton's compile, SDPA's choice) outside the capture
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        cache.length = 120
        with torch.cuda.graph(graph):
            out = model(tokens, cache=cache)
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
    torch.testing.assert_close(out, eager, rtol=1e-2, atol=1e-2)  # bf16; a stale or empty replay is far off
