"""Attention mechanisms: one file per mechanism, each a subclass of ``Attention`` registered by name.

Symbols (papers' notation, ../shared/papers): d = d_model, h = n_head, d_h = head_dim, g = n_kv_head,
d_c = kv_lora_rank, d'_c = q_lora_rank, d_h^R = rope_head_dim.

- ``Attention`` (base.py): the contract every mechanism fulfils and everything about it that the rest of kvlm
  reads: its cache (``cache_spec``), its decode routes (``decode_routes``; ``forward`` records the one it took
  in ``Step.trace``), their cost (``decode_flops``, ``decode_cost``), its tensor-parallel split
  (``tp_shards``, ``tp_max_degree``), its config defaults and validation, capability flags and model hooks.
- ``Step`` (step.py): where one call's new tokens sit (positions, cache slots, mask, mode, trace), shared by
  all layers; ``attend``: the GQA-style SDPA call most routes end in.
- ``register`` / ``registry`` / ``get_attention_class`` (registry.py): name -> class. Every module of this
  package is imported on first use, so a new mechanism is a new file; code outside kvlm registers a subclass
  of ``Attention`` the same way and it works with every verb.
- ``LatentAttention`` (latent.py): the one base of the latent family (MLA, GLA, MLRA and EG-MLA), with
  DeepSeek-V3's parameter names (``wq`` or ``wq_a``/``q_norm``/``wq_b``, ``wkv_a`` = [c_kv; k_rope], ``kv_norm``,
  ``wkv_b`` = each head's [k_nope; v], ``wo``), one ``auto`` route rule, ``prepare_for_inference`` (absorbed
  weights built once) and the upgrade of pre-v2 checkpoints' names; latent_ops.py: attention over latents.
- rope.py: rotary embeddings. The mechanisms: mha.py (MHA, MQA, GQA), gta.py (GTA), mfa.py (MFA), tpa.py
  (TPA), mla.py (MLA), eg_mla.py (EG-MLA), mlra.py (GLA-2/4, MLRA-2/4).

Two decode routes recur (vLLM's MLA backend names them the same way): *expand* rebuilds per-head keys and
values from the compact cache and runs ordinary attention (prefill, training); *absorbed* folds the
up-projections into the query and the output so attention runs over the compact cache itself (decode).
``naive`` caches the materialised per-head K/V instead: the MHA-sized baseline the benchmarks compare with.
"""

from __future__ import annotations

from kvlm.attention.base import MATERIALISED, MODES, Attention, GateEmbedding, Step, attend
from kvlm.attention.registry import get_attention_class, register, registry

__all__ = [
    "MATERIALISED",
    "MODES",
    "Attention",
    "GateEmbedding",
    "Step",
    "attend",
    "get_attention_class",
    "register",
    "registry",
]
