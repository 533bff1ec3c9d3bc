"""The per-hardware decode cost model: projections on tiny models checked against bytes and FLOPs derived
here by hand from the architecture (not from kvlm's accounting), and the kv-table --hardware option."""

import json

import pytest
from conftest import tiny_config

from kvlm.bench.costmodel import (
    HARDWARE,
    Hardware,
    from_measurement,
    get_hardware,
    project_decode,
)
from kvlm.cli import main as kvlm_main
from kvlm.config import ConfigError

# 1 GB/s and 1 GFLOP/s: a floor in ms is bytes / 1e6 or FLOPs / 1e6
UNIT = Hardware("unit", 1e9, 1e9, "test", dtype="fp32")


def test_mha_projection_by_hand():
    d, f, v, h, L = 64, 96, 97, 4, 2
    cfg = tiny_config("mha", ffn_dim=f, tie_embeddings=False)
    B, S = 3, 10
    p = project_decode(cfg, UNIT, batch=B, context=S)
    ops = p["operations"]
    gemm_elements = L * (4 * d * d + 3 * d * f)  # W_Q W_K W_V W_O, SwiGLU's gate, up, down
    norm_elements = (2 * L + 1) * d  # two RMSNorms a block and the final one
    assert ops["weight GEMMs"]["bytes"] == 4 * (gemm_elements + norm_elements)
    assert ops["weight GEMMs"]["flops"] == 2 * B * gemm_elements
    assert ops["LM head"]["bytes"] == 4 * v * d and ops["LM head"]["flops"] == 2 * B * v * d
    # attention: K and V of every cached token, every layer; q.k and p.v, 2 FLOPs per multiply-add
    assert ops["attention"]["bytes"] == 4 * L * B * S * 2 * d
    assert ops["attention"]["flops"] == L * B * S * h * 2 * (2 * (d // h))
    # UNIT's ridge is 1 FLOP/byte. Weights: 2 B FLOPs per 4-byte element = 1.5 at B = 3 -> compute-bound;
    # attention: 4 d_h h FLOPs per 2 d 4-byte elements = 0.5 -> memory-bound
    gemm_ms = max(4 * (gemm_elements + norm_elements), 2 * B * gemm_elements) / 1e6
    head_ms = max(4 * v * d, 2 * B * v * d) / 1e6
    att_ms = max(4 * L * B * S * 2 * d, L * B * S * h * 4 * (d // h)) / 1e6
    assert ops["weight GEMMs"]["bound"] == "compute" and ops["attention"]["bound"] == "memory"
    assert p["ms_per_step"] == pytest.approx(gemm_ms + head_ms + att_ms)
    assert p["ms_per_token"] == pytest.approx((gemm_ms + head_ms + att_ms) / B)
    assert p["tokens_per_s"] == pytest.approx(B / ((gemm_ms + head_ms + att_ms) * 1e-3))


def test_mla_absorbed_vs_naive_and_dtypes_by_hand():
    d, h, dc, dr, L, B, S = 64, 4, 16, 8, 2, 2, 5
    cfg = tiny_config("mla", kv_lora_rank=dc, rope_head_dim=dr)
    bf16 = Hardware("bf", 1e9, 1e12, "test")  # bf16 by default: 2 bytes a weight and a cached element
    p = project_decode(cfg, bf16, batch=B, context=S)
    # absorbed: each head scores over c_kv and k_rope, accumulates over c_kv; reads c_kv and k_rope once
    att = p["operations"]["attention"]
    assert att["bytes"] == 2 * L * B * S * (dc + dr)
    assert att["flops"] == L * B * S * h * (2 * (dc + dr) + 2 * dc)
    assert att["bound"] == "memory" and p["dtype"] == "bf16"
    # naive: materialised keys (d_h + d_h^R) and values d_h per head, in an fp8 cache (1 byte)
    naive = project_decode(cfg, bf16, batch=B, context=S, mode="naive", cache_dtype="fp8")
    dh = d // h
    assert naive["operations"]["attention"]["bytes"] == L * B * S * h * (dh + dr + dh)
    # the weights are the same model either way
    for k in ("bytes", "flops"):
        assert (
            naive["operations"]["LM head"][k]
            == p["operations"]["LM head"][k]
            == (B * 97 * d * 2 if k == "flops" else 2 * 97 * d)
        )


def test_hardware_table_and_errors():
    h100 = get_hardware("H100-SXM")  # alias, case-insensitive
    assert h100 is HARDWARE["h100"] and h100.bandwidth_bytes_per_s == 3.35e12
    # H100's ridge is ~300 FLOP/byte: absorbed MLA decode (~h FLOPs per byte) is far below it
    assert 250 < h100.ridge_flops_per_byte < 350
    assert all(hw.source and hw.peak_flops > hw.bandwidth_bytes_per_s for hw in HARDWARE.values())
    with pytest.raises(ConfigError, match="unknown hardware 'tpu'.*h100"):
        get_hardware("tpu")
    with pytest.raises(ConfigError, match="batch"):
        project_decode(tiny_config("mha"), UNIT, batch=0, context=4)
    with pytest.raises(ConfigError, match="dtype"):
        project_decode(tiny_config("mha"), UNIT, batch=1, context=4, dtype="int3")
    cpu = from_measurement({"bandwidth_gbs": 30.0, "matmul_fp32_gflops": 194.0}, "cpu")
    assert cpu.dtype == "fp32" and cpu.ridge_flops_per_byte == pytest.approx(194 / 30)


def test_kv_table_hardware_cli(capsys):
    assert kvlm_main(["kv-table", "--preset", "small-lm/6L-512d/mha", "--no-params", "--hardware", "h100,a100",
                      "--batch", "2", "--context", "128", "--json"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "h100 ms/step" in out and "a100 ms/step" in out
    data = json.loads(out.strip().splitlines()[-1])
    (row,) = data["projections"]
    h100, a100 = row["projections"]["h100"], row["projections"]["a100"]
    assert h100["batch"] == 2 and h100["context"] == 128
    # same bytes, H100 has 3.35 / 2.039 times A100's bandwidth, and both are memory-bound at batch 2
    assert h100["bytes_per_step"] == a100["bytes_per_step"]
    assert a100["ms_per_step"] / h100["ms_per_step"] == pytest.approx(3.35 / 2.039, rel=1e-6)
    assert kvlm_main(["kv-table", "--preset", "small-lm/6L-512d/mha", "--hardware", "tpu"]) == 1
    assert "unknown hardware 'tpu'" in capsys.readouterr().err


def test_operation_times_by_hand():
    """Measured time per operation class: attention = step - step at 1 cached token; LM head as timed;
    weight GEMMs = step at 1 token - LM head; x_floor = measured / floor."""
    from kvlm.bench.opstime import attach, operation_times

    t = operation_times(10.0, {"short_ms": 4.0, "lm_head_ms": 1.5})
    assert t == {"weight GEMMs": 2.5, "attention": 6.0, "LM head": 1.5}
    ops = {"attention": {"floor_ms": 3.0}, "LM head": {"floor_ms": 0.5}, "weight GEMMs": {"floor_ms": 0.0}}
    attach(ops, t)
    assert ops["attention"]["x_floor"] == 2.0 and ops["LM head"]["x_floor"] == 3.0
    assert ops["weight GEMMs"]["measured_ms"] == 2.5 and ops["weight GEMMs"]["x_floor"] is None


def test_bench_rows_carry_measured_operation_times(capsys):
    """A toy `kvlm bench` run: every kvlm decode row has, per operation class, its floor and its measured time."""
    import argparse

    from kvlm.bench.report import markdown
    from kvlm.cli import bench as bench_cli

    parser = argparse.ArgumentParser()
    bench_cli.add_arguments(parser)
    argv = (
        "--variants mla:kv_lora_rank=16:rope_head_dim=8,gqa:n_kv_head=1 --modes absorbed --batch 2 --context 16 "
        "--prompt 4 --steps 2 --warmup 1 --repeats 1 --n-layer 1 --d-model 32 --n-head 2 --vocab-size 64 "
        "--bandwidth-mib 4 --no-peers --json"
    ).split()
    assert bench_cli.main(parser.parse_args(argv)) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    rows = [r for r in res["decode"] if r["impl"] == "kvlm"]
    assert rows
    for r in rows:
        ops = r["operations"]
        assert set(ops) == {"weight GEMMs", "attention", "LM head"}
        for op in ops.values():
            assert op["measured_ms"] >= 0 and op["x_floor"] == pytest.approx(
                op["measured_ms"] / op["floor_ms"]
            )
        # the three measured parts add up to the measured step (unless a difference was clamped at 0 by noise)
        if ops["attention"]["measured_ms"] > 0 and ops["weight GEMMs"]["measured_ms"] > 0:
            assert sum(op["measured_ms"] for op in ops.values()) == pytest.approx(r["median_ms"])
    assert "attention x floor" in markdown(res)
