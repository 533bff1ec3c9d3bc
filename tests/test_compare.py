"""kvlm compare end to end at a toy budget: every file, numbers consistent with kv-table and the models, finished
runs kept and an interrupted multi-seed job resumed to the same result, --baseline, --data with text files,
stale run folders. The statistics and sentences are tested on hand-made numbers in test_compare_stats.py."""

import csv
import json

import pytest

from kvlm.cli import main as cli_main
from kvlm.compare import compare, default_train_config
from kvlm.config import ConfigError

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
        "--seeds",
        "0,1",
        "--hardware",
        "h100",
        "--eval-tokens",
        "2000",
        "--no-progress",
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
    assert "## Answers" in report and "Pareto front of validation loss" in report
    assert "synthetic stories (not real text)" in report  # the default data is labelled wherever it appears
    assert "Appendix: the tiny trained models' own speed" in report  # --contexts: timings kept, labelled
    assert "h100 ms/token" in report


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
        assert row["kv_bytes_per_token_by_dtype"]["bf16"] == row["kv_bytes_per_token"]
        assert row["kv_bytes_per_token_by_dtype"]["fp32"] == 2 * row["kv_bytes_per_token"]
        assert row["n_seeds"] == 2 and row["val_loss_ci95"][0] < row["val_loss"] < row["val_loss_ci95"][1]
        assert row["train_tokens"] == [3 * 2 * 32]  # steps x batch x seq_len
        assert row["reference"]["projection"]["h100"]["ms_per_token"] > 0
    assert data["meta"]["baseline"] == "mha" and data["meta"]["synthetic"]
    with open(out / "results.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert [r["label"] for r in rows] == [v["label"] for v in data["variants"]]
    assert int(rows[1]["kv_bytes_per_token"]) == data["variants"][1]["kv_bytes_per_token"]


def test_rerun_resumes_finished_variants(run, capsys):
    _, out, args = run
    before = {p: p.stat().st_mtime for p in out.glob("runs/*/seed*/result.json")}
    assert len(before) == 4
    assert cli_main(args) == 0
    captured = capsys.readouterr()
    assert captured.err.count("done earlier") == 4
    summary = json.loads(captured.out.strip().splitlines()[-1])
    assert {v["label"] for v in summary["variants"]} == {"mha", "mla"}
    assert all(p.stat().st_mtime == t for p, t in before.items())


# --- resume, baseline, data, stale folders -----------------------------------------------------------------
TWO = """
base: {n_layer: 1, d_model: 32, n_head: 2, max_seq_len: 64, vocab_size: 300}
variants:
  - {label: mha, attention: mha}
  - {label: mla, attention: mla, kv_lora_rank: 16, rope_head_dim: 8, q_lora_rank: 0}
"""


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    from kvlm.data import prepare

    tmp = tmp_path_factory.mktemp("compare-small")
    (tmp / "v.yaml").write_text(TWO)
    prepare("synthetic", tmp / "data", vocab_size=300, max_tokens=20_000, val_tokens=4_000)
    return tmp


def _job(small, out, **kw):
    kw = {"seeds": [0, 1], "train_cfg": default_train_config(max_steps=8, batch_size=2, seq_len=32), **kw}
    return compare(variants_file=str(small / "v.yaml"), data_source=str(small / "data"), out=out,
                   eval_tokens=1000, hardware=["h100"], progress=False, **kw)  # fmt: skip


def _outcome(out):
    runs = json.loads((out / "results.json").read_text())["runs"]
    return {
        (r["label"], r["seed"]): (r["val_loss"], [h["val_loss"] for h in r["history"]], r["train_tokens"])
        for r in runs
    }


def test_interrupted_multi_seed_job_resumes_to_the_same_result(small, tmp_path, monkeypatch, caplog):
    """Stop a 2-variant x 2-seed job inside (mla, seed 1) at step 5 of 8, run the same job again: the three
    finished runs are kept as they are, the fourth continues from its step-4 checkpoint, and every loss equals
    the uninterrupted job's."""
    import kvlm.compare.runner as runner

    _job(small, tmp_path / "whole")
    expected = _outcome(tmp_path / "whole")

    real_train = runner.train

    def stopping_train(cfg, tcfg, **kw):
        if tcfg.seed == 1 and (cfg is None or cfg.attention == "mla"):
            callback = kw["callback"]

            def stop_at_5(rec):
                callback(rec)
                if rec["step"] == 5:
                    raise KeyboardInterrupt

            kw["callback"] = stop_at_5
        return real_train(cfg, tcfg, **kw)

    monkeypatch.setattr(runner, "train", stopping_train)
    out = tmp_path / "cut"
    with pytest.raises(KeyboardInterrupt):
        _job(small, out)
    assert not (out / "runs/mla/seed1/result.json").exists()
    assert (out / "runs/mla/seed1/checkpoint/trainer_state.pt").is_file()
    kept = {p: p.stat().st_mtime_ns for p in out.glob("runs/*/seed*/result.json")}
    assert len(kept) == 3
    steps_trained = []

    def counting_train(cfg, tcfg, **kw):
        callback = kw["callback"]

        def count(rec):
            steps_trained.append(rec["step"])
            callback(rec)

        kw["callback"] = count
        return real_train(cfg, tcfg, **kw)

    monkeypatch.setattr(runner, "train", counting_train)
    caplog.set_level("INFO", logger="kvlm")
    _job(small, out)
    assert "[mla seed 1] resuming from" in caplog.text and caplog.text.count("done earlier") == 3
    assert steps_trained == [5, 6, 7, 8]  # only the interrupted run trains, from its step-4 checkpoint
    assert all(p.stat().st_mtime_ns == t for p, t in kept.items())
    assert _outcome(out) == expected


def test_baseline_option(small, tmp_path):
    summary = _job(small, tmp_path / "b", baseline="mla", seeds=[0])
    assert summary["baseline"] == "mla" and summary["vs_baseline"]["mla"] == "baseline"
    assert summary["vs_baseline"]["mha"] == "not tested"  # one seed
    rows = json.loads((tmp_path / "b" / "results.json").read_text())["variants"]
    mha = next(r for r in rows if r["label"] == "mha")
    mla = next(r for r in rows if r["label"] == "mla")
    assert mha["kv_reduction_vs_baseline"] == pytest.approx(
        1 - mha["kv_bytes_per_token"] / mla["kv_bytes_per_token"]
    )
    with pytest.raises(ConfigError, match="--baseline 'gqa' is not a variant"):
        _job(small, tmp_path / "c", baseline="gqa")
    assert not (tmp_path / "c").exists()  # refused before anything was prepared or trained


def test_a_run_folder_holding_another_run_needs_force(small, tmp_path):
    out = tmp_path / "o"
    _job(small, out, seeds=[0])
    with pytest.raises(ConfigError, match="holds a different run.*--force"):
        _job(small, out, seeds=[0], train_cfg=default_train_config(max_steps=6, batch_size=2, seq_len=32))
    assert json.loads((out / "runs/mha/seed0/result.json").read_text())["train_steps"] == 8  # untouched
    _job(
        small,
        out,
        seeds=[0],
        train_cfg=default_train_config(max_steps=6, batch_size=2, seq_len=32),
        force=True,
    )
    assert json.loads((out / "runs/mha/seed0/result.json").read_text())["train_steps"] == 6


def test_text_data_is_a_first_class_path(small, tmp_path):
    from kvlm.data import synthetic

    docs = tmp_path / "texts"
    docs.mkdir()
    for i in range(3):
        (docs / f"part{i}.txt").write_text("\n\n".join(synthetic.story(7, 40 * i + j) for j in range(40)))
    out = tmp_path / "t"
    rc = cli_main(["compare", "--variants", str(small / "v.yaml"), "--data", str(docs), "--tokenizer", "bpe",
                   "--vocab-size", "300", "--out", str(out), "--steps", "2", "--batch-size", "2", "--seq-len", "32",
                   "--seeds", "0", "--hardware", "h100", "--eval-tokens", "500", "--no-progress"])  # fmt: skip
    assert rc == 0
    meta = json.loads((out / "results.json").read_text())["meta"]
    assert not meta["synthetic"] and "not real text" not in meta["data"] and str(docs) in meta["data"]
    assert "bpe tokenizer" in meta["data"]
    report = (out / "report.md").read_text()
    assert "not tested" in report  # one seed: the report says the differences are untested


def test_unknown_preset_is_a_clear_error():
    from kvlm.config import ConfigError

    with pytest.raises(ConfigError, match="unknown compare preset"):
        compare(preset="nope", train_cfg=default_train_config(max_steps=1))


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
    tcfg = default_train_config(max_steps=300)
    assert run_key(cfg, tcfg, 65536, 3, "abc") == hashlib.sha256(blob.encode()).hexdigest()[:16]
    assert run_key(cfg, tcfg.replace(weight_decay=0.0), 65536, 3, "abc") != run_key(
        cfg, tcfg, 65536, 3, "abc"
    )
    assert describe_budget(tcfg) == "300 steps of 16x128 tokens, peak lr 0.002"
    assert describe_budget(default_train_config()) == "150 steps of 16x128 tokens, peak lr 0.002"
    assert (
        describe_budget(default_train_config(max_tokens=5000))
        == "5000 tokens of 16x128 tokens, peak lr 0.002"
    )
