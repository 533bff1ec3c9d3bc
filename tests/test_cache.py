"""The cache interface (kvlm.cache.CacheLayer) and the bytes each mechanism's cache holds, against the papers'
per-token formulas (written here from the equations, not from cache_spec)."""

import pytest
import torch
from conftest import tiny_config

from kvlm import CacheError, KVCache, build_model
from kvlm.attention import Step
from kvlm.cache import CacheLayer, ContiguousLayer

# tiny_config: d_model 64, n_head h = 4, head_dim d_h = 16, rope_head_dim d_h^R = 8, kv_lora_rank d_c = 64
H, DH, DR, DC = 4, 16, 8, 64

# (attention, overrides, compact elements per token per layer, naive elements or None), from the papers
PAPER = [
    ("mha", {}, 2 * H * DH, None),  # 2 h d_h (mlra.md C.1)
    ("mqa", {}, 2 * 1 * DH, None),  # 2 d_h
    ("gqa", {"n_kv_head": 2}, 2 * 2 * DH, None),  # 2 g d_h (C.2)
    ("mla", {}, DC + DR, H * (2 * DH + DR)),  # d_c + d_h^R (DeepSeek-V2 Sec. 2.1.3); naive h (2 d_h + d_h^R)
    ("mla", {"kv_lora_rank": 24, "rope": False}, 24, H * 2 * DH),  # d_c alone without RoPE
    ("mla", {"kv_latent": "separate", "kv_lora_rank": 32}, 2 * 32 + DR, H * (2 * DH + DR)),  # 2 r + d_h^R
    ("mla", {"rope_kv_heads": 2}, DC + 2 * DR, H * (2 * DH + DR)),  # d_c + n_R d_h^R
    ("eg-mla", {"kv_lora_rank": 32}, 32 + DR, H * (2 * DH + DR)),  # MLA's cache (eg-mla.md Sec. 3)
    ("gla-2", {}, DC + DR, H * (2 * DH + DR)),  # d_c + d_h^R (mlra.md C.6)
    ("mlra-4", {}, DC + DR, 4 * H * (2 * DH + DR)),  # d_c + d_h^R; naive: 4 branches per head
    ("mlra-2", {}, DC + DR, 2 * H * (2 * DH + DR)),
    ("gta", {"n_kv_head": 2}, 2 * DH + DR, None),  # g d_h + d_h^R (C.7)
    ("mfa", {"head_dim": 32}, 2 * 32, None),  # one key and one value head (C.4)
    ("tpa", {"tpa_kv_rank": 2}, 2 * 2 * (H + DH), 2 * H * DH),  # 2 beta_kv (h + d_h) (C.5)
]


def _storage_bytes(cache: KVCache) -> int:
    """What the contiguous layout actually allocated (its buffers), not what the specs say."""
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in layer.values())


@pytest.mark.parametrize("attention,overrides,compact,naive", PAPER, ids=lambda v: str(v))
def test_cache_bytes_equal_the_papers_formulas(attention, overrides, compact, naive):
    cfg = tiny_config(attention, **overrides)
    model = build_model(cfg)
    B, S = 3, 16
    assert cfg.kv_cache_elements_per_token() == cfg.n_layer * compact
    cache = model.new_cache(B, S, dtype=torch.bfloat16)
    assert cache.nbytes == _storage_bytes(cache) == B * S * cfg.n_layer * compact * 2
    if naive is not None:
        cache = model.new_cache(B, S, dtype=torch.float32, naive=True)
        assert cache.nbytes == _storage_bytes(cache) == B * S * cfg.n_layer * naive * 4
    else:
        assert not model.layers[0].attn.has_naive_cache
    cache = model.new_cache(B, S)
    model(torch.randint(0, cfg.vocab_size, (B, 5)), cache=cache)
    assert cache.nbytes_used == B * 5 * cfg.n_layer * compact * 4


