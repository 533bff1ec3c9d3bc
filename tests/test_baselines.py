"""GTA, MFA and TPA beyond the generic contract: their decode routes against each other, the structure they
reduce to (GTA without RoPE = GQA with K = V; MFA = MQA with a factored W_Q), parameter counts against
mlra.md Tables 11, 12, 15 and Table 1's formulas, TP loading against Table 1, and configuration errors."""

import math

import pytest
import torch
from conftest import tiny_config
from test_mlra import BASE, per_device_loading

import kvlm.attention.gta as gta_module
import kvlm.attention.tpa as tpa_module
from kvlm import ConfigError, ModelConfig, build_model, count_parameters
from kvlm.attention import MATERIALISED, Step, get_attention_class


def _model(attention, dtype=torch.float64, **overrides):
    torch.manual_seed(0)
    model = build_model(tiny_config(attention, **overrides)).to(dtype).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


@pytest.mark.parametrize(
    "attention,overrides,modes",
    [
        ("gta", {"n_kv_head": 2}, ["expand", "absorbed"]),
        ("gta", {"n_kv_head": 2, "rope": False}, ["expand", "absorbed"]),
        ("tpa", {}, ["naive", "expand", "absorbed"]),
        ("tpa", {"tpa_q_rank": 2, "tpa_kv_rank": 3, "rope": False}, ["naive", "expand", "absorbed"]),
    ],
)
def test_decode_routes_agree_on_long_cache(attention, overrides, modes):
    """After a 40-token ragged prefill, decode logits agree across routes, and with the uncached forward."""
    model = _model(attention, **overrides)
    prompts = torch.randint(1, 97, (2, 40))
    steps = torch.randint(1, 97, (2, 3))
    logits = {}
    for mode in modes:
        cache = model.new_cache(2, 43, naive=(mode == "naive"))
        out = [model(prompts, cache=cache, mode=mode)[:, -1]]
        out += [model(steps[:, t : t + 1], cache=cache, mode=mode)[:, -1] for t in range(3)]
        logits[mode] = torch.stack(out, 1)
    full = model(torch.cat([prompts, steps], 1))[:, 39:]
    for mode in modes:
        assert (logits[mode] - full).abs().max().item() < 1e-10, mode


@pytest.mark.parametrize(
    "attention,overrides",
    [
        ("mha", {}),
        ("gqa", {"n_kv_head": 2}),
        ("mfa", {"q_lora_rank": 32}),
        ("gta", {"n_kv_head": 2}),
        ("tpa", {}),
    ],
)
def test_each_mode_takes_its_declared_route(attention, overrides):
    """Step.trace shows, layer by layer, that a decode step in each mode runs the route decode_routes names."""
    model = _model(attention, **overrides)
    routes = get_attention_class(attention).decode_routes(model.cfg)
    tokens = torch.randint(1, 97, (2, 21))
    for mode, route in routes.items():
        cache = model.new_cache(2, 21, naive=route == MATERIALISED)
        trace = []
        model(tokens[:, :20], cache=cache, mode=mode, trace=trace)  # a long first prefill
        if mode == "auto" and route in ("absorbed", "factorised"):
            assert trace == [(i, "expand") for i in range(model.cfg.n_layer)]  # 20 new tokens: expand once
        trace = []
        model(tokens[:, 20:], cache=cache, mode=mode, trace=trace)
        assert trace == [(i, route) for i in range(model.cfg.n_layer)], mode


@pytest.mark.parametrize(
    "attention,overrides,forbidden",
    [
        ("gta", {"n_kv_head": 2}, [(gta_module, "attend")]),
        ("gta", {"n_kv_head": 2, "rope": False}, [(gta_module, "attend")]),
        ("tpa", {}, [(tpa_module, "attend"), (tpa_module.TensorProductAttention, "heads")]),
    ],
)
def test_in_place_routes_never_build_per_head_keys(attention, overrides, forbidden, monkeypatch):
    """GTA's absorbed and TPA's factorised decode attend over the compact cache in place: with the functions that
    build or attend over per-head keys and values disabled they still match the full forward."""
    model = _model(attention, **overrides)
    tokens = torch.randint(1, 97, (2, 12))
    full = model(tokens)

    def materialises(*args, **kwargs):
        raise AssertionError("per-head keys and values were built")

    for owner, name in forbidden:
        monkeypatch.setattr(owner, name, materialises)
    cache = model.new_cache(2, 12)
    trace = []
    out = torch.cat([model(tokens[:, t : t + 1], cache=cache, trace=trace) for t in range(12)], 1)
    assert {route for _, route in trace} == {get_attention_class(attention).decode_routes(model.cfg)["auto"]}
    assert (out - full).abs().max().item() < 1e-10
    with pytest.raises(AssertionError, match="per-head"):
        model(tokens)  # the full forward (expand) does build them: the patch is live


