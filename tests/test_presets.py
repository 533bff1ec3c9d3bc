"""Presets against the papers' configuration tables (numbers typed here from ../shared/papers)."""

import math

import pytest

import kvlm
from kvlm import ConfigError, ModelConfig, count_parameters
from kvlm.preset_table import families, get_preset, match_ffn_dim, presets

# mlra.md Appendix F: "# Parameters" (M) and d_f of Tables 7-17 (main), 30-32 (2x heads), 33-37 (gated)
MLRA_29B = {
    "mha": ("2872.59", 8192),
    "mqa": ("2872.00", 10152),
    "gqa": ("2872.59", 9728),
    "mla": ("2872.05", 9448),
    "mfa": ("2873.23", 8024),
    "tpa": ("2873.18", 10760),
    "gla-2": ("2872.63", 10048),
    "gla-4": ("2873.22", 10136),
    "gta": ("2872.00", 9960),
    "mlra-2": ("2872.63", 10048),
    "mlra-4": ("2873.22", 9880),
    "gqa-2xheads": ("2872.59", 7680),
    "mla-2xheads": ("2873.23", 7320),
    "gla-2-2xheads": ("2873.22", 8344),
    "gqa-gated": ("2872.59", 8704),
    "mla-gated": ("2872.05", 8424),
    "gla-2-gated": ("2872.63", 9024),
    "mlra-2-gated": ("2872.63", 9024),
    "mlra-4-gated": ("2873.22", 8856),
}


def test_names_and_families():
    fams = families()
    assert {"mlra-2.9b", "mlra-table1", "eg-mla-base", "eg-mla-large", "small-lm", "tiny"} <= set(fams)
    names = presets()
    assert len(names) == len(set(names))
    for fam, members in fams.items():
        assert members and all(n.startswith(fam + "/") and n in names for n in members)
    assert set(fams["mlra-2.9b"]) == {f"mlra-2.9b/{v}" for v in MLRA_29B}
    # kvlm.presets() keeps working after the kvlm.preset_table module has been imported (it is, above)
    assert kvlm.presets() == names


def test_from_preset_overrides_aliases_and_case():
    cfg = get_preset("mlra-2.9b/mla", latent_scaling=False)
    assert cfg.attention == "mla" and not cfg.latent_scaling and cfg.ffn_dim == 9448
    assert get_preset("MLRA-2.9B/MLA").to_dict() == get_preset("mlra-2.9b/mla").to_dict()
    assert get_preset("small-lm/6L-256d").to_dict() == get_preset("small-lm/6L-256d/mha").to_dict()
    a, b = get_preset("tiny/mha"), get_preset("tiny/mha")
    a.n_layer = 99  # a fresh config each time
    assert b.n_layer == 4


def test_unknown_preset_suggests_close_names():
    with pytest.raises(ConfigError, match="mlra-2.9b/mlra-4") as e:
        get_preset("mlra-2.9b/mlra4")
    assert "families" in str(e.value)
    with pytest.raises(ValueError, match="unknown preset"):
        get_preset("nope")


@pytest.mark.parametrize("variant", list(MLRA_29B))
def test_mlra_29b_parameters_equal_tables(variant):
    paper_m, paper_ff = MLRA_29B[variant]
    cfg = get_preset(f"mlra-2.9b/{variant}")
    # Table 11 lists MFA's head as d_h = 256 (its heads are 2 d_h wide)
    assert (cfg.n_layer, cfg.d_model, cfg.head_dim, cfg.vocab_size) == (
        24,
        3072,
        256 if variant == "mfa" else 128,
        50304,
    )
    assert cfg.ffn_dim == paper_ff
    total = count_parameters(cfg)["total"]
    assert f"{total / 1e6:.2f}" == paper_m, f"{variant}: {total:,} parameters, paper {paper_m}M"


