"""Slicing a module's weights into a per-rank module (the sharders' toolkit).

A rule says how one parameter of the full module becomes the rank's: ("rows"/"cols", unit, units kept) keeps the
listed blocks of `unit` rows (dim 0) or columns (dim 1); "first" keeps the tensor on rank 0 and zeros elsewhere
(the bias of a row-parallel output, added once by the all-reduce); a callable maps the full tensor to the rank's.
Unlisted parameters are replicated. ``build_shard`` builds a module of the same class from a per-rank config
(``local_config``) and loads the sliced state strictly.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from torch import nn

from kvlm.config import ConfigError

Rule = tuple  # ("rows" | "cols", unit, kept units), ("first",) or a callable


def _take(t: torch.Tensor, dim: int, unit: int, keep: Sequence[int]) -> torch.Tensor:
    if dim >= t.dim():
        raise ValueError(f"cannot slice dim {dim} of a {t.dim()}-d tensor")
    blocks = t.unflatten(dim, (t.shape[dim] // unit, unit))
    idx = torch.as_tensor(list(keep), dtype=torch.long, device=t.device)
    return blocks.index_select(dim, idx).flatten(dim, dim + 1).clone()


def slice_state(module: nn.Module, rules: dict[str, Rule], rank: int) -> dict[str, torch.Tensor]:
    """The state dict of `module` with each ruled parameter replaced by this rank's part."""
    state = {}
    for name, t in module.state_dict().items():
        rule = rules.get(name)
        if rule is None:
            state[name] = t.clone()
        elif callable(rule):
            state[name] = rule(t).clone()
        elif rule[0] == "first":
            state[name] = t.clone() if rank == 0 else torch.zeros_like(t)
        else:
            kind, unit, keep = rule
            state[name] = _take(t, 0 if kind == "rows" else 1, unit, keep)
    return state


def build_shard(cls, cfg, layer_idx: int, like: nn.Module, state: dict[str, torch.Tensor]) -> nn.Module:
    """A module of class `cls` built from the per-rank config, holding the sliced weights (strict load:
    a shape that does not fit says which parameter and how)."""
    p = next(like.parameters())
    with torch.device(p.device):
        shard = cls(cfg, layer_idx) if layer_idx is not None else cls(cfg)
    shard = shard.to(p.dtype)
    try:
        shard.load_state_dict(state, strict=True)
    except RuntimeError as e:
        raise ConfigError(f"cannot shard {cls.__name__}: per-rank weights do not fit ({e})") from e
    return shard


def local_config(cfg, **fields):
    """The config a shard's module is built from: the full config with per-rank sizes (n_head, n_kv_head,
    kv_lora_rank, ...). Not validated as a model of its own: a shard need not be one (e.g. one latent block
    of MLRA-4 with a d_c that is no multiple of 4)."""
    local = copy.copy(cfg)
    local.extra = dict(cfg.extra)
    for k, v in fields.items():
        if not hasattr(cfg, k):
            raise ConfigError(f"internal: ModelConfig has no field {k!r}")
        setattr(local, k, v)
    return local


def copy_model(model: nn.Module) -> nn.Module:
    """copy.deepcopy, keeping the attributes set on parameters (is_gate_embedding, ...): deepcopy of an
    nn.Parameter drops them."""
    new = copy.deepcopy(model)
    for (_, p), (_, q) in zip(model.named_parameters(), new.named_parameters()):
        for k, v in vars(p).items():
            if not hasattr(q, k):
                setattr(q, k, v)
    return new
