"""MLA beyond the generic contract: the three decode routes agree with each other and really differ in what they
do, absorbed weights are built once by prepare_for_inference, parameter and cache counts equal the papers'
formulas, checkpoints in the pre-DeepSeek names load."""

import math

import pytest
import torch
from conftest import tiny_config

from kvlm import ConfigError, build_model
from kvlm.attention import Step
from kvlm.attention.latent_ops import latent_attention
from kvlm.attention.mla import MLA
from kvlm.cache import CacheError, ContiguousLayer


def _model(dtype=torch.float64, **overrides):
    torch.manual_seed(0)
    model = build_model(tiny_config("mla", **overrides)).to(dtype).eval()
    with torch.no_grad():  # non-trivial norms and biases
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    return model


def _decode(model, tokens, mode, prefill=6, trace=None):
    cache = model.new_cache(tokens.shape[0], tokens.shape[1], naive=(mode == "naive"))
    out = [model(tokens[:, :prefill], cache=cache, mode=mode, trace=trace)]
    out += [
        model(tokens[:, t : t + 1], cache=cache, mode=mode, trace=trace)
        for t in range(prefill, tokens.shape[1])
    ]
    return torch.cat(out, 1)


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"q_lora_rank": 24, "latent_scaling": True},
        {"kv_latent": "separate", "kv_lora_rank": 16},
        {"rope_kv_heads": 2},
    ],
    ids=["plain", "q_lora", "separate", "rope_kv_heads"],
)
@pytest.mark.parametrize("fold", ["none", "all"])
def test_absorbed_equals_naive_equals_expand(overrides, fold):
    model = _model(**overrides, bias=True)
    for b in model.layers:
        b.attn.absorb_fold = fold
    tokens = torch.randint(0, model.cfg.vocab_size, (2, 12))
    with torch.no_grad():
        outs = {mode: _decode(model, tokens, mode) for mode in ("absorbed", "naive", "expand")}
    assert (outs["absorbed"] - outs["naive"]).abs().max() < 1e-10
    assert (outs["expand"] - outs["naive"]).abs().max() < 1e-10


def test_routes_do_what_they_say():
    """absorbed never up-projects the cache with W^UK / W^UV (wkv_b); expand does, over every cached token; the
    trace names the route each layer ran."""
    model = _model()
    attn = model.layers[0].attn
    rows = []
    attn.wkv_b.register_forward_hook(lambda m, i, o: rows.append(i[0].shape[1]))
    tokens = torch.randint(0, model.cfg.vocab_size, (1, 10))
    with torch.no_grad():
        trace = []
        _decode(model, tokens, "absorbed", trace=trace)
        assert rows == []
        assert trace == [(i, "absorbed") for _ in range(5) for i in range(model.cfg.n_layer)]
        _decode(model, tokens, "expand")
        assert rows == [6, 7, 8, 9, 10]  # the whole cache each step
        rows.clear()
        trace = []
        _decode(
            model, tokens, "auto", prefill=2, trace=trace
        )  # prefill expands; decode absorbs once 4 T <= cached
        assert rows == [2, 3]
        assert [r for i, r in trace if i == 0] == ["expand", "expand"] + ["absorbed"] * 7
        rows.clear()
        trace = []
        _decode(model, tokens, "naive", trace=trace)
        assert rows == [6, 1, 1, 1, 1]  # the new tokens only, into the materialised cache
        assert {r for _, r in trace} == {"materialised"}


def test_auto_prefers_absorbed_for_decode_only():
    attn = _model(kv_lora_rank=64).layers[0].attn  # d_c = 64, d_h = 16: absorption cheaper while T < 21.3
    assert attn.prefers_absorbed(1, 4096)
    assert not attn.prefers_absorbed(512, 512)  # the first prefill
    assert not attn.prefers_absorbed(64, 8192)  # a long chunk: expanding once is cheaper
    assert not attn.prefers_absorbed(1, 3)


