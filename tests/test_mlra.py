"""GLA-2/4 and MLRA-2/4 beyond the generic contract: the routes against each other, the structure the paper
derives them from (GLA = MLA with group-restricted up-projections, Eq. 4; MLRA-2 = MLRA-4 with the off-group
branches silenced, Eq. 5 vs 6), parameter counts against mlra.md Tables 13-17, scaling factors, TP sharding
against Table 1, and configuration errors."""

import math

import pytest
import torch
from conftest import tiny_config

from kvlm import ConfigError, ModelConfig, build_model, count_parameters
from kvlm.attention import Step, get_attention_class
from kvlm.reference import reference_attention
from kvlm.reference.common import causal_attention, rope

LATENT = ["gla-2", "gla-4", "mlra-2", "mlra-4"]


def _attn(attention, dtype=torch.float64, **overrides):
    torch.manual_seed(0)
    model = build_model(tiny_config(attention, **overrides)).to(dtype).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model, model.layers[0].attn


@pytest.mark.parametrize("attention", LATENT)
def test_routes_agree_without_cache(attention):
    """The absorbed and expand routes compute the same full causal forward (float64)."""
    _, attn = _attn(attention, q_lora_rank=32, latent_scaling=True, attn_out_scaling=True)
    x = torch.randn(2, 9, 64, dtype=torch.float64)
    tokens = torch.zeros(2, 9, dtype=torch.long)
    outs = {m: attn(x, Step.build(tokens, mode=m)) for m in ("expand", "absorbed", "naive")}
    ref = reference_attention(attn, x, Step.build(tokens).positions)
    for mode, out in outs.items():
        assert (out - ref).abs().max().item() < 1e-12, mode


@pytest.mark.parametrize("attention", LATENT)
def test_decode_modes_agree_on_long_cache(attention):
    """After a 40-token ragged prefill, every decode step's logits agree across naive / expand / absorbed."""
    model, _ = _attn(attention, rope_head_dim=4)
    prompts = torch.randint(1, 97, (2, 40))
    steps = torch.randint(1, 97, (2, 3))
    logits = {}
    for mode in ("naive", "expand", "absorbed"):
        cache = model.new_cache(2, 43, naive=(mode == "naive"))
        cache.set_left_padding([0, 7])
        out = [model(prompts, cache=cache, mode=mode)[:, -1]]
        out += [model(steps[:, t : t + 1], cache=cache, mode=mode)[:, -1] for t in range(3)]
        logits[mode] = torch.stack(out, 1)
    assert (logits["absorbed"] - logits["naive"]).abs().max().item() < 1e-10
    assert (logits["expand"] - logits["naive"]).abs().max().item() < 1e-10


@pytest.mark.parametrize("attention", LATENT)
def test_routes_do_what_they_say(attention):
    """absorbed never up-projects the cached latent (wkv_b is not called, K/V never materialised); expand does,
    over every cached token; "auto" expands the prefill and absorbs the decode steps; the trace says so."""
    model, attn = _attn(attention)
    rows = []
    attn.wkv_b.register_forward_hook(lambda m, i, o: rows.append(i[0].shape[2]))  # (B, blocks, S, d_lat)
    tokens = torch.randint(0, 97, (1, 10))
    for mode, want_rows, want_routes in [
        ("absorbed", [], ["absorbed"] * 5),
        ("expand", [6, 7, 8, 9, 10], ["expand"] * 5),
        ("auto", [6], ["expand"] + ["absorbed"] * 4),
        ("naive", [6, 1, 1, 1, 1], ["materialised"] * 5),
    ]:
        rows.clear()
        trace = []
        cache = model.new_cache(1, 10, naive=(mode == "naive"))
        with torch.no_grad():
            model(tokens[:, :6], cache=cache, mode=mode, trace=trace)
            for t in range(6, 10):
                model(tokens[:, t : t + 1], cache=cache, mode=mode, trace=trace)
        assert rows == want_rows, mode
        assert [r for i, r in trace if i == 0] == want_routes, mode


