"""The float32 fast paths against the float64 references (kvlm.reference), every variant, prefill and decode.

Float64 takes plain matmuls everywhere (exact tests); float32 takes the fused ones: SDPA with boolean or float
masks, MLA's latent attention with the RoPE scores as SDPA's additive mask, ``attend_split`` (shared RoPE key
as a bias) and ``attend_padded`` (values zero-padded to the query width). The float64 contract tests never run
those branches, and float32 self-consistency (cached decode == full forward, both float32) cannot see an error
they share. Here each attention layer's float32 output is compared with its reference equations evaluated in
float64 on the same input, captured by a forward hook on the layer, so every call shape the model makes is
checked: training forward, prefill, a second prefill chunk (explicit mask), decode steps, left-padded batches.
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import all_variants, decode_route, decode_route_keys, tiny_config

from kvlm import build_model
from kvlm.reference import reference_attention

VARIANTS = all_variants()
# float32 against float64, relative to the largest reference output of the layer: the worst case observed over
# every variant and mode is 6e-7 (inputs rounded to float32 once, then a few hundred float32 operations)
RTOL = 1e-5


def _model(attention, overrides):
    torch.manual_seed(0)
    cfg = tiny_config(attention, **{"init_std": 0.1, **overrides})
    model = build_model(cfg)
    # random (not zero / one) norms, biases and output projections, so that every parameter matters
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
            elif p.dim() == 2 and p.abs().max() == 0:
                p.normal_(0.0, 0.1)
    return model.eval().prepare_for_inference()


class Capture:
    """Every call of each layer's attention: (input x, output) as computed in the model's dtype."""

    def __init__(self, model):
        self.calls: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in model.layers]
        self._handles = [
            layer.attn.register_forward_hook(self._hook(i), with_kwargs=True)
            for i, layer in enumerate(model.layers)
        ]

    def _hook(self, i):
        def hook(module, args, kwargs, out):
            x = args[0] if args else kwargs["x"]
            self.calls[i].append((x.detach().clone(), out.detach().clone()))

        return hook

    def close(self):
        for h in self._handles:
            h.remove()


def _check(model, model64, capture, tokens, real_from=None) -> list[str]:
    """Reference outputs of each layer on the concatenated captured inputs (float64) against the captured
    float32 outputs. real_from (B,): the first real slot of each sequence (left padding), default 0."""
    bad = []
    B, T = tokens.shape
    real_from = real_from if real_from is not None else [0] * B
    for i, calls in enumerate(capture.calls):
        x = torch.cat([c[0] for c in calls], dim=1)
        out = torch.cat([c[1] for c in calls], dim=1)
        assert x.shape[1] == T, (x.shape, T)
        attn64 = model64.layers[i].attn
        for b in range(B):
            p = real_from[b]
            xb = x[b : b + 1, p:].to(torch.float64)
            positions = torch.arange(T - p)[None]
            ref = reference_attention(attn64, xb, positions, token_ids=tokens[b : b + 1, p:])
            err = (out[b : b + 1, p:].to(torch.float64) - ref).abs().max().item()
            size = ref.abs().max().item()
            if not err <= RTOL * size:
                bad.append(f"layer {i} sequence {b}: max error {err:.3g} for outputs up to {size:.3g}")
    return bad


def _run(model, fn):
    capture = Capture(model)
    try:
        fn()
    finally:
        capture.close()
    return capture


@pytest.mark.parametrize("attention,overrides", VARIANTS)
def test_prefill_and_training_forward(attention, overrides):
    model = _model(attention, overrides)
    model64 = copy.deepcopy(model).to(torch.float64)
    tokens = torch.randint(0, model.cfg.vocab_size, (2, 13))
    with torch.no_grad():
        capture = _run(model, lambda: model(tokens))
    assert not _check(model, model64, capture, tokens)
    # with autograd recording, attend_split concatenates the RoPE key and attend_padded pads the values
    capture = _run(model, lambda: model(tokens))
    assert not _check(model, model64, capture, tokens)


@pytest.mark.parametrize("attention,overrides", VARIANTS)
def test_chunked_prefill_and_decode_in_every_mode(attention, overrides):
    model = _model(attention, overrides)
    model64 = copy.deepcopy(model).to(torch.float64)
    tokens = torch.randint(0, model.cfg.vocab_size, (2, 14))

    def decode(mode):
        cache = model.new_cache(2, 16, naive=(mode == "naive"))
        model(tokens[:, :6], cache=cache, mode=mode)  # prefill
        model(tokens[:, 6:9], cache=cache, mode=mode)  # a second chunk: causal mask over the cached past
        for t in range(9, 14):  # decode steps
            model(tokens[:, t : t + 1], cache=cache, mode=mode)

    for key in decode_route_keys(model):
        with torch.no_grad(), decode_route(model, key) as mode:
            capture = _run(model, lambda: decode(mode))  # noqa: B023
        bad = _check(model, model64, capture, tokens)
        assert not bad, (key, bad)


@pytest.mark.parametrize("attention,overrides", VARIANTS)
def test_left_padded_batch_in_every_mode(attention, overrides):
    model = _model(attention, overrides)
    model64 = copy.deepcopy(model).to(torch.float64)
    lengths = [7, 3, 5]
    width, steps = max(lengths), 3
    tokens = torch.randint(1, model.cfg.vocab_size, (3, width + steps))
    pad = [width - n for n in lengths]

    def decode(mode):
        cache = model.new_cache(3, width + steps, naive=(mode == "naive"))
        cache.set_left_padding(pad)
        model(tokens[:, :width], cache=cache, mode=mode)
        for t in range(width, width + steps):
            model(tokens[:, t : t + 1], cache=cache, mode=mode)

    for key in decode_route_keys(model):
        with torch.no_grad(), decode_route(model, key) as mode:
            capture = _run(model, lambda: decode(mode))  # noqa: B023
        bad = _check(model, model64, capture, tokens, real_from=pad)
        assert not bad, (key, bad)


def test_the_fused_kernels_run(monkeypatch):
    """The float32 calls above do reach SDPA's fused CPU kernel (not only the math fallbacks). kvlm's own decode
    kernels (kvlm.kernels, tests/test_kernels.py) take cached calls first: off here, so SDPA's path is the one run."""
    from torch.utils._python_dispatch import TorchDispatchMode

    monkeypatch.setenv("KVLM_KERNELS", "0")

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.add(str(func))
            return func(*args, **(kwargs or {}))

    fused = "aten._scaled_dot_product_flash_attention_for_cpu.default"
    for attention, overrides in [("mha", {}), ("mla", {}), ("gqa", {"n_kv_head": 2})]:
        model = _model(attention, overrides)
        tokens = torch.randint(0, model.cfg.vocab_size, (2, 9))
        for mode in decode_route_keys(model):
            cache = model.new_cache(2, 12, naive=(mode == "naive"))
            with torch.no_grad(), Ops() as ops:
                model(tokens[:, :5], cache=cache, mode=mode)
                model(tokens[:, 5:7], cache=cache, mode=mode)
                model(tokens[:, 7:8], cache=cache, mode=mode)
            assert fused in ops.names, (attention, mode, sorted(n for n in ops.names if "dot_product" in n))


def test_the_check_can_fail():
    """A float32 error of 1e-4 relative in one output row is caught."""
    model = _model("mla", {})
    model64 = copy.deepcopy(model).to(torch.float64)
    tokens = torch.randint(0, model.cfg.vocab_size, (2, 6))
    with torch.no_grad():
        capture = _run(model, lambda: model(tokens))
    x, out = capture.calls[1][0]
    out[1, 3] += 1e-4 * out.abs().max()
    bad = _check(model, model64, capture, tokens)
    assert len(bad) == 1 and bad[0].startswith("layer 1 sequence 1")
