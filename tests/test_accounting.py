"""kv-table against the papers: eg-mla.md Table 10, mlra.md Tables 1 and 2 (numbers typed from the papers)."""

import argparse
import json

import pytest

from kvlm import ConfigError, ModelConfig
from kvlm.accounting import (
    arithmetic_intensity,
    cache_tensors,
    kv_table,
    per_device_elements,
    select,
)
from kvlm.cli.kv_table import add_arguments, main
from kvlm.preset_table import families, get_preset

# --- eg-mla.md Appendix F, Table 10: KV cache / token (#element) -----------------------------------------

TABLE10 = {
    "eg-mla-base/mha-base": "18.43K",
    "eg-mla-base/mla-base": "3.84K",
    "eg-mla-base/eg-mla-base-kv256": "3.84K",
    "eg-mla-base/eg-mla-base-kv128": "2.30K",
    "eg-mla-base/eg-mla-base-kv64": "1.54K",
    "eg-mla-base/eg-mla-base-kv16": "0.96K",
}


def test_eg_mla_table10_elements_and_reductions():
    rows = {r["name"]: r for r in kv_table(list(TABLE10), params=False)}
    for name, paper in TABLE10.items():
        assert f"{rows[name]['kv_elements_per_token'] / 1000:.2f}K" == paper, name
    kv64 = rows["eg-mla-base/eg-mla-base-kv64"]
    assert kv64["reference"] == "eg-mla-base/mha-base" and kv64["mla_reference"] == "eg-mla-base/mla-base"
    # exact savings: 1 - 1536 / 18432 = 91.67 %, 1 - 1536 / 3840 = 60.0 %
    assert round(100 * kv64["kv_reduction_vs_mha"], 1) == 91.7
    assert round(100 * kv64["kv_reduction_vs_mla"], 1) == 60.0
    # the paper's 91.6 % and 59.9 % come from the rounded 1.54K / 18.43K / 3.84K
    assert round(100 * (1 - 1.54 / 18.43), 1) == 91.6 and round(100 * (1 - 1.54 / 3.84), 1) == 59.9
    # "reduces this number by up to 94.8 %" (kv16)
    assert round(100 * rows["eg-mla-base/eg-mla-base-kv16"]["kv_reduction_vs_mha"], 1) == 94.8


# --- mlra.md Table 1: KV cache and loading per token per device, in units of d_h --------------------------

TABLE1_LOADING = {  # 1, 2, 4, 8 devices
    "mha": (128, 64, 32, 16),
    "mqa": (2, 2, 2, 2),
    "gqa": (16, 8, 4, 2),
    "mla": (4.5, 4.5, 4.5, 4.5),
    "mfa": (4, 4, 4, 4),
    "tpa": (6, 5, 4.5, 4.25),
    "gla-2": (4.5, 2.5, 2.5, 2.5),
    "gta": (8.5, 4.5, 2.5, 1.5),
    "mlra-2": (4.5, 2.5, 1.5, 1.5),
    "mlra-4": (4.5, 2.5, 1.5, 1.5),
}


def test_mlra_table1_per_device_loading():
    rows = {r["attention"]: r for r in kv_table("mlra-table1", tp=(1, 2, 4, 8), params=False)}
    for attention, paper in TABLE1_LOADING.items():
        row = rows[attention]
        assert row["unit_d_h"] == 128
        got = tuple(row["per_device"][t]["d_h"] for t in (1, 2, 4, 8))
        assert got == pytest.approx(paper, abs=1e-12), attention


def test_mlra_table1_kv_cache_column():
    h, dh, g, dc, dr, bkv = 64, 128, 8, 512, 64, 2
    paper = {  # "KV Cache" column, per token per layer
        "mha": 2 * h * dh,
        "mqa": 2 * dh,
        "gqa": 2 * g * dh,
        "mla": dc + dr,
        "mfa": 4 * dh,
        "tpa": 2 * bkv * (h + dh),
        "gla-2": dc + dr,
        "gta": g * dh + dr,
        "mlra-2": dc + dr,
        "mlra-4": dc + dr,
    }
    for attention, elements in paper.items():
        cfg = get_preset(f"mlra-table1/{attention}")
        assert cfg.kv_cache_elements_per_token() == elements, attention


