"""Tensor-parallel decoding and EG-MLA embedding parallelism (kvlm/parallel/).

Multi-process tests run real torch.distributed groups (gloo, one thread per rank) of 2 and 4 ranks; each
world is started once and checks every mechanism, so a failure message lists every case that failed.
Each mechanism declares its split (``Attention.tp_plan``): torch's ColwiseParallel / RowwiseParallel (DTensor) for
contiguous head splits, slicing rules for the rest; the runs check that the declared submodules hold DTensors.
The per-device KV of mlra.md Table 1 is checked without processes: sharding needs no process group, and on
the meta device the paper-size layers cost nothing."""

import pytest
import torch
from conftest import tiny_config
from dist_scripts import workers

from kvlm import build_model
from kvlm.accounting import per_device_elements
from kvlm.attention import get_attention_class
from kvlm.config import ConfigError, spec_numel
from kvlm.parallel import (
    init_distributed,
    require_world,
    shard_attention,
    shard_gate_embeddings,
    shard_model,
)
from kvlm.preset_table import get_preset

# mlra.md Table 1: KV cache loaded per token per device, in units of d_h, at 1 / 2 / 4 / 8 devices.
# Typed from the paper (Qwen3-32B / Kimi-K2 shapes: 64 heads, d_h = 128, g = 8, d_c = 4 d_h, d_h^R = d_h / 2).
TABLE1 = {
    "mha": (128, 64, 32, 16),
    "mqa": (2, 2, 2, 2),
    "gqa": (16, 8, 4, 2),
    "mla": (4.5, 4.5, 4.5, 4.5),
    "mfa": (4, 4, 4, 4),
    "tpa": (6, 5, 4.5, 4.25),
    "gla-2": (4.5, 2.5, 2.5, 2.5),
    "gta": (8.5, 4.5, 2.5, 1.5),
    "mlra-2": (4.5, 2.5, 1.5, 1.5),
    "mlra-4": (4.5, 2.5, 1.5, 1.5),
}
D_H = 128


@pytest.mark.parametrize("row", sorted(TABLE1))
def test_per_rank_cache_is_mlra_table1(row):
    cfg = get_preset(f"mlra-table1/{row}")
    with torch.device("meta"):
        attn = get_attention_class(cfg.attention)(cfg, 0)
    for world, paper in zip((1, 2, 4, 8), TABLE1[row]):
        per_rank = [spec_numel(shard_attention(attn, rank, world)[0].cache_spec()) for rank in range(world)]
        assert {n / D_H for n in per_rank} == {paper}, (row, world, per_rank)
        assert max(per_rank) == per_device_elements(cfg, world), (row, world)  # kvlm kv-table --tp


# --- the multi-process runs ---------------------------------------------------------------------------
# (attention, overrides, extra checks): "modes" decodes in all four attention modes, "sample" compares
# seeded sampling too. Two ranks: every mechanism and its options; four ranks (one layer, to keep the run
# short): every mechanism, including the replicated cases (GQA/GTA with g = 2, GLA-2 beyond its 2 latent
# heads, MLRA-2 with the two branches of a head on different ranks).
TP2 = [
    ("mha", {"arch": "gpt2", "bias": True}, {"sample"}),
    ("mqa", {}, set()),
    ("gqa", {"n_kv_head": 2, "gated": True}, set()),
    ("mla", {"q_lora_rank": 32}, {"modes"}),
    ("mla", {"arch": "gpt2", "bias": True, "kv_lora_rank": 8}, {"modes"}),  # folded absorption
    ("mla", {"kv_latent": "separate", "kv_lora_rank": 32, "gated": True}, set()),
    ("eg-mla", {"eg_group_size": 2, "n_layer": 4, "kv_emb_dim": 16, "arch": "gpt2", "bias": True}, set()),
    ("eg-mla", {"eg_norm": False, "eg_op": "add", "gated": True}, set()),
    ("gla-2", {"q_lora_rank": 32, "latent_scaling": True}, {"modes"}),
    ("gla-4", {"arch": "gpt2", "bias": True}, set()),
    (
        "mlra-2",
        {"q_lora_rank": 32, "latent_scaling": True, "attn_out_scaling": True, "gated": True},
        {"modes"},
    ),
    ("mlra-4", {"rope_head_dim": 0, "gated": True, "attn_out_scaling": True}, set()),
    ("gta", {"n_kv_head": 2, "gated": True}, set()),
    ("mfa", {"q_lora_rank": 32}, set()),
    ("tpa", {"rope": False, "arch": "gpt2", "bias": True}, {"modes"}),
]
TP4 = [
    ("mha", {"n_layer": 1}, {"sample"}),
    ("gqa", {"n_layer": 1, "n_kv_head": 2}, set()),
    ("mla", {"n_layer": 1, "q_lora_rank": 32, "gated": True}, set()),
    ("eg-mla", {"n_layer": 1}, set()),
    ("gla-2", {"n_layer": 1, "arch": "gpt2", "bias": True}, set()),
    (
        "mlra-2",
        {"n_layer": 1, "q_lora_rank": 32, "latent_scaling": True, "attn_out_scaling": True},
        {"modes"},
    ),
    (
        "mlra-4",
        {"n_layer": 1, "q_lora_rank": 32, "latent_scaling": True, "attn_out_scaling": True, "gated": True},
        set(),
    ),
    ("gta", {"n_layer": 1, "n_kv_head": 2}, set()),
    ("mfa", {"n_layer": 1, "q_lora_rank": 32}, set()),
    ("tpa", {"n_layer": 1}, set()),
]
EP = [
    ("eg-mla", {}),
    ("eg-mla", {"eg_group_size": 2, "n_layer": 4, "kv_emb_dim": 15, "arch": "gpt2", "bias": True}),  # uneven
]