def test_cache_layer_append_and_read():
    spec = {"k": (2, 4), "c": (3,)}
    layer = ContiguousLayer(spec, batch_size=2, max_seq_len=10, dtype=torch.float64, naive=False)
    assert isinstance(layer, CacheLayer)
    assert set(layer) == {"k", "c"} and len(layer) == 2 and "k" in layer and "v" not in layer
    assert layer.elements_per_token == 2 * 4 + 3 and layer.nbytes == 2 * 10 * 11 * 8
    first = Step.build(torch.zeros(2, 3, dtype=torch.long))  # slots [0, 3)
    k1, c1 = torch.randn(2, 2, 3, 4), torch.randn(2, 3, 3)
    got = layer.append("k", k1, first)
    assert got.shape == (2, 2, 3, 4) and got.dtype == torch.float64 and torch.equal(got, k1.double())
    assert torch.equal(layer.append("c", c1, first), c1.double())
    second = Step.build(torch.zeros(2, 1, dtype=torch.long), start=3)  # slot 3
    k2 = torch.randn(2, 2, 1, 4)
    got = layer.append("k", k2, second)
    assert got.shape == (2, 2, 4, 4) and torch.equal(got, torch.cat([k1, k2], 2).double())
    assert torch.equal(layer.read("k", 4), got) and torch.equal(layer.read("c", 3), c1.double())
    with pytest.raises(KeyError):
        layer.token_ids(4)  # built without token ids


def test_kv_cache_layers_token_ids_and_modes():
    cfg = tiny_config("eg-mla")
    model = build_model(cfg)
    cache = model.new_cache(2, 12)
    assert len(cache.layers) == cfg.n_layer and all(not layer.naive for layer in cache.layers)
    tokens = torch.randint(0, cfg.vocab_size, (2, 5))
    model(tokens, cache=cache)
    assert cache.length == 5
    assert all(torch.equal(layer.token_ids(5), tokens) for layer in cache.layers)
    assert all(layer.naive for layer in model.new_cache(2, 12, naive=True).layers)
    assert build_model(tiny_config("mha")).new_cache(1, 4).token_ids is None  # only needs_token_ids keeps ids
    cache.reset()
    assert cache.length == 0


def test_kv_cache_public_behaviour_and_errors():
    cache = KVCache([{"k": (2, 4), "v": (2, 4)}], batch_size=2, max_seq_len=8)
    assert cache.elements_per_token == 16 and cache.nbytes == 2 * 8 * 16 * 4
    cache.set_left_padding([1, 0])
    assert cache.pad.tolist() == [1, 0]
    with pytest.raises(CacheError):
        cache.set_left_padding([0])  # wrong batch
    with pytest.raises(CacheError):
        cache.check_append(2, 9, torch.float32, torch.device("cpu"))  # beyond max_seq_len
    with pytest.raises(CacheError):
        cache.check_append(3, 1, torch.float32, torch.device("cpu"))  # wrong batch
    cache.fill_random_(6, vocab_size=10)
    assert cache.length == 6 and cache.layers[0]["k"][..., :6, :].abs().sum() > 0
    assert cache.layers[0]["k"][..., 6:, :].abs().sum() == 0
    with pytest.raises(CacheError):
        cache.fill_random_(9, vocab_size=10)


def test_mechanisms_write_only_through_the_cache_layer():
    """A layer that records its calls stands in for the contiguous one: every cached tensor of every layer
    arrives through append, and decoding through it gives the same logits as the contiguous cache."""

    class Recording(ContiguousLayer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.appended: list[str] = []

        def append(self, name, value, step):
            self.appended.append(name)
            return super().append(name, value, step)

    for attention in ("gqa", "gta", "tpa", "mfa"):
        torch.manual_seed(0)
        model = build_model(tiny_config(attention)).double().eval()
        tokens = torch.randint(0, 97, (1, 6))
        plain = model.new_cache(1, 6)
        recorded = model.new_cache(1, 6)
        recorded.layers = [
            Recording(layer.spec, 1, 6, torch.float64, False, None, "cpu") for layer in recorded.layers
        ]
        logits = []
        for cache in (plain, recorded):
            out = [model(tokens[:, :4], cache=cache)] + [
                model(tokens[:, t : t + 1], cache=cache) for t in (4, 5)
            ]
            logits.append(torch.cat(out, 1))
        assert (logits[0] - logits[1]).abs().max().item() < 1e-12, attention
        for layer in recorded.layers:
            assert sorted(set(layer.appended)) == sorted(layer.spec), attention
            assert len(layer.appended) == 3 * len(layer.spec), attention
