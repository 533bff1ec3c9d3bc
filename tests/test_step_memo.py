"""What the layers of one decode call share (issue 15, "the rest of the step"): the caches build the kernels'
block views once per call from host values they already hold (``BlockView.keys`` / ``longest``, the contiguous
cache's ``StepSlots``, the paged cache's index), so no layer reads a tensor back; and a value built for one call
is never served to another (another end, another padding, other sequences)."""

import pytest
import torch
from conftest import require_kernels, tiny_config
from torch.utils._python_dispatch import TorchDispatchMode

from kvlm import build_model, kernels
from kvlm.attention.rope import RotaryEmbedding, apply_rope
from kvlm.attention.step import Step
from kvlm.cache import KVCache
from kvlm.cache.layer import StepSlots
from kvlm.cache.paged import PagedKVCache

SPECS = [{"k": (2, 4), "v": (2, 4)}, {"k": (2, 4), "v": (2, 4)}]


def _from_tensors(view) -> tuple[list[int], list[int], int, int]:
    """start, end, and the totals a kernel needs, read from the view's tensors (the definition)."""
    n = view.end.long() - view.start.long()
    return view.start.tolist(), view.end.tolist(), int(n.sum()), int(n.max())


def test_contiguous_views_are_shared_by_layers_and_rebuilt_each_call():
    cache = KVCache(SPECS, batch_size=3, max_seq_len=16)
    cache.set_left_padding([0, 2, 5])
    step = cache.begin_step(torch.zeros(3, 4, dtype=torch.long), torch.float32)
    a, b = cache.layers[0].block_view("k", step), cache.layers[1].block_view("v", step)
    assert a.start is b.start and a.end is b.end and a.block_table is b.block_table  # built once per call
    assert (
        _from_tensors(a)
        == ([0, 2, 5], [4, 4, 4], 12 - 7, 4)
        == (a.start.tolist(), a.end.tolist(), a.keys, a.longest)
    )
    cache.commit(step)
    # the padding rewritten in place between calls (a beam reorder): the next call must see it
    cache.reorder_(torch.tensor([2, 0, 1]))
    step2 = cache.begin_step(torch.zeros(3, 1, dtype=torch.long), torch.float32)
    c = cache.layers[1].block_view("k", step2)
    assert c.start is not a.start and c.end is not a.end
    assert (
        _from_tensors(c)
        == ([5, 0, 2], [5, 5, 5], 15 - 7, 5)
        == (c.start.tolist(), c.end.tolist(), c.keys, c.longest)
    )
    cache.commit(step2)
    cache.reset()  # zero padding: a view of a new call starts at slot 0 again
    step3 = cache.begin_step(torch.zeros(3, 2, dtype=torch.long), torch.float32)
    d = cache.layers[0].block_view("k", step3)
    assert _from_tensors(d) == ([0, 0, 0], [2, 2, 2], 6, 2) and (d.keys, d.longest) == (6, 2)


def test_step_slots_ignore_a_padding_noted_for_another_step():
    pad = torch.tensor([1, 0])
    slots = StepSlots(2, "cpu", pad)
    first = Step.build(torch.zeros(2, 1, dtype=torch.long), 3, pad)
    slots.begin(first, [1, 0])
    pad.copy_(torch.tensor([0, 2]))
    second = Step.build(torch.zeros(2, 1, dtype=torch.long), 3, pad)
    start, end, keys, longest = slots.get(second)  # the note belongs to `first`: read the tensor
    assert start.tolist() == [0, 2] and end.tolist() == [4, 4] and (keys, longest) == (6, 4)
    assert slots.get(second)[0] is start  # the same call again: the memo, not a rebuild
    slots.begin(second, [0, 2])
    again = slots.get(second)
    assert again[0] is not start and again[2:] == (6, 4)  # a step begun anew: built anew


def test_paged_views_share_one_index_per_call():
    cache = PagedKVCache(SPECS, num_pages=16, page_size=4)
    for sid, n in (("a", 5), ("b", 2), ("c", 9)):
        cache.add_sequence(sid)
        cache.fill_random_(sid, n, vocab_size=10)
    view = cache.batch(["a", "b", "c"])
    step = view.begin_step(torch.zeros(3, 1, dtype=torch.long), torch.float32)
    k0, v1 = cache.layers[0].block_view("k", step), cache.layers[1].block_view("v", step)
    assert k0.start is v1.start and k0.end is v1.end and k0.block_table is v1.block_table
    assert _from_tensors(k0) == ([0, 0, 0], [6, 3, 10], 19, 10) and (k0.keys, k0.longest) == (19, 10)
    view.commit(step)
    # another call, other sequences and several new tokens each: nothing of the first index survives
    view = cache.batch(["c", "b"], n_new=[1, 3])
    step = view.begin_step(torch.zeros(2, 3, dtype=torch.long), torch.float32)
    k = cache.layers[1].block_view("k", step)
    assert k.start is not k0.start
    assert _from_tensors(k) == ([0, 0], [11, 6], 17, 11) and (k.keys, k.longest) == (17, 11)


