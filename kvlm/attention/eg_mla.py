"""EG-MLA: embedding-gated multi-head latent attention (eg-mla.md Eqs. 1-14, Appendix E Listing 1).

A member of the latent family (kvlm/attention/latent.py) by composition: MLA's query and latent paths and
parameters (wq / wq_a, q_norm, wq_b, wkv_a, kv_norm, wkv_b, wo), with the family's hook ``keys_values``, how latents
become keys and values, replaced by the gated up-projection::

    c^KV = RMSNorm(W^DKV x)               (Eq. 1, cached)       kv^C = W^UKV c^KV   (Eq. 2, wkv_b, h 2 d_h wide)
    e = Emb(i_t)  (per-layer table, vocab x kv_emb_dim, Eq. 3)   g = W^UE e          (Eq. 4)
    kv~ = LN(kv^C * g)                     (Eq. 5)               [k^C_i; v^C_i] = split per head (Eq. 6)

then MLA's attention with the decoupled RoPE key (Eqs. 7-14). Layout as Listing 1: head i owns rows
[i (2 d_h), (i + 1) 2 d_h) of W^UKV, W^UE and the LayerNorm, first its key then its value (exactly DeepSeek's
wkv_b layout); the LayerNorm spans all heads' keys and values of a token. Options: cfg.eg_norm = False drops the
LayerNorm, cfg.eg_op = "add" uses kv^C + g (Table 3's ablations), cfg.kv_emb_dim the table width,
cfg.eg_group_size = lgz shares the gate branch.

Layer grouping (Appendix H, "Toward Greater Efficiency"): lgz consecutive layers share one parameter set "and
its intermediate activations". Our reading: the shared part is the embedding-gate branch (table Emb and W^UE),
the one KV projection whose activation g = W^UE Emb(i_t) does not depend on the layer's input and so can be
reused across the group: the group's first layer computes it and hands it to the others within the same call
(``EmbeddingGate.handoff``, cleared by the group's last layer). It divides the gate-embedding parameters,
n_layer vocab kv_emb_dim, by lgz. W^DKV, W^UKV and the LayerNorm stay per layer and the cache is unchanged.

No weight absorption (``supports_absorption = False``): the LayerNorm of Eq. 5 normalises each cached token's full
up-projected h (d_h + d_h) vector, a nonlinear function of c^KV, so W^UKV cannot be folded into the query or the
output; even without it (eg_norm = False) the per-token Hadamard gate keeps keys from factoring through c^KV. Mode
"absorbed" therefore runs the rebuild route (with a one-time warning) rather than failing.

Decode routes and their trade-offs (orientation, fp32 on a shared 2-core CPU, 6 layers, d = 768, h = 12, batch 8,
1024 cached tokens, d_c = 64, kv_emb_dim = 256, vocab 8192: rebuild ~1.2 s, EG-MLA-A ~0.53 s, naive ~0.13 s per
step; MLA absorbed at the same d_c ~0.07 s):
- "rebuild" (modes "auto", "expand", "absorbed"): cache only c^KV and k^R, exactly MLA's cache (d_c + d_h^R per
  token per layer; the token ids live once in the model-level cache, one int per token for all layers). Every
  step rebuilds all S cached tokens' keys and values: W^UKV c (2 S d_c h d_h multiply-adds) + the gate
  W^UE Emb(i) (S kv_emb_dim 2 h d_h) + LayerNorm, then attention: compute grows with S per step.
- "gate table", EG-MLA-A (``precompute_gate_table()``, or ``precompute_gate_tables(model)``): g for every
  vocabulary token computed once (vocab x 2 h d_h per layer group, ``gate_table_nbytes``), so the gate is a table
  lookup and the W^UE matmul disappears from each step; costs vocab 2 h d_h floats per group (eg. 50257 x 1536
  fp32 = 309 MB), far more than the kv_emb_dim-wide table it replaces. ``prepare_for_inference()`` rebuilds it
  from the current weights; train(True) or a move/cast drops it (the gate is then computed, not looked up).
- "naive": materialised per-head K/V after the gate and LayerNorm, MHA-sized cache (h (2 d_h + d_h^R) per token
  per layer); the cheapest step (plain attention), the largest memory.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvlm.attention import register
from kvlm.attention.base import MATERIALISED, GateEmbedding, Linear, Step, require
from kvlm.attention.latent import LatentAttention, check_latent_config
from kvlm.attention.mla import MLA
from kvlm.cache import CacheError
from kvlm.config import ModelConfig, spec_numel


class EmbeddingGate(nn.Module):
    """g = W^UE Emb(i) (Eqs. 3-4): a token table and its up-projection; shared by a layer group.

    With ``use_table`` (EG-MLA-A) the product for every vocabulary token, built by ``build_table``, is looked up.
    ``handoff``: the gate of the current call, from the group's first layer to the others (module docstring)."""

    def __init__(self, vocab_size: int, kv_emb_dim: int, out_dim: int, bias: bool):
        super().__init__()
        self.kv_emb = GateEmbedding(vocab_size, kv_emb_dim)
        self.w_ue = Linear(kv_emb_dim, out_dim, bias=bias)
        self.use_table = False
        self.table: torch.Tensor | None = None  # (vocab, out_dim), built by build_table
        self.handoff: tuple[torch.Tensor, torch.Tensor] | None = None  # (ids, g) within one call

    def build_table(self) -> None:
        self.table = None  # free the old table before building the new one
        with torch.no_grad():
            self.table = self.w_ue(self.kv_emb.weight)

    def release_table(self) -> None:
        self.table = None

    @property
    def table_nbytes(self) -> int:
        return self.table.numel() * self.table.element_size() if self.table is not None else 0

    def table_in_use(self) -> bool:
        """The table is looked up (not while autograd records through the gate's parameters)."""
        differentiable = torch.is_grad_enabled() and any(p.requires_grad for p in self.parameters())
        return self.use_table and self.table is not None and not differentiable

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.table_in_use():
            return F.embedding(ids, self.table)
        return self.w_ue(self.kv_emb(ids))

    def train(self, mode: bool = True):
        if mode:
            self.release_table()
        return super().train(mode)

    def _apply(self, fn, recurse=True):
        self.release_table()  # the table would keep the old dtype / device
        return super()._apply(fn, recurse)


