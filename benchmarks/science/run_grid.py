"""Resumable runner of the science grid: many small trainings at once, under a wall-clock guard.

    python benchmarks/science/run_grid.py --runs RUNS --data DATA --ood OOD [--workers 16] [--minutes 8]

A job (variant, seed) is done when RUNS/<label>/seed<k>/summary.json exists; done jobs are skipped, so the
grid can be run in several sittings (a job stopped half-way resumes from its last checkpoint when it is run
again on the same machine). Jobs run in seed-major order (grid.jobs). The guard: no job starts unless the
time left exceeds the slowest finished job's duration (or --job-minutes before any has finished), and at
the deadline the workers still running are stopped (their checkpoints stay). Writes RUNS/runner.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import grid  # noqa: E402


def pending_jobs(runs: Path, labels: list[str] | None, seeds: tuple[int, ...]) -> list[tuple[str, int]]:
    out = []
    for v, s in grid.jobs(seeds):
        if labels and v.label not in labels:
            continue
        if not (runs / v.label / f"seed{s}" / "summary.json").exists():
            out.append((v.label, s))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--runs", type=Path, required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--ood", required=True)
    p.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) // 2))
    p.add_argument("--minutes", type=float, default=60.0, help="wall-clock guard for the whole sitting")
    p.add_argument("--job-minutes", type=float, default=3.0, help="assumed job length before one finishes")
    p.add_argument("--labels", nargs="*", help="only these variants")
    p.add_argument("--seeds", type=int, nargs="*", default=list(grid.SEEDS))
    p.add_argument("--device", default="auto")
    p.add_argument("--steps", type=int, help="override max_steps (smoke tests only)")
    p.add_argument("--eval-interval", type=int, help="override eval_interval (smoke tests only)")
    p.add_argument("--eval-iters", type=int, help="override eval_iters (smoke tests only)")
    p.add_argument("--keep-weights", type=Path, help="folder for float16 weights of --keep labels (seed 0)")
    p.add_argument("--keep", nargs="*", default=[], help="labels whose seed-0 weights are kept")
    args = p.parse_args(argv)

    args.runs.mkdir(parents=True, exist_ok=True)
    log = (args.runs / "runner.jsonl").open("a")
    deadline = time.time() + args.minutes * 60
    queue = pending_jobs(args.runs, args.labels, tuple(args.seeds))
    print(f"{len(queue)} jobs pending, {args.workers} workers, {args.minutes:g} min", flush=True)
    running: dict[tuple[str, int], tuple[subprocess.Popen, float]] = {}
    durations: list[float] = []
    done = failed = 0

    def note(**rec) -> None:
        log.write(json.dumps({"time": time.time(), **rec}) + "\n")
        log.flush()

    while queue or running:
        for job, (proc, t0) in list(running.items()):
            rc = proc.poll()
            if rc is None:
                continue
            del running[job]
            dt = time.time() - t0
            ok = rc == 0 and (args.runs / job[0] / f"seed{job[1]}" / "summary.json").exists()
            if ok:
                done += 1
                durations.append(dt)
            else:
                failed += 1
            note(event="end", label=job[0], seed=job[1], rc=rc, seconds=dt, ok=ok)
            print(f"[{done} done, {failed} failed, {len(queue)} queued] {job} rc={rc} {dt:.0f} s", flush=True)
        left = deadline - time.time()
        need = max(durations) if durations else args.job_minutes * 60
        while queue and len(running) < args.workers and left > need:
            label, seed = queue.pop(0)
            out = args.runs / label / f"seed{seed}"
            out.mkdir(parents=True, exist_ok=True)
            cmd = [sys.executable, str(HERE / "train_one.py"), "--label", label, "--seed", str(seed)]
            cmd += ["--runs", str(args.runs), "--data", args.data, "--ood", args.ood, "--device", args.device]
            if args.steps:
                cmd += ["--steps", str(args.steps)]
            if args.eval_interval:
                cmd += ["--eval-interval", str(args.eval_interval)]
            if args.eval_iters:
                cmd += ["--eval-iters", str(args.eval_iters)]
            if args.keep_weights and label in args.keep and seed == 0:
                cmd += ["--keep-weights", str(args.keep_weights / label)]
            env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
            with (out / "worker.log").open("a") as f:
                proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
            running[(label, seed)] = (proc, time.time())
            note(event="start", label=label, seed=seed)
        if time.time() >= deadline or (not running and queue and left <= need):
            break
        time.sleep(1.0)

    for proc, _ in running.values():  # the guard: stop what is left; checkpoints stay for a resume
        proc.terminate()
    for job, (proc, _) in running.items():
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
        note(event="stopped", label=job[0], seed=job[1])
    print(
        f"sitting over: {done} done, {failed} failed, {len(running)} stopped, {len(queue)} not started",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