@pytest.mark.parametrize(
    "lens, n_new, T",
    [
        ([3, 0, 7], None, 1),
        ([4, 4], None, 3),
        ([5, 1, 2], [2, 3, 1], 3),
        ([0, 6], [1, 1], 1),
        ([2, 9], [4, 4], 4),
    ],
)
def test_build_ragged_from_host_lists_equals_from_tensors(lens, n_new, T):
    tokens = torch.zeros(len(lens), T, dtype=torch.long)
    want = Step.build_ragged(tokens, torch.tensor(lens), n_new=None if n_new is None else torch.tensor(n_new))
    got = Step.build_ragged(tokens, lens, n_new=n_new)
    assert (got.start, got.end, got.causal) == (want.start, want.end, want.causal)
    assert torch.equal(got.positions, want.positions)
    assert (got.mask is None) == (want.mask is None)
    assert got.mask is None or torch.equal(got.mask, want.mask)


def test_cos_sin_still_refuses_positions_beyond_the_table():
    rope = RotaryEmbedding(8, 16)
    ok = Step.build(torch.zeros(2, 3, dtype=torch.long), 10)
    cos, sin = ok.cos_sin(rope, torch.float64)  # whole-width: [cos, cos], [-sin, sin]
    half_cos, half_sin = rope.cos_table[torch.arange(10, 13)], rope.sin_table[torch.arange(10, 13)]
    assert torch.equal(cos[:, 0], torch.cat((half_cos, half_cos), -1).expand(2, 3, 8))
    assert torch.equal(sin[:, 0], torch.cat((-half_sin, half_sin), -1).expand(2, 3, 8))
    with pytest.raises(ValueError, match="beyond max_seq_len=16"):
        Step.build(torch.zeros(1, 2, dtype=torch.long), 15).cos_sin(rope, torch.float32)
    by_hand = Step(positions=torch.tensor([[20]]))  # end unset (0): the positions themselves are checked
    with pytest.raises(ValueError, match="position 20"):
        by_hand.cos_sin(rope, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_rope_short_form_equals_the_half_split_rotation(dtype):
    """apply_rope with the step's whole-width tables gives the half-split rotation's values bit for bit (what
    tests/test_v1_compat.py pins for whole models), on strided inputs as the mechanisms pass them."""
    rope = RotaryEmbedding(16, 64)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 4, 16, generator=gen, dtype=dtype).transpose(1, 2)  # (B, H, T, d), not contiguous
    pos = torch.randint(0, 64, (3, 5), generator=gen)
    half = apply_rope(x, *rope.cos_sin(pos, dtype))
    x1, x2 = x[..., :8], x[..., 8:]
    c, s = (t[pos].to(dtype)[:, None] for t in (rope.cos_table, rope.sin_table))
    assert torch.equal(half, torch.cat((x1 * c - x2 * s, x1 * s + x2 * c), -1))  # the definition
    assert torch.equal(apply_rope(x, *rope.cos_sin(pos, dtype, full=True)), half)


class _ReadBacks(TorchDispatchMode):
    """Counts the operators that copy a tensor's value to the host (``int(t)``, ``bool(t)``, ``t.item()``)."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.item.default, torch.ops.aten._local_scalar_dense.default):
            self.n += 1
        elif func is torch.ops.aten.is_nonzero.default:
            self.n += 1
        return func(*args, **(kwargs or {}))


def _decode_read_backs(attention: str, n_layer: int, paged: bool, **cfg) -> tuple[int, int]:
    """Read-backs and kernel calls of one decode step (batch 3, ragged or left-padded), after a prefill."""
    torch.manual_seed(0)
    model = build_model(tiny_config(attention, n_layer=n_layer, **cfg)).eval().prepare_for_inference()
    mode = "absorbed" if attention == "mla" else "auto"
    with torch.inference_mode():
        if paged:
            cache = PagedKVCache.for_model(model, cache_tokens=64, page_size=4)
            for i, n in enumerate((5, 2, 7)):
                cache.add_sequence(i)
                model(torch.randint(0, 97, (1, n)), cache=cache.batch([i]))
            view = cache.batch([0, 1, 2])
        else:
            view = model.new_cache(3, 32)
            view.set_left_padding([0, 3, 1])
            model(torch.randint(0, 97, (3, 6)), cache=view)
        before = _layer_calls()
        with _ReadBacks() as rb:
            model(torch.randint(0, 97, (3, 1)), cache=view, mode=mode)
    return rb.n, _layer_calls() - before


def _layer_calls() -> int:
    """The kernels' calls a layer each (not the stack's, which runs every layer's block in one)."""
    return sum(n for name, n in kernels.CALLS.items() if name != "block_stack")


