"""kill -9 a `kvlm train` again and again while it saves, then `--resume` until done: the losses, metrics and final
weights must equal the uninterrupted run's exactly (issue 14: checkpoints survive a crash at any instant).

The trainer runs through a small driver that slows every rename a little, so the kills often land between the
renames of the checkpoint swap (kvlm.files.replace_folder), the window where checkpoint/ does not exist at all.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from kvlm.checkpoint import load_checkpoint
from kvlm.data import prepare
from kvlm.files import leftovers

REPO = Path(__file__).resolve().parent.parent
DRIVER = """
import os, sys, time
real = os.replace
def slow_replace(src, dst, **kw):  # widen the crash windows between the swap's renames
    time.sleep(0.03)
    real(src, dst, **kw)
    time.sleep(0.03)
os.replace = slow_replace
from kvlm.cli import main
sys.exit(main(sys.argv[1:]))
"""
STEPS = 24


def train_cmd(driver, data, run, *more):
    return [sys.executable, str(driver), "train", "--data", str(data), "--out", str(run), "--n-layer", "1",
            "--d-model", "32", "--n-head", "2", "--max-seq-len", "32", "--seq-len", "16", "--batch-size", "4",
            "--dropout", "0.1", "--steps", str(STEPS), "--eval-interval", "4", "--eval-iters", "1", "--log-interval",
            "1", "--set", "checkpoint_interval=1", "--set", "warmup_steps=2", "--no-progress", *more]  # fmt: skip


def records(run):
    return [
        (r["step"], r["loss"], r["val_loss"], r["lr"]) for r in map(json.loads, open(run / "metrics.jsonl"))
    ]


@pytest.mark.slow
def test_kill_9_during_saves_then_resume_reproduces_the_run(tmp_path):
    data = prepare("synthetic", tmp_path / "data", max_tokens=8_000, vocab_size=300).path
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    full, cut = tmp_path / "full", tmp_path / "cut"
    subprocess.run(train_cmd(driver, data, full), env=env, cwd=REPO, check=True, capture_output=True)

    rng = random.Random(0)
    kills = missing_after_kill = 0
    for _attempt in range(40):
        started = (cut / "checkpoint").exists() or any(
            k != "tmp" for k, _, _ in leftovers(cut / "checkpoint")
        )
        flag = ["--resume"] if started else (["--force"] if cut.exists() else [])
        proc = subprocess.Popen(train_cmd(driver, data, cut, *flag), env=env, cwd=REPO,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)  # fmt: skip
        if kills < 8:
            # wait until it trains (a metrics record newer than any before), then kill -9 at a random instant
            seen = len(records(cut)) if (cut / "metrics.jsonl").exists() else 0
            deadline = time.monotonic() + 120
            while proc.poll() is None and time.monotonic() < deadline:
                if (cut / "metrics.jsonl").exists() and len(
                    (cut / "metrics.jsonl").read_text().splitlines()
                ) > seen:
                    break
                time.sleep(0.01)
            time.sleep(rng.uniform(0.0, 0.3))
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
                kills += 1
                proc.wait()
                missing_after_kill += not (cut / "checkpoint").exists()
                continue
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
        break
    else:
        pytest.fail("the interrupted run never finished")
    assert kills == 8
    assert records(cut) == records(full)  # exact: every loss, validation loss and learning rate
    a, _, meta_a = load_checkpoint(full / "checkpoint")
    b, _, meta_b = load_checkpoint(cut / "checkpoint")
    assert meta_a["step"] == meta_b["step"] == STEPS
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(x, y), name
    assert [p.name for p in cut.iterdir() if p.name.startswith(".checkpoint.")] == []  # leftovers cleaned
    print(f"{kills} kills, {missing_after_kill} left no checkpoint/ (recovered on resume)")
