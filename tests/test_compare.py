"""kvlm compare end to end at a toy budget: every file, numbers consistent with kv-table and the models,
resume skips finished runs."""

import csv
import json

import pytest

from kvlm.cli import main as cli_main
from kvlm.compare import aggregate, compare, default_train_config

VARIANTS_YAML = """
base: {n_layer: 1, d_model: 32, n_head: 2, max_seq_len: 64, vocab_size: 300}
variants:
  - {label: mha, attention: mha}
  - {label: mla, attention: mla, kv_lora_rank: 16, rope_head_dim: 8, q_lora_rank: 0}
"""


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("compare")
    vf = tmp / "variants.yaml"
    vf.write_text(VARIANTS_YAML)
    data = tmp / "data"
    from kvlm.data import prepare

    prepare("synthetic", data, vocab_size=300, max_tokens=20_000, val_tokens=4_000)
    out = tmp / "out"
    args = [
        "compare",
        "--variants",
        str(vf),
        "--data",
        str(data),
        "--out",
        str(out),
        "--steps",
        "3",
        "--batch-size",
        "2",
        "--seq-len",
        "32",
        "--contexts",
        "8,16",
        "--json",
    ]
    rc = cli_main(args)
    assert rc == 0
    return tmp, out, args


def test_every_file_is_written(run):
    _, out, _ = run
    for name in (
        "results.json",
        "results.csv",
        "report.md",
        "pareto.png",
        "loss_curves.png",
        "decode_speed.png",
    ):
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    report = (out / "report.md").read_text()
    assert "| mha |" in report and "| mla |" in report
    assert "kvlm compare" in report  # the reproduce command