@pytest.mark.parametrize(
    "attention, cfg", [("gqa", dict(n_kv_head=2)), ("mla", dict(kv_lora_rank=16, rope_head_dim=8))]
)
@pytest.mark.parametrize("paged", [False, True])
def test_decode_reads_nothing_back_per_layer(attention, cfg, paged):
    """A layer more adds a kernel call and no read-back: what the kernels need per call (key counts, the split
    of the key axis) comes from the cache's host values, once per step."""
    require_kernels()
    one, calls_one = _decode_read_backs(attention, 1, paged, **cfg)
    three, calls_three = _decode_read_backs(attention, 3, paged, **cfg)
    assert calls_one == 1 and calls_three == 3  # the kernels ran (else there is nothing to measure)
    assert three == one


def test_kernel_flop_count_uses_the_views_keys():
    """kvlm.kernels.FLOPS (what ``kvlm bench`` adds to torch's FLOP count) from the cache's host key counts
    equals the definition: 2 h (2 d_c + d_R) multiply-adds per new token and visible cached key."""
    require_kernels()
    torch.manual_seed(0)
    cfg = tiny_config("mla", n_layer=2, kv_lora_rank=16, rope_head_dim=8)
    model = build_model(cfg).eval().prepare_for_inference()
    cache = model.new_cache(3, 32)
    cache.set_left_padding([0, 3, 1])
    with torch.inference_mode():
        model(torch.randint(0, 97, (3, 6)), cache=cache)
        before = kernels.FLOPS["attention"]
        model(torch.randint(0, 97, (3, 1)), cache=cache, mode="absorbed")
    visible = (7 - 0) + (7 - 3) + (7 - 1)
    assert kernels.FLOPS["attention"] - before == cfg.n_layer * 2 * cfg.n_head * visible * (2 * 16 + 8)


@pytest.mark.parametrize("attention", ["gqa", "mla"])
def test_contiguous_decode_step_reads_no_tensor_to_the_host(attention, monkeypatch):
    """A decode step on the contiguous cache takes the padding from the host copy the cache keeps
    (``host_pad``), so on a GPU it waits for nothing and can be captured in a CUDA graph; the copy follows
    every change of the padding (``set_left_padding``, ``reorder_``, ``reset``), and the step's logits stay
    those of the full forward."""
    torch.manual_seed(0)
    cfg = {"gqa": dict(n_kv_head=2), "mla": dict(kv_lora_rank=16, rope_head_dim=8)}[attention]
    model = build_model(tiny_config(attention, n_layer=2, **cfg)).eval().prepare_for_inference()
    tokens = torch.randint(0, 97, (3, 7))
    pad = [0, 3, 1]
    cache = model.new_cache(3, 16)
    cache.set_left_padding(pad)
    assert cache.host_pad == pad
    reads = []

    def no_read(t, *a, **k):
        reads.append(t.shape)
        raise AssertionError("a decode step read a tensor back to the host")

    with torch.inference_mode():
        model(tokens[:, :6], cache=cache)
        with monkeypatch.context() as m:
            # the token-id check reads the ids back on CPU only (on a GPU a one-token step skips it)
            m.setattr(model, "_check_token_ids", lambda tokens, cache: None)
            for name in ("tolist", "item", "__bool__", "__int__"):
                m.setattr(torch.Tensor, name, no_read)
            step = model(tokens[:, 6:], cache=cache)[:, -1]
        cache.reorder_(torch.tensor([2, 0, 1]))
        assert cache.host_pad == [1, 0, 3] == cache.pad.tolist()
        cache.reset()
        assert cache.host_pad == [0, 0, 0]
    assert not reads
    full = model_logits_left_padded(model, tokens, pad)
    torch.testing.assert_close(step, full, rtol=1e-4, atol=1e-4)


def model_logits_left_padded(model, tokens, pad) -> torch.Tensor:
    """The last position's logits of each sequence without its left padding, by a plain forward."""
    with torch.inference_mode():
        return torch.stack([model(tokens[b : b + 1, p:])[0, -1] for b, p in enumerate(pad)])
