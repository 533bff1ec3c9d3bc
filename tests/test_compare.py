"""kvlm compare end to end at a toy budget: every file, numbers consistent with kv-table and the models,
resume skips finished runs."""

import csv
import json

import pytest

from kvlm.cli import main as cli_main
from kvlm.compare.run import Budget, aggregate, compare

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
    from kvlm.data.prepare import prepare

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
        compare(preset="nope", budget=Budget(steps=1))