def test_numbers_are_consistent(run):
    from kvlm import ModelConfig
    from kvlm.accounting import kv_table
    from kvlm.model import build_model

    _, out, _ = run
    data = json.loads((out / "results.json").read_text())
    for row in data["variants"]:
        run_ = next(r for r in data["runs"] if r["label"] == row["label"])
        cfg = ModelConfig.from_dict(run_["config"])
        table = kv_table([cfg], tp=(1,), dtype_bytes=2)[0]
        assert row["kv_bytes_per_token"] == table["kv_bytes_per_token"]
        model = build_model(cfg)
        assert row["params_total"] == sum(p.numel() for p in model.parameters())
        assert run_["val_loss"] > 0 and run_["val_perplexity"] > 1
    with open(out / "results.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert [r["label"] for r in rows] == [v["label"] for v in data["variants"]]
    assert int(rows[1]["kv_bytes_per_token"]) == data["variants"][1]["kv_bytes_per_token"]


def test_rerun_resumes_finished_variants(run, capsys):
    _, out, args = run
    before = {p: p.stat().st_mtime for p in out.glob("runs/*/seed0/result.json")}
    assert len(before) == 2
    assert cli_main(args) == 0
    captured = capsys.readouterr()
    assert captured.err.count("done earlier") == 2
    summary = json.loads(captured.out.strip().splitlines()[-1])
    assert {v["label"] for v in summary["variants"]} == {"mha", "mla"}
    assert all(p.stat().st_mtime == t for p, t in before.items())


def test_noise_and_pareto_marking():
    base = {
        "attention": "mha",
        "params": {"total": 1, "activated": 1, "embedding": 0, "gate_embedding": 0},
        "prefill_ms": 1.0,
        "train_tokens_per_s": 1.0,
        "decode_tokens_per_s": {},
        "repetition": {},
    }
    runs = (
        [
            {
                **base,
                "label": "a",
                "seed": s,
                "val_loss": v,
                "val_loss_stderr": 0.001,
                "val_perplexity": 1,
                "kv_elements_per_token": 10,
                "kv_bytes_per_token": 20,
            }
            for s, v in ((0, 2.00), (1, 2.02))
        ]
        + [
            {
                **base,
                "label": "b",
                "seed": s,
                "val_loss": v,
                "val_loss_stderr": 0.001,
                "val_perplexity": 1,
                "kv_elements_per_token": 5,
                "kv_bytes_per_token": 10,
            }
            for s, v in ((0, 2.01), (1, 2.03))
        ]
        + [
            {
                **base,
                "label": "c",
                "seed": s,
                "val_loss": v,
                "val_loss_stderr": 0.001,
                "val_perplexity": 1,
                "kv_elements_per_token": 10,
                "kv_bytes_per_token": 20,
            }
            for s, v in ((0, 3.0), (1, 3.01))
        ]
    )
    rows = {r["label"]: r for r in aggregate(runs)}
    assert rows["a"]["within_noise_of_best"] and rows["b"]["within_noise_of_best"]
    assert not rows["c"]["within_noise_of_best"]
    assert rows["a"]["pareto"] and rows["b"]["pareto"] and not rows["c"]["pareto"]


def test_unknown_preset_is_a_clear_error():
    from kvlm.config import ConfigError

    with pytest.raises(ConfigError, match="unknown compare preset"):
        compare(preset="nope", train_cfg=default_train_config(max_steps=1))


# --- the report's numbers against values computed by hand -------------------------------------------------
def _hand_runs():
    """Two variants, two seeds each, with round numbers: MHA caches 512 elements (1024 bytes) a token, MLA 128
    (256 bytes); MLA's losses are lower."""
    import math

    def run(label, attention, seed, loss, kv_elements, decode):
        return {
            "label": label,
            "attention": attention,
            "seed": seed,
            "params": {
                "total": 2_500_000,
                "activated": 2_000_000,
                "embedding": 300_000,
                "gate_embedding": 200_000,
            }
            if attention == "mla"
            else {"total": 3_000_000, "activated": 3_000_000, "embedding": 400_000, "gate_embedding": 0},
            "kv_elements_per_token": kv_elements,
            "kv_bytes_per_token": 2 * kv_elements,
            "val_loss": loss,
            "val_loss_stderr": 0.01,
            "val_perplexity": math.exp(loss),
            "prefill_ms": 10.0 + seed,
            "train_tokens_per_s": 1000.0 * (seed + 1),
            "decode_tokens_per_s": {"16": decode + seed},
            "repetition": {"distinct_2": 0.5, "rep_4": 0.25},
            "samples": [{"prompt": "Once", "text": " upon"}],
            "history": [],
        }

    return [
        run("mha", "mha", 0, 2.0, 512, 100.0),
        run("mha", "mha", 1, 2.2, 512, 100.0),
        run("mla", "mla", 0, 1.9, 128, 50.0),
        run("mla", "mla", 1, 2.0, 128, 50.0),
    ]


def test_aggregate_numbers_by_hand():
    import math

    rows = {r["label"]: r for r in aggregate(_hand_runs())}
    mha, mla = rows["mha"], rows["mla"]
    # KV reduction against MHA: 1 - 256 / 1024
    assert mha["kv_reduction_vs_first_mha"] == 0.0
    assert mla["kv_reduction_vs_first_mha"] == pytest.approx(0.75)
    # means over seeds, and the loss change against MHA: 100 * (1.95 / 2.1 - 1) = -7.142857 % (lower is better)
    assert mha["val_loss"] == pytest.approx(2.1) and mla["val_loss"] == pytest.approx(1.95)
    assert mla["val_loss_delta_pct"] == pytest.approx(-100 * 0.15 / 2.1) and mla["val_loss_delta_pct"] < 0
    assert mha["val_loss_delta_pct"] == 0.0
    # sample standard deviation over seeds: |2.0 - 2.2| / sqrt(2)
    assert mha["val_loss_std"] == pytest.approx(0.2 / math.sqrt(2))
    assert mla["val_loss_std"] == pytest.approx(0.1 / math.sqrt(2))
    # perplexity: the mean of the runs' perplexities, each exp(its loss)
    assert mha["val_perplexity"] == pytest.approx((math.exp(2.0) + math.exp(2.2)) / 2)
    assert mla["val_perplexity"] == pytest.approx((math.exp(1.9) + math.exp(2.0)) / 2)
    # parameters: embedding = token embedding + gate tables
    assert (mla["params_total"], mla["params_activated"], mla["params_embedding"]) == (
        2_500_000,
        2_000_000,
        500_000,
    )
    # speed: means over seeds
    assert mha["decode_tokens_per_s"] == {"16": 100.5} and mla["prefill_ms"] == 10.5
    assert mla["train_tokens_per_s"] == 1500.0
    # noise: std / sqrt(seeds) = 0.1 (mha) and 0.05 (mla); the gap 0.15 <= 2 * hypot(0.1, 0.05) = 0.2236
    assert mla["within_noise_of_best"] and mha["within_noise_of_best"]
    # MLA has less cache and lower loss: it dominates MHA
    assert mla["pareto"] and not mha["pareto"]


def test_noise_gap_by_hand():
    """Move MHA's losses up until the gap passes 2 sigma: 2 * hypot(0.1, 0.05) = 0.2236 against the gap."""
    runs = _hand_runs()
    for r in runs[:2]:
        r["val_loss"] += 0.08  # mean 2.18: gap 0.23 > 0.2236, the spread is unchanged
    rows = {r["label"]: r for r in aggregate(runs)}
    assert not rows["mha"]["within_noise_of_best"] and rows["mla"]["within_noise_of_best"]
    # one seed: the validation standard errors are the noise, hypot(0.01, 0.01) = 0.01414
    one = [r for r in _hand_runs() if r["seed"] == 0]  # mha 2.0, mla 1.9: gap 0.1 > 0.0283
    rows = {r["label"]: r for r in aggregate(one)}
    assert rows["mha"]["val_loss_std"] is None and not rows["mha"]["within_noise_of_best"]


def test_report_tables_by_hand():
    import math

    from kvlm.compare import render_report

    runs = _hand_runs()
    rows = aggregate(runs)
    meta = {
        "preset": "hand",
        "data": "d",
        "budget": "b",
        "seeds": [0, 1],
        "models_note": "n",
        "machine": {"gpu": None, "cpu": "cpu", "threads": 1, "torch": "t"},
        "kvlm": "v",
        "date": "today",
        "command": "kvlm compare --preset hand",
    }
    lines = render_report(rows, runs, meta, ["16"]).splitlines()
    ppl_mla = (math.exp(1.9) + math.exp(2.0)) / 2
    ppl_mha = (math.exp(2.0) + math.exp(2.2)) / 2
    # quality table, sorted by KV bytes; MLA is best in both columns (bold), 75 % less cache, 7.14 % lower loss
    assert (
        f"| mla | 128 | **256** | -75.0 % | **1.9500** ± 0.0707 | {ppl_mla:.2f} | -7.14 % | within noise of best | yes |"
        in lines
    )
    assert (
        f"| mha | 512 | 1,024 | +0.0 % | 2.1000 ± 0.1414 | {ppl_mha:.2f} | +0.00 % | within noise of best |  |"
        in lines
    )
    quality = [ln for ln in lines if ln.startswith(("| mla | 128", "| mha | 512"))]
    assert quality[0].startswith("| mla")  # fewest KV bytes first
    # parameters in millions
    assert "| mla | 2.500 M | 2.000 M | 0.500 M |" in lines
    assert "| mha | 3.000 M | 3.000 M | 0.400 M |" in lines
    # speed: the best (highest decode, lowest prefill) in bold
    assert "| mha | **10.5** | **100.5** | 1500 |" in lines
    assert "| mla | **10.5** | 50.5 | 1500 |" in lines
    assert "| mla | 0.500 | 0.250 |" in lines


def test_perplexity_of_a_uniform_model_is_the_vocabulary_size():
    """All weights zero: every logit is 0, the next-token distribution uniform over V tokens, the loss ln V
    nats and the perplexity exactly V, whatever the tokens."""
    import math

    import torch

    from kvlm import ModelConfig, build_model
    from kvlm.inference.evaluation import perplexity

    cfg = ModelConfig(attention="mha", n_layer=1, d_model=16, n_head=2, vocab_size=50, max_seq_len=16)
    model = build_model(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    ids = torch.randint(0, 50, (40,), generator=torch.Generator().manual_seed(0))
    val = perplexity(model, ids, seq_len=16)
    assert val["tokens"] == 39
    assert val["loss"] == pytest.approx(math.log(50), rel=1e-6)
    assert val["perplexity"] == pytest.approx(50, rel=1e-5)


def test_run_key_and_budget_line_match_earlier_results():
    """A comparison run before TrainConfig replaced compare's own Budget is still recognised as done: its key
    hashed these eight numbers under these names."""
    import hashlib

    from kvlm import ModelConfig
    from kvlm.compare.runner import describe_budget, run_key

    cfg = ModelConfig(attention="mha", n_layer=1, d_model=16, n_head=2, vocab_size=50, max_seq_len=16)
    legacy = {"steps": 300, "tokens": None, "minutes": None, "batch_size": 16, "seq_len": 128, "lr": 2e-3,
              "warmup": 20, "eval_tokens": 65536}  # fmt: skip
    blob = json.dumps({"cfg": cfg.to_dict(), "budget": legacy, "seed": 3, "data": "abc"}, sort_keys=True)
    tcfg = default_train_config()
    assert run_key(cfg, tcfg, 65536, 3, "abc") == hashlib.sha256(blob.encode()).hexdigest()[:16]
    assert run_key(cfg, tcfg.replace(weight_decay=0.0), 65536, 3, "abc") != run_key(
        cfg, tcfg, 65536, 3, "abc"
    )
    assert describe_budget(tcfg) == "300 steps of 16x128 tokens, peak lr 0.002"
    assert (
        describe_budget(default_train_config(max_tokens=5000))
        == "5000 tokens of 16x128 tokens, peak lr 0.002"
    )
