"""Checkpoints written before architecture v2 still load, and give the same outputs.

tests/fixtures/v1_outputs.* were recorded on the last commit before the refactor (make_v1_outputs.py): for every
configuration of tests/variants_*.py, float64 logits of a full forward and of cached decoding in every mode, for
weights that are a pure function of the old parameter name. Here the old-format checkpoint folder is rebuilt
from those names, loaded through ``load_checkpoint`` (and whatever upgrade it applies), and run again."""

import json
import pathlib

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvlm.checkpoint import load_checkpoint
from kvlm.config import ModelConfig

FIXTURES = pathlib.Path(__file__).parent / "fixtures"
RECORD = json.loads((FIXTURES / "v1_outputs.json").read_text())
OUTPUTS = load_file(str(FIXTURES / "v1_outputs.safetensors"))

import sys  # noqa: E402

sys.path.insert(0, str(FIXTURES))
from make_v1_outputs import v1_weight  # noqa: E402


def _v1_checkpoint(folder: pathlib.Path, vid: str) -> None:
    from conftest import tiny_config

    entry = RECORD["variants"][vid]
    cfg: ModelConfig = tiny_config(entry["attention"], **entry["overrides"])
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(cfg.to_dict()))
    (folder / "meta.json").write_text(json.dumps({"format": "kvlm-checkpoint", "version": 1}))
    state = {n: v1_weight(n, shape).to(torch.float32) for n, shape in entry["params"].items()}
    save_file(state, str(folder / "model.safetensors"))


@pytest.mark.parametrize("vid", sorted(RECORD["variants"]))
def test_v1_checkpoint_loads_with_same_outputs(vid, tmp_path):
    _v1_checkpoint(tmp_path / "ckpt", vid)
    entry = RECORD["variants"][vid]
    model, _, _ = load_checkpoint(tmp_path / "ckpt", dtype=torch.float64)
    tokens = torch.tensor(RECORD["tokens"])
    with torch.no_grad():
        assert (model(tokens) - OUTPUTS[f"{vid}/full"]).abs().max().item() < 1e-10
        for mode in entry["modes"]:
            cache = model.new_cache(1, 16, naive=(mode == "naive"))
            parts = [model(tokens[:, :5], cache=cache, mode=mode)]
            parts += [model(tokens[:, t : t + 1], cache=cache, mode=mode) for t in range(5, 8)]
            got = torch.cat(parts, dim=1)
            assert (got - OUTPUTS[f"{vid}/{mode}"]).abs().max().item() < 1e-10, mode
