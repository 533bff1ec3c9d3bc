"""EG-MLA: embedding-gated multi-head latent attention (eg-mla.md Eqs. 1-14, Appendix E Listing 1).

MLA's query and latent paths (see mla.py) with the joint up-projection gated per token::

    c^KV = RMSNorm(W^DKV x)               (Eq. 1, cached)       kv^C = W^UKV c^KV   (Eq. 2, h (d_h + d_h) wide)
    e = Emb(i_t)  (per-layer table, vocab x kv_emb_dim, Eq. 3)   g = W^UE e          (Eq. 4)
    kv~ = LN(kv^C * g)                     (Eq. 5)               [k^C_i; v^C_i] = split per head (Eq. 6)

then MLA's attention with the decoupled RoPE key (Eqs. 7-14). Layout as Listing 1: head i owns columns
[i (2 d_h), (i + 1) 2 d_h) of W^UKV, W^UE and the LayerNorm, first its key then its value; the LayerNorm spans
all heads' keys and values of a token. Options: cfg.eg_norm = False drops the LayerNorm, cfg.eg_op = "add" uses
kv^C + g (Table 3's ablations), cfg.kv_emb_dim the table width, cfg.eg_group_size = lgz shares the gate branch.

Layer grouping (Appendix H, "Toward Greater Efficiency"): lgz consecutive layers share one parameter set "and
its intermediate activations". Our reading: the shared part is the embedding-gate branch (table Emb and W^UE),
the one KV projection whose activation g = W^UE Emb(i_t) does not depend on the layer's input and so can be
reused across the group (we compute it once per group per call); it divides the gate-embedding parameters,
n_layer vocab kv_emb_dim, by lgz. W^DKV, W^UKV and the LayerNorm stay per layer and the cache is unchanged.

No weight absorption: the LayerNorm of Eq. 5 normalises each cached token's full up-projected h (d_h + d_h)
vector, a nonlinear function of c^KV, so W^UKV cannot be folded into the query or the output; even without it
(eg_norm = False) the per-token Hadamard gate keeps keys from factoring through c^KV. Mode "absorbed" therefore
runs the rebuild route (with a one-time warning) rather than failing, so mode sweeps across mechanisms work;
``supports_absorption`` is False for callers that want to know.

Decode routes and their trade-offs (orientation, fp32 on a shared 2-core CPU, 6 layers, d = 768, h = 12, batch 8,
1024 cached tokens, d_c = 64, kv_emb_dim = 256, vocab 8192: rebuild ~1.2 s, EG-MLA-A ~0.53 s, naive ~0.13 s per
step; MLA absorbed at the same d_c ~0.07 s):
- "rebuild" (modes "auto", "expand", "absorbed"): cache only c^KV and k^R, exactly MLA's cache (d_c + d_h^R per
  token per layer; the token ids live once in the model-level cache, one int per token for all layers). Every
  step rebuilds all S cached tokens' keys and values: W^UKV c (2 S d_c h d_h multiply-adds) + the gate
  W^UE Emb(i) (S kv_emb_dim 2 h d_h) + LayerNorm, then attention: compute grows with S per step.
- EG-MLA-A (``precompute_gate_table()``, or ``precompute_gate_tables(model)``): g for every vocabulary token
  computed once (vocab x 2 h d_h per layer group, ``gate_table_nbytes``), so the gate is a table lookup and the
  W^UE matmul disappears from each step; costs vocab 2 h d_h floats per group (eg. 50257 x 1536 fp32 = 309 MB),
  far more than the kv_emb_dim-wide table it replaces. Rebuilt automatically when W^UE or Emb change.
- "naive": materialised per-head K/V after the gate and LayerNorm, MHA-sized cache (h (2 d_h + d_h^R) per token
  per layer); the cheapest step (plain attention), the largest memory.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import nn

from kvlm.attention import register
from kvlm.attention.base import Linear, Step, require
from kvlm.attention.mla import MLA, attend_padded, attend_split
from kvlm.cache import CacheError
from kvlm.config import ModelConfig


class EmbeddingGate(nn.Module):
    """g = W^UE Emb(i) (Eqs. 3-4): a token table and its up-projection; shared by a layer group.

    With ``use_table`` (EG-MLA-A) the product for every vocabulary token is precomputed once and looked up."""

    def __init__(self, vocab_size: int, kv_emb_dim: int, out_dim: int, bias: bool):
        super().__init__()
        self.kv_emb = nn.Embedding(vocab_size, kv_emb_dim)
        self.kv_emb.weight.is_gate_embedding = True  # off the matmul path: counted apart from "activated"
        self.w_ue = Linear(kv_emb_dim, out_dim, bias=bias)
        self.use_table = False
        self._table: tuple | None = None  # (key, (vocab, out_dim) tensor)

    def _sources(self) -> list[torch.Tensor]:
        return [p for p in (self.kv_emb.weight, self.w_ue.weight, self.w_ue.bias) if p is not None]

    def table(self) -> torch.Tensor:
        """The precomputed gate for every token id, rebuilt when a source parameter changed."""
        key = tuple((p.data_ptr(), p._version, p.dtype, p.device) for p in self._sources())
        if self._table is None or self._table[0] != key:
            self._table = None  # free the old table before building the new one
            with torch.no_grad():
                self._table = (key, self.w_ue(self.kv_emb.weight))
        return self._table[1]

    @property
    def table_nbytes(self) -> int:
        t = self._table[1] if self._table is not None else None
        return t.numel() * t.element_size() if t is not None else 0

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        differentiable = torch.is_grad_enabled() and any(p.requires_grad for p in self._sources())
        if self.use_table and not differentiable:
            return F.embedding(ids, self.table())
        return self.w_ue(self.kv_emb(ids))


@register("eg-mla")
class EGMLA(MLA):
    name = "eg-mla"
    needs_token_ids = True
    supports_absorption = False
    _warned_absorbed = False

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__(cfg, layer_idx)
        width = cfg.n_head * 2 * cfg.head_dim
        self.emb_gate = EmbeddingGate(cfg.vocab_size, cfg.kv_emb_dim, width, cfg.bias)
        self.ln_emb = nn.LayerNorm(width, eps=cfg.norm_eps) if cfg.eg_norm else None
        self.gate_shared = False  # set by tie_layers when a layer group shares emb_gate

    def build_up(self, cfg: ModelConfig) -> None:
        """W^UKV (Eq. 2), joint: d_c -> h (d_h + d_h), per head [key; value] as Listing 1's wkv_b."""
        self.w_ukv = Linear(cfg.kv_lora_rank, cfg.n_head * 2 * cfg.head_dim, bias=cfg.bias)

    # --- configuration ---------------------------------------------------------------------------
    @classmethod
    def check_config(cls, cfg: ModelConfig) -> None:
        super().check_config(cfg)
        require(cfg.kv_latent == "joint", "eg-mla gates the joint latent (Eq. 2): kv_latent must be 'joint'")
        require(cfg.kv_emb_dim > 0, f"kv_emb_dim must be positive for eg-mla, got {cfg.kv_emb_dim}")
        require(
            1 <= cfg.eg_group_size <= cfg.n_layer,
            f"eg_group_size (lgz) must be in [1, n_layer={cfg.n_layer}], got {cfg.eg_group_size}",
        )

    @classmethod
    def tie_layers(cls, attns: list[EGMLA]) -> None:
        """Appendix H: each group of lgz consecutive layers uses its first layer's gate branch."""
        lgz = attns[0].cfg.eg_group_size if attns else 1
        if lgz <= 1:
            return
        for i, attn in enumerate(attns):
            attn.emb_gate = attns[i - i % lgz].emb_gate
            attn.gate_shared = True

    # --- EG-MLA-A ------------------------------------------------------------------------------
    def precompute_gate_table(self, enable: bool = True) -> int:
        """EG-MLA-A: look the gate up from a precomputed (vocab, 2 h d_h) table; returns its bytes."""
        self.emb_gate.use_table = enable
        if not enable:
            self.emb_gate._table = None
            return 0
        self.emb_gate.table()
        return self.gate_table_nbytes

    @property
    def gate_table_nbytes(self) -> int:
        return self.emb_gate.table_nbytes

    # --- the gated keys and values ---------------------------------------------------------------
    def embedding_gate(self, ids: torch.Tensor, step: Step) -> torch.Tensor:
        """g (B, S, 2 h d_h) for token ids (B, S); a layer group computes it once per call (Appendix H)."""
        if not self.gate_shared:
            return self.emb_gate(ids)
        memo = getattr(step, "_eg_gate_memo", None)  # the latest group's gate, lives as long as the step
        if memo is not None and memo[0] is self.emb_gate and memo[1] is ids:
            return memo[2]
        g = self.emb_gate(ids)
        step._eg_gate_memo = (self.emb_gate, ids, g)
        return g

    def gated_kv(
        self, c_kv: torch.Tensor, ids: torch.Tensor, step: Step
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """c^KV (B, S, d_c), token ids (B, S) -> k^C, v^C (B, h, S, d_h) (Eqs. 2-6), strided views of one
        (B, S, h, 2 d_h) tensor."""
        B, S, _ = c_kv.shape
        h, dh = self.n_head, self.head_dim
        kv = self.w_ukv(c_kv)
        g = self.embedding_gate(ids, step)
        if kv.requires_grad or g.requires_grad:
            kv = kv + g if self.cfg.eg_op == "add" else kv * g
        else:  # inference: in place, S x 2 h d_h floats per layer is as big as the naive cache
            kv = kv.add_(g) if self.cfg.eg_op == "add" else kv.mul_(g)
        if self.ln_emb is not None:
            kv = self.ln_emb(kv)
        kv = kv.view(B, S, h, 2 * dh).transpose(1, 2)
        return kv[..., :dh], kv[..., dh:]

    def absorbed_weights(self):
        raise NotImplementedError(
            "eg-mla has no absorbed weights: the LayerNorm of Eq. 5 is nonlinear in c^KV"
        )

    def expanded_kv(self, lat, ids=None, step=None):
        k, v = self.gated_kv(lat["c_kv"], ids, step)
        if self.rope_head_dim:
            k = torch.cat([k, lat["k_rope"][:, None].expand(-1, self.n_head, -1, -1)], dim=-1)
        return k, v

    def forward(
        self, x: torch.Tensor, step: Step, cache: dict[str, torch.Tensor] | None = None
    ) -> torch.Tensor:
        if step.token_ids is None:
            raise ValueError("eg-mla gates keys and values by token: step.token_ids is required")
        mode = step.mode
        q_nope, q_rope = self.query(x, step)
        lat = self.latents(x, step)
        ids = step.token_ids
        if cache is not None and mode == "auto" and "k" in cache:
            mode = "naive"  # a materialised K/V cache has one route
        if cache is not None and mode == "naive":
            if "k" not in cache:
                raise CacheError("mode='naive' needs model.new_cache(..., naive=True)")
            k, v = self.expanded_kv(lat, ids, step)
            k, v = self.write(cache, "k", k, step), self.write(cache, "v", v, step)
            q = torch.cat([q_nope, q_rope], dim=-1) if q_rope is not None else q_nope
            return self.output(attend_padded(q, k, v, step, self.scale), x)
        if cache is not None:  # rebuild: every cached token's keys and values from its latent and its token
            if "c_kv" not in cache:
                raise CacheError(f"mode={mode!r} needs the compact cache (model.new_cache(..., naive=False))")
            if step.cached_token_ids is None:
                raise CacheError("eg-mla rebuilds K/V from token ids: use a cache from model.new_cache()")
            if mode == "absorbed" and not EGMLA._warned_absorbed:
                EGMLA._warned_absorbed = True
                warnings.warn(
                    "eg-mla has no absorbed route (the LayerNorm after the embedding gate is nonlinear in the "
                    "latent); running the rebuild route instead",
                    stacklevel=2,
                )
            lat = {n: self.write(cache, n, t, step) for n, t in lat.items()}
            ids = step.cached_token_ids
        k_nope, v = self.gated_kv(lat["c_kv"], ids, step)
        o = attend_split(q_nope, q_rope, k_nope, lat.get("k_rope"), v, step, self.scale)
        return self.output(o, x)


def precompute_gate_tables(model: nn.Module, enable: bool = True) -> int:
    """EG-MLA-A for a whole model: precompute every layer group's gate table; returns their total bytes
    (a table shared by a layer group counted once)."""
    seen, total = set(), 0
    for m in model.modules():
        if isinstance(m, EGMLA):
            m.precompute_gate_table(enable)
            if id(m.emb_gate) not in seen:
                seen.add(id(m.emb_gate))
                total += m.gate_table_nbytes
    return total
