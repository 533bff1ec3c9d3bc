"""Data-parallel training (2 processes, gloo on CPU) matches one process with the same global batch."""

import json
import pathlib

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kvlm import ModelConfig
from kvlm.data.prepare import prepare
from kvlm.training.train import TrainConfig, train

pytestmark = pytest.mark.distributed


def _worker(rank, world, init_file, data_dir, out_dir, result_file, cfg, tcfg):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        res = train(ModelConfig.from_dict(cfg), TrainConfig.from_dict(tcfg), data_dir, out_dir,
                    progress=False, log=None)  # fmt: skip
        if rank == 0:
            pathlib.Path(result_file).write_text(json.dumps({"losses": res.losses, "val": res.val_losses}))
    finally:
        dist.destroy_process_group()


def test_two_ranks_match_one_process(tmp_path):
    data = prepare("synthetic", tmp_path / "data", max_tokens=20_000, vocab_size=300)
    cfg = ModelConfig(
        attention="mha", n_layer=1, d_model=32, n_head=2, vocab_size=data.vocab_size, max_seq_len=16
    )
    tcfg = TrainConfig(batch_size=8, seq_len=16, max_steps=4, lr=3e-3, warmup_steps=1, eval_interval=2,
                       eval_iters=2, log_interval=1)  # fmt: skip
    single = train(cfg, tcfg, data, tmp_path / "single", progress=False, log=None)
    # two ranks, each two micro-batches of 2 (no_sync on the first): the global batch is still 8.
    # fork: the children inherit the imported torch (the test's cost is then the training, not imports)
    ddp_cfg = tcfg.replace(grad_accum=2)
    result = tmp_path / "ddp.json"
    mp.start_processes(
        _worker,
        args=(
            2,
            str(tmp_path / "init"),
            str(data.path),
            str(tmp_path / "ddp"),
            str(result),
            cfg.to_dict(),
            ddp_cfg.to_dict(),
        ),  # fmt: skip
        nprocs=2,
        join=True,
        start_method="fork",
    )
    ddp = json.loads(result.read_text())

    assert len(ddp["losses"]) == 4
    assert ddp["losses"] == pytest.approx(single.losses, abs=1e-5)
    assert [s for s, _ in ddp["val"]] == [s for s, _ in single.val_losses] == [2, 4]
    assert [v for _, v in ddp["val"]] == pytest.approx([v for _, v in single.val_losses], abs=1e-5)
    # the losses moved: equality is not two untrained models agreeing
    assert single.losses[-1] < single.losses[0] - 0.05
    # rank 0 wrote the run folder; its checkpoint holds both ranks' RNG states
    state = torch.load(tmp_path / "ddp" / "checkpoint" / "trainer_state.pt", weights_only=True)
    assert state["world_size"] == 2 and len(state["rng"]) == 2
    assert len((tmp_path / "ddp" / "metrics.jsonl").read_text().splitlines()) == 4