def test_absorbed_weights_prepared_once_and_rebuilt_on_request():
    """prepare_for_inference builds the absorbed weights once; without it they are built on the fly (uncached);
    after the weights change, preparing again refreshes them; training mode or a cast drops them."""
    model = _model()
    attn = model.layers[1].attn
    tokens = torch.randint(0, model.cfg.vocab_size, (2, 9))
    with torch.no_grad():
        assert attn.absorbed_weights() is not attn.absorbed_weights()  # not prepared: nothing kept
        assert model.prepare_for_inference() is model
        first = attn.absorbed_weights()
        assert attn.absorbed_weights() is first  # not rebuilt while prepared
        cache = model.new_cache(2, 9)
        model(tokens[:, :8], cache=cache, mode="absorbed")
        assert attn.absorbed_weights() is first
        attn.wkv_b.weight.mul_(1.5)  # an in-place update, as an optimizer step does
        model.prepare_for_inference()
        assert attn.absorbed_weights() is not first
        w_uk = attn.wkv_b.weight.view(4, 2, 16, -1)[:, 0]  # (h, d_h, d_c): W^UK rows of each head
        assert torch.equal(attn.absorbed_weights().w_uk, w_uk)
        step_abs = model(tokens[:, 8:], cache=cache, mode="absorbed")
        full = model(tokens)[:, 8:]
        assert (step_abs - full).abs().max() < 1e-10
        model.to(torch.float32)  # new storage and dtype: the float64 weights are dropped
        assert attn.absorbed_weights().w_uk.dtype == torch.float32
        model.prepare_for_inference().train()
        assert attn.absorbed_weights() is not attn.absorbed_weights()


def test_absorbed_route_is_differentiable():
    model = _model()
    tokens = torch.randint(0, model.cfg.vocab_size, (1, 7))
    grads = {}
    for mode in ("absorbed", "expand"):
        model.zero_grad()
        cache = model.new_cache(1, 7)
        with torch.no_grad():
            model(tokens[:, :6], cache=cache, mode=mode)
        model(tokens[:, 6:], cache=cache, mode=mode).sum().backward()
        grads[mode] = model.layers[1].attn.wkv_b.weight.grad.clone()
    assert grads["absorbed"].abs().sum() > 0
    assert torch.allclose(grads["absorbed"], grads["expand"], atol=1e-10)


@pytest.mark.parametrize("masked", ["ragged", "causal_chunk"])
def test_latent_attention_fused_float32_matches_float64_math(masked):
    """The float32 route (SDPA with the RoPE scores as additive mask) against the float64 plain matmuls."""
    B, H, T, S, dc, dr = 3, 4, 3, 11, 32, 8
    g = torch.Generator().manual_seed(1)
    q, qr = (
        torch.randn(B, H, T, dc, generator=g, dtype=torch.float64),
        torch.randn(B, H, T, dr, generator=g, dtype=torch.float64),
    )
    c, kr = (
        torch.randn(B, S, dc, generator=g, dtype=torch.float64),
        torch.randn(B, S, dr, generator=g, dtype=torch.float64),
    )
    tokens = torch.zeros(B, T, dtype=torch.long)
    step = Step.build(tokens, start=S - T, pad=torch.tensor([0, 2, 5]) if masked == "ragged" else None)
    assert step.mask is not None
    ref = latent_attention(q, qr, c, kr, c, step, 0.3)
    fast = latent_attention(q.float(), qr.float(), c.float(), kr.float(), c.float(), step, 0.3)
    assert (fast.double() - ref).abs().max() < 1e-5
    causal = Step.build(torch.zeros(B, S, dtype=torch.long))  # prefill from empty: causal, no mask tensor
    q2, qr2 = torch.randn(B, H, S, dc, dtype=torch.float64), torch.randn(B, H, S, dr, dtype=torch.float64)
    ref = latent_attention(q2, qr2, c, kr, c, causal, 0.3)
    fast = latent_attention(q2.float(), qr2.float(), c.float(), kr.float(), c.float(), causal, 0.3)
    assert (fast.double() - ref).abs().max() < 1e-5
    assert (ref[:, :, 0] - c[:, None, 0]).abs().max() < 1e-12  # the first token sees only itself


