"""`kvlm bench`: well-formed results at a toy size, correct accounting, and transformers peers that compute
the same function as kvlm (no timing asserts: timings on a shared machine are noise)."""

import argparse
import json

import pytest
import torch
from conftest import tiny_config

from kvlm import build_model, count_parameters
from kvlm.bench import (
    BenchError,
    PeakMemory,
    fit_to_budget,
    parse_variant,
    peer_ratios,
    plot,
    roofline,
    route_table,
    streamed_weight_bytes,
    summarize,
)
from kvlm.bench.report import cell, markdown, table
from kvlm.bench.roofline import attention_cost, operation_classes, operation_roofline, weight_classes
from kvlm.cli import bench as bench_cli
from kvlm.config import ConfigError

TOY = (
    "--batch 1,2 --context 8,16 --prompt 4 --steps 2 --warmup 1 --repeats 1 "
    "--n-layer 1 --d-model 32 --n-head 2 --vocab-size 64 --bandwidth-mib 4"
).split()
MLA = "mla:kv_lora_rank=16:rope_head_dim=8"
EG = "eg-mla:kv_lora_rank=16:rope_head_dim=8:kv_emb_dim=8"
# decode modes asked for: naive,absorbed,table -> what each mechanism distinguishes
MODES = {
    "mha": ["auto"],
    "gqa:n_kv_head=1": ["auto"],
    MLA: ["naive", "absorbed"],
    EG: ["naive", "auto", "table"],
}
# the route each mode takes, as the mechanisms declare them (Attention.decode_routes)
ROUTES = {"naive": "materialised", "absorbed": "absorbed", "auto": "plain"}
EG_ROUTES = {"naive": "materialised", "auto": "rebuild", "table": "gate table"}
DECODE_FIELDS = (
    "median_ms min_ms max_ms tokens_per_s kv_cache_bytes peak_mem_bytes bytes_per_step floor_ms roofline_ratio "
    "achieved_gbs flops_per_step compute_floor_ms"
).split()


def _args(*argv):
    parser = argparse.ArgumentParser()
    bench_cli.add_arguments(parser)  # the `kvlm bench` verb, without importing every other verb
    return parser.parse_args(list(argv))


