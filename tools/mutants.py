"""A small mutation check of kvlm's core: does the test suite notice when the code is wrong?

Each mutant is one source edit (flip a comparison, drop a term, force a route, ignore a config flag, an
off-by-one in a slice) in one kvlm file. The script copies the repository (tracked and untracked, not ignored,
files) into a temporary folder, applies the mutants there one at a time, runs a fast subset of the tests on
the copy (``-x -p no:xdist``) and records each mutant as

    killed     a test failed (or the mutated code no longer imported)
    survived   every test of its subset passed: a hole in the tests, or an equivalent mutant
    timeout    its tests ran past --timeout (counted as killed, reported apart)
    stale      its source line is gone (the code moved): update the mutant
    unrun      its test subset fails on the unmutated code (baseline), so the mutant would prove nothing

The working tree is never modified, so other people's edits and test runs are safe during a run; within the
copy each file is restored after its mutant in a ``finally`` (also on Ctrl-C), and checked against its
original at the end.

    python tools/mutants.py --list                  the mutants
    python tools/mutants.py                         all of them (a baseline run of each test subset first)
    python tools/mutants.py -k mla -k cache         those whose id contains "mla" or "cache"
    python tools/mutants.py --json mutants.json     also write the results as JSON
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# test subsets, each a pytest argument list run from the copy's root
ATTENTION = [
    "tests/test_attention_contract.py",
    "tests/test_routes.py",
    "tests/test_fused_vs_reference.py",
    "tests/test_v1_compat.py",
    "tests/test_mla.py",
    "tests/test_mlra.py",
    "tests/test_baselines.py",
    "tests/test_eg_mla.py",
]
MODEL = ["tests/test_attention_contract.py", "tests/test_v1_compat.py", "tests/test_generate.py"]
CACHE = [
    "tests/test_attention_contract.py",
    "tests/test_generate.py",
    "tests/test_engine_errors.py",
    "tests/test_boundaries.py",
]
ACCOUNTING = ["tests/test_accounting.py", "tests/test_presets.py", "tests/test_boundaries.py"]
COMPARE = ["tests/test_compare.py", "tests/test_boundaries.py"]
COMPARE_STATS = ["tests/test_compare_stats.py", "tests/test_boundaries.py"]
COMPARE_RESUME = ["tests/test_compare.py::test_interrupted_multi_seed_job_resumes_to_the_same_result"]
BENCH = ["tests/test_bench.py"]


@dataclass(frozen=True)
class Mutant:
    id: str
    path: str  # relative to the repository root
    find: str  # exact source text, must occur exactly once
    replace: str
    tests: tuple[str, ...]
    why: str


def m(id: str, path: str, find: str, replace: str, tests: list[str], why: str) -> Mutant:
    return Mutant(id, path, find, replace, tuple(tests), why)


A = "kvlm/attention/"
MUTANTS: list[Mutant] = [
    # --- the step: masks, causality, padding ---------------------------------------------------------
    m(
        "step-causal-off-by-one",
        A + "step.py",
        "return torch.ones(T, S, dtype=torch.bool, device=device).tril(S - T)[None, None]",
        "return torch.ones(T, S, dtype=torch.bool, device=device).tril(S - T - 1)[None, None]",
        ATTENTION,
        "off-by-one in the causal rule of Step.visible",
    ),
    m(
        "step-chunk-mask-strict",
        A + "step.py",
        "mask = (key[None, :] <= slots[:, None])[None, None].expand(B, 1, T, end)",
        "mask = (key[None, :] < slots[:, None])[None, None].expand(B, 1, T, end)",
        ATTENTION,
        "flip <= to <: a chunk's tokens cannot see themselves",
    ),
    m(
        "step-pad-valid-strict",
        A + "step.py",
        "valid = key[None, :] >= pad[:, None]",
        "valid = key[None, :] > pad[:, None]",
        ATTENTION,
        "flip >= to >: the first real token is masked",
    ),
    m(
        "attend-float32-math",
        A + "step.py",
        "if q.shape[-1] != v.shape[-1] or q.dtype == torch.float64:",
        "if q.shape[-1] != v.shape[-1] or q.dtype != torch.float16:",
        ATTENTION,
        "SDPA's fused kernel never runs (float32 on the math path)",
    ),
    m(
        "attend-no-group-fold",
        A + "step.py",
        "if r > 1 and not is_causal:",
        "if False:",
        ATTENTION,
        "GQA decode repeats K/V per query head instead of folding heads (same numbers, more bytes)",
    ),
    # --- the latent family ------------------------------------------------------------------------------
    m(
        "latent-absorbed-runs-expand",
        A + "latent.py",
        'if route == "absorbed":\n            return self.forward_absorbed(x, step, cache, cs)',
        'if route == "absorbed" and False:\n            return self.forward_absorbed(x, step, cache, cs)',
        ATTENTION,
        "the absorbed route falls through to expand (trace still says absorbed)",
    ),
    m(
        "latent-auto-never-absorbs",
        A + "latent.py",
        "return cheaper and n_new * self.absorb_ratio <= n_cached",
        "return False",
        ATTENTION,
        "'auto' never takes the absorbed route",
    ),
    m(
        "latent-absorb-ratio-boundary",
        A + "latent.py",
        "return cheaper and n_new * self.absorb_ratio <= n_cached",
        "return cheaper and n_new * self.absorb_ratio < n_cached",
        ATTENTION,
        "<= to < in the auto rule (boundary)",
    ),
    m(
        "latent-ignore-latent-scaling",
        A + "latent.py",
        "self.alpha_kv = math.sqrt(d / self.d_lat) if cfg.latent_scaling else 1.0",
        "self.alpha_kv = 1.0",
        ATTENTION,
        "cfg.latent_scaling ignored for alpha_kv",
    ),
    m(
        "latent-ignore-attn-out-scaling",
        A + "latent.py",
        "self.alpha_attn = 1.0 / math.sqrt(self.bpg) if cfg.attn_out_scaling else 1.0",
        "self.alpha_attn = 1.0",
        ATTENTION,
        "cfg.attn_out_scaling ignored",
    ),
    m(
        "latent-scale-drops-rope-dims",
        A + "latent.py",
        "self.scale = 1.0 / math.sqrt(dh + dr)  # Eq. 46, tau",
        "self.scale = 1.0 / math.sqrt(dh)",
        ATTENTION,
        "softmax scale without the RoPE dims (Eq. 46)",
    ),
    m(
        "latent-branches-mean",
        A + "latent.py",
        "o = o.view(B, self.G, self.bpg, self.r, T, D).sum(dim=2)",
        "o = o.view(B, self.G, self.bpg, self.r, T, D).mean(dim=2)",
        ATTENTION,
        "MLRA branches averaged instead of summed (Eq. 5, 6)",
    ),
    # --- MLA --------------------------------------------------------------------------------------------
    m(
        "mla-fold-drops-query-bias",
        A + "mla.py",
        "q_lat = q_lat + aw.b_q",
        "q_lat = q_lat",
        ATTENTION,
        "the folded query bias b_i W~^UK_i dropped in the absorbed route",
    ),
    m(
        "mla-absorbed-drops-value-bias",
        A + "mla.py",
        "o = o + aw.b_uv.view(H, 1, -1)",
        "o = o",
        ATTENTION,
        "the W^UV bias dropped in the absorbed route",
    ),
    m(
        "mla-fold-choice-flipped",
        A + "mla.py",
        "return n_in * dc < n_in * dh + dh * dc, can_out and d * dc < dh * dc + d * dh",
        "return n_in * dc > n_in * dh + dh * dc, can_out and d * dc > dh * dc + d * dh",
        ATTENTION,
        "fold W^UQ.W~^UK / W~^UV.W^O exactly when it reads more bytes (same numbers)",
    ),
    m(
        "latent-attention-rope-unscaled",
        A + "latent_ops.py",
        "bias = rope_scores(q_rope, k_rope).mul_(scale)\n",
        "bias = rope_scores(q_rope, k_rope)\n",
        ATTENTION,
        "float32 absorbed MLA: RoPE scores not scaled",
    ),
    m(
        "attend-split-mask-dropped",
        A + "latent_ops.py",
        '            bias = bias.masked_fill(~mask, float("-inf"))\n',
        "            pass\n",
        ATTENTION,
        "float32 attend_split ignores the mask (chunked prefill sees the future)",
    ),
    m(
        "attend-padded-pads-left",
        A + "latent_ops.py",
        "v = F.pad(v, (0, q.shape[-1] - dv))",
        "v = F.pad(v, (q.shape[-1] - dv, 0))",
        ATTENTION,
        "float32 naive route pads values on the wrong side",
    ),
    # --- GLA / MLRA, GTA, TPA ------------------------------------------------------------------------------
    m(
        "mlra-absorbed-drops-rope",
        A + "mlra.py",
        "z = split_score_attention(q_lat, c, c, q_rope, k_rope, step, self.scale)",
        "z = split_score_attention(q_lat, c, c, None, None, step, self.scale)",
        ATTENTION,
        "GLA/MLRA absorbed route without the RoPE logits",
    ),
    m(
        "split-score-mask-dropped",
        A + "latent_ops.py",
        'scores = scores.masked_fill_(~visible[:, :, None], float("-inf"))',
        "pass",
        ATTENTION,
        "absorbed GLA/MLRA/GTA ignore the mask",
    ),
    m(
        "gta-auto-expands",
        A + "gta.py",
        'mode = "absorbed" if cache is not None and T <= ABSORB_MAX_NEW else "expand"',
        'mode = "expand"',
        ATTENTION,
        "GTA's 'auto' never absorbs",
    ),
    m(
        "gta-absorbed-drops-rope",
        A + "gta.py",
        "q_rope = q[..., self.nope_dim :] if k_rope is not None else None",
        "q_rope = None",
        ATTENTION,
        "GTA absorbed route without the RoPE logits",
    ),
    m(
        "tpa-factorised-runs-expand",
        A + "tpa.py",
        'if mode == "absorbed":',
        "if False:",
        ATTENTION,
        "TPA's factorised route falls through to expand",
    ),
    m(
        "tpa-drops-kv-rank-scale",
        A + "tpa.py",
        "qa = qa * (self.scale / (bq * bkv))",
        "qa = qa * (self.scale / bq)",
        ATTENTION,
        "factorised logits lose the 1/beta_kv",
    ),
    m(
        "mha-key-without-rope",
        A + "mha.py",
        "q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)",
        "q, k = apply_rope(q, cos, sin), k",
        ATTENTION,
        "MHA keys not rotated",
    ),
    m(
        "base-ignore-gated",
        A + "base.py",
        "if cfg.gated:",
        "if False:",
        ATTENTION,
        "cfg.gated ignored: the output gate is never built",
    ),
    # --- cache and model ---------------------------------------------------------------------------------
    m(
        "cache-view-one-too-long",
        "kvlm/cache/layer.py",
        "return buf[..., : step.end, :]",
        "return buf[..., : step.end + 1, :]",
        CACHE,
        "append returns one unfilled slot too many",
    ),
    m(
        "cache-capacity-off-by-one",
        "kvlm/cache/contiguous.py",
        "if self.length + n_new > self.max_seq_len:",
        "if self.length + n_new >= self.max_seq_len:",
        CACHE,
        "a cache cannot be filled to its last slot",
    ),
    m(
        "cache-pad-bound",
        "kvlm/cache/contiguous.py",
        "bool((pad >= self.max_seq_len).any())",
        "bool((pad > self.max_seq_len).any())",
        CACHE,
        "left padding of max_seq_len slots accepted",
    ),
    m(
        "model-pos-embed-by-slot",
        "kvlm/model.py",
        "x = x + self.pos_embed(step.positions)",
        "x = x + self.pos_embed(torch.arange(step.start, step.end).expand_as(step.positions))",
        MODEL,
        "learned positions indexed by cache slot, not position (wrong under left padding)",
    ),
    m(
        "model-last-only-off-by-one",
        "kvlm/model.py",
        "x = x[:, -1:]",
        "x = x[:, -2:-1] if x.shape[1] > 1 else x",
        MODEL,
        "last_only returns the second-to-last position",
    ),
    # --- accounting ---------------------------------------------------------------------------------------
    m(
        "acct-replicated-split",
        "kvlm/accounting.py",
        '            total += t["numel"]\n',
        '            total += t["numel"] / shards\n',
        ACCOUNTING,
        "replicated cache tensors counted as split",
    ),
    m(
        "acct-ceil-to-floor",
        "kvlm/accounting.py",
        'total += t["numel"] * math.ceil(degree / shards) / degree',
        'total += t["numel"] / shards',
        ACCOUNTING,
        "uneven TP splits: busiest device's share rounded down",
    ),
    m(
        "acct-intensity-tp-not-capped",
        "kvlm/accounting.py",
        "return flops / min(tp, cfg.n_head) / (elements * dtype_bytes)",
        "return flops / tp / (elements * dtype_bytes)",
        ACCOUNTING,
        "arithmetic intensity divides by tp > n_head",
    ),
    m(
        "acct-intensity-drops-gathered-rows",
        "kvlm/accounting.py",
        'elements += cfg.mechanism().decode_cost(cfg, 1, 1, "auto", layer_idx)["weight_elements"]',
        "elements += 0",
        ACCOUNTING,
        "eg-mla's gathered gate rows left out of the intensity",
    ),
    m(
        "acct-reduction-not-complement",
        "kvlm/accounting.py",
        '"kv_reduction_vs_mha": 1.0 - total / ref_total,',
        '"kv_reduction_vs_mha": total / ref_total,',
        ACCOUNTING,
        "kv-table reduction reports the kept fraction",
    ),
    # --- compare and bench report math -----------------------------------------------------------------------
    m(
        "compare-reduction-not-complement",
        "kvlm/compare/aggregate.py",
        'r["kv_reduction_vs_baseline"] = 1 - r["kv_bytes_per_token"] / base["kv_bytes_per_token"]',
        'r["kv_reduction_vs_baseline"] = r["kv_bytes_per_token"] / base["kv_bytes_per_token"]',
        COMPARE_STATS,
        "KV reduction reports the kept fraction",
    ),
    m(
        "compare-loss-delta-inverted",
        "kvlm/compare/aggregate.py",
        'r["val_loss_delta_pct"] = 100 * (r["val_loss"] / base["val_loss"] - 1)',
        'r["val_loss_delta_pct"] = 100 * (base["val_loss"] / r["val_loss"] - 1)',
        COMPARE_STATS,
        "loss change against the baseline inverted (sign flips)",
    ),
    m(
        "compare-perplexity-first-seed",
        "kvlm/compare/aggregate.py",
        '"val_perplexity": statistics.fmean([r["val_perplexity"] for r in rs]),',
        '"val_perplexity": statistics.fmean([r["val_perplexity"] for r in rs[:1]]),',
        COMPARE_STATS,
        "perplexity of the first seed, not the mean over seeds",
    ),
    m(
        "compare-non-embedding-keeps-gate-tables",
        "kvlm/compare/aggregate.py",
        '"params_non_embedding": p["total"] - p["embedding"] - p["gate_embedding"],',
        '"params_non_embedding": p["total"] - p["embedding"],',
        COMPARE_STATS,
        "eg-mla gate tables counted as non-embedding",
    ),
    m(
        "compare-pareto-ignores-noise",
        "kvlm/compare/aggregate.py",
        'return test["significant"] and test["diff"] < 0',
        'return test["diff"] < 0',
        COMPARE_STATS,
        "Pareto dominance by a lower mean within seed noise",
    ),
    m(
        "compare-pareto-equal-bytes-never-dominate",
        "kvlm/compare/aggregate.py",
        'if o is r or o["kv_bytes_per_token"] > r["kv_bytes_per_token"]:',
        'if o is r or o["kv_bytes_per_token"] >= r["kv_bytes_per_token"]:',
        COMPARE_STATS,
        "a variant with the same cache and a significantly lower loss does not dominate",
    ),
    m(
        "compare-pareto-one-seed-tie",
        "kvlm/compare/aggregate.py",
        'lower = o["val_loss"] < r["val_loss"] or (fewer and o["val_loss"] == r["val_loss"])',
        'lower = o["val_loss"] < r["val_loss"]',
        COMPARE_STATS,
        "one seed: a tie on loss no longer goes to the smaller cache",
    ),
    m(
        "compare-verdict-sign",
        "kvlm/compare/aggregate.py",
        'word = "better" if test["diff"] < 0 else "worse"',
        'word = "better" if test["diff"] > 0 else "worse"',
        COMPARE_STATS,
        "a higher loss called better",
    ),
    m(
        "compare-baseline-ignores-mha",
        "kvlm/compare/aggregate.py",
        'return next((label for label, att in labels_attention if att == "mha"), labels[0])',
        "return labels[0]",
        COMPARE_STATS,
        "default baseline is the first variant even when an MHA is present",
    ),
    m(
        "stats-welch-pooled-df",
        "kvlm/compare/stats.py",
        "df = se2 * se2 / (va * va / (len(a) - 1) + vb * vb / (len(b) - 1))",
        "df = len(a) + len(b) - 2",
        COMPARE_STATS,
        "Student's pooled degrees of freedom instead of Welch-Satterthwaite",
    ),
    m(
        "stats-interval-normal",
        "kvlm/compare/stats.py",
        "half = t_quantile(1.0 - ALPHA / 2.0, n - 1) * sem",
        "half = 1.96 * sem",
        COMPARE_STATS,
        "normal interval for a handful of seeds",
    ),
    m(
        "stats-population-std",
        "kvlm/compare/stats.py",
        "std = statistics.stdev(values)",
        "std = statistics.pstdev(values)",
        COMPARE_STATS,
        "population std (n) instead of the sample std (n - 1)",
    ),
    m(
        "stats-t-tail-swapped",
        "kvlm/compare/stats.py",
        "return betainc(df / 2.0, 0.5, df / (df + t * t))",
        "return betainc(0.5, df / 2.0, df / (df + t * t))",
        COMPARE_STATS,
        "incomplete beta arguments swapped",
    ),
    m(
        "compare-match-params-uses-activated",
        "kvlm/compare/variants.py",
        'key = "total" if match == "params" else "activated"',
        'key = "activated"',
        COMPARE_STATS,
        "--match params leaves the gate tables out",
    ),
    m(
        "compare-int8-without-scales",
        "kvlm/compare/costs.py",
        "total += math.prod(shape[:-1]) * SCALE_BYTES",
        "total += 0",
        COMPARE_STATS,
        "int8 KV bytes forget the per-vector scales",
    ),
    m(
        "compare-resume-restarts",
        "kvlm/compare/job.py",
        'return "resume" if (ckpt / "trainer_state.pt").is_file() else "fresh"',
        'return "fresh"',
        COMPARE_RESUME,
        "an interrupted run starts over instead of resuming",
    ),
    m(
        "bench-roofline-ratio-inverted",
        "kvlm/bench/roofline.py",
        '"roofline_ratio": median_ms / floor_ms,',
        '"roofline_ratio": floor_ms / median_ms,',
        BENCH,
        "roofline ratio inverted",
    ),
    m(
        "bench-gbs-units",
        "kvlm/bench/roofline.py",
        '"achieved_gbs": bytes_per_step / (median_ms * 1e-3) / 1e9,',
        '"achieved_gbs": bytes_per_step / (median_ms * 1e-3) / 2**30,',
        BENCH,
        "achieved GB/s in GiB/s",
    ),
    m(
        "bench-x-roofline-min",
        "kvlm/bench/roofline.py",
        '"x_roofline": median_ms / max(floor_ms, compute_ms),',
        '"x_roofline": median_ms / min(floor_ms, compute_ms),',
        BENCH,
        "x roofline against the lower floor",
    ),
    m(
        "bench-kv-bytes-drop-gathered",
        "kvlm/bench/roofline.py",
        'total["bytes"] += int(cost["cache_elements"] + cost["weight_elements"]) * dtype_bytes',
        'total["bytes"] += int(cost["cache_elements"]) * dtype_bytes',
        BENCH,
        "attention bytes leave out gathered rows (eg-mla gate tables)",
    ),
]


def copy_repo(dest: Path) -> None:
    """Copy what git would carry (tracked and untracked files, not ignored ones) into dest."""
    files = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        check=True,
        capture_output=True,
    ).stdout.split(b"\0")
    for name in files:
        if not name:
            continue
        src = REPO / os.fsdecode(name)
        if not src.is_file():  # deleted in the working tree, not yet in the index
            continue
        dst = dest / os.fsdecode(name)
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dst)


def run_tests(root: Path, tests: tuple[str, ...], timeout: float) -> tuple[str, float, str]:
    """(outcome, seconds, last output line): outcome "passed", "failed" or "timeout"."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(root), PYTHONDONTWRITEBYTECODE="1")
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:xdist", "-p", "no:cacheprovider", *tests]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return "timeout", time.perf_counter() - t0, ""
    lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.strip()]
    last = lines[-1] if lines else ""
    return ("passed" if proc.returncode == 0 else "failed"), time.perf_counter() - t0, last


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def apply_and_test(root: Path, mutant: Mutant, timeout: float) -> dict:
    path = root / mutant.path
    row = {"id": mutant.id, "path": mutant.path, "why": mutant.why, "tests": list(mutant.tests)}
    if not path.is_file():
        return {**row, "status": "stale", "detail": "file not found"}
    original = path.read_text()
    n = original.count(mutant.find)
    if n != 1:
        return {**row, "status": "stale", "detail": f"source text found {n} times"}
    try:
        path.write_text(original.replace(mutant.find, mutant.replace))
        outcome, seconds, last = run_tests(root, mutant.tests, timeout)
    finally:
        path.write_text(original)
    status = {"passed": "survived", "failed": "killed", "timeout": "timeout"}[outcome]
    return {**row, "status": status, "seconds": round(seconds, 1), "detail": last}


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "-k", action="append", default=[], help="run only mutants whose id contains this (repeatable)"
    )
    ap.add_argument("--list", action="store_true", help="list the mutants and exit")
    ap.add_argument("--check", action="store_true", help="only check that each mutant applies to the source")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per test run (default 600)")
    ap.add_argument("--no-baseline", action="store_true", help="skip the unmutated run of each test subset")
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args(argv)

    chosen = [mu for mu in MUTANTS if not args.k or any(k in mu.id for k in args.k)]
    if args.list:
        for mu in chosen:
            print(f"{mu.id:34s} {mu.path:34s} {mu.why}")
        print(f"{len(chosen)} mutants")
        return 0

    if args.check:
        stale = []
        for mu in chosen:
            path = REPO / mu.path
            n = path.read_text().count(mu.find) if path.is_file() else -1
            if n != 1:
                stale.append(mu.id)
                print(
                    f"stale {mu.id}: {mu.path} "
                    + ("missing" if n < 0 else f"holds the source text {n} times")
                )
        print(f"{len(chosen) - len(stale)} of {len(chosen)} mutants apply")
        return 1 if stale else 0

    signal.signal(signal.SIGTERM, _interrupt)  # kill <pid>: restore and report, as Ctrl-C does
    results: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="kvlm-mutants-") as tmp:
        root = Path(tmp) / REPO.name
        copy_repo(root)
        shared = REPO.parent / "shared"
        if shared.exists():  # the tests find ../shared beside the repository
            (Path(tmp) / "shared").symlink_to(shared)
        before = {mu.path: digest(root / mu.path) for mu in chosen if (root / mu.path).is_file()}
        broken: set[tuple[str, ...]] = set()  # test subsets the unmutated code already fails
        if not args.no_baseline:
            for tests in dict.fromkeys(mu.tests for mu in chosen):
                outcome, seconds, last = run_tests(root, tests, args.timeout)
                print(f"baseline {' '.join(tests)}: {outcome} in {seconds:.0f} s", flush=True)
                if outcome != "passed":
                    print(f"  the unmutated code fails these tests ({last}): their mutants are not run")
                    broken.add(tests)
        try:
            for i, mu in enumerate(chosen, 1):
                if mu.tests in broken:
                    row = {"id": mu.id, "path": mu.path, "why": mu.why, "tests": list(mu.tests)}
                    row.update(status="unrun", detail="its tests fail without the mutant")
                else:
                    row = apply_and_test(root, mu, args.timeout)
                results.append(row)
                took = f" in {row['seconds']:.0f} s" if "seconds" in row else ""
                print(f"[{i}/{len(chosen)}] {row['status']:8s} {mu.id}{took}", flush=True)
        except KeyboardInterrupt:
            print("interrupted: reporting the mutants run so far")
        changed = [p for p, d in before.items() if digest(root / p) != d]
        if changed:  # cannot happen unless a restore failed: the results after it are suspect
            print(f"ERROR: files not restored in the copy: {changed}")
            return 3

    statuses = ("killed", "survived", "timeout", "stale", "unrun")
    counts = {s: sum(r["status"] == s for r in results) for s in statuses}
    print("\n" + ", ".join(f"{n} {s}" for s, n in counts.items()) + f" of {len(results)} mutants")
    for r in results:
        if r["status"] in ("survived", "stale", "unrun"):
            print(
                f"  {r['status']:8s} {r['id']:34s} {r['path']}: {r['why']}"
                + (f" ({r['detail']})" if r["status"] != "survived" else "")
            )
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
