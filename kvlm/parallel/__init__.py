"""More than one process, on torch.distributed (gloo on CPU, NCCL on CUDA), launched with torchrun.

One handle on the process group: ``init_distributed`` (kvlm.parallel.mesh) joins torchrun's group, or reuses one
the caller created, and returns a ``ParallelContext`` (rank, world, device, a 1-D ``DeviceMesh``); everything
below takes its group from that mesh. The modules, each with one job:

- ``mesh``: ParallelContext, init_distributed, tp_setup (a command's ``--tp N``), require_world, teardown.
- ``collectives``: all_reduce_sum (autograd), all_to_all_uneven (autograd), all_gather_uneven, and the small
  object collectives (gather_objects, broadcast_float, barrier).
- ``data_parallel``: training across ranks: ``wrap`` (DDP), ``wrap_fsdp`` (FSDP2, ``fully_shard`` per block),
  ``wrap_ddp`` (DDP that leaves sharded gate tables alone) and the per-rank metrics helpers.
- ``tensor_parallel``: decoding with every layer split across ranks (mlra.md Sec. 3.4, Table 1), on torch's DTensor
  engine: ``shard_model(model, rank, world)`` applies each mechanism's own plan (``Attention.tp_plan(rank,
  world)``: the rank's config fields, a ``parallelize_module`` plan of ColwiseParallel / RowwiseParallel for the
  contiguous splits, slicing rules for the others) to every attention layer (``TPAttention``) and Megatron's plan
  to every FFN; ``attention="dp"`` keeps whole attention layers, each rank serving its own requests
  (``DPGatherMLP``). ``shard_attention``, ``tp_plan``, ``kv_elements_per_token`` say what a rank holds.
- ``slicing``: cutting a parameter into a rank's part (the slicing rules, ``style_slices``: torch's styles as
  slices for a rank without a mesh), ``build_shard``, ``local_config``.
- ``embedding_parallel``: EG-MLA's dimension-wise gate-table sharding (eg-mla.md Eqs. 9-11):
  ``shard_gate_embeddings``, ``ShardedGateEmbedding`` (its all-to-all exchange), ``clip_grad_norm``.
- ``sharded_state``: checkpoints of sharded state: ``save_sharded`` / ``load_sharded`` (FSDP2 model and optimizer
  through torch.distributed.checkpoint), ``full_model_state``, and EG-MLA's whole-table helpers.

The benchmarks (``kvlm bench --tp N``, ``kvlm bench-parallel``) live in kvlm.bench.parallel.
"""

from kvlm.parallel.collectives import all_gather_uneven, all_reduce_sum, all_to_all_uneven
from kvlm.parallel.data_parallel import wrap, wrap_ddp, wrap_for, wrap_fsdp
from kvlm.parallel.embedding_parallel import (
    GateExchange,
    ShardedGateEmbedding,
    clip_grad_norm,
    shard_gate_embeddings,
    sharded_parameter_names,
)
from kvlm.parallel.mesh import ParallelContext, init_distributed, require_world, teardown, tp_setup
from kvlm.parallel.sharded_state import (
    full_model_state,
    gather_gate_embeddings,
    load_sharded,
    save_sharded,
)
from kvlm.parallel.tensor_parallel import (
    kv_bytes_per_token,
    kv_elements_per_token,
    parameter_bytes,
    shard_attention,
    shard_model,
    tp_plan,
)

__all__ = [
    "GateExchange",
    "ParallelContext",
    "ShardedGateEmbedding",
    "all_gather_uneven",
    "all_reduce_sum",
    "all_to_all_uneven",
    "clip_grad_norm",
    "full_model_state",
    "gather_gate_embeddings",
    "init_distributed",
    "kv_bytes_per_token",
    "kv_elements_per_token",
    "load_sharded",
    "parameter_bytes",
    "require_world",
    "save_sharded",
    "shard_attention",
    "shard_gate_embeddings",
    "shard_model",
    "sharded_parameter_names",
    "teardown",
    "tp_plan",
    "tp_setup",
    "wrap",
    "wrap_ddp",
    "wrap_for",
    "wrap_fsdp",
]