def _run(capsys, *argv):
    assert bench_cli.main(_args(*argv, "--json")) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_toy_run_emits_complete_json_and_plot(capsys, tmp_path):
    out = tmp_path / "r.json"
    variants = ",".join(MODES)
    res = _run(
        capsys,
        "--variants",
        variants,
        "--modes",
        "naive,absorbed,table",
        "--no-peers",
        "--out",
        str(out),
        *TOY,
    )
    assert json.loads(out.read_text()) == res
    assert (tmp_path / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    plot({**res, "decode": [r for r in res["decode"] if r["context"] == 8]}, tmp_path / "one.png")  # bars
    assert (tmp_path / "one.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    hw = res["hardware"]
    assert hw["bandwidth_gbs"] > 0 and hw["matmul_fp32_gflops"] > 0
    assert res["machine"]["torch"] == torch.__version__ and res["machine"]["cores"] >= 1
    assert list(res["models"]) == list(MODES)
    expected = {(v, m, b, c) for v in MODES for m in MODES[v] for b in (1, 2) for c in (8, 16)}
    assert {(r["variant"], r["mode"], r["batch"], r["context"]) for r in res["decode"]} == expected
    for r in res["decode"]:
        for f in DECODE_FIELDS:
            assert r[f] > 0, (f, r)
        assert r["impl"] == "kvlm" and r["n"] == 2 and r["min_ms"] <= r["median_ms"] <= r["max_ms"]
        assert r["route"] == (EG_ROUTES if r["variant"] == EG else ROUTES)[r["mode"]]
        m = res["models"][r["variant"]]
        per_token = m["naive_kv_bytes_per_token"] if r["mode"] == "naive" else m["kv_bytes_per_token"]
        assert r["kv_cache_bytes"] == r["batch"] * r["context"] * per_token
        assert r["bytes_per_step"] == m["streamed_weight_bytes"] + r["kv_cache_bytes"]
        assert r["floor_ms"] == pytest.approx(r["bytes_per_step"] / hw["bandwidth_gbs"] / 1e6)
        assert r["compute_floor_ms"] == pytest.approx(r["flops_per_step"] / hw["matmul_fp32_gflops"] / 1e6)
        assert r["tokens_per_s"] == pytest.approx(r["batch"] * 1e3 / r["median_ms"])
        # the precomputed gate table: vocab x 2 h d_h floats for the one layer
        assert r["extra_state_bytes"] == (64 * 2 * 32 * 4 if r["mode"] == "table" else 0)
    # FLOPs counted in the MHA decode step (first step: context + 1 keys): every weight matrix once per
    # sequence (all parameters but the norms; the tied embedding is the LM head), and q.k plus p.v per head
    n_matmul = (
        count_parameters(
            parse_variant("mha", {"n_layer": 1, "d_model": 32, "n_head": 2, "vocab_size": 64})[1]
        )["total"]
        - 3 * 32
    )
    for r in res["decode"]:
        if r["variant"] == "mha":
            assert r["flops_per_step"] == r["batch"] * (2 * n_matmul + 4 * 2 * (r["context"] + 1) * 16)
    prefill_modes = {
        "mha": ["auto"],
        "gqa:n_kv_head=1": ["auto"],
        MLA: ["naive", "auto"],
        EG: ["naive", "auto", "table"],
    }
    assert {(r["variant"], r["mode"], r["batch"]) for r in res["prefill"]} == {
        (v, m, b) for v in MODES for m in prefill_modes[v] for b in (1, 2)
    }
    for r in res["prefill"]:
        assert r["prompt"] == 4 and r["median_ms"] > 0 and r["tokens_per_s"] > 0 and r["kv_cache_bytes"] > 0
    # per token per layer: MHA 2 h d_h floats, MQA 2 d_h, MLA d_c + d_h^R (naive: h (d_h + d_h^R) + h d_h)
    assert res["models"]["mha"]["kv_bytes_per_token"] == 2 * 32 * 4
    assert res["models"]["gqa:n_kv_head=1"]["kv_bytes_per_token"] == 2 * 16 * 4
    for label in (MLA, EG):
        assert res["models"][label]["kv_bytes_per_token"] == (16 + 8) * 4
        assert res["models"][label]["naive_kv_bytes_per_token"] == 2 * (16 + 8 + 16) * 4
    # every kvlm decode row against the baseline (the first variant, mha: one route) and its own naive route
    kvlm_rows = [r for r in res["decode"] if r["impl"] == "kvlm"]
    assert res["routes"] == route_table(res) and len(res["routes"]) == len(kvlm_rows) == 7 * 4
    mha_ms = {(r["batch"], r["context"]): r["median_ms"] for r in kvlm_rows if r["variant"] == "mha"}
    naive_ms = {
        (r["variant"], r["batch"], r["context"]): r["median_ms"] for r in kvlm_rows if r["mode"] == "naive"
    }
    for row in res["routes"]:
        assert row["x_baseline"] == pytest.approx(row["ms"] / mha_ms[(row["batch"], row["context"])])
        naive = naive_ms.get((row["variant"], row["batch"], row["context"]))
        assert row["naive_speedup"] == (None if naive is None else pytest.approx(naive / row["ms"]))
    assert "targets" not in res  # no hand-typed expectations in the result
    # the roofline per operation class: weights split without loss, attention from the mechanism's decode cost
    e = 8  # eg-mla's kv_emb_dim: the rebuild route gathers one gate-embedding row per cached token
    extra = {"plain": 0, "absorbed": 0, "materialised": 0, "rebuild": e * 4, "gate table": 2 * 32 * 4}
    for r in kvlm_rows:
        ops, m = r["operations"], res["models"][r["variant"]]
        assert ops["weight GEMMs"]["bytes"] + ops["LM head"]["bytes"] == m["streamed_weight_bytes"]
        assert ops["LM head"]["flops"] == 2 * r["batch"] * 64 * 32  # vocab x d_model per sequence
        assert (
            ops["attention"]["bytes"] == r["kv_cache_bytes"] + r["batch"] * r["context"] * extra[r["route"]]
        )
        if r["variant"] == "mha":  # q.k and p.v: 2 (d_h + d_h) per head and cached token, one layer
            assert ops["attention"]["flops"] == r["batch"] * r["context"] * 2 * 2 * (16 + 16)


def test_streamed_weight_bytes_counts_every_matrix_once():
    cfg = tiny_config("mha")
    model = build_model(cfg)  # tied embeddings: the LM head reads the whole embedding each step
    assert streamed_weight_bytes(model) == 4 * count_parameters(cfg)["total"]
    untied = tiny_config("mha", tie_embeddings=False)  # the input table is only gathered
    assert streamed_weight_bytes(build_model(untied)) == 4 * (count_parameters(untied)["total"] - 97 * 64)


def test_fit_to_budget_times_fewer_steps_only_when_slow():
    assert fit_to_budget(0.01, 2, 6, 30.0) == (2, 6)  # fast: as asked
    assert fit_to_budget(4.0, 2, 6, 30.0) == (0, 6)  # 32 s > 30 s: the counted step was the warm-up
    assert fit_to_budget(10.0, 2, 6, 30.0) == (0, 3)
    assert fit_to_budget(60.0, 2, 6, 30.0) == (0, 3)  # never fewer than 3
    assert fit_to_budget(60.0, 2, 6, None) == (2, 6)
    assert fit_to_budget(60.0, 1, 2, 30.0) == (0, 2)  # never more than asked: the cache has room for no more


def test_summarize_and_peak_memory():
    s = summarize([0.003, 0.001, 0.002, 0.010])
    assert (
        s["median_ms"] == pytest.approx(2.5)
        and s["min_ms"] == pytest.approx(1)
        and s["max_ms"] == pytest.approx(10)
    )
    with PeakMemory(torch.device("cpu")) as mem:
        x = torch.ones(32 * 2**20 // 4)  # 32 MiB, touched
        del x
    assert mem.extra >= 24 * 2**20 and mem.peak >= mem.start


@pytest.mark.parametrize(
    "argv,error,message",
    [
        (["--variants", "nope"], BenchError, "unknown variant"),
        (["--variants", "mha", "--modes", "fast"], BenchError, "unknown mode"),
        (["--variants", "mha", "--batch", "0"], ConfigError, "integers >= 1"),  # kvlm.cli.common's parser
        (["--variants", "mha", "--batch", "1,x"], ConfigError, "comma-separated list of integers"),
        (["--variants", "mha", "--baseline", "mla"], BenchError, "not one of the variants"),
        (["--variants", "mha:n_head"], BenchError, "key=value"),
    ],
)
def test_bad_options_give_one_clear_error(argv, error, message):
    assert issubclass(BenchError, ConfigError)  # one kind of error for every bad option
    with pytest.raises(error, match=message):
        bench_cli.main(_args(*argv, "--no-peers"))


# --- the ratios, against numbers computed by hand on synthetic measurements ---------------------------
HW = {"bandwidth_gbs": 10.0, "matmul_fp32_gflops": 100.0, "copy_gbs": 8.0, "read_gbs": 10.0}


def test_roofline_ratios_by_hand():
    # 6 MB of weights + 2 MB of cache at 10 GB/s: 0.8 ms; 2e8 FLOPs at 100 GFLOP/s: 2 ms; measured 4 ms
    r = roofline(6_000_000, 2_000_000, HW, 4.0, 200_000_000)
    assert r["bytes_per_step"] == 8_000_000
    assert r["floor_ms"] == pytest.approx(0.8)
    assert r["roofline_ratio"] == pytest.approx(5.0)  # 4 / 0.8: "x bw floor"
    assert r["achieved_gbs"] == pytest.approx(2.0)  # 8 MB in 4 ms
    assert r["compute_floor_ms"] == pytest.approx(2.0) and r["compute_ratio"] == pytest.approx(2.0)
    assert r["roofline_floor_ms"] == pytest.approx(2.0)  # the larger floor binds
    assert r["x_roofline"] == pytest.approx(2.0)  # 4 / max(0.8, 2)
    # bandwidth-bound: 2e7 FLOPs are 0.2 ms, so x roofline is measured / bandwidth floor
    r = roofline(6_000_000, 2_000_000, HW, 4.0, 20_000_000)
    assert r["compute_floor_ms"] == pytest.approx(0.2) and r["x_roofline"] == pytest.approx(5.0)
    assert roofline(1_000_000, 0, HW, 1.0)["compute_ratio"] is None  # no FLOPs counted: no ratio


def test_operation_roofline_by_hand():
    weights = dict(gemm_bytes=4_000_000, gemm_elements=1_000_000, norm_bytes=1_000, lm_head_bytes=2_000_000,
                   lm_head_elements=500_000)  # fmt: skip
    classes = operation_classes(weights, {"bytes": 3_000_000, "flops": 9e8}, batch=4)
    assert classes["weight GEMMs"] == {"bytes": 4_001_000, "flops": 8e6}  # 2 FLOPs x 4 rows x 1e6 elements
    assert classes["LM head"] == {"bytes": 2_000_000, "flops": 4e6}
    ops = operation_roofline(classes, HW)
    att = ops["attention"]  # 3 MB at 10 GB/s: 0.3 ms; 9e8 FLOPs at 100 GFLOP/s: 9 ms -> compute-bound
    assert att["bandwidth_floor_ms"] == pytest.approx(0.3) and att["compute_floor_ms"] == pytest.approx(9.0)
    assert att["floor_ms"] == pytest.approx(9.0) and att["flops_per_byte"] == pytest.approx(300.0)
    gemm = ops["weight GEMMs"]  # 0.4001 ms of bytes against 0.08 ms of FLOPs -> bandwidth-bound
    assert gemm["floor_ms"] == pytest.approx(0.4001) and gemm["flops_per_byte"] == pytest.approx(
        8e6 / 4_001_000
    )
    assert ops["LM head"]["floor_ms"] == pytest.approx(0.2)
    # a mechanism that does not count its FLOPs: the bandwidth floor alone, no intensity
    uncounted = operation_roofline({"attention": {"bytes": 3_000_000, "flops": None}}, HW)["attention"]
    assert uncounted["floor_ms"] == pytest.approx(0.3) and uncounted["flops_per_byte"] is None


def test_weight_classes_and_attention_cost_by_hand():
    cfg = tiny_config("mha", tie_embeddings=False)  # 2 layers, d = 64, 4 heads, vocab 97
    w = weight_classes(build_model(cfg))
    d, f, v = 64, cfg.ffn_dim, 97
    assert w["gemm_elements"] == 2 * (4 * d * d + 3 * d * f)  # W_Q, W_K, W_V, W_O and SwiGLU's three
    assert w["lm_head_elements"] == v * d and w["lm_head_bytes"] == 4 * v * d  # the input table is gathered
    assert w["norm_bytes"] == 4 * (2 * 2 + 1) * d
    # MLA, absorbed: per head and cached token 4 d_c + 2 d_h^R FLOPs, and d_c + d_h^R cached elements a layer
    mla = tiny_config("mla", kv_lora_rank=16, rope_head_dim=8)
    cost = attention_cost(mla, batch=3, n_cached=10, mode="absorbed", dtype_bytes=4)
    assert cost["flops"] == 2 * 3 * 10 * 4 * (4 * 16 + 2 * 8)
    assert cost["bytes"] == 2 * 3 * 10 * (16 + 8) * 4
    # naive: the materialised cache, h (d_h + d_h^R) keys and h d_h values
    naive = attention_cost(mla, batch=3, n_cached=10, mode="naive", dtype_bytes=4)
    assert naive["bytes"] == 2 * 3 * 10 * 4 * (16 + 8 + 16) * 4


def _decode_row(variant, mode, route, ms, impl="kvlm", batch=1, context=8):
    return dict(impl=impl, variant=variant, mode=mode, route=route, batch=batch, context=context, median_ms=ms,
                kv_cache_bytes=2 * 2**20, extra_state_bytes=0, peak_extra_bytes=3 * 2**20)  # fmt: skip


def test_peer_ratios_by_hand():
    decode = [
        _decode_row("a", "auto", "plain", 10.0),
        _decode_row("a", "hf", "hf", 25.0, impl="hf:X"),
        _decode_row("b", "auto", "plain", 7.0),  # no peer: no ratio
    ]
    prefill = [
        {"impl": "kvlm", "variant": "a", "mode": "auto", "route": "auto", "batch": 1, "prompt": 4, "median_ms": 8.0},
        {"impl": "hf:X", "variant": "a", "mode": "hf", "route": "hf", "batch": 1, "prompt": 4, "median_ms": 6.0},
    ]  # fmt: skip
    ratios = peer_ratios(decode, prefill)
    assert [(r["kind"], r["variant"], r["peer"]) for r in ratios] == [
        ("decode", "a", "hf:X"),
        ("prefill", "a", "hf:X"),
    ]
    assert ratios[0]["speedup"] == pytest.approx(2.5) and ratios[0]["context"] == 8  # 25 / 10: kvlm faster
    assert ratios[1]["speedup"] == pytest.approx(0.75) and ratios[1]["prompt"] == 4  # 6 / 8: the peer faster


def test_route_table_by_hand():
    decode = [
        _decode_row("a", "naive", "materialised", 30.0),
        _decode_row("a", "absorbed", "absorbed", 20.0),
        _decode_row("b", "auto", "plain", 10.0),
        _decode_row("b", "naive", "materialised", 8.0),
        _decode_row("b", "hf", "hf", 1.0, impl="hf:X"),  # peers are not routes
        _decode_row("a", "absorbed", "absorbed", 5.0, context=16),  # no baseline row at this context
    ]
    result = {"models": {"a": {}, "b": {}}, "settings": {"baseline": "b"}, "decode": decode}
    rows = {(r["variant"], r["route"]): r for r in route_table(result)}
    assert len(rows) == 4 and all(
        r["baseline"] == "b materialised" for r in rows.values()
    )  # b's fastest: 8 ms
    assert rows[("a", "absorbed")]["x_baseline"] == pytest.approx(20 / 8)
    assert rows[("a", "absorbed")]["naive_speedup"] == pytest.approx(30 / 20)
    assert rows[("a", "materialised")]["naive_speedup"] == pytest.approx(1.0)
    assert rows[("b", "plain")]["x_baseline"] == pytest.approx(10 / 8)
    assert rows[("b", "plain")]["naive_speedup"] == pytest.approx(8 / 10)
    assert rows[("a", "absorbed")]["kv_mib"] == 2.0 and rows[("a", "absorbed")]["peak_mib"] == 3.0
    result["settings"]["baseline"] = None  # default: the first variant, a (fastest route 20 ms)
    assert {r["route"]: r["x_baseline"] for r in route_table(result) if r["variant"] == "b"} == {
        "plain": pytest.approx(0.5),
        "materialised": pytest.approx(0.4),
    }


def test_markdown_cells_and_summary_by_hand():
    assert [cell(x) for x in (1.2345, 2.5, 12.345, 1234.5, 7, True, False, None)] == [
        "1.23", "2.5", "12.3", "1234", "7", "yes", "**NO**", "-"
    ]  # fmt: skip
    assert table([("name", "n"), ("x", lambda r: r["v"] * 2)], [{"n": "a", "v": 1.25}]) == [
        "| name | x |", "|---|---:|", "| a | 2.5 |"
    ]  # fmt: skip
    s = summarize([0.004, 0.001, 0.003, 0.002])  # 1, 2, 3, 4 ms: quartiles 1.75 and 3.25
    assert s["median_ms"] == pytest.approx(2.5) and s["iqr_ms"] == pytest.approx(1.5) and s["n"] == 4
    row = {**_decode_row("a", "auto", "plain", 4.0), **roofline(6_000_000, 2_000_000, HW, 4.0, 200_000_000)}
    row.update(iqr_ms=0.5, n=3, tokens_per_s=250.0)
    result = {
        "date": "2026-01-01", "suite": None, "models": {"a": {"parameters": {"total": 2_000_000},
        "streamed_weight_bytes": 6_000_000, "kv_bytes_per_token": 8, "naive_kv_bytes_per_token": 8}},
        "machine": {"cpu": "c", "cores": 1, "threads": 1, "torch": "t", "transformers": None},
        "settings": {"device": "cpu", "dtype": "float32", "context": [8]}, "hardware": HW,
        "decode": [row], "prefill": [], "peers": [], "ratios": [],
    }  # fmt: skip
    text = markdown(result)
    # ms/step 4, bandwidth floor 0.8 ms, x bw floor 5, 0.2 GFLOP, compute floor 2 ms, x roofline 2
    assert "| a | kvlm | plain | 1 | 8 | 4 | 0.5 | 3 | 250.0 | 2 | 0 | 3 | 0.8 | 5 | 0.2 | 2 | 2 |" in text


# --- peers --------------------------------------------------------------------------------------------
PEER_CASES = [
    ("mha", {}),
    ("mqa", {}),
    ("gqa", {"n_kv_head": 2}),
    ("gqa", {"n_kv_head": 2, "bias": True}),
    ("mla", {}),
    ("mla", {"q_lora_rank": 32}),
    ("mla", {"kv_lora_rank": 48, "rope_head_dim": 4}),
]


def _model(attention, overrides):
    torch.manual_seed(0)
    model = build_model(tiny_config(attention, init_std=0.1, **overrides)).double().eval()
    with torch.no_grad():  # random norms and biases: every parameter must be mapped to the right place
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.2 * torch.randn_like(p))
    return model


@pytest.mark.parametrize("attention,overrides", PEER_CASES)
def test_peer_computes_the_same_function(attention, overrides):
    pytest.importorskip("transformers", reason="transformers not installed (pip install 'kvlm[hf]')")
    from kvlm.bench.peers import build_peer, max_logit_diff

    model = _model(attention, overrides)
    peer = build_peer(model)
    tokens = torch.randint(0, model.cfg.vocab_size, (2, 9))
    with torch.inference_mode():
        scale = model(tokens).abs().max().item()
    assert scale > 1.0  # logits large enough that a wrong mapping shows
    # float64 on both sides; transformers rounds RoPE angles and RMSNorm through float32, hence 1e-6
    assert max_logit_diff(model, peer, tokens, decode_steps=3) < 1e-6 * scale
    # and the check can fail: one perturbed peer weight is visible
    with torch.no_grad():
        peer.model.model.layers[-1].self_attn.o_proj.weight.mul_(1.5)
    assert max_logit_diff(model, peer, tokens) > 1e-4


def test_peer_synthetic_cache_matches_real_cache_layout():
    pytest.importorskip("transformers", reason="transformers not installed (pip install 'kvlm[hf]')")
    from kvlm.bench.peers import build_peer

    for attention in ("gqa", "mla"):
        model = _model(attention, {})
        peer = build_peer(model)
        cache = peer.new_cache()
        peer.forward(torch.randint(0, 97, (2, 5)), cache)
        synthetic = peer.synthetic_cache(2, 5)
        for real, fake in zip(cache.layers, synthetic.layers):
            assert real.keys.shape == fake.keys.shape and real.values.shape == fake.values.shape
        # the peer caches exactly what kvlm's compact cache holds per token
        assert peer.cache_nbytes(cache) == 2 * 5 * model.cfg.kv_cache_bytes_per_token(8)


@pytest.mark.parametrize(
    "attention,overrides,why",
    [
        ("gqa", {"n_kv_head": 2, "gated": True}, "gated"),
        ("mha", {"rope": False}, "RoPE"),
        ("mha", {"arch": "gpt2"}, "arch"),
        ("mla", {"latent_scaling": True}, "unscaled"),
        ("mla", {"kv_latent": "separate"}, "separate"),
        ("eg-mla", {}, "no transformers implementation"),
    ],
)
def test_peer_unavailable_says_why(attention, overrides, why):
    pytest.importorskip("transformers", reason="transformers not installed (pip install 'kvlm[hf]')")
    from kvlm.bench.peers import PeerUnavailable, build_peer

    with pytest.raises(PeerUnavailable, match=why):
        build_peer(build_model(tiny_config(attention, **overrides)))


def test_bench_decode_packs_as_generate_and_says_how(monkeypatch):
    """``bench_decode`` times the step with the weights packed in the layout ``packs_for`` names (as generate
    decodes), records it in the row, and drops the packed copy after."""
    from kvlm.attention.linear import ANY_ROWS, packing_available
    from kvlm.bench import measure

    if not packing_available(ANY_ROWS):
        pytest.skip("this torch build has no oneDNN packed GEMM")
    model = build_model(tiny_config("gqa", n_kv_head=2)).eval()
    seen = []
    monkeypatch.setattr(measure, "packs_for", lambda m, batch: ANY_ROWS if batch >= 9 else None)
    real = type(model).pack_for_decode
    monkeypatch.setattr(type(model), "pack_for_decode", lambda self, rows: seen.append(rows) or real(self, rows))
    row = measure.bench_decode(model, 12, 8, "auto", 1, 2)
    assert row["weights_packed"] == ANY_ROWS and seen == [ANY_ROWS, None] and model.lm_head._packed is None
    seen.clear()
    assert measure.bench_decode(model, 2, 8, "auto", 1, 2)["weights_packed"] is None and seen == []