@pytest.mark.parametrize("variant", [v for v in MLRA_29B if v != "mha"])
def test_match_ffn_dim_derives_the_papers_widths(variant):
    """mlra.md Sec. 4.1: d_f is chosen so the total matches MHA; from any start width we land on the table's."""
    cfg = get_preset(f"mlra-2.9b/{variant}").replace(ffn_dim=8192)
    matched = match_ffn_dim(cfg, "mlra-2.9b/mha")
    assert matched.ffn_dim == MLRA_29B[variant][1]
    assert matched.ffn_dim % 8 == 0


def test_match_ffn_dim_is_closest_and_errors():
    ref = get_preset("tiny/mha")
    cfg = get_preset("tiny/mla").replace(ffn_dim=64)
    m = match_ffn_dim(cfg, ref, multiple=16)
    target = count_parameters(ref)["total"]
    gap = abs(count_parameters(m)["total"] - target)
    for other in (m.ffn_dim - 16, m.ffn_dim + 16):
        assert gap <= abs(count_parameters(m.replace(ffn_dim=other))["total"] - target)
    tiny_ref = ModelConfig(attention="mha", n_layer=1, d_model=64, n_head=4, vocab_size=10, ffn_dim=8)
    with pytest.raises(ConfigError, match="cannot match"):
        match_ffn_dim(get_preset("tiny/mha"), tiny_ref)


def test_tiny_family_covers_every_mechanism_at_matched_size():
    from kvlm.attention import registry

    tiny = {n.split("/", 1)[1]: get_preset(n) for n in families()["tiny"]}
    assert set(registry()) <= {c.attention for c in tiny.values()}
    assert {"mla-norope", "eg-mla"} <= set(tiny)
    ref = count_parameters(tiny["mha"])["activated"]
    assert 1e6 <= ref <= 5e6
    for name, cfg in tiny.items():
        assert (cfg.n_layer, cfg.d_model, cfg.vocab_size, cfg.max_seq_len) == (4, 192, 4096, 256)
        counts = count_parameters(cfg)
        # within one FFN step (8 widths x 3 matrices x d x n_layer) of tiny/mha
        assert abs(counts["activated"] - ref) <= 4 * 3 * 192 * 4, name
    assert not tiny["mla-norope"].rope and tiny["mla-norope"].rope_head_dim == 0


def test_mlra_table1_attention_parameters_equal_table1_formulas():
    """mlra.md Table 1, "# Parameters" column, per layer; the RMSNorm weights of the latents (q_norm over
    d'_c, kv_norm over d_c) are not in the paper's formulas and are added here."""
    d, h, dh, dr, dc, dq, g, bq, bkv = 7168, 64, 128, 64, 512, 1536, 8, 6, 2
    latent = dq * (d + h * dh + h * dr) + d * dr + d * h * dh + dq + dc
    formulas = {
        "mha": 4 * d * h * dh,
        "mqa": 2 * d * dh * (h + 1),
        "gqa": 2 * d * dh * (h + g),
        "mla": latent + dc * (d + 2 * h * dh),
        "mfa": dq * (d + h * 2 * dh) + 2 * d * 2 * dh + d * h * 2 * dh + dq,
        "tpa": d * (bq + 2 * bkv) * (h + dh) + d * h * dh,
        "gla-2": latent + dc * (d + h * dh),
        "gta": d * h * dh + d * g * dh + d * dr + d * h * dh,
        "mlra-2": latent + dc * (d + h * dh),
        "mlra-4": latent + dc * (d + 2 * h * dh),
    }
    for name, expected in formulas.items():
        cfg = get_preset(f"mlra-table1/{name}")
        assert cfg.n_layer == 1 and cfg.n_head == 64
        assert count_parameters(cfg)["attention"] == expected, name


