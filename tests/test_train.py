"""kvlm train: the loss falls on real text, exact resume, schedule, optimizer groups, errors, CLI."""

import json
import math
import shutil
import time

import numpy as np
import pytest
import torch
from conftest import shared_path

from kvlm import ModelConfig
from kvlm.checkpoint import CheckpointError, load_checkpoint
from kvlm.cli import main as cli
from kvlm.config import ConfigError
from kvlm.data import prepare
from kvlm.training import BatchOrder, TrainConfig, lr_at, make_optimizer, train


@pytest.fixture(scope="module")
def stories(tmp_path_factory):
    return prepare("synthetic", tmp_path_factory.mktemp("data") / "d", max_tokens=20_000, vocab_size=300)


def tiny(data, **kw):
    base = dict(attention="mha", n_layer=1, d_model=32, n_head=2, vocab_size=data.vocab_size, max_seq_len=32)
    return ModelConfig(**{**base, **kw})


def quick(**kw):
    base = dict(batch_size=4, seq_len=16, max_steps=10, lr=3e-3, warmup_steps=2, eval_interval=4, eval_iters=2,
                log_interval=1)  # fmt: skip
    return TrainConfig(**{**base, **kw})


def test_loss_falls_on_real_text(tmp_path):
    data = prepare(
        shared_path("data", "english-mix"),
        tmp_path / "data",
        tokenizer=shared_path("tokenizers", "gpt2"),
        max_tokens=50_000,
        val_tokens=2_048,
    )
    cfg = ModelConfig(
        attention="mha", n_layer=1, d_model=64, n_head=4, vocab_size=data.vocab_size, max_seq_len=32
    )
    tcfg = TrainConfig(batch_size=4, seq_len=32, max_steps=20, lr=1e-2, warmup_steps=2, eval_interval=20,
                       eval_iters=4, eval_at_start=True)  # fmt: skip
    res = train(cfg, tcfg, data, progress=False)
    (s0, v0), (s1, v1) = res.val_losses
    assert (s0, s1) == (0, 20)
    assert abs(v0 - math.log(50257)) < 0.3  # the untrained model is near uniform
    assert v1 < v0 - 2.0, res.val_losses  # 20 steps learn at least the unigram statistics
    assert res.losses[-1] < res.losses[0] - 2.0
    assert res.data_source.startswith("local:") and res.tokens == 20 * 4 * 32


def test_resume_reproduces_the_uninterrupted_run_exactly(stories, tmp_path):
    cfg = tiny(stories, dropout=0.1)  # dropout: the restored RNG state matters
    tcfg = quick(max_steps=10, grad_accum=2, checkpoint_interval=4)
    full = train(cfg, tcfg, stories, tmp_path / "full", progress=False)

    class Crash(Exception):
        pass

    def crash_at_7(rec):
        if rec["step"] == 7:
            raise Crash

    with pytest.raises(Crash):
        train(cfg, tcfg, stories, tmp_path / "cut", progress=False, callback=crash_at_7)
    assert json.loads((tmp_path / "cut" / "checkpoint" / "meta.json").read_text())["step"] == 4
    resumed = train(cfg, tcfg, stories, tmp_path / "cut", resume=True, progress=False)

    assert resumed.losses == full.losses  # exact, not approximate
    assert resumed.val_losses == full.val_losses
    for a, b in zip(full.model.state_dict().values(), resumed.model.state_dict().values()):
        assert torch.equal(a, b)

    def curve(path):
        return [(r["step"], r["loss"], r["val_loss"], r["lr"]) for r in map(json.loads, path.open())]

    assert curve(tmp_path / "cut" / "metrics.jsonl") == curve(tmp_path / "full" / "metrics.jsonl")
    assert [r[0] for r in curve(tmp_path / "full" / "metrics.jsonl")] == list(range(1, 11))