@pytest.mark.parametrize("n_r", [1, 2])
@pytest.mark.parametrize("pad", [None, [0, 2, 5]])
def test_attend_split_rope_bias_equals_concatenated_keys(pad, n_r, monkeypatch):
    """Decode-sized calls add the shared RoPE key's scores as a mask; longer ones concatenate K: same result.
    n_r = 2: two RoPE keys, heads 0-1 read the first, heads 2-3 the second."""
    import kvlm.attention.latent_ops as mla_mod

    B, H, T, S, dh, dr = 3, 4, 3, 11, 16, 8
    q, qr = torch.randn(B, H, T, dh, dtype=torch.float64), torch.randn(B, H, T, dr, dtype=torch.float64)
    k, v = (
        torch.randn(B, S, H, dh, dtype=torch.float64).transpose(1, 2),
        torch.randn(B, H, S, dh, dtype=torch.float64),
    )
    kr = torch.randn(B, S, dr, dtype=torch.float64) if n_r == 1 else torch.randn(B, n_r, S, dr).double()
    kr_heads = kr[:, None].expand(-1, H, -1, -1) if n_r == 1 else kr[:, [0, 0, 1, 1]]
    step = Step.build(
        torch.zeros(B, T, dtype=torch.long), start=S - T, pad=None if pad is None else torch.tensor(pad)
    )
    scores = (torch.cat([q, qr], -1) @ torch.cat([k, kr_heads], -1).transpose(-1, -2)) * 0.3
    mask = step.mask if step.mask is not None else torch.ones(T, S, dtype=torch.bool).tril(S - T)
    ref = scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v
    with torch.no_grad():  # the RoPE-bias route is for inference-sized calls
        bias_route = mla_mod.attend_split(q, qr, k, kr, v, step, 0.3)
        monkeypatch.setattr(mla_mod, "_BIAS_ELEMENTS", 0)
        cat_route = mla_mod.attend_split(q, qr, k, kr, v, step, 0.3)
    assert (bias_route - ref).abs().max() < 1e-12
    assert (cat_route - ref).abs().max() < 1e-12


@pytest.mark.parametrize("q_lora_rank", [0, 24])
def test_parameters_carry_deepseek_names_and_layouts(q_lora_rank):
    """DeepSeek-V3's names and fused layouts (kvlm/attention/latent.py): wq or wq_a / q_norm / wq_b, wkv_a =
    [W^DKV; W^KR], kv_norm, wkv_b with each head's [W^UK_i; W^UV_i], wo."""
    cfg = tiny_config("mla", q_lora_rank=q_lora_rank, bias=True)
    d, h, dh, dr, dc = cfg.d_model, cfg.n_head, cfg.head_dim, cfg.rope_head_dim, cfg.kv_lora_rank
    shapes = {n: tuple(p.shape) for n, p in MLA(cfg, 0).named_parameters()}
    query = (
        {
            "wq_a.weight": (24, d),
            "wq_a.bias": (24,),
            "q_norm.weight": (24,),
            "wq_b.weight": (h * (dh + dr), 24),
        }
        if q_lora_rank
        else {"wq.weight": (h * (dh + dr), d)}
    )
    query.update({"wq_b.bias": (h * (dh + dr),)} if q_lora_rank else {"wq.bias": (h * (dh + dr),)})
    assert shapes == {
        **query,
        "wkv_a.weight": (dc + dr, d),
        "wkv_a.bias": (dc + dr,),
        "kv_norm.weight": (dc,),
        "wkv_b.weight": (h * 2 * dh, dc),
        "wkv_b.bias": (h * 2 * dh,),
        "wo.weight": (d, h * dh),
        "wo.bias": (d,),
    }