def test_decode_cost_per_route():
    """decode_cost against hand counts: TPA's factorised step, its expand step (mlra.md Table 2's count) and the
    materialised one, with the cache elements each reads; GQA's plain step."""
    cfg = tiny_config("tpa")  # h 4, d_h 16, beta_q 6, beta_kv 2
    tpa = get_attention_class("tpa")
    h, dh, bq, bkv = 4, 16, 6, 2
    cost = tpa.decode_cost(cfg, batch=3, n_cached=10)
    factorised = 2 * bq * bkv * dh + 2 * bq * bkv * h + 2 * bkv * h + bkv * h + 2 * bkv * h * dh
    assert cost == {"flops": 30 * factorised, "cache_elements": 30 * 2 * bkv * (h + dh), "weight_elements": 0}
    assert tpa.decode_cost(cfg, 3, 10, "expand")["flops"] == 30 * (4 * h * bkv * dh + 4 * h * dh)
    naive = tpa.decode_cost(cfg, 3, 10, "naive")
    assert naive["flops"] == 30 * 4 * h * dh and naive["cache_elements"] == 30 * 2 * h * dh
    gqa = get_attention_class("gqa")
    cfg = tiny_config("gqa", n_kv_head=2)
    assert gqa.decode_cost(cfg, 2, 5) == {
        "flops": 10 * 4 * h * dh,
        "cache_elements": 10 * 2 * 2 * dh,
        "weight_elements": 0,
    }
    with pytest.raises(ConfigError, match="no decode mode or route"):
        gqa.decode_cost(cfg, 2, 5, "absorbed")


def test_gta_without_rope_is_gqa_with_tied_keys():
    """C.7 with d_h^R = 0: every key is its group's value, so GTA is GQA whose W^K equals W^V."""
    gta = _model("gta", n_kv_head=2, rope=False).layers[0].attn
    gqa = _model("gqa", n_kv_head=2, rope=False).layers[0].attn
    with torch.no_grad():
        gqa.wq.weight.copy_(gta.wq.weight)
        gqa.wk.weight.copy_(gta.wkv.weight)
        gqa.wv.weight.copy_(gta.wkv.weight)
        gqa.wo.weight.copy_(gta.wo.weight)
    x = torch.randn(2, 9, 64, dtype=torch.float64)
    step = Step.build(torch.zeros(2, 9, dtype=torch.long))
    assert (gta(x, step) - gqa(x, step)).abs().max().item() < 1e-12


def test_mfa_without_query_norm_is_mqa_with_factored_query():
    """C.4 with the RMSNorm off: Q = H W^CQ W^UQ, one K/V head, so MFA is MQA with W^Q = W^CQ W^UQ."""
    mfa = _model("mfa", q_lora_rank=24, head_dim=32, latent_norm=False).layers[0].attn
    mqa = _model("mqa", head_dim=32).layers[0].attn
    with torch.no_grad():
        mqa.wq.weight.copy_(mfa.wq_b.weight @ mfa.wq_a.weight)
        mqa.wk.weight.copy_(mfa.wk.weight)
        mqa.wv.weight.copy_(mfa.wv.weight)
        mqa.wo.weight.copy_(mfa.wo.weight)
    x = torch.randn(2, 9, 64, dtype=torch.float64)
    step = Step.build(torch.zeros(2, 9, dtype=torch.long))
    assert (mfa(x, step) - mqa(x, step)).abs().max().item() < 1e-12