@register("eg-mla")
class EGMLA(LatentAttention):
    name = "eg-mla"
    needs_token_ids = True
    kv_baseline = "mla"  # eg-mla.md Table 10 reports its KV saving against MLA
    supports_absorption = False
    no_absorption_reason = "the LayerNorm after the embedding gate is nonlinear in the latent"

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__(cfg, layer_idx)
        width = cfg.n_head * 2 * cfg.head_dim
        self.emb_gate = EmbeddingGate(cfg.vocab_size, cfg.kv_emb_dim, width, cfg.bias)
        self.ln_emb = nn.LayerNorm(width, eps=cfg.norm_eps) if cfg.eg_norm else None
        self.group_pos, self.group_len = 0, 1  # place in the layer group sharing emb_gate (tie_layers)

    # --- configuration ---------------------------------------------------------------------------
    @classmethod
    def check_config(cls, cfg: ModelConfig) -> None:
        check_latent_config(cfg)
        require(cfg.kv_latent == "joint", "eg-mla gates the joint latent (Eq. 2): kv_latent must be 'joint'")
        require(cfg.kv_emb_dim > 0, f"kv_emb_dim must be positive for eg-mla, got {cfg.kv_emb_dim}")
        require(
            1 <= cfg.eg_group_size <= cfg.n_layer,
            f"eg_group_size (lgz) must be in [1, n_layer={cfg.n_layer}], got {cfg.eg_group_size}",
        )

    @classmethod
    def spec_for(cls, cfg, layer_idx=0, naive=False):
        return MLA.spec_for(cfg, layer_idx, naive)  # exactly MLA's cache (+ the model-level token ids)

    @classmethod
    def tp_shards(cls, cfg):
        return MLA.tp_shards(cfg)

    @classmethod
    def tp_max_degree(cls, cfg):
        return MLA.tp_max_degree(cfg)

    @classmethod
    def tie_layers(cls, attns: list[EGMLA]) -> None:
        """Appendix H: each group of lgz consecutive layers uses its first layer's gate branch."""
        lgz = attns[0].cfg.eg_group_size if attns else 1
        if lgz <= 1:
            return
        for i, attn in enumerate(attns):
            first = i - i % lgz
            attn.emb_gate = attns[first].emb_gate
            attn.group_pos, attn.group_len = i % lgz, min(lgz, len(attns) - first)

    # --- routes and their cost -------------------------------------------------------------------
    @classmethod
    def decode_routes(cls, cfg: ModelConfig) -> dict[str, str]:
        return {"auto": "rebuild", "expand": "rebuild", "naive": MATERIALISED, "table": "gate table"}

    @classmethod
    def decode_flops(cls, cfg: ModelConfig, layer_idx: int = 0) -> float:
        """The rebuild route (no absorption): W^UKV c and the gate W^UE e of every cached token, then attention."""
        h, dh, dv, dr, e = cfg.n_head, cfg.head_dim, cfg.head_dim, cfg.rope_head_dim, cfg.kv_emb_dim
        rebuild = 2.0 * cfg.kv_lora_rank * h * (dh + dv) + 2.0 * e * h * (dh + dv)
        return rebuild + 2.0 * h * (dh + dr) + 2.0 * h * dv

    @classmethod
    def decode_cost(
        cls, cfg: ModelConfig, batch: int, n_cached: int, route: str = "auto", layer_idx: int = 0
    ):
        """weight_elements: the rows gathered per cached token that the streamed weights leave out: the
        kv_emb row (e elements) when rebuilding, the gate-table row (2 h d_h) with EG-MLA-A's table."""
        route = cls.route_of(cfg, route)
        h, dh, e = cfg.n_head, cfg.head_dim, cfg.kv_emb_dim
        if route == "rebuild":
            flops, rows = cls.decode_flops(cfg, layer_idx), e
        elif route == "gate table":
            flops, rows = cls.decode_flops(cfg, layer_idx) - 2.0 * e * h * 2 * dh, 2 * h * dh
        else:
            flops, rows = 2.0 * h * (dh + cfg.rope_head_dim) + 2.0 * h * dh, 0
        spec = cls.spec_for(cfg, layer_idx, naive=route == MATERIALISED)
        tokens = batch * n_cached
        return {
            "flops": tokens * flops,
            "cache_elements": tokens * spec_numel(spec),
            "weight_elements": tokens * rows,
        }

    def route(self, step: Step, cache) -> str:
        """The family's resolution, after checking the token ids the gate needs (before anything is written)."""
        if step.token_ids is None:
            raise ValueError("eg-mla gates keys and values by token: step.token_ids is required")
        route = super().route(step, cache)
        if cache is not None and route != "naive" and step.cached_token_ids is None:
            raise CacheError("eg-mla rebuilds K/V from token ids: use a cache from model.new_cache()")
        return route

    def route_label(self, route: str) -> str:
        if route == "expand":
            return "gate table" if self.emb_gate.table_in_use() else "rebuild"
        return super().route_label(route)

    # --- EG-MLA-A ------------------------------------------------------------------------------
    def precompute_gate_table(self, enable: bool = True) -> int:
        """EG-MLA-A: look the gate up from a precomputed (vocab, 2 h d_h) table; returns its bytes."""
        self.emb_gate.use_table = enable
        if not enable:
            self.emb_gate.release_table()
            return 0
        self.emb_gate.build_table()
        return self.gate_table_nbytes

    @property
    def gate_table_nbytes(self) -> int:
        return self.emb_gate.table_nbytes

    def prepare_for_inference(self) -> None:
        """Rebuild the gate table from the current weights where the table route is on (a shared table once)."""
        if self.emb_gate.use_table and self.group_pos == 0:
            self.emb_gate.build_table()

    # --- the gated keys and values ---------------------------------------------------------------
    def embedding_gate(self, ids: torch.Tensor) -> torch.Tensor:
        """g (B, S, 2 h d_h) for token ids (B, S); a layer group computes it once per call (Appendix H)."""
        gate = self.emb_gate
        if self.group_len == 1:
            return gate(ids)
        handoff = gate.handoff if self.group_pos else None
        g = handoff[1] if handoff is not None and handoff[0] is ids else gate(ids)
        gate.handoff = (ids, g) if self.group_pos < self.group_len - 1 else None
        return g

    def keys_values(self, lat: dict[str, torch.Tensor], step: Step, cached: bool):
        """c^KV (B, S, d_c) and the tokens' ids -> k^C, v^C (B, h, S, d_h) (Eqs. 2-6), strided views of one
        (B, S, h, 2 d_h) tensor."""
        ids = step.cached_token_ids if cached else step.token_ids  # checked by ``route``
        c_kv = lat["c_kv"]
        B, S, _ = c_kv.shape
        h, dh = self.n_head, self.head_dim
        kv = self.wkv_b(c_kv)
        g = self.embedding_gate(ids)
        if kv.requires_grad or g.requires_grad:
            kv = kv + g if self.cfg.eg_op == "add" else kv * g
        else:  # inference: in place, S x 2 h d_h floats per layer is as big as the naive cache
            kv = kv.add_(g) if self.cfg.eg_op == "add" else kv.mul_(g)
        if self.ln_emb is not None:
            kv = self.ln_emb(kv)
        kv = kv.view(B, S, h, 2 * dh).transpose(1, 2)
        return kv[..., :dh], kv[..., dh:]

    def tp_plan(self, rank: int, world: int) -> dict:
        """MLA's split by query head, plus the rank's heads' rows of W^UE (2 d_h per head, Listing 1) and of the
        LayerNorm; the gate table on every rank (every head's gate needs the whole e, Eq. 4). The LayerNorm (Eq. 5)
        spans all heads of a token, so the rank's normalises with all-reduced statistics ("norms")."""
        plan = super().tp_plan(rank, world)
        q = plan["holds"]["query_heads"]
        for w in ("emb_gate.w_ue", "ln_emb"):
            plan["slices"][f"{w}.weight"] = plan["slices"][f"{w}.bias"] = ("rows", 2 * self.head_dim, q)
        if self.ln_emb is not None:
            plan["norms"] = {"ln_emb": self.ln_emb.normalized_shape[0]}
        return plan


def precompute_gate_tables(model: nn.Module, enable: bool = True) -> int:
    """EG-MLA-A for a whole model: precompute every layer group's gate table; returns their total bytes
    (a table shared by a layer group counted once)."""
    seen, total = set(), 0
    for m in model.modules():
        if isinstance(m, EGMLA):
            if id(m.emb_gate) in seen:
                continue
            seen.add(id(m.emb_gate))
            total += m.precompute_gate_table(enable)
    return total
