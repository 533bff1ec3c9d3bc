"""kvlm.progress: a tqdm bar on a terminal, plain periodic log lines (rate, ETA, no carriage-return frames)
elsewhere, used by prepare, train and eval; and `kvlm eval --tasks` runs only what was asked."""

import io
import json
import logging

import pytest

from kvlm.cli import main as cli
from kvlm.progress import Progress


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_not_a_terminal_gives_log_lines_with_rate_and_eta(caplog):
    stream = io.StringIO()
    with caplog.at_level(logging.INFO, logger="kvlm"):
        with Progress(10, "work", "step", stream=stream, interval=0) as bar:
            for _ in range(4):
                bar.update(1)
            bar.set_postfix({"loss": "3.21"})
            bar.update(1)
    lines = [r.getMessage() for r in caplog.records if r.name == "kvlm.progress"]
    assert stream.getvalue() == ""  # nothing drawn on the stream: the lines go through logging
    assert lines[0].startswith("work: 1/10 step (10 %)") and "ETA" in lines[0] and "step/s" in lines[0]
    assert "5/10 step (50 %)" in lines[4] and lines[4].endswith("loss 3.21")
    assert lines[-1].startswith("work: done, 5/10 step") and "ETA" not in lines[-1]
    assert not bar.drawn and not any("\r" in line for line in lines)


def test_lines_are_spaced_by_the_interval(caplog):
    with caplog.at_level(logging.INFO, logger="kvlm"):
        with Progress(1000, "x", stream=io.StringIO(), interval=3600) as bar:
            for _ in range(1000):
                bar.update(1)
    lines = [r.getMessage() for r in caplog.records if r.name == "kvlm.progress"]
    assert len(lines) == 1 and lines[0].startswith("x: done, 1,000/1,000 it")


def test_a_terminal_gets_a_tqdm_bar_and_disabled_shows_nothing(caplog):
    tty = Terminal()
    with caplog.at_level(logging.INFO, logger="kvlm"):
        with Progress(10, "work", "step", stream=tty, interval=0) as bar:
            bar.update(3)
        assert bar.drawn and "\r" in tty.getvalue() and "/10 [" in tty.getvalue()  # a tqdm frame
        quiet = Terminal()
        with Progress(10, "off", stream=quiet, enabled=False, interval=0) as bar:
            bar.update(3)
        assert quiet.getvalue() == "" and not bar.drawn
    assert not [r for r in caplog.records if r.name == "kvlm.progress"]


@pytest.fixture()
def every_update(monkeypatch):
    monkeypatch.setenv("KVLM_PROGRESS_INTERVAL", "0")


def test_prepare_train_eval_report_progress_without_frames(tmp_path, capsys, every_update):
    data, run = str(tmp_path / "data"), str(tmp_path / "run")
    assert cli(["prepare", "synthetic", "--out", data, "--max-tokens", "6000", "--vocab-size", "300"]) == 0
    err = capsys.readouterr().err
    assert "prepare: " in err and " tok (" in err and "ETA" in err and "\r" not in err
    args = ["train", "--data", data, "--out", run, "--n-layer", "1", "--d-model", "32", "--n-head", "2",
            "--max-seq-len", "32", "--seq-len", "16", "--batch-size", "4", "--steps", "3", "--eval-iters", "1"]  # fmt: skip
    assert cli(args) == 0
    err = capsys.readouterr().err
    assert "train: 1/3 step (33 %)" in err and "ETA" in err and "\r" not in err
    assert cli(["eval", f"{run}/checkpoint", "--samples", "0", "--seq-len", "16"]) == 0
    err = capsys.readouterr().err
    assert "perplexity: " in err and " window (" in err and "\r" not in err