def test_mlra_table2_arithmetic_intensity():
    """Table 2's formulas (n cancels), with h = 64, d_h = 128, g = 8, d_c = 512, d_h^R = 64, beta_kv = 2, bf16.
    GLA-2's formula is per device at 2-way TP (g = 2 latent heads) and MLRA's at 4-way (g = 4 blocks);
    the others at one device."""
    h, dh, dc, dr, bkv = 64, 128, 512, 64, 2
    paper = {
        "mha": (1, (4 * h * dh) / (4 * h * dh)),
        "mqa": (1, (4 * h * dh) / (4 * dh)),
        "gqa": (1, (4 * h * dh) / (4 * 8 * dh)),
        "mla": (1, (4 * h * dc + 2 * h * dr) / (2 * (dc + dr))),
        "mfa": (1, (4 * h * 2 * dh) / (4 * 2 * dh)),
        "tpa": (1, (4 * h * bkv * dh + 4 * h * dh) / (4 * bkv * (h + dh))),
        "gla-2": (2, (2 * h * dc / 2 + h * dr) / (2 * (dc / 2 + dr))),
        "gta": (1, (4 * h * dh) / (2 * (8 * dh + dr))),
        "mlra-2": (4, (2 * h * dc / 4 + h * dr) / (2 * (dc / 4 + dr))),
        "mlra-4": (4, (4 * h * dc / 4 + 2 * h * dr) / (2 * (dc / 4 + dr))),
    }
    for attention, (tp, ai) in paper.items():
        cfg = get_preset(f"mlra-table1/{attention}")
        assert arithmetic_intensity(cfg, tp=tp, dtype_bytes=2) == pytest.approx(ai, rel=1e-12), attention
    # the approximations of Table 2's second line
    mla = arithmetic_intensity(get_preset("mlra-table1/mla"))
    assert 1.8 * h < mla < 2 * h
    assert arithmetic_intensity(get_preset("mlra-table1/mqa")) == h


def test_sharding_metadata_covers_every_cached_tensor():
    """Every mechanism names a TP kind for each tensor it caches (no silent "replicated" default)."""
    from kvlm.attention import get_attention_class

    for name in families()["tiny"]:
        cfg = get_preset(name)
        shards = get_attention_class(cfg.attention).tp_shards(cfg)
        assert set(cfg.cache_spec()) <= set(shards), name
        kinds = {t["tp"] for t in cache_tensors(cfg).values()}
        assert kinds <= {"heads", "blocks", "coefficients", "replicated"}


def test_uneven_tp_counts_the_busiest_device():
    # GQA with g = 6 on 4 devices: two devices hold 2 KV heads, so the busiest loads 2/6 of K and V
    cfg = get_preset("mlra-2.9b/gqa")
    assert per_device_elements(cfg, 4) == 2 * 6 * 128 * 2 / 6
    assert per_device_elements(cfg, 6) == per_device_elements(cfg, 12) == 2 * 128
    with pytest.raises(ConfigError):
        per_device_elements(cfg, 0)


def test_kv_table_inputs_and_fields():
    cfg = ModelConfig(attention="gqa", n_layer=3, d_model=64, n_head=4, n_kv_head=2, vocab_size=50)
    mha = cfg.replace(attention="mha", n_kv_head=None)
    rows = kv_table([mha, cfg], tp=(2, 1), dtype_bytes=4)
    assert [r["attention"] for r in rows] == ["mha", "gqa"]
    gqa = rows[1]
    assert gqa["kv_elements_per_token"] == 3 * 2 * 2 * 16 and gqa["kv_bytes_per_token"] == 4 * 3 * 2 * 2 * 16
    assert gqa["kv_reduction_vs_mha"] == 0.5 and gqa["reference"] == "0:mha"
    assert gqa["per_device"][2]["elements_per_layer"] == 2 * 16
    assert gqa["params"]["total"] > 0 and set(gqa["cache"]) == {"k", "v"}
    # a family, a prefix of names and comma lists resolve to preset names
    assert select("small-lm/6L-512d")[0] == "small-lm/6L-512d/mha" and len(select("small-lm/6L-512d")) == 13
    assert select("tiny/mha, tiny/gqa") == ["tiny/mha", "tiny/gqa"]
    with pytest.raises(ConfigError, match="unknown preset"):
        kv_table("tiny/nope")
    with pytest.raises(ConfigError):
        kv_table("tiny/mha", tp=(0,))
    # a group without MHA (eg-mla-large) is compared with the same-shape MHA, and MLA of the same depth
    xl = kv_table("eg-mla-large/eg-mla-xlarge-kv128emb512", params=False)[0]
    assert xl["reference"] == "same-shape MHA" and xl["mla_reference"] == "eg-mla-large/mla-xlarge-kv512"
    assert xl["kv_reduction_vs_mha"] == 1 - (128 + 64) / (2 * 16 * 128)


def _cli(*argv):
    p = argparse.ArgumentParser()
    add_arguments(p)
    return main(p.parse_args(list(argv)))


def test_cli_text_and_json(capsys):
    assert _cli("--preset", "mlra-table1", "--tp", "1,2,4,8", "--no-params") == 0
    out = capsys.readouterr().out
    assert "load tp=8" in out and "mlra-table1/mlra-4" in out
    assert _cli("--preset", "eg-mla-base/mha-base,eg-mla-base/eg-mla-base-kv64", "--tp", "1", "--json") == 0
    lines = capsys.readouterr().out.strip().splitlines()
    data = json.loads(lines[-1])
    assert data["dtype_bytes"] == 2 and [r["kv_elements_per_token"] for r in data["rows"]] == [18432, 1536]
    assert data["rows"][1]["params"]["gate_embedding"] == 12 * 50304 * 256
    assert _cli("--list") == 0 and "mlra-2.9b" in capsys.readouterr().out
    with pytest.raises(ConfigError, match="--tp"):
        _cli("--preset", "tiny", "--tp", "x")
    with pytest.raises(ConfigError, match="needs --preset"):
        _cli()
