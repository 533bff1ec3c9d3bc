"""Cutting a module into the part one rank holds, from a tensor-parallel plan (kvlm.parallel.tensor_parallel).

A mechanism's plan (``Attention.tp_plan``) names two kinds of split:
- torch's styles (``ColwiseParallel`` / ``RowwiseParallel``): applied with ``parallelize_module`` when the ranks
  share a ``DeviceMesh``; on a single process (no mesh: what a rank *would* hold, e.g. on the meta device)
  ``style_slices`` turns them into the equivalent slicing rules (the rows / columns ``Shard(0)`` / ``Shard(1)``
  give a rank, W_O's bias on rank 0 only since the all-reduce adds it once).
- slicing rules, for splits no even ``Shard`` expresses (TPA's interleaved rows, latent blocks, a KV head
  replicated on several ranks) and for weights the module reads itself in its local geometry (MLA's absorbed
  route folds W^UK, W^UV and W^O into new matrices; a DTensor would hand it the global shape). A rule says how
  one parameter of the full module becomes the rank's: ("rows"/"cols", unit, units kept) keeps the listed blocks
  of `unit` rows (dim 0) or columns (dim 1); ("first",) keeps the tensor on rank 0 and zeros elsewhere (the bias
  of a row-parallel output, added once by the all-reduce); a callable maps the full tensor to the rank's.
  Unlisted parameters are replicated.

``build_shard`` builds a module of the same class from a per-rank config (``local_config``) and loads the sliced
state strictly.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from kvlm.config import ConfigError

Rule = tuple  # ("rows" | "cols", unit, kept units), ("first",) or a callable


def _take(t: torch.Tensor, dim: int, unit: int, keep: Sequence[int]) -> torch.Tensor:
    if dim >= t.dim():
        raise ValueError(f"cannot slice dim {dim} of a {t.dim()}-d tensor")
    blocks = t.unflatten(dim, (t.shape[dim] // unit, unit))
    idx = torch.as_tensor(list(keep), dtype=torch.long, device=t.device)
    return blocks.index_select(dim, idx).flatten(dim, dim + 1).clone()


def slice_state(
    module: nn.Module, rules: dict[str, Rule], rank: int, skip: Sequence[str] = ()
) -> dict[str, torch.Tensor]:
    """The state dict of `module` with each ruled parameter replaced by this rank's part; entries under the
    submodules in `skip` (those torch's styles distribute) are left out."""
    state = {}
    for name, t in module.state_dict().items():
        if any(name.startswith(f"{s}.") for s in skip):
            continue
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


def chunk_indices(n: int, rank: int, world: int) -> list[int]:
    """The indices of `rank` in torch.chunk's split of n into `world` parts (DTensor's Shard layout)."""
    parts = torch.arange(n).chunk(world)
    return parts[rank].tolist() if rank < len(parts) else []


def style_slices(styles: dict, module: nn.Module, rank: int, world: int) -> dict[str, Rule]:
    """Slicing rules equal to torch's styles (ColwiseParallel: rows of weight and bias; RowwiseParallel:
    columns of the weight, the bias on rank 0), for a rank without a mesh."""
    rules: dict[str, Rule] = {}
    for path, style in styles.items():
        sub = module.get_submodule(path)
        if isinstance(style, ColwiseParallel):
            keep = chunk_indices(sub.weight.shape[0], rank, world)
            rules[f"{path}.weight"] = ("rows", 1, keep)
            rules[f"{path}.bias"] = ("rows", 1, keep)
        elif isinstance(style, RowwiseParallel):
            rules[f"{path}.weight"] = ("cols", 1, chunk_indices(sub.weight.shape[1], rank, world))
            rules[f"{path}.bias"] = ("first",)
        else:
            raise ConfigError(
                f"without a process group only ColwiseParallel / RowwiseParallel can be planned, "
                f"{path!r} has {type(style).__name__}"
            )
    return rules


def build_shard(cls, cfg, layer_idx: int | None, like: nn.Module) -> nn.Module:
    """A module of class `cls` built from the per-rank config on the device and in the dtype of `like`."""
    p = next(like.parameters())
    with torch.device(p.device):
        shard = cls(cfg, layer_idx) if layer_idx is not None else cls(cfg)
    return shard.to(p.dtype)


def load_shard(shard: nn.Module, state: dict[str, torch.Tensor], skip: Sequence[str] = ()) -> None:
    """Load the sliced weights into the rank's module: every entry outside `skip` must be given and fit (a shape
    that does not says which parameter and how)."""
    name = type(shard).__name__
    try:
        missing, unexpected = shard.load_state_dict(state, strict=False)
    except RuntimeError as e:
        raise ConfigError(f"cannot shard {name}: per-rank weights do not fit ({e})") from e
    missing = [k for k in missing if not any(k.startswith(f"{s}.") for s in skip)]
    if missing or unexpected:
        raise ConfigError(f"cannot shard {name}: missing {missing}, unexpected {unexpected}")


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