def test_eval_tasks_skip_perplexity_unless_asked(tmp_path, capsys, monkeypatch):
    data, run = str(tmp_path / "data"), str(tmp_path / "run")
    assert (
        cli(
            [
                "prepare",
                "synthetic",
                "--out",
                data,
                "--max-tokens",
                "4000",
                "--vocab-size",
                "300",
                "--no-progress",
            ]
        )
        == 0
    )
    args = ["train", "--data", data, "--out", run, "--n-layer", "1", "--d-model", "32", "--n-head", "2",
            "--max-seq-len", "32", "--seq-len", "16", "--batch-size", "4", "--steps", "1", "--eval-iters", "1",
            "--no-progress"]  # fmt: skip
    assert cli(args) == 0
    import kvlm.cli.eval as eval_cli
    import kvlm.inference.evaluation as evaluation

    scored = []
    monkeypatch.setattr(
        eval_cli, "run_tasks", lambda model, tok, tasks, limit=None: {t: {"acc": 0.5} for t in tasks}
    )
    real = evaluation.perplexity
    monkeypatch.setattr(eval_cli, "perplexity", lambda *a, **k: scored.append(1) or real(*a, **k))
    capsys.readouterr()
    assert cli(["eval", f"{run}/checkpoint", "--tasks", "fake", "--json", "--no-progress"]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert res["tasks"] == {"fake": {"acc": 0.5}} and "perplexity" not in res and "samples" not in res
    assert not scored
    assert (
        cli(["eval", f"{run}/checkpoint", "--tasks", "fake", "--perplexity", "--json", "--no-progress"]) == 0
    )
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert "perplexity" in res and scored
    # without --tasks, perplexity and samples stay the default
    assert (
        cli(
            [
                "eval",
                f"{run}/checkpoint",
                "--seq-len",
                "16",
                "--sample-tokens",
                "2",
                "--json",
                "--no-progress",
            ]
        )
        == 0
    )
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert "perplexity" in res and len(res["samples"]) == 8


def test_train_writes_a_log_log_loss_plot_with_readable_ticks(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from kvlm import ModelConfig
    from kvlm.data import prepare
    from kvlm.training import TrainConfig, train
    from kvlm.training.plot import readable_log_ticks

    data = prepare("synthetic", tmp_path / "d", max_tokens=4000, vocab_size=300)
    cfg = ModelConfig(attention="mha", n_layer=1, d_model=32, n_head=2, vocab_size=300, max_seq_len=32)
    tcfg = TrainConfig(batch_size=4, seq_len=16, max_steps=5, eval_interval=2, eval_iters=1, warmup_steps=1)
    train(cfg, tcfg, data, tmp_path / "run", progress=False)
    png = tmp_path / "run" / "loss.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and (tmp_path / "run" / "metrics.jsonl").is_file()

    # a loss axis inside one decade (3.2 .. 5.7) gets several plain-number labels, not none
    fig, ax = plt.subplots()
    ax.plot([1, 10, 300], [5.7, 4.1, 3.2])
    ax.set_xscale("log")
    ax.set_yscale("log")
    readable_log_ticks(ax.yaxis)
    readable_log_ticks(ax.xaxis)
    fig.canvas.draw()
    lo, hi = ax.get_ylim()
    ys = [
        (t.get_position()[1], t.get_text())
        for t in ax.yaxis.get_ticklabels()
        if lo <= t.get_position()[1] <= hi
    ]
    labels = [text for _, text in ys if text]
    assert len(labels) >= 3 and all(float(t) > 0 for t in labels), labels
    xs = [t.get_text() for t in ax.xaxis.get_ticklabels() if t.get_text()]
    assert "10" in xs and "100" in xs
    plt.close(fig)


def test_bench_reports_progress_per_case(capsys, every_update):
    toy = ("--batch 1 --context 8 --prompt 4 --steps 2 --warmup 1 --repeats 1 --n-layer 1 --d-model 32 --n-head 2 "
           "--vocab-size 64 --bandwidth-mib 4").split()  # fmt: skip
    assert cli(["bench", "--variants", "mha,gqa", "--modes", "naive", "--no-peers", *toy, "--json"]) == 0
    err = capsys.readouterr().err
    assert "bench: 1/2 case (50 %)" in err and "bench: done, 2/2 case" in err and "\r" not in err


def test_prepare_without_a_cap_counts_bytes_of_the_input_files(tmp_path, capsys, every_update):
    """No --max-tokens: the bar's total is the input files' size, so the lines carry a percentage and an ETA."""
    src = tmp_path / "text"
    src.mkdir()
    docs = [f"document {i}: the cat sat on the mat, and the dog sat on the log. " * 8 for i in range(60)]
    (src / "train.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    (src / "val.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[:5]))
    size = (src / "train.jsonl").stat().st_size + (src / "val.jsonl").stat().st_size
    assert cli(["prepare", str(src), "--out", str(tmp_path / "d"), "--vocab-size", "300"]) == 0
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("prepare: ")]
    assert lines and all("\r" not in line for line in lines)
    first, last = lines[0], lines[-1]
    assert "B (" in first and "ETA" in first and "tokens " in first, first
    from tqdm import tqdm

    from kvlm.data import load_prepared

    text_bytes = sum(len(d.encode()) for d in docs + docs[:5])  # the documents' text, within the files' size
    assert last.startswith(
        f"prepare: done, {tqdm.format_sizeof(text_bytes)}/{tqdm.format_sizeof(size)} B ("
    ), last
    meta = load_prepared(tmp_path / "d").meta["splits"]
    assert last.endswith(f"tokens {meta['train']['tokens'] + meta['val']['tokens']:,}"), last


def test_conversion_to_mla_reports_progress(caplog, every_update):
    """import-hf --mla: bars over the calibration windows, the layers and the perplexity windows."""
    import torch

    from kvlm import ModelConfig, build_model
    from kvlm.interop.convert import gqa_to_mla, window_perplexity

    torch.manual_seed(0)
    cfg = ModelConfig(
        attention="gqa", n_kv_head=2, n_layer=3, d_model=32, n_head=4, vocab_size=50, max_seq_len=16
    )
    model = build_model(cfg).eval()
    windows = torch.randint(0, 50, (6, 16))
    with caplog.at_level(logging.INFO, logger="kvlm"):
        mla = gqa_to_mla(model, 16, 4, windows, progress=True)
        window_perplexity(mla, windows, progress=True)
    lines = [r.getMessage() for r in caplog.records if r.name == "kvlm.progress"]
    assert any(line.startswith("calibrate: done, 6/6 window") for line in lines), lines
    assert any(line.startswith("convert to MLA: 1/3 layer (33 %)") and "ETA" in line for line in lines), lines
    assert any(line.startswith("convert to MLA: done, 3/3 layer") for line in lines), lines
    assert any(line.startswith("perplexity: done, 6/6 window") for line in lines), lines
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="kvlm"):
        gqa_to_mla(model, 16, 4, windows)  # the library default: quiet
    assert not [r for r in caplog.records if r.name == "kvlm.progress"]