def test_mode_and_cache_mismatch_is_a_clear_error():
    from kvlm import CacheError

    model, _ = _attn("mlra-4")
    tokens = torch.randint(0, 97, (1, 4))
    with pytest.raises(CacheError, match="naive=True"):
        model(tokens, cache=model.new_cache(1, 8), mode="naive")
    with pytest.raises(CacheError, match="compact"):
        model(tokens, cache=model.new_cache(1, 8, naive=True), mode="absorbed")


def test_gla2_is_mla_with_group_restricted_up_projections():
    """Sec. 2.2 / Eq. 4: GLA-2 equals MLA (one softmax per head over [C^KV W^UK_i, K^RoPE]) whose W^UK, W^UV are
    zero outside each head's latent group. Written here as MLA's equations on the full latent."""
    _, m = _attn("gla-2", latent_norm=False, q_lora_rank=0)
    cfg = m.cfg
    B, T, h, dh, dr, dc = 2, 7, cfg.n_head, cfg.head_dim, cfg.rope_head_dim, cfg.kv_lora_rank
    x = torch.randn(B, T, cfg.d_model, dtype=torch.float64)
    positions = torch.arange(T).expand(B, T)
    W_UK = torch.zeros(dc, h * dh, dtype=torch.float64)  # MLA's d_c x h d_h up-projections
    W_UV = torch.zeros(dc, h * dh, dtype=torch.float64)
    r, d_lat = h // 2, dc // 2
    w_uk, w_uv = m.up_weights()  # (blocks, r, d_h, d_lat): W^UK_(b),i^T and W^UV_(b),i^T
    for i in range(h):
        g, j = divmod(i, r)
        W_UK[g * d_lat : (g + 1) * d_lat, i * dh : (i + 1) * dh] = w_uk[g, j].T
        W_UV[g * d_lat : (g + 1) * d_lat, i * dh : (i + 1) * dh] = w_uv[g, j].T
    q = (x @ m.wq.weight.T).view(B, T, h, dh + dr)
    q = torch.cat([q[..., :dh], rope(q[..., dh:], positions, cfg.rope_theta)], -1)
    kv = x @ m.wkv_a.weight.T
    c_kv, k_rope = kv[..., :dc], rope(kv[..., dc:], positions, cfg.rope_theta)
    k = torch.cat([(c_kv @ W_UK).view(B, T, h, dh), k_rope[:, :, None].expand(B, T, h, dr)], -1)
    v = (c_kv @ W_UV).view(B, T, h, dh)
    mla = causal_attention(q, k, v, 1 / math.sqrt(dh + dr)).reshape(B, T, h * dh) @ m.wo.weight.T
    out = m(x, Step.build(torch.zeros(B, T, dtype=torch.long)))
    assert (out - mla).abs().max().item() < 1e-12