@pytest.mark.parametrize(
    "attention,overrides,total_m,table,per_layer",
    [
        # Table 1: d h d_h + d g d_h + d d_h^R + d h d_h
        (
            "gta",
            dict(n_kv_head=6, rope_head_dim=64, ffn_dim=9960),
            2872.00,
            "15",
            3072 * 24 * 128 + 3072 * 6 * 128 + 3072 * 64 + 3072 * 24 * 128,
        ),
        # Table 1: d'_c (d + h 2 d_h) + 2 d 2 d_h + d h 2 d_h, + the query RMSNorm (d'_c); the paper's 2 d_h = 256
        (
            "mfa",
            dict(head_dim=256, q_lora_rank=2048, ffn_dim=8024),
            2873.23,
            "11",
            2048 * (3072 + 24 * 256) + 2 * 3072 * 256 + 3072 * 24 * 256 + 2048,
        ),
        # Table 1: d (beta_q + 2 beta_kv)(h + d_h) + d h d_h
        (
            "tpa",
            dict(tpa_q_rank=6, tpa_kv_rank=2, ffn_dim=10760),
            2873.18,
            "12",
            3072 * (6 + 2 * 2) * (24 + 128) + 3072 * 24 * 128,
        ),
    ],
)
def test_parameter_counts_match_paper_tables(attention, overrides, total_m, table, per_layer):
    counts = count_parameters(ModelConfig(attention=attention, **{**BASE, **overrides}))
    assert round(counts["total"] / 1e6, 2) == total_m, f"Table {table}"
    assert counts["attention"] == 24 * per_layer


@pytest.mark.parametrize(
    "attention,overrides,loading",
    [
        ("gta", dict(n_kv_head=8, rope_head_dim=64), [8.5, 4.5, 2.5, 1.5]),
        ("tpa", dict(tpa_kv_rank=2), [6, 5, 4.5, 4.25]),
        ("mfa", dict(head_dim=256, q_lora_rank=1536), [4, 4, 4, 4]),  # MFA's heads are 2 d_h wide
    ],
)
def test_tensor_parallel_loading_matches_table1(attention, overrides, loading):
    """Table 1 (h = 64, d_h = 128; GTA g = 8, TPA beta_kv = 2): loading per device in d_h at TP 1/2/4/8."""
    cfg = ModelConfig(
        attention=attention, **{"n_layer": 1, "d_model": 7168, "n_head": 64, "head_dim": 128, **overrides}
    )
    assert [per_device_loading(cfg, tp) / 128 for tp in (1, 2, 4, 8)] == loading


def test_tpa_gta_mfa_cache_specs():
    assert tiny_config("tpa").cache_spec() == {"k_a": (2, 4), "k_c": (2, 16), "v_a": (2, 4), "v_c": (2, 16)}
    assert get_attention_class("tpa").spec_for(tiny_config("tpa"), naive=True) == {"k": (4, 16), "v": (4, 16)}
    assert tiny_config("gta", n_kv_head=2).cache_spec() == {"v": (2, 16), "k_rope": (8,)}
    assert tiny_config("gta", rope=False).cache_spec() == {"v": (1, 16)}
    assert tiny_config("mfa", head_dim=32).cache_spec() == {"k": (1, 32), "v": (1, 32)}


@pytest.mark.parametrize(
    "attention,overrides,match",
    [
        ("gta", {"rope_head_dim": 18}, "rope_head_dim=18"),
        ("gta", {"n_kv_head": 3}, "n_kv_head=3"),
        ("tpa", {"tpa_kv_rank": 0}, "tpa_kv_rank"),
        ("tpa", {"tpa_q_rank": 0}, "tpa_q_rank"),
    ],
)
def test_config_errors(attention, overrides, match):
    with pytest.raises(ConfigError, match=match):
        tiny_config(attention, **overrides)


def test_tpa_factorized_decode_reads_no_per_head_keys():
    """The absorbed TPA route works from the compact cache alone: it must agree with naive decoding even when the
    cache holds only factors (no 'k'/'v' buffers exist to fall back on)."""
    model = _model("tpa")
    cache = model.new_cache(1, 12)
    assert set(cache.layers[0]) == {"k_a", "k_c", "v_a", "v_c"}
    tokens = torch.randint(0, 97, (1, 12))
    out = torch.cat([model(tokens[:, t : t + 1], cache=cache, mode="absorbed") for t in range(12)], 1)
    assert (out - model(tokens)).abs().max().item() < 1e-10
    assert math.isclose(cache.nbytes, 1 * 12 * model.cfg.kv_cache_elements_per_token() * 8)
