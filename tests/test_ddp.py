"""Data-parallel training (2 processes, gloo on CPU; DDP or FSDP2) matches one process with the same global
batch; FSDP2's sharded checkpoints (torch.distributed.checkpoint) restore exactly."""

import json
import pathlib

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kvlm import ModelConfig
from kvlm.checkpoint import load_checkpoint
from kvlm.data import prepare
from kvlm.training import TrainConfig, train

pytestmark = pytest.mark.distributed


def _worker(rank, world, init_file, data_dir, out_dir, result_file, cfg, tcfg):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        res = train(ModelConfig.from_dict(cfg), TrainConfig.from_dict(tcfg), data_dir, out_dir,
                    progress=False)  # fmt: skip
        if rank == 0:
            pathlib.Path(result_file).write_text(json.dumps({"losses": res.losses, "val": res.val_losses}))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("how", ["ddp", "fsdp"])
def test_two_ranks_match_one_process(tmp_path, how):
    data = prepare("synthetic", tmp_path / "data", max_tokens=20_000, vocab_size=300)
    cfg = ModelConfig(
        attention="mha", n_layer=1, d_model=32, n_head=2, vocab_size=data.vocab_size, max_seq_len=16
    )
    tcfg = TrainConfig(batch_size=8, seq_len=16, max_steps=4, lr=3e-3, warmup_steps=1, eval_interval=2,
                       eval_iters=2, log_interval=1)  # fmt: skip
    single = train(cfg, tcfg, data, tmp_path / "single", progress=False)
    # two ranks, each two micro-batches of 2 (no_sync on the first): the global batch is still 8.
    # fork: the children inherit the imported torch (the test's cost is then the training, not imports)
    ddp_cfg = tcfg.replace(grad_accum=2, fsdp=how == "fsdp")
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
    # the checkpoint is the one a single process writes: whole weights, whole AdamW moments (FSDP2 gathers)
    one = torch.load(tmp_path / "single" / "checkpoint" / "trainer_state.pt", weights_only=True)["optimizer"]
    assert state["optimizer"]["param_groups"] == one["param_groups"]
    for i, st in one["state"].items():
        for k, v in st.items():
            assert torch.allclose(state["optimizer"]["state"][i][k], v, atol=1e-6), (i, k)
    m_ddp, _, _ = load_checkpoint(tmp_path / "ddp" / "checkpoint")
    m_one, _, _ = load_checkpoint(tmp_path / "single" / "checkpoint")
    sd_one = m_one.state_dict()
    assert all(torch.allclose(t, sd_one[n], atol=1e-5) for n, t in m_ddp.state_dict().items())


def test_fsdp2_matches_one_process_and_its_sharded_checkpoint_resumes(tmp_path):
    """kvlm.parallel.wrap_fsdp (FSDP2) on two gloo ranks trains as one process on the whole batch (float64),
    each rank holding half the parameters; save_sharded / load_sharded (torch.distributed.checkpoint) restore
    model and AdamW state exactly, also into one unsharded process (the checkpoint reshards)."""
    from conftest import tiny_config
    from dist_scripts import workers

    from kvlm.parallel import load_sharded

    results = workers.run(workers.fsdp_checks, 2, str(tmp_path), str(tmp_path))
    r0 = results[0]
    assert r0["train_err"] < 1e-12
    for r in results:
        assert r["resume_err"] == 0.0
        assert r["local_numel"] < 0.6 * r["numel"]  # each rank holds about half (dim-0 shards, padded)
    # the folder written by two ranks loads into one unsharded model and optimizer
    model = workers._model(tiny_config("mla", n_layer=2, q_lora_rank=32)).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    load_sharded(tmp_path / "sharded", model, opt)
    assert max((t - r0["ref_after_2"][n]).abs().max().item() for n, t in model.state_dict().items()) < 1e-12
    assert len(opt.state) == len(list(model.parameters()))
