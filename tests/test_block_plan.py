"""The decoder block's one-call plan (kvlm.model.Block.one_call) is built once and kept across decode steps, and
rebuilt, or given up for the modules, whenever something it was built from changes (kvlm.attention.watch): a
weight replaced, written in place, swapped under its module or behind it, a norm's eps changed, a module
replaced, a hook added. After each change a fresh decode must give the logits of the full forward (the modules)
of the changed model; a plan kept stale computes with the old weights, the old eps or stale panels."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import require_kernels, tiny_config
from torch import nn

from kvlm import build_model, kernels
from kvlm.attention.linear import PANELS, Linear
from kvlm.kernels import cpu as kcpu
from kvlm.kernels.few_rows import panels_available
from kvlm.model import Block

MLA = dict(kv_lora_rank=64, rope_head_dim=16)


@pytest.fixture(autouse=True)
def built():
    require_kernels()
    if not hasattr(kcpu.extension(), "gqa_block") or not hasattr(kcpu.extension(), "mla_block"):
        pytest.skip("neither AVX-512 nor AVX2: the block kernel is built on the few-row products")


def _model(attention, extra, panels=True):
    torch.manual_seed(0)
    cfg = tiny_config(attention, d_model=128, n_head=4, ffn_dim=192, vocab_size=101, **extra)
    model = build_model(cfg).eval().prepare_for_inference()
    if panels and panels_available():  # generate's layout at a few rows on AVX-512: a stale plan would read
        assert model.pack_for_decode(PANELS) > 0  # panels of the old weights (AVX2 has none: the plain weights)
    return model


def _decode(model, tokens, prompt_len, mode):
    """Logits of each one-token decode call after a prefill, and how many blocks ran as one call."""
    cache = model.new_cache(tokens.shape[0], 32)
    with torch.inference_mode():
        model(tokens[:, :prompt_len], cache, mode=mode)
        kernels.CALLS.clear()  # the decode calls' (a prefill of at most FEW_ROWS rows takes the blocks too)
        out = [model(tokens[:, t : t + 1], cache, mode=mode) for t in range(prompt_len, tokens.shape[1])]
    return torch.cat(out, 1), kernels.CALLS["gqa_block"] + kernels.CALLS["mla_block"]


def _scaled(w: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(w.detach() * 1.5, requires_grad=w.requires_grad)


def _in_place(model):
    with torch.no_grad():
        model.layers[0].mlp.w1.weight.mul_(1.5)


def _reassigned(model):
    model.layers[0].mlp.w2.weight = _scaled(model.layers[0].mlp.w2.weight)


def _behind_the_module(model):  # as torch.func.functional_call swaps parameters: the dict written directly
    wo = model.layers[0].attn.wo
    wo._parameters["weight"] = _scaled(wo.weight)


def _data_swapped(model):
    w = model.layers[0].mlp.wo.weight
    w.data = w.data * 1.5


def _eps(model):
    model.layers[0].attn_norm.eps = model.layers[0].mlp_norm.eps = 0.5


def _module_replaced(model):
    old = model.layers[0].mlp.w1
    new = Linear(old.in_features, old.out_features, bias=False)
    with torch.no_grad():
        new.weight.copy_(old.weight * 1.5)
    model.layers[0].mlp.w1 = new


CHANGES = [_in_place, _reassigned, _behind_the_module, _data_swapped, _eps, _module_replaced]


@pytest.mark.parametrize("attention,extra", [("gqa", dict(n_kv_head=2)), ("mla", MLA)])
def test_a_plan_is_built_once_a_block_and_kept(monkeypatch, attention, extra):
    model = _model(attention, extra)
    built = []
    plan = Block.one_call_plan
    monkeypatch.setattr(Block, "one_call_plan", lambda self: built.append(self) or plan(self))
    tokens = torch.randint(0, 101, (3, 9), generator=torch.Generator().manual_seed(1))
    mode = "absorbed" if attention == "mla" else "auto"
    _, fused = _decode(model, tokens, 4, mode)
    assert fused == 5 * model.cfg.n_layer
    assert sorted(map(id, built)) == sorted(map(id, model.layers))  # once each, not once a step
    _decode(model, tokens, 4, mode)
    assert len(built) == model.cfg.n_layer


@pytest.mark.parametrize("change", CHANGES, ids=lambda f: f.__name__.strip("_"))
@pytest.mark.parametrize("attention,extra", [("gqa", dict(n_kv_head=2)), ("mla", MLA)])
def test_a_plan_follows_the_changes_of_its_block(attention, extra, change):
    model = _model(attention, extra)
    tokens = torch.randint(0, 101, (3, 9), generator=torch.Generator().manual_seed(2))
    mode = "absorbed" if attention == "mla" else "auto"
    before, fused = _decode(model, tokens, 4, mode)  # plans built and kept
    assert fused == 5 * model.cfg.n_layer
    change(model)
    got, fused = _decode(model, tokens, 4, mode)
    # the changed layer in one call too: its panels stale, its products on the plain weights (as its modules)
    assert fused == 5 * model.cfg.n_layer
    with torch.inference_mode():
        want = model(tokens)[:, 4:]
    assert not torch.allclose(want, before, rtol=1e-3, atol=1e-3)  # the change shows in the logits
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)


def test_a_hook_added_after_the_plan_fires():
    model = _model("gqa", dict(n_kv_head=2), panels=False)
    tokens = torch.zeros(1, 5, dtype=torch.long)
    _decode(model, tokens, 3, "auto")
    seen = []
    handle = model.layers[0].mlp.w1.register_forward_hook(lambda m, a, out: seen.append(out.shape))
    try:
        _, fused = _decode(model, tokens, 3, "auto")
    finally:
        handle.remove()
    assert len(seen) == 3 and fused == 2 * (model.cfg.n_layer - 1)  # prefill and two steps; layer 0 module by module
    _, fused = _decode(model, tokens, 3, "auto")
    assert fused == 2 * model.cfg.n_layer  # the hook removed: one call again


def test_a_copy_carries_no_plan_of_the_original():
    """``copy.deepcopy`` of a model whose blocks hold plans: the copy computes with its own weights, however the
    original's change afterwards."""
    model = _model("gqa", dict(n_kv_head=2))  # the copy's panels are keyed on the original's weights: stale
    tokens = torch.randint(0, 101, (3, 8), generator=torch.Generator().manual_seed(3))
    _decode(model, tokens, 4, "auto")
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.5)
    got, fused = _decode(twin, tokens, 4, "auto")
    assert fused == 4 * twin.cfg.n_layer
    with torch.inference_mode():
        torch.testing.assert_close(got, twin(tokens)[:, 4:], rtol=2e-5, atol=2e-5)


def test_a_model_built_under_inference_mode_keeps_its_plans(monkeypatch):
    """Inference tensors have no version counter: their data pointers and identities are still checked."""
    built = []
    plan = Block.one_call_plan
    monkeypatch.setattr(Block, "one_call_plan", lambda self: built.append(self) or plan(self))
    with torch.inference_mode():
        model = _model("mla", MLA)
        tokens = torch.randint(0, 101, (3, 8), generator=torch.Generator().manual_seed(4))
        got, fused = _decode(model, tokens, 4, "absorbed")
        assert fused == 4 * model.cfg.n_layer and len(built) == model.cfg.n_layer
        torch.testing.assert_close(got, model(tokens)[:, 4:], rtol=2e-5, atol=2e-5)
        _reassigned(model)
        got, _ = _decode(model, tokens, 4, "absorbed")
        torch.testing.assert_close(got, model(tokens)[:, 4:], rtol=2e-5, atol=2e-5)
