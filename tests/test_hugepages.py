"""kvlm.hugepages: large CPU tensors advised for transparent huge pages (the caches' pools, the weights after
prepare_for_inference), with values, identity and tying unchanged, and the switch that turns it off."""

import sys
from pathlib import Path

import pytest
import torch
from conftest import tiny_config

from kvlm import build_model, hugepages
from kvlm.cache import PagedKVCache

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
needs_thp = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not THP.exists(), reason="needs Linux with transparent huge pages"
)


def advised(t: torch.Tensor) -> bool:
    """Whether the memory at t's first byte is advised MADV_HUGEPAGE ("hg" in its mapping's VmFlags)."""
    addr = t.data_ptr()
    lines = Path("/proc/self/smaps").read_text().splitlines()
    inside = False
    for line in lines:
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= addr < hi
        elif inside and line.startswith("VmFlags:"):
            return "hg" in line.split()[1:]
    return False


@needs_thp
def test_large_zeros_are_advised_and_aligned():
    t = hugepages.zeros_in_huge_pages((3, 1024, 1024), torch.float32)
    assert t.shape == (3, 1024, 1024) and t.dtype == torch.float32 and t.is_contiguous()
    assert t.data_ptr() % hugepages.HUGE == 0
    assert not t.any()
    assert advised(t)
    t[2, 1023, 1023] = 5  # the last element is inside the buffer
    assert t.sum().item() == 5


def test_small_other_devices_and_switched_off_are_plain(monkeypatch):
    small = hugepages.zeros_in_huge_pages((4, 5), torch.int8)
    assert small.shape == (4, 5) and small.dtype == torch.int8 and not small.any()
    assert small.untyped_storage().nbytes() == 20  # no slack: torch's own zeros
    monkeypatch.setenv(hugepages.ENV, "0")
    big = hugepages.zeros_in_huge_pages((2, 1024, 1024), torch.float32)
    assert big.untyped_storage().nbytes() == big.numel() * 4 and not big.any()
    assert hugepages.move_to_huge_pages_(torch.nn.Linear(1024, 1024)) == 0


@needs_thp
def test_rehome_keeps_values_identity_and_tying():
    torch.manual_seed(0)
    model = build_model(tiny_config("mha", d_model=256, n_head=4, vocab_size=4096, tie_embeddings=True))
    params = dict(model.named_parameters())
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    moved = hugepages.move_to_huge_pages_(model)
    big = [p for p in model.parameters() if p.numel() * 4 >= hugepages.MIN_BYTES]
    assert big and moved == sum(p.numel() * 4 for p in big)
    assert all(advised(p) and p.data_ptr() % hugepages.HUGE == 0 for p in big)
    assert dict(model.named_parameters()) == params  # the same Parameter objects
    assert model.embed.weight is model.lm_head.weight
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert hugepages.move_to_huge_pages_(model) == 0  # already there
    tokens = torch.randint(0, 4096, (2, 6))
    torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
    assert all(p.grad is not None for p in big)  # still trainable


@needs_thp
def test_moved_under_inference_mode_the_weights_still_train():
    torch.manual_seed(0)
    model = build_model(tiny_config("gqa", n_kv_head=2, d_model=256, n_head=4, vocab_size=4096))
    with torch.inference_mode():
        assert hugepages.move_to_huge_pages_(model) > 0
    assert not model.lm_head.weight.is_inference()
    tokens = torch.randint(0, 4096, (2, 6))
    torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
    assert model.lm_head.weight.grad is not None


@needs_thp
def test_a_model_built_under_inference_mode_is_moved_and_still_packs():
    # the weights of a model built inside inference_mode are inference tensors; moving them must keep them so
    # (new data of another kind left the parameters' version counters inconsistent: packing then raised)
    torch.manual_seed(0)
    cfg = tiny_config("gqa", n_kv_head=2, d_model=256, n_head=4, vocab_size=4096)
    tokens = torch.randint(0, 4096, (4, 1))
    with torch.inference_mode():
        model = build_model(cfg).eval()
        ref = model(tokens)
        assert hugepages.move_to_huge_pages_(model) > 0
        head = model.lm_head.weight
        assert advised(head) and head.is_inference()
        if not model.pack_for_decode(4):
            pytest.skip("this torch build has no MKL packed GEMM")
        torch.testing.assert_close(model(tokens), ref, rtol=1e-5, atol=1e-5)


@needs_thp
def test_prepare_for_inference_moves_the_weights_and_caches_are_advised():
    torch.manual_seed(0)
    cfg = tiny_config("mla", d_model=256, n_head=4, vocab_size=4096, kv_lora_rank=64, max_seq_len=1100)
    model = build_model(cfg)
    head = model.lm_head.weight
    # not "not advised" before: memory an earlier test advised and freed may be handed out again (glibc reuses
    # it), so the test order decides that; torch's own allocation is never 2 MiB aligned, a move always is
    assert head.data_ptr() % hugepages.HUGE != 0
    model.eval().prepare_for_inference()
    assert head.data_ptr() % hugepages.HUGE == 0 and advised(head)
    cache = model.new_cache(16, 1100)  # per layer 16 x 1100 x (64 + RoPE) floats: past MIN_BYTES
    pools = [
        t for layer in cache.layers for t in layer.buffers.values() if t.numel() * 4 >= hugepages.MIN_BYTES
    ]
    assert pools and all(advised(t) for t in pools)
    paged = PagedKVCache(model.cache_specs(), num_pages=1024, page_size=16)
    assert all(advised(t) for layer in paged.layers for t in layer.pools.values())
