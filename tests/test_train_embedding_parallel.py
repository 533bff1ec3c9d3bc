"""kvlm train with EG-MLA's dimension-wise embedding parallelism (TrainConfig.embedding_parallel, eg-mla.md
Eqs. 9-11): two gloo ranks train exactly as plain DDP and as one process with the same global batch, write
ordinary (unsharded) checkpoints with whole optimizer moments, resume, and hold less per rank."""

import contextlib
import datetime
import logging
import math
import pathlib
import shutil

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kvlm import ModelConfig
from kvlm.checkpoint import load_checkpoint
from kvlm.cli import main as cli
from kvlm.config import ConfigError
from kvlm.data import prepare
from kvlm.training import TrainConfig, train


@contextlib.contextmanager
def kvlm_log_lines():
    """The messages logged to the ``kvlm`` loggers meanwhile (INFO and up), whatever handlers the CLI set."""
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logger = logging.getLogger("kvlm")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


MEMORY_FIELDS = ("peak_memory_bytes_per_rank", "parameter_bytes_per_rank", "gradient_bytes_per_rank",
                 "optimizer_bytes_per_rank")  # fmt: skip


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    # 5 validation windows of 16 + 1 tokens: 3 on rank 0 (two calls of micro-batch 2), 2 on rank 1 (one
    # call), so the sharded tables' evaluation must keep the ranks in step
    d = tmp_path_factory.mktemp("data") / "d"
    return prepare("synthetic", d, max_tokens=20_000, vocab_size=300, val_tokens=5 * 16 + 1)


def tiny(data):
    # 3 layers with lgz 2: one table shared by layers 0-1 and one of layer 2's own; kv_emb_dim 15 splits
    # unevenly over 2 ranks (8 + 7 columns)
    return ModelConfig(attention="eg-mla", n_layer=3, d_model=32, n_head=2, kv_lora_rank=16, q_lora_rank=0,
                       rope_head_dim=8, kv_emb_dim=15, eg_group_size=2, vocab_size=data.vocab_size,
                       max_seq_len=16)  # fmt: skip


def quick(**kw):
    base = dict(batch_size=8, seq_len=16, max_steps=4, lr=3e-3, warmup_steps=1, eval_interval=2, eval_iters=3,
                log_interval=1, checkpoint_interval=2)  # fmt: skip
    return TrainConfig(**{**base, **kw})


def _worker(rank, world, init_file, data_dir, tmp, cfg, tcfg):
    torch.set_num_threads(1)
    # a short collective timeout: ranks out of step (a missed exchange) fail the test instead of hanging it
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))  # fmt: skip
    tmp = pathlib.Path(tmp)
    cfg, tcfg = ModelConfig.from_dict(cfg), TrainConfig.from_dict(tcfg)
    ep_cfg = tcfg.replace(embedding_parallel=True)

    def keep_step_2(rec):  # rank 0: at step 3 the checkpoint folder holds step 2's
        if rec["step"] == 3:
            shutil.copytree(tmp / "ep" / "checkpoint", tmp / "ep-step2")

    try:
        runs = {
            "vanilla": train(cfg, tcfg, data_dir, tmp / "vanilla", progress=False),
            "ep": train(cfg, ep_cfg, data_dir, tmp / "ep", progress=False, callback=keep_step_2),
        }
        dist.barrier()
        for name, c in (("resumed-ep", ep_cfg), ("resumed-vanilla", tcfg)):
            runs[name] = train(None, c, data_dir, tmp / name, resume=tmp / "ep-step2", progress=False)
        if rank == 0:
            out = {
                k: {"losses": r.losses, "val": r.val_losses, "history": r.history, "step_ms": r.step_time_ms,
                    "memory": r.memory, "state": {n: t.clone() for n, t in r.model.state_dict().items()}}
                for k, r in runs.items()
            }  # fmt: skip
            torch.save(out, tmp / "runs.pt")
    finally:
        dist.destroy_process_group()


def _close(a, b, tol=1e-5):
    # float32 rounding differs between the runs (all-to-all sums, float64 clip norm); AdamW's first steps
    # move a weight by ~lr whatever the gradient's size, so weights agree to ~1e-6, not to 1e-8
    return a.shape == b.shape and torch.allclose(a, b, atol=tol, rtol=1e-5)


