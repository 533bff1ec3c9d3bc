"""What every mechanism shares: the contract (the ``Attention`` base class) and the ``GateEmbedding`` table type.
``Step`` and ``attend`` (``kvlm.attention.step``) and the few-row ``Linear`` (``kvlm.attention.linear``) are
re-exported here.

The contract (DESIGN.md), all of it declared on ``Attention`` with a default, so that nothing outside a
mechanism's file tests its name and nothing probes for attributes:
- ``cache_spec()`` / ``spec_for(cfg)`` declare the per-token tensors the mechanism caches; the cache allocates
  exactly these and every KV number in kvlm is derived from them.
- ``forward(x, step, cache)``: with ``cache=None`` the full causal forward (training); with a cache layer
  (``kvlm.cache.CacheLayer``), the new tokens' tensors are appended through it (``write``) and attention runs
  over everything cached. Mechanisms never slice cache buffers themselves.
- ``decode_routes(cfg)``: the modes it accepts and the route each takes (``"auto"`` picks the fast route,
  ``"naive"`` the materialised per-head K/V cache of ``cache_spec(naive=True)``, ``"absorbed"`` weight
  absorption, ``"expand"`` re-expanding the compact cache); ``forward`` records the route it ran in
  ``step.trace``. ``decode_flops`` / ``decode_cost`` give its FLOPs and bytes per decode step (roofline).
- ``config_defaults`` / ``check_config`` (derived defaults, validation), ``tp_shards`` / ``tp_max_degree``
  (tensor parallelism), capability flags (``has_naive_cache``, ``needs_token_ids``,
  ``supports_rope_kv_heads``, ``hf_peer``), and model hooks (``tie_layers``, ``prepare_for_inference``,
  ``output_projections``, ``reset_extra_parameters``).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import nn

from kvlm.attention.linear import ANY_ROWS, GroupPacking, Linear, PackedGroup  # noqa: F401 (re-exported)
from kvlm.attention.step import MODES, Step, attend
from kvlm.attention.watch import Watched, hooked  # noqa: F401 (hooked re-exported)
from kvlm.config import ModelConfig, spec_numel
from kvlm.errors import ConfigError

if TYPE_CHECKING:
    from kvlm.cache import CacheLayer

# the route that attends over the materialised per-head K/V cache (cache_spec(naive=True))
MATERIALISED = "materialised"
# GTA's and TPA's "auto": the in-place (absorbed / factorised) route when a call appends at most this many tokens
# to a cache (decode, speculative chunks); longer prefills rebuild per-head keys once and run SDPA
ABSORB_MAX_NEW = 16


class GateEmbedding(nn.Embedding):
    """A token-indexed table that lives off the matmul path (EG-MLA's per-layer gate embedding, eg-mla.md
    Eq. 3): a decode step gathers a few rows of it instead of streaming it, and eg-mla.md reports it apart
    from the activated parameters. The type is the declaration: ``KVLM.parameter_counts`` and the benchmarks
    recognise these tables by ``isinstance``, which ``copy.deepcopy`` and sharding keep."""


class BlockPlan:
    """A decoder block's one-call plan (``Attention.decode_block_plan``): ``call`` its kernel call with the
    weights checked (``kvlm.kernels.gqa_block_call`` / ``mla_block_call``), ``names`` the two cache tensors it
    reads (K and V, or c_kv and k_rope), ``tables(step, dtype)`` the RoPE tables it takes, ``route`` its
    attention route (where the step's ``route`` is another the plan does not apply), ``label`` what the step's
    trace records. ``plan(x, step, cache)`` runs the block; ``inputs`` gives what its kernel reads of a step,
    which a model's stack of blocks (``kvlm.kernels.block_stack``) gathers for all its layers."""

    def __init__(self, attn: Attention, call, names: tuple[str, str], tables, label: str, route: str | None = None):
        self.attn, self.call, self.names, self.tables, self.label, self.route = attn, call, names, tables, label, route

    def inputs(self, x: torch.Tensor, step: Step, cache: CacheLayer) -> tuple | None:
        """(RoPE tables, view of names[0], view of names[1]) of this step, or None where its route is another."""
        if self.route is not None and self.attn.route(step, cache) != self.route:
            return None
        a, b = self.names
        return self.tables(step, x.dtype), cache.block_view(a, step), cache.block_view(b, step)

    def ran(self, step: Step) -> None:
        self.attn.record_route(step, self.label)

    def __call__(self, x: torch.Tensor, step: Step, cache: CacheLayer) -> torch.Tensor | None:
        inputs = self.inputs(x, step, cache)
        y = None if inputs is None else self.call(x, *inputs)
        if y is not None:
            self.ran(step)
        return y


class Attention(Watched, nn.Module):
    """Base class of every mechanism. A subclass sets ``name``, implements ``spec_for`` and ``forward`` and
    overrides the declarations below that differ from the defaults. ``make_output`` builds W_O (``wo``)."""

    name: str = ""
    has_naive_cache: bool = False  # cache_spec(naive=True) differs: a materialised per-head K/V cache exists
    needs_token_ids: bool = False  # forward reads step.token_ids and the cached tokens' ids (eg-mla)
    supports_rope_kv_heads: bool = False  # accepts cfg.rope_kv_heads > 1 (several decoupled RoPE key heads)
    hf_peer: str | None = None  # the transformers model_type `kvlm bench` compares against, if one exists
    # besides MHA, the mechanism whose KV cache the paper reports savings against (kv-table's "vs" column)
    kv_baseline: str | None = None

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.cfg = cfg
        self.layer_idx = layer_idx
        self.gate: nn.Linear | None = None

    # --- configuration ----------------------------------------------------------------------
    @classmethod
    def config_defaults(cls, cfg: ModelConfig) -> None:
        """Fill the derived defaults this mechanism owns (e.g. n_kv_head) on a config being built, in place;
        runs before the generic defaults and before validation."""

    @classmethod
    def check_config(cls, cfg: ModelConfig) -> None:
        """Raise ConfigError for dimensions this mechanism cannot use."""

    @classmethod
    def spec_for(
        cls, cfg: ModelConfig, layer_idx: int = 0, naive: bool = False
    ) -> dict[str, tuple[int, ...]]:
        """cache_spec computed from the config alone (no weights), for accounting."""
        raise NotImplementedError

    def cache_spec(self, naive: bool = False) -> dict[str, tuple[int, ...]]:
        return self.spec_for(self.cfg, self.layer_idx, naive)

    @classmethod
    def tp_shards(cls, cfg: ModelConfig) -> dict[str, str]:
        """For each cached tensor: the axis along which tensor parallelism splits it
        ("heads", "blocks", "coefficients") or "replicated". Used by kv-table --tp and distributed decode."""
        return {}

    @classmethod
    def tp_max_degree(cls, cfg: ModelConfig) -> int:
        """Largest TP degree that still splits the sharded tensors (beyond it they are replicated)."""
        return cfg.n_head

    # --- decode routes and their cost ----------------------------------------------------------
    @classmethod
    def decode_routes(cls, cfg: ModelConfig) -> dict[str, str]:
        """The decode modes this mechanism distinguishes -> the route each takes (the names ``forward``
        records in ``step.trace``). Modes not listed run as "auto"."""
        return {"auto": "plain"}

    @classmethod
    def route_of(cls, cfg: ModelConfig, mode_or_route: str) -> str:
        """The route a mode takes (a route name is returned as is); ConfigError for neither."""
        routes = cls.decode_routes(cfg)
        if mode_or_route in routes:
            return routes[mode_or_route]
        if mode_or_route in routes.values():
            return mode_or_route
        raise ConfigError(
            f"{cfg.attention} has no decode mode or route {mode_or_route!r}; modes: {', '.join(routes)}"
        )

    @classmethod
    def decode_flops(cls, cfg: ModelConfig, layer_idx: int = 0) -> float | None:
        """FLOPs of one decode query token against one cached token, all heads, one layer, on the route the
        papers count (mlra.md Table 2); None when the mechanism does not say."""
        return None

    @classmethod
    def decode_cost(
        cls, cfg: ModelConfig, batch: int, n_cached: int, route: str = "auto", layer_idx: int = 0
    ) -> dict[str, float | None]:
        """One decode step (one new token per sequence) of attention over ``n_cached`` cached tokens of one
        layer, on ``route`` (a mode or a route name): {"flops", "cache_elements" (elements read from the
        cache), "weight_elements" (derived weights read that are not parameters; 0 here)}. The default
        scales ``decode_flops`` and reads the naive cache on the materialised route, the compact one else."""
        route = cls.route_of(cfg, route)
        tokens = batch * n_cached
        per_token = cls.decode_flops(cfg, layer_idx)
        spec = cls.spec_for(cfg, layer_idx, naive=route == MATERIALISED)
        return {
            "flops": None if per_token is None else tokens * per_token,
            "cache_elements": tokens * spec_numel(spec),
            "weight_elements": 0,
        }

    # --- hooks the model calls --------------------------------------------------------------------
    @classmethod
    def tie_layers(cls, attns: list[Attention]) -> None:
        """Share parameters across the model's layers after they are built (e.g. eg-mla's layer groups)."""

    def prepare_for_inference(self) -> None:
        """Build derived weights (absorbed matrices, gate tables) from the current parameters, once; called
        by ``KVLM.prepare_for_inference`` after loading or training, never per step."""

    def reset_extra_parameters(self) -> None:
        """Initialise parameters that are not nn.Linear / nn.Embedding weights (the model's init does those)."""

    def output_projections(self) -> list[nn.Linear]:
        """The projections that write into the residual stream (W_O): the model initialises them scaled by
        1/sqrt(2 n_layer), or zero with cfg.zero_init_out."""
        return [self.wo]

    # --- shared helpers -----------------------------------------------------------------------
    def make_output(self, in_dim: int) -> None:
        """W_O (and the optional output gate of mlra.md Appendix E) from in_dim = h * d_v to d_model."""
        cfg = self.cfg
        self.wo = Linear(in_dim, cfg.d_model, bias=cfg.bias)
        if cfg.gated:
            self.gate = Linear(cfg.d_model, in_dim, bias=cfg.bias)

    def output(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """o (B, H, T, d_v) -> (B, T, d_model): optional sigmoid gate G = sigma(x W_G), then W_O."""
        B, H, T, Dv = o.shape
        o = o.transpose(1, 2).reshape(B, T, H * Dv)
        if self.gate is not None:
            o = o * torch.sigmoid(self.gate(x))
        return self.wo(o)

    @staticmethod
    def write(cache: CacheLayer, name: str, value: torch.Tensor, step: Step) -> torch.Tensor:
        """Append value (B, *lead, T, last), the new tokens' ``name`` tensor, to the cache layer and return
        everything cached of it, (B, *lead, end, last) (``CacheLayer.append``)."""
        return cache.append(name, value, step)

    def record_route(self, step: Step, route: str) -> None:
        """Note in ``step.trace`` that this layer ran ``route``."""
        step.record(self.layer_idx, route)

    def forward(self, x: torch.Tensor, step: Step, cache: CacheLayer | None = None) -> torch.Tensor:
        raise NotImplementedError

    def decode_block_plan(self, block_weights: tuple) -> BlockPlan | None:
        """The whole pre-norm decoder block (this attention, then a SwiGLU MLP) in one kernel call at decode: a
        ``BlockPlan``, whose ``plan(x, step, cache)`` is a step of a few new tokens a sequence (None where that step
        does not apply, e.g. a route or a cache the kernel does not take), or None (the default: the block runs its
        modules one by one). block_weights: (attention norm weight, MLP norm weight, eps, [W_1, W_2], W_O of the
        MLP, the panels of its two products or None), from ``kvlm.model.Block``, which keeps the plan while
        nothing it was built from changes (``kvlm.attention.watch.Bound``: weights, attributes, hooks) and
        runs the block module by module where any module has forward hooks (``hooked``), so that those fire."""
        return None

    # --- tensor parallelism (applied by kvlm.parallel.tensor_parallel) ---------------------------------
    def tp_plan(self, rank: int, world: int) -> dict:
        """How rank `rank` of `world` holds this layer, a dict (kvlm.parallel.tensor_parallel's docstring):
        "config" (the rank's config fields, e.g. n_head), "parallelize" ({submodule: torch ParallelStyle} for
        contiguous even splits, run on DTensor), "slices" ({parameter: slicing rule} for the others), "holds"
        (what the rank holds, for reports), optionally "class_attrs", "inherit", "norms". Default: unsupported."""
        raise ConfigError(f"tensor-parallel decoding is not implemented for attention {self.cfg.attention!r}")

    @staticmethod
    def tp_heads(h: int, rank: int, world: int) -> list[int]:
        """The query heads of `rank` when h heads split evenly across `world` ranks."""
        require(h % world == 0, f"n_head={h} is not divisible by the tensor-parallel degree {world}")
        n = h // world
        return list(range(rank * n, (rank + 1) * n))

    @staticmethod
    def tp_groups(h: int, g: int, rank: int, world: int) -> tuple[list[int], list[int]]:
        """Query heads and KV heads (groups) of `rank` when h query heads share g KV heads (head i reads group
        i // (h / g)). Up to g ranks split the groups; beyond, each group is replicated on world / g ranks that
        split its query heads."""
        q = Attention.tp_heads(h, rank, world)
        if world <= g:
            require(g % world == 0, f"n_kv_head={g} is not divisible by the tensor-parallel degree {world}")
            return q, list(range(rank * (g // world), (rank + 1) * (g // world)))
        require(world % g == 0, f"tensor-parallel degree {world} is not a multiple of n_kv_head={g}")
        return q, [rank // (world // g)]

    def tp_output_styles(self) -> dict:
        """torch's styles for the output: W_O row-parallel (torch's engine sums the ranks' partial outputs) and
        the output gate column-parallel (the rows of the rank's heads)."""
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel  # ~2 s: only for TP

        styles = {"wo": RowwiseParallel()}
        if self.gate is not None:
            styles["gate"] = ColwiseParallel()
        return styles

    @staticmethod
    def tp_output_slices(heads: list[int], dv: int) -> dict:
        """The output as slices, for a module that reads W_O itself or whose heads are no even split: W_O's
        columns and the gate's rows of `heads` (d_v = dv each), W_O's bias on rank 0 (the all-reduce adds it)."""
        return {
            "wo.weight": ("cols", dv, heads),
            "wo.bias": ("first",),
            "gate.weight": ("rows", dv, heads),
            "gate.bias": ("rows", dv, heads),
        }


def softmax_scale(dim: int) -> float:
    return 1.0 / math.sqrt(dim)


def require(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


__all__ = [
    "ABSORB_MAX_NEW",
    "MATERIALISED",
    "MODES",
    "Attention",
    "GateEmbedding",
    "GroupPacking",
    "Linear",
    "PackedGroup",
    "Step",
    "attend",
    "require",
    "softmax_scale",
]