def _paper_params(d, h, dh, dr, dc, dq, n_r=1):
    """mlra.md Table 1, MLA row; with d'_c = 0 a plain W^Q of d x h (d_h + d_h^R); W^KR n_R times as wide."""
    q = dq * (d + h * dh + h * dr) if dq else d * h * (dh + dr)
    return q + d * n_r * dr + dc * (d + 2 * h * dh) + d * h * dh


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"q_lora_rank": 24},
        {"rope": False},
        {"q_lora_rank": 40, "rope_head_dim": 16, "kv_lora_rank": 48},
        {"rope_kv_heads": 4},
    ],
)
def test_parameter_count_equals_paper(overrides):
    cfg = tiny_config("mla", **overrides)
    attn = MLA(cfg, 0)
    d, h, dh, dr, dc, dq = (
        cfg.d_model,
        cfg.n_head,
        cfg.head_dim,
        cfg.rope_head_dim,
        cfg.kv_lora_rank,
        cfg.q_lora_rank,
    )
    n_r = overrides.get("rope_kv_heads", 1)
    norms = dc + dq  # RMSNorm weights on c^KV and c^Q
    assert sum(p.numel() for p in attn.parameters()) == _paper_params(d, h, dh, dr, dc, dq, n_r) + norms
    # separate latents: a second down-projection and norm, W^UK / W^UV unchanged
    sep = MLA(cfg.replace(kv_latent="separate"), 0)
    n_sep = sum(p.numel() for p in sep.parameters())
    assert n_sep == _paper_params(d, h, dh, dr, dc, dq, n_r) + norms + dc * d + dc


@pytest.mark.parametrize(
    "overrides",
    [{}, {"rope": False}, {"kv_latent": "separate", "kv_lora_rank": 32}, {"rope_kv_heads": 2}],
)
def test_cache_bytes_are_latent_plus_rope_key(overrides):
    model = _model(torch.float32, **overrides)
    cfg = model.cfg
    n_latent = 2 if cfg.kv_latent == "separate" else 1
    n_r = overrides.get("rope_kv_heads", 1)
    per_layer = n_latent * cfg.kv_lora_rank + n_r * cfg.rope_head_dim  # d_c + n_R d_h^R (2 r + .. separate)
    assert cfg.kv_cache_elements_per_token() == cfg.n_layer * per_layer
    cache = model.new_cache(3, 10)
    assert cache.nbytes == 3 * 10 * cfg.n_layer * per_layer * 4
    assert set(cache.layers[0]) == ({"c_k", "c_v"} if n_latent == 2 else {"c_kv"}) | (
        {"k_rope"} if cfg.rope_head_dim else set()
    )
    naive = model.new_cache(3, 10, naive=True)
    h, dh, dr = cfg.n_head, cfg.head_dim, cfg.rope_head_dim
    assert naive.nbytes == 3 * 10 * cfg.n_layer * h * (2 * dh + dr) * 4


def test_small_lm_grid_r_equal_d_caches_what_mha_caches():
    """mla-small-lm.md Table 2: r = d without RoPE caches as much as MHA, r = d/2 half of it."""
    mha = tiny_config("mha").kv_cache_elements_per_token()
    full = tiny_config("mla", kv_latent="separate", kv_lora_rank=64, rope=False)
    half = tiny_config("mla", kv_latent="separate", kv_lora_rank=32, rope=False)
    assert full.kv_cache_elements_per_token() == mha
    assert half.kv_cache_elements_per_token() * 2 == mha


def test_scale_and_scaling_factors():
    cfg = tiny_config("mla", q_lora_rank=16, kv_lora_rank=32, latent_scaling=True)
    attn = MLA(cfg, 0)
    assert attn.scale == 1 / math.sqrt(cfg.head_dim + cfg.rope_head_dim)
    assert attn.alpha_q == math.sqrt(64 / 16) and attn.alpha_kv == math.sqrt(64 / 32)


