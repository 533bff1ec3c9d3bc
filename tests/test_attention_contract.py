"""Every mechanism and option, against the contract: reference equations, causality, gradients,
incremental decode == full forward, ragged batches == alone, cache bytes == accounting."""

import pytest
import torch
from conftest import all_variants, tiny_config

from kvlm import build_model
from kvlm.attention import Step
from kvlm.reference import reference_attention

VARIANTS = all_variants()


def _model(attention, overrides, dtype=torch.float64):
    torch.manual_seed(0)
    model = build_model(tiny_config(attention, **overrides)).to(dtype)
    # random (not zero / one) norms and gates so that every parameter matters in the comparison
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    return model.eval()


@pytest.mark.parametrize("attention,overrides", VARIANTS)
def test_matches_reference_float64(attention, overrides):
    model = _model(attention, overrides)
    attn = model.layers[1].attn
    x = torch.randn(2, 11, model.cfg.d_model, dtype=torch.float64)
    tokens = torch.randint(0, model.cfg.vocab_size, (2, 11))
    step = Step.build(tokens)
    fast = attn(x, step)
    ref = reference_attention(attn, x, step.positions, token_ids=tokens)
    assert (fast - ref).abs().max().item() < 1e-10


@pytest.mark.parametrize("attention,overrides", VARIANTS)
def test_causal(attention, overrides):
    model = _model(attention, overrides)
    tokens = torch.randint(0, model.cfg.vocab_size, (1, 12))
    changed = tokens.clone()
    changed[0, 8:] = (changed[0, 8:] + 1) % model.cfg.vocab_size
    a, b = model(tokens), model(changed)
    assert torch.allclose(a[:, :8], b[:, :8], atol=1e-12)
    assert not torch.allclose(a[:, 8:], b[:, 8:], atol=1e-6)


@pytest.mark.parametrize("attention,overrides", VARIANTS)
def test_gradients_reach_every_parameter(attention, overrides):
    model = _model(attention, overrides, torch.float32).train()
    if model.cfg.zero_init_out:
        pytest.skip("zero-initialised output projections block gradients to inputs by design at step 0")
    tokens = torch.randint(0, model.cfg.vocab_size, (2, 10))
    logits = model(tokens)
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten()).backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, f"no gradient reaches {name}"


def _modes(model):
    modes = ["auto"]
    if model.layers[0].attn.has_naive_cache:
        modes += ["naive", "absorbed", "expand"]
    return modes


@pytest.mark.parametrize("attention,overrides", VARIANTS)
def test_incremental_decode_equals_full_forward(attention, overrides):
    model = _model(attention, overrides)
    tokens = torch.randint(0, model.cfg.vocab_size, (2, 14))
    full = model(tokens)
    for mode in _modes(model):
        cache = model.new_cache(2, 20, naive=(mode == "naive"))
        parts = [model(tokens[:, :5], cache=cache, mode=mode)]
        parts.append(model(tokens[:, 5:8], cache=cache, mode=mode))  # a second prefill chunk
        for t in range(8, 14):
            parts.append(model(tokens[:, t : t + 1], cache=cache, mode=mode))
        inc = torch.cat(parts, dim=1)
        assert (inc - full).abs().max().item() < 1e-9, mode
        assert cache.length == 14


@pytest.mark.parametrize("attention,overrides", VARIANTS)
def test_incremental_decode_float32(attention, overrides):
    model = _model(attention, overrides, torch.float32)
    tokens = torch.randint(0, model.cfg.vocab_size, (1, 12))
    full = model(tokens)
    for mode in _modes(model):
        cache = model.new_cache(1, 12, naive=(mode == "naive"))
        inc = torch.cat(
            [model(tokens[:, :6], cache=cache, mode=mode)]
            + [model(tokens[:, t : t + 1], cache=cache, mode=mode) for t in range(6, 12)],
            1,
        )
        assert (inc - full).abs().max().item() < 1e-4, mode


@pytest.mark.parametrize("attention,overrides", VARIANTS)
def test_ragged_batch_equals_alone(attention, overrides):
    model = _model(attention, overrides)
    lengths = [7, 3, 5]
    seqs = [torch.randint(1, model.cfg.vocab_size, (n + 4,)) for n in lengths]  # prompt + 4 decoded
    width = max(lengths)
    prompts = torch.zeros(3, width, dtype=torch.long)
    for i, (s, n) in enumerate(zip(seqs, lengths)):
        prompts[i, width - n :] = s[:n]
    for mode in _modes(model):
        cache = model.new_cache(3, width + 4, naive=(mode == "naive"))
        cache.set_left_padding([width - n for n in lengths])
        out = [model(prompts, cache=cache, mode=mode)[:, -1]]
        for j in range(4):
            nxt = torch.stack([s[n + j] for s, n in zip(seqs, lengths)])[:, None]
            out.append(model(nxt, cache=cache, mode=mode)[:, -1])
        batched = torch.stack(out, 1)  # (3, 5, V)
        for i, (s, n) in enumerate(zip(seqs, lengths)):
            alone = model(s[None, : n + 4])[0, n - 1 :]
            assert (batched[i] - alone).abs().max().item() < 1e-9, (mode, i)


@pytest.mark.parametrize("attention,overrides", VARIANTS)
def test_cache_bytes_equal_accounting(attention, overrides):
    model = _model(attention, overrides, torch.float32)
    cfg = model.cfg
    cache = model.new_cache(3, 16, dtype=torch.bfloat16)
    assert cache.nbytes == 3 * 16 * cfg.kv_cache_elements_per_token() * 2
    tokens = torch.randint(0, cfg.vocab_size, (3, 5))
    model.to(torch.bfloat16)(tokens, cache=cache)
    assert cache.nbytes_used == 3 * 5 * cfg.kv_cache_bytes_per_token(2)


def test_step_carries_only_declared_fields():
    """Mechanisms keep no memos on the step: every field is declared (slots), anything else is refused."""
    step = Step.build(torch.zeros(1, 3, dtype=torch.long))
    step.trace = []
    with pytest.raises(AttributeError):
        step.memo = 1


@pytest.mark.parametrize("attention,overrides", VARIANTS)
def test_every_layer_records_its_route(attention, overrides):
    """A traced call gets one (layer, route) entry per layer, and cached decode a route the mechanism declares."""
    model = _model(attention, overrides)
    routes = set(type(model.layers[0].attn).decode_routes(model.cfg).values())
    tokens = torch.randint(0, model.cfg.vocab_size, (1, 6))
    cache = model.new_cache(1, 6)
    model(tokens[:, :5], cache=cache)
    trace = []
    model(tokens[:, 5:], cache=cache, trace=trace)
    assert [i for i, _ in trace] == list(range(model.cfg.n_layer))
    assert {r for _, r in trace} <= routes, trace