def test_mlra2_is_mlra4_with_off_group_branches_silenced():
    """Eq. 6 vs Eq. 5: MLRA-4 whose block b has W^UV = 0 for heads outside group b // 2 computes exactly MLRA-2
    (same W^DQ, W^DKV, norms, W^O); checks MLRA-2's latent-group-to-head mapping gamma(i)."""
    over = dict(q_lora_rank=32, latent_scaling=True, gated=True)
    _, m2 = _attn("mlra-2", **over)
    _, m4 = _attn("mlra-4", **over)
    h = m2.cfg.n_head
    with torch.no_grad():
        for name, p in m2.named_parameters():
            if name != "wkv_b.weight":
                m4.get_parameter(name).copy_(p)
        (uk2, uv2), (uk4, uv4) = m2.up_weights(), m4.up_weights()  # views of wkv_b
        uv4.zero_()  # W^UK stays random: a silenced branch contributes nothing whatever its scores
        for b in range(4):
            heads = slice((b // 2) * (h // 2), (b // 2 + 1) * (h // 2))
            uk4[b, heads] = uk2[b]
            uv4[b, heads] = uv2[b]
    x = torch.randn(2, 8, 64, dtype=torch.float64)
    step = Step.build(torch.zeros(2, 8, dtype=torch.long))
    assert (m2(x, step) - m4(x, step)).abs().max().item() < 1e-12


@pytest.mark.parametrize("attention,alpha_attn", [("mlra-4", 0.5), ("mlra-2", 1 / math.sqrt(2))])
def test_first_token_is_the_scaled_sum_of_block_values(attention, alpha_attn):
    """With one token every softmax is 1, so O_i = alpha_attn sum_b C_b W^UV_(b),i (Eq. 2 moved outside the
    softmax, Eq. 10's alpha_attn): an independent check of the branch sum and its scale."""
    _, m = _attn(attention, attn_out_scaling=True)
    x = torch.randn(3, 1, 64, dtype=torch.float64)
    c = m.latents(x, m.rope.cos_sin(torch.zeros(3, 1, dtype=torch.long), x.dtype))["c_kv"]  # (3, 4, 1, d_lat)
    w_uv = m.up_weights()[1]  # (4, r, d_h, d_lat): W^UV_(b),i^T
    h, bpg = m.cfg.n_head, 4 if attention == "mlra-4" else 2
    heads = []
    for i in range(h):
        blocks = range(4) if bpg == 4 else (2 * (i // (h // 2)), 2 * (i // (h // 2)) + 1)
        j = i if bpg == 4 else i % (h // 2)
        heads.append(alpha_attn * sum(c[:, b, 0] @ w_uv[b, j].T for b in blocks))
    expected = torch.cat(heads, -1) @ m.wo.weight.T
    out = m(x, Step.build(torch.zeros(3, 1, dtype=torch.long)))[:, 0]
    assert (out - expected).abs().max().item() < 1e-12


# --- the paper's 2.9B configurations (mlra.md Appendix F.1) -----------------------------------------------
BASE = dict(
    n_layer=24, d_model=3072, n_head=24, head_dim=128, vocab_size=50304, tie_embeddings=True, arch="llama"
)
LAT = dict(q_lora_rank=1024, kv_lora_rank=512, rope_head_dim=64, latent_scaling=True)


def _table1_attention(attention, d, h, dh, dr, dc, dq, g):
    """mlra.md Table 1 parameter formulas for one attention layer, + the latent RMSNorm weights (d'_c + d_c)."""
    up = {"gla": dc * h * dh * 2 // g, "mlra-2": dc * h * dh, "mlra-4": dc * 2 * h * dh}[attention]
    return dq * (d + h * dh + h * dr) + d * dr + dc * d + up + d * h * dh + dq + dc


@pytest.mark.parametrize(
    "attention,overrides,total_m,table",
    [
        ("gla-2", dict(ffn_dim=10048), 2872.63, "13"),
        ("gla-4", dict(ffn_dim=10136), 2873.22, "14"),
        ("mlra-2", dict(ffn_dim=10048, attn_out_scaling=True), 2872.63, "16"),
        ("mlra-4", dict(ffn_dim=9880, attn_out_scaling=True), 2873.22, "17"),
        ("gla-2", dict(ffn_dim=8344, n_head=48), 2873.22, "32 (2x heads)"),
        ("mlra-4", dict(ffn_dim=8856, gated=True), 2873.22, "37 (gated)"),
    ],
)
def test_parameter_counts_match_paper_tables(attention, overrides, total_m, table):
    cfg = ModelConfig(attention=attention, **{**BASE, **LAT, **overrides})
    counts = count_parameters(cfg)
    assert round(counts["total"] / 1e6, 2) == total_m, f"Table {table}"
    kind = "gla" if attention.startswith("gla") else attention
    g = {"gla-2": 2, "gla-4": 4}.get(attention, 1)
    per_layer = _table1_attention(kind, 3072, cfg.n_head, 128, 64, 512, 1024, g)
    per_layer += 3072 * cfg.n_head * 128 if cfg.gated else 0  # Appendix E's W^G
    assert counts["attention"] == 24 * per_layer


@pytest.mark.parametrize(
    "attention,alpha_kv,alpha_attn",
    [
        ("gla-2", math.sqrt(12), 1.0),
        ("gla-4", math.sqrt(24), 1.0),
        ("mlra-2", math.sqrt(24), math.sqrt(2) / 2),
        ("mlra-4", math.sqrt(24), 0.5),
    ],
)
def test_scaling_factors_match_paper_tables(attention, alpha_kv, alpha_attn):
    """Tables 13, 14, 16, 17: alpha_q = sqrt(3) for d'_c = 1024; alpha_kv and alpha_attn per mechanism."""
    cfg = ModelConfig(attention=attention, **{**BASE, **LAT, "n_layer": 1, "attn_out_scaling": True})
    with torch.device("meta"):
        m = get_attention_class(attention)(cfg, 0)
    assert m.alpha_q == pytest.approx(math.sqrt(3))
    assert m.alpha_kv == pytest.approx(alpha_kv)
    assert m.alpha_attn == pytest.approx(alpha_attn)


def per_device_loading(cfg, tp):
    """Cached elements each of tp devices reads per token per layer, from cache_spec and tp_shards."""
    cls = get_attention_class(cfg.attention)
    degree = min(tp, cls.tp_max_degree(cfg))
    shards = cls.tp_shards(cfg)
    spec = cfg.cache_spec()
    return sum(math.prod(s) / (1 if shards[n] == "replicated" else degree) for n, s in spec.items())


@pytest.mark.parametrize(
    "attention,loading",
    [("gla-2", [4.5, 2.5, 2.5, 2.5]), ("mlra-2", [4.5, 2.5, 1.5, 1.5]), ("mlra-4", [4.5, 2.5, 1.5, 1.5])],
)
def test_tensor_parallel_loading_matches_table1(attention, loading):
    """Table 1 (Kimi-K2 shape: h = 64, d_h = 128, d_c = 4 d_h, d_h^R = d_h / 2), loading per device in d_h at TP 1/2/4/8."""
    cfg = ModelConfig(
        attention=attention,
        n_layer=1,
        d_model=7168,
        n_head=64,
        head_dim=128,
        kv_lora_rank=512,
        rope_head_dim=64,
        q_lora_rank=1536,
    )
    assert cfg.kv_cache_elements_per_token() == 512 + 64
    assert [per_device_loading(cfg, tp) / 128 for tp in (1, 2, 4, 8)] == loading


def test_naive_cache_materialises_every_branch():
    cfg = tiny_config("mlra-4")
    spec = get_attention_class("mlra-4").spec_for(cfg, naive=True)
    assert spec == {"k": (16, 16 + 8), "v": (16, 16)}  # 4 branches x 4 heads
    assert get_attention_class("gla-2").spec_for(tiny_config("gla-2"), naive=True)["v"] == (4, 16)


@pytest.mark.parametrize(
    "attention,overrides,match",
    [
        ("mlra-4", {"kv_lora_rank": 30}, "kv_lora_rank=30"),
        ("mlra-2", {"kv_lora_rank": 18}, "multiple of 4"),
        ("gla-4", {"kv_lora_rank": 34}, "multiple of 4"),
        ("gla-4", {"d_model": 48, "n_head": 6}, "n_head=6"),
        ("mlra-2", {"d_model": 48, "n_head": 3}, "n_head=3"),
        ("gla-2", {"kv_latent": "separate"}, "kv_latent"),
    ],
)
def test_config_errors(attention, overrides, match):
    with pytest.raises(ConfigError, match=match):
        tiny_config(attention, **overrides)