@pytest.mark.distributed
def test_two_ranks_embedding_parallel_match_ddp_and_one_process(data, tmp_path):
    import torch._dynamo  # noqa: F401  (DDP imports it on first use: import it once, before forking)

    cfg, tcfg = tiny(data), quick()
    single = train(cfg, tcfg, data, tmp_path / "single", progress=False)
    # two ranks, two micro-batches each (no_sync on the first): the global batch is still 8
    mp.start_processes(
        _worker,
        args=(2, str(tmp_path / "init"), str(data.path), str(tmp_path), cfg.to_dict(),
              tcfg.replace(grad_accum=2).to_dict()),
        nprocs=2, join=True, start_method="fork",
    )  # fmt: skip
    runs = torch.load(tmp_path / "runs.pt", weights_only=False)
    van, ep = runs["vanilla"], runs["ep"]

    # the same training: losses, validation losses (lock-stepped evaluation of 5 windows over 2 ranks)
    assert single.losses[-1] < single.losses[0] - 0.05  # they moved: not two untrained models agreeing
    assert van["losses"] == pytest.approx(single.losses, abs=1e-5)
    assert ep["losses"] == pytest.approx(van["losses"], abs=1e-5)
    assert [s for s, _ in ep["val"]] == [2, 4]
    assert [v for _, v in ep["val"]] == pytest.approx([v for _, v in van["val"]], abs=1e-5)
    # the model handed back is whole, and equal to plain DDP's
    assert all(_close(ep["state"][n], t) for n, t in van["state"].items())

    # the checkpoint loads into an unsharded model with the vanilla run's weights
    m_ep, _, meta = load_checkpoint(tmp_path / "ep" / "checkpoint")
    m_van, _, _ = load_checkpoint(tmp_path / "vanilla" / "checkpoint")
    assert meta["step"] == 4
    assert m_ep.layers[0].attn.emb_gate.kv_emb.weight.shape == (cfg.vocab_size, 15)
    assert m_ep.layers[1].attn.emb_gate is m_ep.layers[0].attn.emb_gate  # the layer group shares again
    sd_van = m_van.state_dict()
    assert all(_close(t, sd_van[n]) for n, t in m_ep.state_dict().items())
    # ... and whole AdamW moments: the state an unsharded run holds
    opt_ep = torch.load(tmp_path / "ep" / "checkpoint" / "trainer_state.pt", weights_only=True)["optimizer"]
    opt_van = torch.load(tmp_path / "vanilla" / "checkpoint" / "trainer_state.pt", weights_only=True)[
        "optimizer"
    ]
    assert opt_ep["state"].keys() == opt_van["state"].keys()
    for i, st in opt_van["state"].items():
        for k in ("exp_avg", "exp_avg_sq"):
            assert _close(opt_ep["state"][i][k], st[k], 1e-7), (i, k)

    # resume from step 2 with embedding parallelism (moments re-sliced) or without: the same steps 3-4
    for name in ("resumed-ep", "resumed-vanilla"):
        assert runs[name]["losses"][:2] == ep["losses"][:2]  # restored from the checkpoint
        assert runs[name]["losses"] == pytest.approx(ep["losses"], abs=1e-6), name

    # per-rank memory figures in every record; the sharded tables are what each rank saves
    tables = 2 * cfg.vocab_size * 15 * 4  # two unique tables, float32
    dropped = [tables * (15 - w) // 15 for w in (8, 7)]  # bytes of the columns a rank does not hold
    for run in (van, ep):
        for rec in run["history"]:
            assert all(len(rec[f]) == 2 and min(rec[f]) > 0 for f in MEMORY_FIELDS), rec
            assert (
                rec["peak_memory_bytes"] == max(rec["peak_memory_bytes_per_rank"]) and rec["step_time_ms"] > 0
            )
        assert run["memory"] == {k: v for k, v in run["history"][-1].items() if k in run["memory"]}
        assert run["step_ms"] > 0
    v, e = van["history"][-1], ep["history"][-1]
    assert v["parameter_bytes_per_rank"][0] == v["parameter_bytes_per_rank"][1]
    for r in range(2):
        assert e["parameter_bytes_per_rank"][r] == v["parameter_bytes_per_rank"][r] - dropped[r]
        assert e["gradient_bytes_per_rank"][r] == v["gradient_bytes_per_rank"][r] - dropped[r]
        assert e["optimizer_bytes_per_rank"][r] == v["optimizer_bytes_per_rank"][r] - 2 * dropped[r]
    assert math.isclose(single.memory["parameter_bytes_per_rank"][0], v["parameter_bytes_per_rank"][0])
    # rank 0 wrote the run folder
    assert len((tmp_path / "ep" / "metrics.jsonl").read_text().splitlines()) == 4


def test_one_process_is_a_no_op_and_other_attentions_are_refused(data, tmp_path, capsys):
    cfg, tcfg = tiny(data), quick(max_steps=2, eval_interval=2)
    plain = train(cfg, tcfg, data, progress=False)
    with kvlm_log_lines() as lines:
        ep = train(cfg, tcfg.replace(embedding_parallel=True), data, progress=False)
    assert ep.losses == plain.losses
    assert any("one process, nothing to shard" in ln for ln in lines)
    assert (
        ep.memory["peak_memory_kind"] == "process peak RSS"
        and len(ep.memory["parameter_bytes_per_rank"]) == 1
    )

    with pytest.raises(ConfigError, match="embedding_parallel .* attention 'mla' has none"):
        train(
            cfg.replace(attention="mla"),
            tcfg.replace(embedding_parallel=True),
            data,
            progress=False,
        )
    with pytest.raises(ConfigError, match="embedding_parallel does not support compile"):
        tcfg.replace(embedding_parallel=True, compile=True)
    # the CLI flag reaches TrainConfig (here: the error for a model without gate tables, exit status 1)
    args = ["train", "--data", str(data.path), "--out", str(tmp_path / "run"), "--attention", "mla", "--n-layer", "1", "--kv-lora-rank", "16",
            "--d-model", "32", "--n-head", "2", "--max-seq-len", "16", "--seq-len", "16", "--batch-size", "4",
            "--steps", "1", "--embedding-parallel", "--no-progress"]  # fmt: skip
    assert cli(args) == 1
    assert "embedding_parallel" in capsys.readouterr().err