DP = [("mla", {"q_lora_rank": 32}), ("mlra-2", {"arch": "gpt2", "bias": True})]


def _check_dp(results):
    bad = []
    for attention, overrides in DP:
        key = f"{attention}{overrides}"
        for rank, r in enumerate(res["dp"][key] for res in results):
            if "error" in r:
                bad.append(f"dp {key} rank {rank}: {r['error']}")
                continue
            if r["logits_err"] > 1e-12:
                bad.append(f"dp {key} rank {rank}: logits differ by {r['logits_err']}")
            if r["greedy"][0] != r["greedy"][1]:
                bad.append(f"dp {key} rank {rank}: tokens {r['greedy'][1]} != {r['greedy'][0]}")
            if r["cache_elements_per_token"] != r["full_elements_per_token"]:
                bad.append(f"dp {key} rank {rank}: a rank caches whole layers for its own requests")
    return bad


def _check_tp(world, results, cases):
    from kvlm.accounting import kv_table

    bad = []
    for attention, overrides, _ in cases:
        key = f"{attention}{overrides}"
        per_rank = [r["tp"][key] for r in results]
        errors = [r["error"] for r in per_rank if "error" in r]
        if errors:
            bad.append(f"{key}: {errors[0]}")
            continue
        for rank, r in enumerate(per_rank):
            errs = {"full": r["full_err"], **r["decode_err"]}
            if max(errs.values()) > 1e-12:
                bad.append(f"{key} rank {rank}: logits differ from one process {errs}")
            if r["greedy"][0] != r["greedy"][1]:
                bad.append(f"{key} rank {rank}: greedy tokens {r['greedy'][1]} != {r['greedy'][0]}")
            if "sampled" in r and r["sampled"][0] != r["sampled"][1]:
                bad.append(f"{key} rank {rank}: sampled tokens differ")
            if not torch.equal(r["logits"], per_rank[0]["logits"]):
                bad.append(f"{key} rank {rank}: logits not bitwise equal to rank 0's")
            # what the rank allocated == what it declares == kvlm kv-table's per-device column
            cfg = tiny_config(attention, **overrides)
            want = kv_table(cfg, tp=[world], params=False)[0]["per_device"][world]["elements_per_token"]
            if r["kv_elements_per_token"] != want or r["cache_elements_per_token"] != want:
                bad.append(
                    f"{key} rank {rank}: caches {r['kv_elements_per_token']} elements/token, kv-table {want}"
                )
            if r["cache_nbytes"] != r["cache_tokens"] * want * 8:  # float64
                bad.append(f"{key} rank {rank}: allocated {r['cache_nbytes']} bytes")
            got, declared, ffn_on_dtensor = r["dtensor"]
            if got != declared or not ffn_on_dtensor:
                bad.append(
                    f"{key} rank {rank}: DTensor weights {got}, declared {declared}, FFN {ffn_on_dtensor}"
                )
        # the ranks' shards cover every query head; for latent blocks every block
        plans = [r["plan"][0] for r in per_rank]
        cfg = tiny_config(attention, **overrides)
        heads = {h for p in plans for h in p["query_heads"]}
        if heads != set(range(cfg.n_head)):
            bad.append(f"{key}: ranks hold query heads {sorted(heads)}")
        if "latent_blocks" in plans[0]:
            blocks = sorted({b for p in plans for b in p["latent_blocks"]})
            if blocks != list(range(get_attention_class(attention)._blocks(cfg))):
                bad.append(f"{key}: ranks hold latent blocks {blocks}")
    return bad


