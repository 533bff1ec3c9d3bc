"""`kvlm bench`: well-formed results at a toy size, correct accounting, and transformers peers that compute
the same function as kvlm (no timing asserts: timings on a shared machine are noise)."""

import argparse
import json

import pytest
import torch
from conftest import tiny_config

from kvlm import build_model, count_parameters
from kvlm.bench import run as bench
from kvlm.bench.run import BenchError, PeakMemory, streamed_weight_bytes, summarize

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
ROUTES = {"naive": "naive", "absorbed": "absorbed", "auto": "auto"}
EG_ROUTES = {"naive": "materialised", "auto": "rebuild", "table": "gate table"}
DECODE_FIELDS = (
    "median_ms min_ms max_ms tokens_per_s kv_cache_bytes peak_mem_bytes bytes_per_step floor_ms roofline_ratio "
    "achieved_gbs flops_per_step compute_floor_ms"
).split()


def _args(*argv):
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)  # the `kvlm bench` verb, without importing every other verb
    return parser.parse_args(list(argv))


def _run(capsys, *argv):
    assert bench.main(_args(*argv, "--json")) == 0
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
    bench.plot(
        {**res, "decode": [r for r in res["decode"] if r["context"] == 8]}, tmp_path / "one.png"
    )  # bars
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
            bench.parse_variant("mha", {"n_layer": 1, "d_model": 32, "n_head": 2, "vocab_size": 64})[1]
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
    eg_rows = bench.eg_mla_vs_mla(res)
    assert {r["route"] for r in eg_rows} == set(EG_ROUTES.values()) and len(eg_rows) == 3 * 4
    assert res["targets"] and all(t["claim"].startswith("decode within 2x") for t in res["targets"])  # < 1K


def test_streamed_weight_bytes_counts_every_matrix_once():
    cfg = tiny_config("mha")
    model = build_model(cfg)  # tied embeddings: the LM head reads the whole embedding each step
    assert streamed_weight_bytes(model) == 4 * count_parameters(cfg)["total"]
    untied = tiny_config("mha", tie_embeddings=False)  # the input table is only gathered
    assert streamed_weight_bytes(build_model(untied)) == 4 * (count_parameters(untied)["total"] - 97 * 64)


def test_fit_to_budget_times_fewer_steps_only_when_slow():
    assert bench.fit_to_budget(0.01, 2, 6, 30.0) == (2, 6)  # fast: as asked
    assert bench.fit_to_budget(4.0, 2, 6, 30.0) == (0, 6)  # 32 s > 30 s: the counted step was the warm-up
    assert bench.fit_to_budget(10.0, 2, 6, 30.0) == (0, 3)
    assert bench.fit_to_budget(60.0, 2, 6, 30.0) == (0, 3)  # never fewer than 3
    assert bench.fit_to_budget(60.0, 2, 6, None) == (2, 6)


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
    "argv,message",
    [
        (["--variants", "nope"], "unknown variant"),
        (["--variants", "mha", "--modes", "fast"], "unknown mode"),
        (["--variants", "mha", "--batch", "0"], "positive"),
        (["--variants", "mha:n_head"], "key=value"),
    ],
)
def test_bad_options_give_one_clear_error(argv, message):
    with pytest.raises(BenchError, match=message):
        bench.main(_args(*argv, "--no-peers"))


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