@pytest.mark.parametrize(
    "overrides,match",
    [
        ({"kv_lora_rank": 65}, "kv_lora_rank=65 is larger than its input d_model=64"),
        ({"kv_lora_rank": 128, "kv_latent": "separate"}, "kv_lora_rank=128"),
        ({"q_lora_rank": 80}, "q_lora_rank=80"),
        ({"rope_head_dim": 7}, "rope_head_dim must be even"),
        ({"rope_head_dim": 32}, "rope_head_dim=32 is larger than head_dim=16"),
        ({"kv_lora_rank": 0}, "kv_lora_rank"),
        ({"rope_kv_heads": 3}, "n_head=4 is not divisible by rope_kv_heads=3"),
        ({"rope_kv_heads": 0}, "rope_kv_heads must be >= 1"),
        ({"rope_kv_heads": 2, "rope": False}, "rope_kv_heads=2 needs decoupled RoPE keys"),
    ],
)
def test_config_errors(overrides, match):
    with pytest.raises(ConfigError, match=match):
        tiny_config("mla", **overrides)


@pytest.mark.parametrize("attention", ["eg-mla", "mlra-2", "gla-2", "gta", "mha"])
def test_rope_kv_heads_is_mla_only(attention):
    """Subclasses and relatives of MLA keep one shared RoPE key: n_R > 1 is refused, n_R = 1 still builds."""
    with pytest.raises(ConfigError, match=f"rope_kv_heads=2: attention '{attention}'"):
        tiny_config(attention, rope_kv_heads=2)
    tiny_config(attention, rope_kv_heads=1)


def test_mode_and_cache_mismatch_is_a_clear_error():
    model = _model()
    tokens = torch.randint(0, model.cfg.vocab_size, (1, 4))
    with pytest.raises(CacheError, match="naive=True"):
        model(tokens, cache=model.new_cache(1, 8), mode="naive")
    with pytest.raises(CacheError, match="compact cache"):
        model(tokens, cache=model.new_cache(1, 8, naive=True), mode="absorbed")
    attn, x = model.layers[0].attn, torch.randn(1, 4, model.cfg.d_model, dtype=torch.float64)
    naive = ContiguousLayer(attn.cache_spec(naive=True), 1, 8, torch.float64, naive=True)
    out = attn(x, Step.build(tokens), naive)  # "auto" on a naive cache takes the naive route
    assert (out - attn(x, Step.build(tokens))).abs().max() < 1e-12


@pytest.mark.parametrize(
    "overrides",
    [
        dict(kv_lora_rank=8),  # d_c < d_h: both folds read fewer weights
        dict(kv_lora_rank=64),  # d_c = d: neither fold pays
        dict(kv_lora_rank=8, q_lora_rank=16),
        dict(kv_lora_rank=8, gated=True),  # the output gate sits between W~^UV and W^O: no output fold
    ],
)
def test_auto_fold_reads_fewest_weight_elements(overrides):
    """The absorbed route folds W^UQ.W~^UK and W~^UV.W^O exactly when the folded matrix is smaller than the two
    it replaces (fewer weight bytes per decode step); sizes counted here from the shapes, per layer."""
    cfg = tiny_config("mla", **overrides)
    attn = build_model(cfg).layers[0].attn
    h, dh, dc, d = cfg.n_head, cfg.head_dim, cfg.kv_lora_rank, cfg.d_model
    n_in = cfg.q_lora_rank or d
    q_separate, q_folded = h * dh * n_in + h * dh * dc, n_in * h * dc  # (W^UQ nope rows, W~^UK) vs W^UQ W~^UK
    o_separate, o_folded = h * dc * dh + d * h * dh, h * dc * d  # (W~^UV, W^O) vs W~^UV W^O
    assert attn.fold_choice() == (q_folded < q_separate, not cfg.gated and o_folded < o_separate)