def _check_ep(world, results):
    bad = []
    for attention, overrides in EP:
        key = f"{attention}{overrides}"
        per_rank = [r["ep"][key] for r in results]
        if any("error" in r for r in per_rank):
            bad.append(f"{key}: {[r['error'] for r in per_rank if 'error' in r][0]}")
            continue
        cfg = tiny_config(attention, **overrides)
        widths = [dict(r["sharded"]) for r in per_rank]
        for name in widths[0]:
            if sum(w[name][1] for w in widths) != cfg.kv_emb_dim:
                bad.append(f"{key}: slices of {name} do not add up to kv_emb_dim")
        for rank, r in enumerate(per_rank):
            if r["loss_err"] > 1e-12:
                bad.append(f"{key} rank {rank}: loss differs by {r['loss_err']}")
            for what in ("norm_err", "clipped_err", "gathered_err"):
                if r[what] > 1e-12:
                    bad.append(f"{key} rank {rank}: {what} {r[what]}")
            worst = max(r["grad_err"], key=r["grad_err"].get)
            if r["grad_err"][worst] > 1e-12:
                bad.append(f"{key} rank {rank}: gradient of {worst} differs by {r['grad_err'][worst]}")
            n_tables = cfg.n_layer // cfg.eg_group_size
            full = n_tables * cfg.vocab_size * cfg.kv_emb_dim * 8
            if (
                not full / world - cfg.vocab_size * n_tables * 8
                <= r["gate_bytes"]
                <= full / world + cfg.vocab_size * n_tables * 8
            ):
                bad.append(f"{key} rank {rank}: holds {r['gate_bytes']} bytes of gate tables, full {full}")
            if r["param_bytes_unsharded"] - r["param_bytes"] != full - r["gate_bytes"]:
                bad.append(
                    f"{key} rank {rank}: parameter bytes {r['param_bytes']} (unsharded {r['param_bytes_unsharded']})"
                )
    for rank, r in enumerate(results):
        if r["ep"]["ragged"]["out_err"] or r["ep"]["ragged"]["grad_err"] > 1e-12:
            bad.append(f"ragged lookup rank {rank}: {r['ep']['ragged']}")
    return bad


@pytest.mark.distributed
@pytest.mark.parametrize("world,cases", [(2, TP2), (4, TP4)], ids=["2ranks", "4ranks"])
def test_tensor_and_embedding_parallel(tmp_path, world, cases):
    results = workers.run(workers.all_checks, world, str(tmp_path), cases, EP, DP)
    bad = _check_tp(world, results, cases) + _check_ep(world, results) + _check_dp(results)
    assert not bad, "\n".join(bad)


# --- single process: errors and no-ops ------------------------------------------------------------


def test_world_of_one_is_the_model_itself():
    model = build_model(tiny_config("mla"))
    assert shard_model(model, 0, 1) is model


def test_shard_errors_name_the_problem():
    with pytest.raises(ConfigError, match="n_head=4 is not divisible by the tensor-parallel degree 3"):
        shard_model(build_model(tiny_config("mha")), 0, 3)
    with pytest.raises(ConfigError, match="not a multiple of n_kv_head=2"):
        shard_model(build_model(tiny_config("gqa", n_kv_head=2, n_head=6, head_dim=16)), 0, 3)
    with pytest.raises(ConfigError, match="latent blocks"):
        shard_model(build_model(tiny_config("mlra-4")), 0, 3)
    with pytest.raises(ConfigError, match="rank 2 is not in a tensor-parallel world of 2"):
        shard_model(build_model(tiny_config("mha")), 2, 2)
    with pytest.raises(ConfigError, match="no gating embedding tables"):
        shard_gate_embeddings(build_model(tiny_config("mla")), 0, 2)


