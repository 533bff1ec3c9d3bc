"""Edges the mutation check (tools/mutants.py) found untested: each test here kills one surviving mutant."""

from __future__ import annotations

import pytest
from conftest import tiny_config

from kvlm import build_model
from kvlm.accounting import arithmetic_intensity, decode_flops
from kvlm.cache import CacheError
from kvlm.compare.aggregate import aggregate


def test_left_padding_must_leave_a_slot():
    cache = build_model(tiny_config("mha")).new_cache(2, 8)
    with pytest.raises(CacheError, match="pad values"):
        cache.set_left_padding([8, 0])  # a sequence of padding only: no slot left for a token
    cache.set_left_padding([7, 0])


def test_intensity_stops_changing_beyond_one_device_per_head():
    """Devices beyond the h heads hold no heads: TP degree 2 h computes and loads what degree h does."""
    cfg = tiny_config("mha")  # h = 4, d_h = 16: 2 x 16 elements per device at tp = 4, 4 h d_h FLOPs in all
    assert arithmetic_intensity(cfg, tp=4, dtype_bytes=2) == pytest.approx(4 * 4 * 16 / 4 / (2 * 16 * 2))
    assert arithmetic_intensity(cfg, tp=8, dtype_bytes=2) == arithmetic_intensity(cfg, tp=4, dtype_bytes=2)


def test_eg_mla_intensity_counts_the_gathered_gate_row():
    """EG-MLA's rebuild route reads, per cached token, its d_c + d_h^R cache entries and the kv_emb row of the
    token (e elements) that the gate is computed from."""
    cfg = tiny_config("eg-mla", kv_emb_dim=24)
    elements = cfg.kv_lora_rank + cfg.rope_head_dim + cfg.kv_emb_dim
    assert arithmetic_intensity(cfg, tp=1, dtype_bytes=2) == pytest.approx(decode_flops(cfg) / (elements * 2))


def _run(label, kv_bytes, loss):
    return {
        "label": label,
        "attention": "mha" if label == "mha" else "mla",
        "seed": 0,
        "params": {"total": 10, "activated": 10, "embedding": 1, "gate_embedding": 0},
        "kv_elements_per_token": kv_bytes // 2,
        "kv_bytes_per_token": kv_bytes,
        "val_loss": loss,
        "val_loss_stderr": 0.01,
        "val_perplexity": 2.0,
        "prefill_ms": 1.0,
        "train_tokens_per_s": 1.0,
        "decode_tokens_per_s": {"16": 1.0},
        "repetition": {},
    }


def test_pareto_front_with_a_tied_loss():
    """Same loss with a smaller cache dominates: of two variants tied on loss only the smaller one is on the front."""
    rows = {
        r["label"]: r
        for r in aggregate([_run("mha", 512, 2.0), _run("mla", 128, 2.0), _run("big", 1024, 1.5)])
    }
    assert (rows["mha"]["pareto"], rows["mla"]["pareto"], rows["big"]["pareto"]) == (False, True, True)