# eg-mla.md: Embed Size (M) of Tables 2, 7, 10 and 11 -- 12 (or 24) layers x 50,304 x kv_emb_dim, as printed
EG_EMBED_M = {
    "eg-mla-base/eg-mla-base-kv256": 154,
    "eg-mla-base/eg-mla-base-kv128": 154,
    "eg-mla-base/eg-mla-base-kv64": 154,
    "eg-mla-base/eg-mla-base-kv16": 154,
    "eg-mla-base/eg-mla-base-emb64": 38,
    "eg-mla-base/eg-mla-base-emb128": 77,
    "eg-mla-base/eg-mla-base-emb256": 154,
    "eg-mla-base/eg-mla-base-emb512": 309,
    "eg-mla-base/eg-mla-base-emb1024": 618,
    "eg-mla-base/eg-mla-base-emb2048": 1236,
    "eg-mla-large/eg-mla-large-kv128emb512": 309,
    "eg-mla-large/eg-mla-large-kv256emb512": 309,
    "eg-mla-large/eg-mla-xlarge-kv128emb512": 618,
    "eg-mla-base/mha-base": 0,
    "eg-mla-base/mla-base": 0,
}


def test_eg_mla_gate_embedding_sizes_equal_tables():
    for name, paper_m in EG_EMBED_M.items():
        counts = count_parameters(get_preset(name))
        # the paper truncates: 12 * 50304 * 64 = 38.63M is printed 38M, 24 * 50304 * 512 = 618.1M as 618M
        assert math.floor(counts["gate_embedding"] / 1e6) == paper_m, name
        assert counts["activated"] == counts["total"] - counts["gate_embedding"]


def test_eg_mla_base_shapes():
    mha = get_preset("eg-mla-base/mha-base")
    assert (mha.arch, mha.n_layer, mha.d_model, mha.n_head, mha.head_dim) == ("gpt2", 12, 768, 12, 64)
    assert round(count_parameters(mha)["total"] / 1e6) == 124  # Table 10: MHA-Base 124M (GPT-2 small)
    for kv in (256, 128, 64, 16):
        cfg = get_preset(f"eg-mla-base/eg-mla-base-kv{kv}")
        assert (cfg.kv_lora_rank, cfg.kv_emb_dim, cfg.q_lora_rank, cfg.rope_head_dim) == (kv, 256, 0, 64)
    lgz = get_preset("eg-mla-large/eg-mla-large-kv256emb512-lgz2")
    assert (lgz.eg_group_size, lgz.n_layer, lgz.d_model) == (2, 12, 2048)


# mla-small-lm.md Table 1: (layers, hidden, parameters in M)
SMALL_LM = {
    "6L-256d": (6, 256, 17.5),
    "6L-512d": (6, 512, 44.5),
    "9L-256d": (9, 256, 19.9),
    "9L-512d": (9, 512, 53.9),
    "12L-256d": (12, 256, 22.2),
    "12L-512d": (12, 512, 63.3),
    "12L-768d": (12, 768, 123.3),
    "12L-1024d": (12, 1024, 202.7),
}


@pytest.mark.parametrize("config", list(SMALL_LM))
def test_small_lm_configs(config):
    n_layer, d, paper_m = SMALL_LM[config]
    mha = get_preset(f"small-lm/{config}")
    assert (mha.attention, mha.n_layer, mha.d_model, mha.arch, mha.max_seq_len) == (
        "mha",
        n_layer,
        d,
        "gpt2",
        512,
    )
    # the paper's counts are not self-consistent to 0.1M (12L-1024d is above V d + 12 L d^2, 6L-256d below);
    # GPT-2 blocks with biases and 512 learned positions land within 1.5 % of every row
    total = count_parameters(mha)["total"] / 1e6
    assert abs(total - paper_m) / paper_m < 0.015
    # the Table 2 grid: r = d ... d/32, without and with a decoupled RoPE key
    for k in (1, 2, 4, 8, 16, 32):
        r = d // k
        plain = get_preset(f"small-lm/{config}/mla-r{r}")
        rope = get_preset(f"small-lm/{config}/mla-rope-r{r}")
        assert plain.kv_latent == "separate" and plain.kv_lora_rank == r and not plain.rope
        assert rope.rope and rope.rope_head_dim > 0 and rope.kv_lora_rank == r
        # Eqs. 2-3: K and V latents of rank r are what is cached
        assert plain.kv_cache_elements_per_token() == 2 * r * n_layer