def test_contiguous_splits_are_declared_with_torch_styles():
    """MHA/GQA, GTA, MFA and TPA's output run on torch's ColwiseParallel / RowwiseParallel (DTensor); the latent
    family's absorbed routes read their weights in the rank's geometry, so their plans are slices."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    def styles(attention, **overrides):
        cfg = tiny_config(attention, gated=True, **overrides)
        plan = get_attention_class(attention)(cfg, 0).tp_plan(0, 2)
        return {m: type(s) for m, s in plan.get("parallelize", {}).items()}

    col, row = ColwiseParallel, RowwiseParallel
    assert styles("gqa", n_kv_head=2) == {"wq": col, "wk": col, "wv": col, "gate": col, "wo": row}
    assert styles("mqa") == {"wq": col, "gate": col, "wo": row}  # the one KV head: replicated, sliced
    assert styles("gta", n_kv_head=2) == {"wq": col, "wkv": col, "gate": col, "wo": row}
    assert styles("mfa", q_lora_rank=32) == {"wq_b": col, "gate": col, "wo": row}
    assert styles("tpa") == {"gate": col, "wo": row}  # W^A's rows are interleaved: sliced
    for attention in ("mla", "eg-mla", "gla-2", "mlra-4"):
        assert styles(attention) == {}, attention


def test_tp_degree_must_match_the_launch(monkeypatch):
    for var in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    ctx = init_distributed("cpu")
    assert (ctx.rank, ctx.world) == (0, 1)
    require_world(1, ctx)
    with pytest.raises(ConfigError, match="torchrun --nproc-per-node 2"):
        require_world(2, ctx)


def test_shards_hold_a_fraction_of_the_weights():
    """Per-rank attention and FFN weights: the full layer's minus what other ranks hold."""
    model = build_model(tiny_config("mlra-4", n_layer=1))
    full = model.layers[0]
    for world in (2, 4):
        shards = [shard_model(model, r, world).layers[0] for r in range(world)]
        for part in ("attn", "mlp"):
            whole = sum(p.numel() for p in getattr(full, part).parameters())
            held = [sum(p.numel() for p in getattr(s, part).parameters()) for s in shards]
            assert all(h < whole for h in held), (part, world, held, whole)
        # the FFN (no biases here) is split exactly: its slices add up to the whole
        assert sum(sum(p.numel() for p in s.mlp.parameters()) for s in shards) == sum(
            p.numel() for p in full.mlp.parameters()
        )


# --- the launched commands (torchrun) -------------------------------------------------------------------


def _torchrun(nproc, *args, timeout=300):
    import os
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *args]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.slow
@pytest.mark.distributed
def test_generate_tp_under_torchrun(tmp_path, capsys):
    import json

    from kvlm.checkpoint import save_checkpoint
    from kvlm.cli import main
    from kvlm.data.tokenizer import train_bpe

    tok = train_bpe(["The cat sat on the mat and looked at the moon."] * 5, vocab_size=280)
    torch.manual_seed(0)
    model = build_model(tiny_config("mlra-4", vocab_size=tok.vocab_size))
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(5.0)  # peaked logits: greedy choices far from ties
    save_checkpoint(tmp_path / "ckpt", model, tokenizer=tok)
    args = ["generate", str(tmp_path / "ckpt"), "--prompt", "The cat", "--max-new-tokens", "8", "--no-stop"]
    args += ["--json", "--device", "cpu"]
    assert main(args) == 0
    one = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    out = _torchrun(2, "-m", "kvlm.cli", *args, "--tp", "2")
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    assert len(lines) == 1  # rank 0 alone prints
    assert json.loads(lines[0])["token_ids"] == one["token_ids"]


@pytest.mark.slow
@pytest.mark.distributed
def test_embedding_parallel_bench_under_torchrun():
    import json

    common = [
        "-m",
        "kvlm.cli",
        "bench-parallel",
        "embedding-parallel-bench",
        "--preset",
        "eg-mla",
        "--json",
    ]
    common += ["--set", "vocab_size=2048", "--set", "kv_emb_dim=64", "--batch", "2", "--seq", "16"]
    common += ["--steps", "2", "--warmup", "1", "--device", "cpu"]
    runs = {}
    for mode in ("vanilla", "dimension-wise"):
        runs[mode] = json.loads(_torchrun(2, *common, "--mode", mode).strip().splitlines()[-1])["ranks"]
    tables = 4 * 2048 * 64 * 4  # n_layer (ModelConfig default) x vocab x width x fp32 bytes
    for v, d in zip(runs["vanilla"], runs["dimension-wise"]):
        assert v["gate_table_bytes"] == tables and d["gate_table_bytes"] == tables // 2
        assert d["parameter_bytes"] == v["parameter_bytes"] - tables // 2
        assert d["optimizer_state_bytes"] == v["optimizer_state_bytes"] - tables  # AdamW: two moments
        assert d["comm_ms"] is not None and v["comm_ms"] is None