def test_saved_run_folder(stories, tmp_path):
    res = train(tiny(stories), quick(max_steps=4), stories, tmp_path / "run", progress=False)
    model, tok, meta = load_checkpoint(res.checkpoint)
    assert tok.sha256() == stories.tokenizer.sha256()
    assert meta["step"] == 4 and meta["data"]["source"] == "synthetic-stories (generated, not real text)"
    for a, b in zip(model.state_dict().values(), res.model.state_dict().values()):
        assert torch.equal(a, b.cpu())
    import yaml

    doc = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert doc["model"] == res.model_config and doc["train"]["max_steps"] == 4
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    assert result["steps"] == 4 and result["final_val_loss"] == res.final_val_loss


def test_token_and_time_budgets(stories):
    res = train(tiny(stories), quick(max_steps=None, max_tokens=200), stories, progress=False)
    assert res.steps == 4 and res.tokens == 256  # ceil(200 / (4 x 16)) steps
    t0 = time.perf_counter()
    res = train(tiny(stories), quick(max_steps=None, max_minutes=0.005), stories, progress=False)
    assert res.steps >= 1 and time.perf_counter() - t0 < 30
    assert res.final_val_loss is not None and res.val_losses[-1][0] == res.steps  # evaluated at the end


def test_schedule_warmup_then_cosine_to_ten_percent():
    t = TrainConfig(lr=1.0, warmup_steps=10, max_steps=110)
    lrs = [lr_at(t, s) for s in range(110)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(a <= b for a, b in zip(lrs[:10], lrs[1:10]))
    assert lrs[10] == pytest.approx(1.0)
    assert lrs[60] == pytest.approx(0.55)  # halfway down the cosine: (1 + 0.1) / 2
    assert lr_at(t, 110) == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))
    # the default warm-up: 5 % of the steps, at most 100; or 5 % of a time budget, then cosine in time
    assert TrainConfig(max_steps=40).warmup() == 2 and TrainConfig(max_steps=10_000).warmup() == 100
    timed = TrainConfig(lr=1.0, max_steps=None, max_minutes=1.0)
    assert lr_at(timed, 0, 1.5) == pytest.approx(0.5) and lr_at(timed, 5, 3.0) == pytest.approx(1.0)
    assert lr_at(timed, 9, 31.5) == pytest.approx(0.55) and lr_at(timed, 9, 60.0) == pytest.approx(0.1)


def test_weight_decay_on_matrices_only(stories):
    from kvlm.model import build_model

    model = build_model(tiny(stories, bias=True))
    decay, no_decay = make_optimizer(model, quick(), torch.device("cpu")).param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() == 2 for p in decay["params"]) and all(p.dim() == 1 for p in no_decay["params"])
    names = {id(p): n for n, p in model.named_parameters()}
    assert {names[id(p)] for p in no_decay["params"]} >= {"norm.weight", "layers.0.attn_norm.weight"}
    assert "embed.weight" in {names[id(p)] for p in decay["params"]}
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))  # tied once


def test_batch_order_is_a_seeded_permutation(stories):
    order = BatchOrder(stories.train, 16, seed=1)
    starts = order.starts(0, order.n)
    assert len(set(starts)) == order.n  # one epoch: every window once, none overlapping
    assert sorted(np.diff(sorted(starts))) == [16] * (order.n - 1)
    assert order.starts(5, 3) == BatchOrder(stories.train, 16, seed=1).starts(5, 3)
    assert order.starts(0, 8) != BatchOrder(stories.train, 16, seed=2).starts(0, 8)
    assert sorted(order.starts(order.n, order.n)) != sorted(starts) or order.n == 1  # new epoch, new offset


def test_vocabulary_and_length_mismatch(stories):
    with pytest.raises(ConfigError, match="vocabulary mismatch"):
        train(tiny(stories, vocab_size=stories.vocab_size - 1), quick(), stories, progress=False)
    res = train(tiny(stories, vocab_size=64), quick(max_steps=1), stories, progress=False, adapt_vocab=True)
    assert res.model_config["vocab_size"] == stories.vocab_size
    with pytest.raises(ConfigError, match="max_seq_len"):
        train(tiny(stories), quick(seq_len=64), stories, progress=False)
    with pytest.raises(ConfigError, match="budget"):
        TrainConfig(max_steps=None)
    with pytest.raises(ConfigError, match="grad_accum"):
        TrainConfig(batch_size=6, grad_accum=4)


