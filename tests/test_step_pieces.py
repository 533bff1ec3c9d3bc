"""Small pieces of the decode step made cheaper (issue 15, "the rest of the step"): the one-pass RMSNorm of the CPU
extension (kvlm.kernels.rms_norm) against torch's in float64, where it applies and where it declines, and that the
model's decode step takes it; the Dropout that skips aten's call when it drops nothing."""

import pytest
import torch
import torch.nn.functional as F
from conftest import require_kernels, tiny_config

import kvlm.attention.norm
from kvlm import build_model, kernels
from kvlm.kernels import cpu as kcpu
from kvlm.model import Dropout, RMSNorm


def test_dropout_drops_in_training_and_is_the_identity_otherwise():
    x = torch.ones(4000)
    d = Dropout(0.25).train()
    torch.manual_seed(0)
    y = d(x)
    kept = y != 0
    assert 0.6 < kept.float().mean().item() < 0.9  # about 3 in 4 kept
    assert torch.allclose(y[kept], torch.full_like(y[kept], 1 / 0.75))  # rescaled as torch's
    torch.manual_seed(0)
    assert torch.equal(y, torch.nn.functional.dropout(x, 0.25, True))  # the same draws as torch's
    assert d.eval()(x) is x and Dropout(0.0).train()(x) is x


def _reference(x, w, eps):
    return F.rms_norm(x.double(), (x.shape[-1],), w.double(), eps)


@pytest.mark.parametrize("shape", [(1, 1, 768), (8, 1, 256), (3, 5, 7), (2, 300, 64), (17,)])
def test_equals_float64_reference(shape):
    require_kernels()
    torch.manual_seed(0)
    x, w = 3 * torch.randn(shape), torch.randn(shape[-1])
    with torch.inference_mode():
        y = kernels.rms_norm(x, w, 1e-5)
    assert y.dtype == torch.float32 and y.shape == x.shape
    ref = _reference(x, w, 1e-5)
    assert (y.double() - ref).abs().max().item() < 2e-6 * ref.abs().max().item()


def test_rows_split_over_threads_equal_one_thread():
    require_kernels()
    """Enough rows that the extension splits them over the threads (the suite runs at 1 thread)."""
    x, w = torch.randn(4096, 96), torch.randn(96)
    saved = torch.get_num_threads()
    try:
        with torch.inference_mode():
            one = kernels.rms_norm(x, w, 1e-6)
            torch.set_num_threads(2)
            two = kernels.rms_norm(x, w, 1e-6)
    finally:
        torch.set_num_threads(saved)
    assert torch.equal(one, two)
    assert (one.double() - _reference(x, w, 1e-6)).abs().max().item() < 1e-5


def test_non_contiguous_input_and_eps():
    require_kernels()
    x = torch.randn(6, 40)[:, ::2]  # stride 2 in the normalised axis
    w = torch.randn(20)
    tiny = 1e-3 * x  # eps matters when the mean square is this small
    with torch.inference_mode():
        for t in (x, tiny):
            y = kernels.rms_norm(t, w, 1e-4)
            assert (y.double() - _reference(t, w, 1e-4)).abs().max().item() < 1e-5


def test_float64_in_the_extension_matches_torch():
    require_kernels()
    """The extension's double path (the Python entry sends only float32 there) equals torch's to rounding."""
    x, w = torch.randn(5, 33, dtype=torch.float64), torch.randn(33, dtype=torch.float64)
    y = kcpu.extension().rms_norm(x, w, 1e-5)
    assert (y - _reference(x, w, 1e-5)).abs().max().item() < 1e-13


def test_declines_where_it_does_not_apply(monkeypatch):
    require_kernels()
    x, w = torch.randn(2, 8), torch.randn(8)
    assert kernels.rms_norm(x.double(), w.double(), 1e-5) is None  # float64: the reference path
    wg = torch.randn(8, requires_grad=True)
    assert kernels.rms_norm(x, wg, 1e-5) is None  # autograd recording: torch's op, which has a backward
    with torch.no_grad():
        assert kernels.rms_norm(x, wg, 1e-5) is not None
    monkeypatch.setenv(kcpu.ENV, "0")
    with torch.inference_mode():
        assert kernels.rms_norm(x, w, 1e-5) is None


def test_bad_weight_is_one_clear_error():
    require_kernels()
    with pytest.raises(RuntimeError, match="weight must be"):
        kcpu.extension().rms_norm(torch.randn(2, 8), torch.randn(7), 1e-5)


def test_module_uses_it_at_inference_and_trains_through_torch():
    require_kernels()
    norm = RMSNorm(16)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(16))
    x = torch.randn(3, 16)
    before = kernels.NORM_CALLS["rms_norm_cpu"]
    with torch.inference_mode():
        y = norm(x)
    assert kernels.NORM_CALLS["rms_norm_cpu"] == before + 1
    assert (y.double() - _reference(x, norm.weight.detach(), norm.eps)).abs().max().item() < 1e-5
    out = norm(x)  # grad enabled, a trainable weight: torch's op, gradients flow
    out.sum().backward()
    assert kernels.NORM_CALLS["rms_norm_cpu"] == before + 1 and norm.weight.grad is not None


def test_decode_step_takes_it_and_equals_the_plain_path(monkeypatch):
    require_kernels()
    torch.manual_seed(0)
    model = build_model(tiny_config("mla", kv_lora_rank=16, rope_head_dim=8)).eval()
    tokens = torch.randint(0, model.cfg.vocab_size, (2, 9))
    with torch.inference_mode():
        before = kernels.NORM_CALLS["rms_norm_cpu"]
        fused = model(tokens)
        # every norm of the step: two per block, the latent's kv_norm in each block, the final one
        assert kernels.NORM_CALLS["rms_norm_cpu"] - before >= 3 * model.cfg.n_layer + 1
        monkeypatch.setattr(kvlm.attention.norm, "one_pass_rms_norm", lambda *a: None)
        plain = model(tokens)
    assert (fused - plain).abs().max().item() < 1e-4
