"""MLA: multi-head latent attention (DeepSeek-V2 Appendix C, Eqs. 37-47; mlra.md Sec. 2.1 and App. C.3).

The latent family's base (kvlm/attention/latent.py) holds the parameters (DeepSeek-V3's wq / wq_a, q_norm, wq_b,
wkv_a, kv_norm, wkv_b, wo), the query and latent paths, the routes and the "auto" rule; MLA is its one-block case:
every head attends over the whole latent.

Query path (Eqs. 37-40). With q_lora_rank d'_c > 0::

    c^Q = alpha_q RMSNorm(W^DQ h)          [q^C_i; q^R_i] = W^UQB_i c^Q   (wq_b: d_h + d_h^R rows per head)

with q_lora_rank = 0 a plain W^Q (wq, d -> h (d_h + d_h^R)), each head laid out [q^C_i; q^R_i] as DeepSeek's
code; RoPE applies to q^R.

Latent path (Eqs. 41-45)::

    [c; k] = W^DKV_KR h (wkv_a)   c^KV = alpha_kv RMSNorm(c) (d_c, cached)   k^R = RoPE(k) (d_h^R, cached, shared)
    [k^C_i; v^C_i] = W^UKV_i c^KV (wkv_b),   k_i = [k^C_i; k^R],   o_i = softmax(q_i k_i / sqrt(d_h + d_h^R)) v^C_i

With cfg.rope_kv_heads = n_R > 1, wkv_a makes n_R RoPE keys k^R_j (n_R d_h^R cached) and query head i reads
k^R_{i // (h / n_R)}, as GQA groups its heads (MHA2MLA's per-group RoPE keys): a GQA model with g kv heads then
converts to MLA exactly with n_R = g (kvlm/interop/convert.py). n_R = 1 is DeepSeek's form.

alpha_q = sqrt(d / d'_c), alpha_kv = sqrt(d / d_c) with cfg.latent_scaling (mlra.md Sec. 3.3), else 1; the
RMSNorms are dropped with cfg.latent_norm = False; rope_head_dim = 0 removes the RoPE rows and k^R (no positions).
Parameters without biases, exactly mlra.md Table 1's MLA row:
d'_c (d + h d_h + h d_h^R) + d n_R d_h^R + d_c (d + 2 h d_h) + d h d_h (+ norm weights; with q_lora_rank = 0
the first term is d h (d_h + d_h^R); n_R = rope_kv_heads, 1 in the paper). cfg.bias adds a bias to every
projection; each one stays absorbable: the W^UK bias adds q . b to every score of a query (softmax ignores it)
and the W^UV bias passes through the softmax weights, which sum to one.

Separate latents (cfg.kv_latent = "separate"), the small-LM paper's form (mla-small-lm.md Eqs. 2-3):
K = (X W^{K,down}) W^{K,up}, V = (X W^{V,down}) W^{V,up}. Our reading: one latent per tensor shared by all
heads, each of rank r = kv_lora_rank, so the cache holds c_k and c_v (2 r per token, + d_h^R with decoupled
RoPE); wkv_a is [W^DK; W^DV; W^KR], kv_norm has one row per latent, wkv_b's key rows read c_k and its value rows
c_v. This is the only reading under which its Table 2 holds (r = d caches exactly what MHA caches, 2 d, and
r = d/2 halves it); its text's "r < d_k per head, O(nHr) cache" contradicts that table. The grid r = d ... d/32
is kv_lora_rank = d_model ... d_model/32. "MLA+RoPE" is taken as DeepSeek's decoupled RoPE key (rope_head_dim
> 0); RoPE on the whole up-projected key would bind positions into K and make absorption impossible.

Cache (``cache_spec``): compact {"c_kv": (d_c,), "k_rope": (d_h^R,)} (k_rope omitted when d_h^R = 0; "c_k" and
"c_v" for separate latents; "k_rope": (n_R, d_h^R) with n_R > 1 RoPE key heads). Naive: {"k": (h, d_h + d_h^R),
"v": (h, d_h)}, the materialised per-head K/V.

The absorbed route (mlra.md Sec. 2.1 Steps 1-3): fold W^UK into the query (q~ = q^C W~^UK, h x d_c), attend in
the latent space as MQA with one shared key [c^KV; k^R] and value c^KV (``latent_attention``: heads folded into
the query axis, SDPA's fused kernel reading the strided cache views once, the d_h^R-wide RoPE scores as its
additive mask, no copy of the cache), then o_i = z_i W~^UV_i. Cost O(T h S (2 d_c + d_h^R)): the decode route.
Its weights (W~^UK (h, d_h, d_c), W~^UV (h, d_c, d_h), and, where fewer weights are read that way, W^UQ W~^UK
and W~^UV W^O folded together, ``fold_choice``) are built once by ``prepare_for_inference()``; without it they
are built on the fly each call (and always while autograd records, so the route stays differentiable).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvlm import kernels
from kvlm.attention import register
from kvlm.attention.base import BlockPlan, Step, require
from kvlm.attention.latent import LatentAttention, check_latent_config
from kvlm.attention.latent_ops import head_matmul, latent_attention
from kvlm.attention.rope import apply_rope
from kvlm.config import ModelConfig


@dataclass
class AbsorbedWeights:
    """Weights for the absorbed route, derived from the module's parameters (see ``MLA.absorbed_weights``).

    w_uk (h, d_h, d_c): W~^UK, q~_i = q^C_i W~^UK_i. w_uv (h, d_c, d_h): W~^UV, o_i = z_i W~^UV_i + b_uv_i.
    w_q (n_in, h d_c) / b_q: W^UQ (or W^Q's nope part) folded with W~^UK, maps c^Q (or x) straight to q~;
    then w_qr / b_qr: the query's RoPE rows (h d_h^R, n_in), still needed apart.
    w_ov (h d_c, d) / b_ov: W~^UV folded into W^O, maps z straight to the layer output.
    fold: the ``absorb_fold`` they were built for.
    """

    w_uk: torch.Tensor
    w_uv: torch.Tensor
    b_uv: torch.Tensor | None = None
    w_q: torch.Tensor | None = None
    b_q: torch.Tensor | None = None
    w_ov: torch.Tensor | None = None
    b_ov: torch.Tensor | None = None
    w_qr: torch.Tensor | None = None
    b_qr: torch.Tensor | None = None
    fold: str = "auto"


@register("mla")
class MLA(LatentAttention):
    name = "mla"
    supports_rope_kv_heads = (
        True  # cfg.rope_kv_heads > 1 (config.validate; other latent mechanisms refuse it)
    )
    hf_peer = "deepseek_v3"

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__(cfg, layer_idx)
        # "auto" | "none" | "all": fold W^UQ.W~^UK and W~^UV.W^O in the absorbed route ("auto": when cheaper)
        self.absorb_fold = type(self).absorb_fold
        self._absorbed: AbsorbedWeights | None = None  # built by prepare_for_inference

    # --- configuration ---------------------------------------------------------------------------
    @classmethod
    def check_config(cls, cfg: ModelConfig) -> None:
        check_latent_config(cfg)
        n_r = cfg.rope_kv_heads
        require(n_r >= 1, f"rope_kv_heads must be >= 1, got {n_r}")
        require(
            cfg.n_head % n_r == 0,
            f"n_head={cfg.n_head} is not divisible by rope_kv_heads={n_r}: each RoPE key serves n_head / n_R heads",
        )
        require(
            n_r == 1 or cfg.rope_head_dim > 0,
            f"rope_kv_heads={n_r} needs decoupled RoPE keys, but rope_head_dim is 0 (rope=False?)",
        )

    @classmethod
    def latent_spec(cls, cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
        names = ("c_k", "c_v") if cfg.kv_latent == "separate" else ("c_kv",)
        spec = {n: (cfg.kv_lora_rank,) for n in names}
        if cfg.rope_head_dim:
            n_r = cfg.rope_kv_heads
            spec["k_rope"] = (cfg.rope_head_dim,) if n_r == 1 else (n_r, cfg.rope_head_dim)
        return spec

    @classmethod
    def spec_for(cls, cfg, layer_idx=0, naive=False):
        if naive:
            h, dh = cfg.n_head, cfg.head_dim
            return {"k": (h, dh + cfg.rope_head_dim), "v": (h, dh)}
        return cls.latent_spec(cfg)

    @classmethod
    def tp_shards(cls, cfg):
        # head-parallel decoding (FlashMLA) needs the whole latent on every device (mlra.md Sec. 3.4); k_rope
        # too, also with n_R > 1 RoPE key heads (replicated, not split by key head)
        return {name: "replicated" for name in cls.latent_spec(cfg)}

    @classmethod
    def tp_max_degree(cls, cfg):
        return 1

    # --- absorption ----------------------------------------------------------------------------
    def fold_choice(self) -> tuple[bool, bool]:
        """(fold W^UQ with W~^UK, fold W~^UV into W^O): by default whenever the folded matrix is smaller, i.e.
        fewer weight bytes are read per decode step; never for W^O when an output gate sits between them."""
        d, dh, dc = self.cfg.d_model, self.head_dim, self.kv_lora_rank
        n_in = self.q_lora_rank or d
        can_out = self.gate is None
        if self.absorb_fold == "none":
            return False, False
        if self.absorb_fold == "all":
            return True, can_out
        return n_in * dc < n_in * dh + dh * dc, can_out and d * dc < dh * dc + d * dh

    def prepare_for_inference(self) -> None:
        """Build the absorbed weights once from the current parameters (call again after they change)."""
        with torch.no_grad():
            self._absorbed = self._build_absorbed()

    def release_prepared(self) -> None:
        self._absorbed = None

    def absorbed_weights(self) -> AbsorbedWeights:
        """W~^UK (h, d_h, d_c) and W~^UV (h, d_c, d_h) (mlra.md Sec. 2.1 Step 1), plus the optional folds: the
        prepared ones (``prepare_for_inference``) when they fit ``absorb_fold`` and autograd is not recording
        through the parameters, else built now (differentiable while autograd records)."""
        differentiable = torch.is_grad_enabled() and any(p.requires_grad for p in self.parameters())
        prepared = self._absorbed
        if prepared is not None and prepared.fold == self.absorb_fold and not differentiable:
            return prepared
        if differentiable:
            return self._build_absorbed()
        with torch.no_grad():
            return self._build_absorbed()

    def _build_absorbed(self) -> AbsorbedWeights:
        h, dh, dr, dc = self.n_head, self.head_dim, self.rope_head_dim, self.kv_lora_rank
        w_k, w_v = self.up_weights()  # (1, h, d_h, d_c): row p of head i is key / value dim p as a map of c
        w_uk = w_k[0].contiguous()
        w_uv = w_v[0].transpose(1, 2).contiguous()  # (h, d_c, d_h)
        b = self.wkv_b.bias
        b_uv = b.view(h, 2 * dh)[:, dh:].reshape(-1) if b is not None else None
        aw = AbsorbedWeights(w_uk, w_uv, b_uv, fold=self.absorb_fold)
        fold_q, fold_o = self.fold_choice()
        if fold_q:  # q~_i = (c W_i^T + b_i) W~^UK_i = c (W_i^T W~^UK_i) + b_i W~^UK_i
            lin = self.query_weight()
            w = lin.weight.view(h, dh + dr, -1)
            aw.w_q = torch.einsum("hpn,hpc->nhc", w[:, :dh], w_uk).reshape(w.shape[-1], h * dc)
            if lin.bias is not None:
                bq = lin.bias.view(h, dh + dr)
                aw.b_q = torch.einsum("hp,hpc->hc", bq[:, :dh], w_uk).reshape(h * dc)
                aw.b_qr = bq[:, dh:].reshape(-1) if dr else None
            if dr:
                aw.w_qr = w[:, dh:].reshape(h * dr, -1)
        if fold_o:  # u = sum_i W^O_i (z_i W~^UV_i + b_uv_i) + b_o
            wo = self.wo.weight.view(-1, h, dh)  # (d, h, d_h)
            aw.w_ov = torch.einsum("hcp,dhp->hcd", w_uv, wo).reshape(h * dc, -1)
            b = self.wo.bias
            if b_uv is not None:
                b_fold = torch.einsum("hp,dhp->d", b_uv.view(h, dh), wo)
                b = b_fold if b is None else b + b_fold
            aw.b_ov = b
        return aw

    def absorb_query(
        self, x: torch.Tensor, cs, aw: AbsorbedWeights
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x (B, T, d) -> q~ = q^C W~^UK (B, h, T, d_c) (Step 1) and q^R (B, h, T, d_h^R) or None."""
        B, T, _ = x.shape
        c_q = self.query_input(x)
        if aw.w_q is None:
            q_nope, q_rope = self.query_from(c_q, cs)
            return head_matmul(q_nope, aw.w_uk), q_rope  # q^C W~^UK per head
        q_lat = c_q @ aw.w_q
        if aw.b_q is not None:
            q_lat = q_lat + aw.b_q
        q_lat = q_lat.view(B, T, self.n_head, -1).transpose(1, 2)
        q_rope = None
        if self.rope_head_dim:  # only the RoPE rows of the query map
            q_rope = F.linear(c_q, aw.w_qr, aw.b_qr).view(B, T, self.n_head, self.rope_head_dim)
            q_rope = apply_rope(q_rope.transpose(1, 2), *cs)
        return q_lat, q_rope

    def absorbed_output(self, z: torch.Tensor, x: torch.Tensor, aw: AbsorbedWeights) -> torch.Tensor:
        """z (B, h, T, d_c) -> layer output (B, T, d): o_i = z_i W~^UV_i (Step 3), then gate and W^O."""
        B, H, T, Dc = z.shape
        if aw.w_ov is not None:
            out = z.transpose(1, 2).reshape(B, T, H * Dc) @ aw.w_ov
            return out + aw.b_ov if aw.b_ov is not None else out
        o = head_matmul(z, aw.w_uv)  # z W~^UV per head
        if aw.b_uv is not None:
            o = o + aw.b_uv.view(H, 1, -1)
        return self.output(o, x)

    def decode_block_plan(self, block_weights: tuple):
        """The block in one call of kvlm.kernels.mla_block_call on the absorbed route (one latent, no query
        compression, no folds, no bias or output gate, one RoPE key; each product on its panels where they go
        first), else None: the same values as ``forward_absorbed`` and the modules around it one by one. Its steps
        decline where the route is not the absorbed one."""
        if self.q_lora_rank or self.separate or self.gate is not None:
            return None
        if self.cfg.bias or not self.rope_head_dim or self.rope_kv_heads != 1 or self.kv_norm is None:
            return None
        (q_ok, q_panels), (kv_ok, kv_panels), (o_ok, o_panels) = (
            self.wq.first_panels(), self.wkv_a.first_panels(), self.wo.first_panels()
        )
        if not (q_ok and kv_ok and o_ok):
            return None
        aw = self.absorbed_weights()
        if aw.w_q is not None or aw.w_ov is not None or aw.b_uv is not None:
            return None
        attn_norm, mlp_norm, eps, w_up, w_down, up_panels, down_panels = block_weights
        call = kernels.mla_block_call(
            (attn_norm, mlp_norm, eps), self.wq.weight, self.wkv_a.weight,
            (self.kv_norm.weight, self.kv_norm.eps, self.alpha_kv), (aw.w_uk, aw.w_uv), self.wo.weight,
            (w_up, w_down), self.scale, [q_panels, kv_panels, o_panels, up_panels, down_panels],
        )  # fmt: skip
        if call is None:
            return None
        return BlockPlan(self, call, ("c_kv", "k_rope"), self.cos_sin, self.route_label("absorbed"), "absorbed")

    def forward_absorbed(self, x: torch.Tensor, step: Step, cache, cs) -> torch.Tensor:
        """Write the new latents, then attend in latent space (mlra.md Sec. 2.1 Steps 1-3)."""
        aw = self.absorbed_weights()
        q_lat, q_rope = self.absorb_query(x, cs, aw)
        lat = self.latents(x, cs)
        if cache is not None and not self.separate and kernels.ready(q_lat, step.n_new, latent=True):
            # fused flash-decoding over the cache in place (kvlm.kernels); the plain path below if it declines
            for name, t in lat.items():
                cache.store(name, t, step)
            view = {name: cache.block_view(name, step) for name in lat}
            z = kernels.latent_decode(q_lat, q_rope, view["c_kv"], view.get("k_rope"), step.n_new, self.scale)
            if z is not None:
                return self.absorbed_output(z, x, aw)
            lat = {name: cache.read(name, step.end) for name in lat}
        else:
            lat = self.write_latents(lat, step, cache)
        c_k, c_v = (lat["c_k"], lat["c_v"]) if self.separate else (lat["c_kv"], lat["c_kv"])
        z = latent_attention(q_lat, q_rope, c_k, lat.get("k_rope"), c_v, step, self.scale)
        return self.absorbed_output(z, x, aw)