def test_corrupt_or_partial_checkpoint(stories, tmp_path):
    cfg, tcfg = tiny(stories), quick(max_steps=2)
    train(cfg, tcfg, stories, tmp_path / "run", progress=False)
    good = tmp_path / "run" / "checkpoint"

    def broken(name, damage):
        run = tmp_path / name
        shutil.copytree(tmp_path / "run", run)
        damage(run / "checkpoint")
        return run

    def truncate(f):
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])

    cases = {
        "truncated-weights": (lambda c: truncate(c / "model.safetensors"), "model.safetensors"),
        "no-weights": (lambda c: (c / "model.safetensors").unlink(), "model.safetensors is missing"),
        "no-state": (lambda c: (c / "trainer_state.pt").unlink(), "trainer_state.pt is missing"),
        "truncated-state": (lambda c: truncate(c / "trainer_state.pt"), "trainer_state.pt"),
        "no-config": (lambda c: (c / "config.json").unlink(), "config.json is missing"),
    }
    for name, (damage, message) in cases.items():
        run = broken(name, damage)
        with pytest.raises(CheckpointError, match=message):
            train(cfg, tcfg.replace(max_steps=3), stories, run, resume=True, progress=False)
    with pytest.raises(CheckpointError, match="nothing to resume"):
        train(cfg, tcfg, stories, tmp_path / "empty", resume=True, progress=False)
    with pytest.raises(ConfigError, match="data order"):
        train(cfg, tcfg.replace(seed=1), stories, tmp_path / "run", resume=True, progress=False)
    assert good.is_dir()


def test_cli_prepare_and_train(tmp_path, capsys):
    data, run = str(tmp_path / "data"), str(tmp_path / "run")
    rc = cli(["prepare", "synthetic", "--out", data, "--max-tokens", "8000", "--vocab-size", "300", "--no-progress",
              "--json"])  # fmt: skip
    assert rc == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (
        summary["source"] == "synthetic-stories (generated, not real text)"
        and summary["train_tokens"] == 8000
    )
    args = ["train", "--data", data, "--out", run, "--n-layer", "1", "--d-model", "32", "--n-head", "2",
            "--max-seq-len", "32", "--seq-len", "16", "--batch-size", "4", "--steps", "4", "--eval-interval", "2",
            "--eval-iters", "1", "--log-interval", "1", "--set", "warmup_steps=1", "--no-progress", "--json"]  # fmt: skip
    assert cli(args) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["steps"] == 4 and out["model_config"]["vocab_size"] == summary["tokenizer"]["vocab_size"]
    assert out["train_config"]["warmup_steps"] == 1 and math.isfinite(out["final_val_loss"])
    records = [json.loads(line) for line in open(f"{run}/metrics.jsonl")]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert set(records[0]) == {"step", "tokens", "loss", "val_loss", "lr", "tokens_per_s", "elapsed",
                               "step_time_ms", "peak_memory_bytes", "peak_memory_kind", "peak_memory_bytes_per_rank",
                               "parameter_bytes_per_rank", "gradient_bytes_per_rank", "optimizer_bytes_per_rank"}  # fmt: skip
    assert [r["val_loss"] is not None for r in records] == [False, True, False, True]
    # continue the same run to 6 steps
    steps_at = args.index("--steps") + 1
    assert cli(args[:steps_at] + ["6"] + args[steps_at + 1 :] + ["--resume"]) == 0
    assert [json.loads(line)["step"] for line in open(f"{run}/metrics.jsonl")] == [1, 2, 3, 4, 5, 6]
    # bad input: one clear error, exit status 1
    assert (
        cli(["train", "--data", str(tmp_path / "missing"), "--out", run, "--steps", "1", "--no-progress"])
        == 1
    )
    assert "not found" in capsys.readouterr().err
