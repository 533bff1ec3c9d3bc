"""MLA: multi-head latent attention (DeepSeek-V2 Appendix C, Eqs. 37-47; mlra.md Sec. 2.1 and App. C.3).

Query path (Eqs. 37-40). With q_lora_rank d'_c > 0::

    c^Q = alpha_q RMSNorm(W^DQ h)          q^C = W^UQ c^Q  (h heads x d_h)    q^R = RoPE(W^QR c^Q)  (h x d_h^R)

with q_lora_rank = 0 a plain W^Q (d -> h (d_h + d_h^R)), each head laid out [q^C_i; q^R_i] as DeepSeek's code.

Latent path (Eqs. 41-45)::

    c^KV = alpha_kv RMSNorm(W^DKV h)  (d_c, cached)      k^R = RoPE(W^KR h)  (d_h^R, cached, shared by all heads)
    k^C = W^UK c^KV,  v^C = W^UV c^KV,  k_i = [k^C_i; k^R],  o_i = softmax(q_i k_i / sqrt(d_h + d_h^R)) v^C_i

With cfg.rope_kv_heads = n_R > 1, W^KR makes n_R RoPE keys k^R_j (n_R d_h^R cached) and query head i reads
k^R_{i // (h / n_R)}, as GQA groups its heads (MHA2MLA's per-group RoPE keys): a GQA model with g kv heads then
converts to MLA exactly with n_R = g (kvlm/convert.py). n_R = 1 is DeepSeek's form.

alpha_q = sqrt(d / d'_c), alpha_kv = sqrt(d / d_c) with cfg.latent_scaling (mlra.md Sec. 3.3), else 1; the
RMSNorms are dropped with cfg.latent_norm = False; rope_head_dim = 0 removes W^QR, W^KR and k^R (no positions).
Parameters without biases, exactly mlra.md Table 1's MLA row:
d'_c (d + h d_h + h d_h^R) + d n_R d_h^R + d_c (d + 2 h d_h) + d h d_h (+ norm weights; with q_lora_rank = 0
the first term is d h (d_h + d_h^R); n_R = rope_kv_heads, 1 in the paper). cfg.bias adds a bias to every projection; each one stays absorbable: the
W^UK bias adds q . b to every score of a query (softmax ignores it) and the W^UV bias passes through the
softmax weights, which sum to one.

Separate latents (cfg.kv_latent = "separate"), the small-LM paper's form (mla-small-lm.md Eqs. 2-3):
K = (X W^{K,down}) W^{K,up}, V = (X W^{V,down}) W^{V,up}. Our reading: one latent per tensor shared by all
heads, each of rank r = kv_lora_rank, so the cache holds c_k and c_v (2 r per token, + d_h^R with decoupled
RoPE). This is the only reading under which its Table 2 holds (r = d caches exactly what MHA caches, 2 d, and
r = d/2 halves it); its text's "r < d_k per head, O(nHr) cache" contradicts that table. The grid r = d ... d/32
is kv_lora_rank = d_model ... d_model/32. "MLA+RoPE" is taken as DeepSeek's decoupled RoPE key (rope_head_dim
> 0); RoPE on the whole up-projected key would bind positions into K and make absorption impossible.

Cache (``cache_spec``): compact {"c_kv": (d_c,), "k_rope": (d_h^R,)} (k_rope omitted when d_h^R = 0; "c_k" and
"c_v" for separate latents; "k_rope": (n_R, d_h^R) with n_R > 1 RoPE key heads). Naive: {"k": (h, d_h + d_h^R), "v": (h, d_h)}, the materialised per-head K/V.

Routes (``step.mode``):
- no cache (training): up-project to per-head K/V, one SDPA call with is_causal.
- "naive": write materialised K/V to the naive cache, attend over them (the MHA-sized baseline).
- "expand": write the latent, up-project the whole cached latent to K/V, attend (``attend_split``: the shared
  RoPE key is never copied per head for decode-sized calls). Cost O(S d_c h d_h) per call regardless of the
  number of new tokens: the prefill route.
- "absorbed" (mlra.md Sec. 2.1 Steps 1-3): fold W^UK into the query (q~ = q^C W~^UK, h x d_c), attend in the
  latent space as MQA with one shared key [c^KV; k^R] and value c^KV (``latent_attention``: heads folded into
  the query axis, SDPA's fused kernel reading the strided cache views once, the d_h^R-wide RoPE scores
  q^R k_rope^T as its additive mask, no copy of the cache), then o_i = z_i W~^UV_i.
  Cost O(T h S (2 d_c + d_h^R)): the decode route.
- "auto": absorbed when few tokens are new relative to what is cached (``prefers_absorbed``), expand otherwise.
The absorbed weights (W~^UK (h, d_h, d_c), W~^UV (h, d_c, d_h), and, where fewer weights are read that way,
W^UQ W~^UK and W~^UV W^O folded together, ``fold_choice``) are built once and cached on the module, rebuilt
when any source weight changes (version counter / storage / dtype / device), never per step.

Reusable pieces (for GLA / MLRA and subclasses such as EG-MLA): construction hooks ``build_latent`` and
``build_up``; ``query`` / ``query_input`` / ``query_from`` (query path), ``cos_sin`` (RoPE angles shared by all
layers of a call), ``latents`` / ``latent_kv`` (latent path, cache layout), ``up_project`` / ``expanded_kv``,
``absorbed_weights`` / ``absorb_query`` / ``absorbed_output`` (absorption), and the module functions
``latent_attention`` (MQA over latents), ``attend_split`` (keys with a shared RoPE part), ``attend_padded``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kvlm.attention import register
from kvlm.attention.base import Attention, Linear, Step, attend, require
from kvlm.attention.rope import RotaryEmbedding, apply_rope
from kvlm.cache import CacheError
from kvlm.config import ModelConfig


@dataclass
class AbsorbedWeights:
    """Weights for the absorbed route, derived from the module's parameters (see ``MLA.absorbed_weights``).

    w_uk (h, d_h, d_c): W~^UK, q~_i = q^C_i W~^UK_i. w_uv (h, d_c, d_h): W~^UV, o_i = z_i W~^UV_i + b_uv_i.
    w_q (n_in, h d_c) / b_q: W^UQ (or W^Q's nope part) folded with W~^UK, maps c^Q (or x) straight to q~.
    w_ov (h d_c, d) / b_ov: W~^UV folded into W^O, maps z straight to the layer output.
    """

    w_uk: torch.Tensor
    w_uv: torch.Tensor
    b_uv: torch.Tensor | None = None
    w_q: torch.Tensor | None = None
    b_q: torch.Tensor | None = None
    w_ov: torch.Tensor | None = None
    b_ov: torch.Tensor | None = None
    w_qr: torch.Tensor | None = None  # with w_q and q_lora_rank = 0: W^Q's RoPE rows (h d_h^R, d)
    b_qr: torch.Tensor | None = None


def latent_attention(
    q: torch.Tensor,
    q_rope: torch.Tensor | None,
    c_k: torch.Tensor,
    k_rope: torch.Tensor | None,
    c_v: torch.Tensor,
    step: Step,
    scale: float,
) -> torch.Tensor:
    """MQA-style attention in latent space (mlra.md Sec. 2.1 Step 2), one shared key/value head.

    q (B, H, T, D_c), q_rope (B, H, T, d_R) or None; c_k (B, S, D_c), k_rope (B, S, d_R) (or (B, n_R, S, d_R):
    grouped RoPE keys) or None, c_v (B, S, D_v): usually strided views of cache buffers (B, max_len, .), never
    copied. Returns z (B, H, T, D_v) with
    z = softmax(scale (q c_k^T + q_rope k_rope^T)) c_v. Heads and new tokens share one query axis, so each
    cached latent is read once per sequence, not once per head.

    When q and c_v have the same width (always for MLA's absorbed route, D_c = D_v) the latent part runs in
    SDPA's fused kernel, one pass over the cache with scores kept in blocks, and the small RoPE term
    scale q_rope k_rope^T (d_R = d_h/2 wide) plus any mask enters as its additive float mask: about 20 % faster
    on CPU than separate score and value matmuls. Float64 keeps the plain matmuls (exact tests).
    """
    B, H, T, Dc = q.shape
    S = c_k.shape[1]
    mask = step.visible(T, S, q.device)
    if q.dtype != torch.float64 and Dc == c_v.shape[-1]:
        bias = None
        if q_rope is not None:
            bias = rope_scores(q_rope, k_rope).mul_(scale)
        if mask is not None:
            if bias is None:
                bias = torch.zeros(B, H * T, S, dtype=q.dtype, device=q.device)
            bias.view(B, H, T, S).masked_fill_(~mask, float("-inf"))
        z = F.scaled_dot_product_attention(
            q.reshape(B, 1, H * T, Dc),
            c_k[:, None],
            c_v[:, None],
            attn_mask=bias[:, None] if bias is not None else None,
            scale=scale,
        )
        return z.view(B, H, T, Dc)
    scores = torch.bmm((q * scale).reshape(B, H * T, Dc), c_k.transpose(1, 2))  # (B, H T, S)
    if q_rope is not None and k_rope.dim() == 3:
        scores.baddbmm_(q_rope.reshape(B, H * T, -1), k_rope.transpose(1, 2), alpha=scale)
    elif q_rope is not None:
        scores.add_(rope_scores(q_rope, k_rope), alpha=scale)
    if mask is not None:
        scores = scores.view(B, H, T, S).masked_fill(~mask, float("-inf")).view(B, H * T, S)
    p = torch.softmax(scores, dim=-1)
    return torch.bmm(p, c_v).view(B, H, T, c_v.shape[-1])


def rope_scores(q_rope: torch.Tensor, k_rope: torch.Tensor) -> torch.Tensor:
    """q^R k^R^T as (B, H T, S): q_rope (B, H, T, d_R); k_rope (B, S, d_R), one key for every head, or
    (B, n_R, S, d_R), head i reading key i // (H / n_R): one matmul per key head over its H / n_R query heads."""
    B, H, T, dr = q_rope.shape
    if k_rope.dim() == 3:
        return torch.bmm(q_rope.reshape(B, H * T, dr), k_rope.transpose(1, 2))
    n_r, S = k_rope.shape[1], k_rope.shape[2]
    return torch.matmul(q_rope.reshape(B, n_r, H // n_r * T, dr), k_rope.transpose(-1, -2)).view(B, H * T, S)


def rope_keys_per_head(k_rope: torch.Tensor, n_head: int) -> torch.Tensor:
    """The RoPE key of every query head, (B, h, S, d_R), from k_rope (B, S, d_R) or (B, n_R, S, d_R)."""
    if k_rope.dim() == 3:
        return k_rope[:, None].expand(-1, n_head, -1, -1)
    return k_rope.repeat_interleave(n_head // k_rope.shape[1], dim=1)


@register("mla")
class MLA(Attention):
    name = "mla"
    has_naive_cache = True
    supports_absorption = True
    supports_rope_kv_heads = True  # cfg.rope_kv_heads > 1 (config.validate; subclasses do not inherit it)
    # "auto" takes the absorbed route when n_new * absorb_ratio <= cached tokens (and absorption is cheaper in
    # FLOPs at that n_new, see prefers_absorbed); the first prefill always expands.
    absorb_ratio = 4

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__(cfg, layer_idx)
        d, h, dh, dr = cfg.d_model, cfg.n_head, cfg.head_dim, cfg.rope_head_dim
        dc, dq = cfg.kv_lora_rank, cfg.q_lora_rank
        self.n_head, self.head_dim, self.rope_head_dim = h, dh, dr
        self.rope_kv_heads = cfg.rope_kv_heads  # n_R
        self.kv_lora_rank, self.q_lora_rank = dc, dq
        self.separate = cfg.kv_latent == "separate"
        self.scale = 1.0 / math.sqrt(dh + dr)  # Eq. 46
        self.alpha_q = math.sqrt(d / dq) if cfg.latent_scaling and dq else 1.0
        self.alpha_kv = math.sqrt(d / dc) if cfg.latent_scaling else 1.0
        # "auto" | "none" | "all": fold W^UQ.W~^UK and W~^UV.W^O in the absorbed route ("auto": when cheaper)
        self.absorb_fold = "auto"
        self._absorbed: tuple | None = None  # (key, AbsorbedWeights)
        bias = cfg.bias
        # query path, Eqs. 37-40
        if dq:
            self.w_dq = Linear(d, dq, bias=bias)
            self.q_norm = nn.RMSNorm(dq, eps=cfg.norm_eps) if cfg.latent_norm else None
            self.w_uq = Linear(dq, h * dh, bias=bias)
            self.w_qr = Linear(dq, h * dr, bias=bias) if dr else None
        else:
            self.wq = Linear(d, h * (dh + dr), bias=bias)
        # latent path, Eqs. 41-45
        self.build_latent(cfg)
        self.w_kr = Linear(d, cfg.rope_kv_heads * dr, bias=bias) if dr else None
        self.rope = RotaryEmbedding(dr, cfg.max_seq_len, cfg.rope_theta) if dr else None
        self.build_up(cfg)
        self.make_output(h * dh)

    def build_latent(self, cfg: ModelConfig) -> None:
        """Down-projections W^DKV (or W^DK, W^DV) and their RMSNorms."""
        d, dc, eps = cfg.d_model, cfg.kv_lora_rank, cfg.norm_eps
        names = ("k", "v") if self.separate else ("kv",)
        for n in names:
            setattr(self, f"w_d{n}", Linear(d, dc, bias=cfg.bias))
            setattr(self, f"{n}_norm", nn.RMSNorm(dc, eps=eps) if cfg.latent_norm else None)

    def build_up(self, cfg: ModelConfig) -> None:
        """Up-projections W^UK, W^UV (d_c -> h d_h)."""
        h, dh, dc = cfg.n_head, cfg.head_dim, cfg.kv_lora_rank
        self.w_uk = Linear(dc, h * dh, bias=cfg.bias)
        self.w_uv = Linear(dc, h * dh, bias=cfg.bias)

    # --- configuration ---------------------------------------------------------------------------
    @classmethod
    def check_config(cls, cfg: ModelConfig) -> None:
        d = cfg.d_model
        require(cfg.kv_lora_rank > 0, f"kv_lora_rank (d_c) must be positive, got {cfg.kv_lora_rank}")
        require(
            cfg.kv_lora_rank <= d,
            f"kv_lora_rank={cfg.kv_lora_rank} is larger than its input d_model={d}: a latent wider than the "
            "hidden state compresses nothing (the small-LM grid tops out at r = d)",
        )
        require(
            cfg.q_lora_rank <= d,
            f"q_lora_rank={cfg.q_lora_rank} is larger than its input d_model={d}; use 0 for a plain W^Q",
        )
        require(
            cfg.rope_head_dim <= cfg.head_dim,
            f"rope_head_dim={cfg.rope_head_dim} is larger than head_dim={cfg.head_dim}: the decoupled RoPE key "
            "is at most one head wide (DeepSeek uses d_h/2)",
        )
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

    # --- query path ----------------------------------------------------------------------------
    def query_input(self, x: torch.Tensor) -> torch.Tensor:
        """What the nope query is a linear map of: c^Q = alpha_q RMSNorm(W^DQ x) (Eq. 37), or x itself."""
        if not self.q_lora_rank:
            return x
        c_q = self.w_dq(x)
        if self.q_norm is not None:
            c_q = self.q_norm(c_q)
        return c_q * self.alpha_q if self.alpha_q != 1.0 else c_q

    def query(self, x: torch.Tensor, step: Step) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x (B, T, d) -> q^C (B, h, T, d_h), q^R (B, h, T, d_h^R) with RoPE applied, or None (Eqs. 37-40)."""
        return self.query_from(self.query_input(x), step)

    def query_from(self, c_q: torch.Tensor, step: Step) -> tuple[torch.Tensor, torch.Tensor | None]:
        B, T, _ = c_q.shape
        h, dh, dr = self.n_head, self.head_dim, self.rope_head_dim
        if self.q_lora_rank:
            q_nope = self.w_uq(c_q).view(B, T, h, dh).transpose(1, 2)
            q_rope = self.w_qr(c_q).view(B, T, h, dr).transpose(1, 2) if dr else None
        else:
            q = self.wq(c_q).view(B, T, h, dh + dr).transpose(1, 2)
            q_nope, q_rope = (q[..., :dh], q[..., dh:]) if dr else (q, None)
        if q_rope is not None:
            q_rope = apply_rope(q_rope, *self.cos_sin(step, c_q.dtype))
        return q_nope, q_rope

    def cos_sin(self, step: Step, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE angles of the new tokens, computed once per model call and shared by every layer."""
        key = (self.rope_head_dim, self.rope.theta, dtype, self.rope.cos_table.device)
        memo = getattr(step, "_mla_cos_sin", None)
        if memo is None or memo[0] != key:
            memo = (key, self.rope.cos_sin(step.positions, dtype))
            step._mla_cos_sin = memo
        return memo[1]

    # --- latent path ---------------------------------------------------------------------------
    def latents(self, x: torch.Tensor, step: Step) -> dict[str, torch.Tensor]:
        """x (B, T, d) -> the compact cache entries of the new tokens, keyed as ``cache_spec()``:
        c_kv (or c_k, c_v) (B, T, d_c) = alpha_kv RMSNorm(W^D x) (Eq. 41), k_rope (B, T, d_h^R) = RoPE(W^KR x)
        (Eq. 43), (B, n_R, T, d_h^R) with n_R > 1 RoPE key heads."""
        out = {}
        for n in ("k", "v") if self.separate else ("kv",):
            c = getattr(self, f"w_d{n}")(x)
            norm = getattr(self, f"{n}_norm")
            if norm is not None:
                c = norm(c)
            out[f"c_{n}"] = c * self.alpha_kv if self.alpha_kv != 1.0 else c
        if self.rope_head_dim and self.rope_kv_heads == 1:
            k_rope = self.w_kr(x)[:, None]  # (B, 1, T, d_R)
            out["k_rope"] = apply_rope(k_rope, *self.cos_sin(step, x.dtype))[:, 0]
        elif self.rope_head_dim:
            B, T, _ = x.shape
            k_rope = self.w_kr(x).view(B, T, self.rope_kv_heads, -1).transpose(1, 2)  # (B, n_R, T, d_R)
            out["k_rope"] = apply_rope(k_rope, *self.cos_sin(step, x.dtype))
        return out

    def latent_kv(self, lat: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The latents that make keys and values: (c_kv, c_kv) or (c_k, c_v)."""
        return (lat["c_k"], lat["c_v"]) if self.separate else (lat["c_kv"], lat["c_kv"])

    def up_project(self, lat: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Latents (B, S, d_c) -> k^C (B, h, S, d_h), v^C (B, h, S, d_h) (Eqs. 42, 45)."""
        c_k, c_v = self.latent_kv(lat)
        B, S, _ = c_k.shape
        h, dh = self.n_head, self.head_dim
        k = self.w_uk(c_k).view(B, S, h, dh).transpose(1, 2)
        v = self.w_uv(c_v).view(B, S, h, dh).transpose(1, 2)
        return k, v

    def expanded_kv(self, lat: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-head keys [k^C_i; k^R] (B, h, S, d_h + d_h^R) (Eq. 44) and values (B, h, S, d_h)."""
        k, v = self.up_project(lat)
        if self.rope_head_dim:
            k = torch.cat([k, rope_keys_per_head(lat["k_rope"], self.n_head)], dim=-1)
        return k, v

    # --- absorption ----------------------------------------------------------------------------
    def _query_nope_weight(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The map c^Q (or x) -> q^C as per-head weights (h, d_h, n_in) and bias (h, d_h) or None."""
        h, dh, dr = self.n_head, self.head_dim, self.rope_head_dim
        lin = self.w_uq if self.q_lora_rank else self.wq
        w = lin.weight.view(h, dh + (0 if self.q_lora_rank else dr), -1)[:, :dh]
        b = lin.bias.view(h, -1)[:, :dh] if lin.bias is not None else None
        return w, b

    def _absorb_sources(self) -> list[torch.Tensor]:
        mods = [self.w_uk, self.w_uv, self.w_uq if self.q_lora_rank else self.wq, self.wo]
        return [p for m in mods for p in (m.weight, m.bias) if p is not None]

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

    def absorbed_weights(self) -> AbsorbedWeights:
        """W~^UK (h, d_h, d_c) and W~^UV (h, d_c, d_h) (mlra.md Sec. 2.1 Step 1), plus the optional folds.

        Cached: rebuilt only when a source parameter changed (in-place update, new storage, dtype or device) or
        ``absorb_fold`` changed. While autograd records and a source requires grad, built fresh (differentiable).
        """
        sources = self._absorb_sources()
        if torch.is_grad_enabled() and any(p.requires_grad for p in sources):
            return self._build_absorbed()
        key = (self.absorb_fold, *((p.data_ptr(), p._version, p.dtype, p.device) for p in sources))
        if self._absorbed is None or self._absorbed[0] != key:
            with torch.no_grad():
                self._absorbed = (key, self._build_absorbed())
        return self._absorbed[1]

    def _build_absorbed(self) -> AbsorbedWeights:
        h, dh, dc = self.n_head, self.head_dim, self.kv_lora_rank
        w_uk = self.w_uk.weight.view(h, dh, dc)  # row p of head i: the key dim p as a function of c
        w_uv = self.w_uv.weight.view(h, dh, dc).transpose(1, 2).contiguous()  # (h, d_c, d_h)
        b_uv = self.w_uv.bias
        aw = AbsorbedWeights(w_uk.contiguous(), w_uv, b_uv)
        fold_q, fold_o = self.fold_choice()
        if fold_q:  # q~_i = (c W_i^T + b_i) W~^UK_i = c (W_i^T W~^UK_i) + b_i W~^UK_i
            w, b = self._query_nope_weight()
            aw.w_q = torch.einsum("hpn,hpc->nhc", w, w_uk).reshape(w.shape[-1], h * dc)
            aw.b_q = torch.einsum("hp,hpc->hc", b, w_uk).reshape(h * dc) if b is not None else None
            if not self.q_lora_rank and self.rope_head_dim:  # W^Q's RoPE rows, still needed apart
                dr = self.rope_head_dim
                aw.w_qr = self.wq.weight.view(h, dh + dr, -1)[:, dh:].reshape(h * dr, -1)
                if self.wq.bias is not None:
                    aw.b_qr = self.wq.bias.view(h, dh + dr)[:, dh:].reshape(-1)
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
        self, x: torch.Tensor, step: Step, aw: AbsorbedWeights
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x (B, T, d) -> q~ = q^C W~^UK (B, h, T, d_c) (Step 1) and q^R (B, h, T, d_h^R) or None."""
        B, T, _ = x.shape
        c_q = self.query_input(x)
        if aw.w_q is None:
            q_nope, q_rope = self.query_from(c_q, step)
            return torch.einsum("bhtp,hpc->bhtc", q_nope, aw.w_uk), q_rope
        q_lat = c_q @ aw.w_q
        if aw.b_q is not None:
            q_lat = q_lat + aw.b_q
        q_lat = q_lat.view(B, T, self.n_head, -1).transpose(1, 2)
        q_rope = None
        if self.rope_head_dim:
            h, dr = self.n_head, self.rope_head_dim
            if self.q_lora_rank:
                q_rope = self.w_qr(c_q).view(B, T, h, dr)
            else:  # only the RoPE rows of W^Q
                q_rope = F.linear(c_q, aw.w_qr, aw.b_qr).view(B, T, h, dr)
            q_rope = apply_rope(q_rope.transpose(1, 2), *self.cos_sin(step, x.dtype))
        return q_lat, q_rope

    def absorbed_output(self, z: torch.Tensor, x: torch.Tensor, aw: AbsorbedWeights) -> torch.Tensor:
        """z (B, h, T, d_c) -> layer output (B, T, d): o_i = z_i W~^UV_i (Step 3), then gate and W^O."""
        B, H, T, Dc = z.shape
        if aw.w_ov is not None:
            out = z.transpose(1, 2).reshape(B, T, H * Dc) @ aw.w_ov
            return out + aw.b_ov if aw.b_ov is not None else out
        o = torch.einsum("bhtc,hcp->bhtp", z, aw.w_uv)
        if aw.b_uv is not None:
            o = o + aw.b_uv.view(H, 1, -1)
        return self.output(o, x)

    # --- routes ----------------------------------------------------------------------------------
    def prefers_absorbed(self, n_new: int, end: int) -> bool:
        """Absorbed costs ~T h S (2 d_c + d_R) multiply-adds, expand ~S d_c 2 h d_h + T h S (2 d_h + d_R):
        absorption wins while T (d_c - d_h) < d_c d_h. Also require a long cached context relative to T: a first
        prefill (T = S) expands, as large GEMMs plus SDPA's causal kernel, without (h T, S) RoPE scores."""
        dc, dh = self.kv_lora_rank, self.head_dim
        cheaper = dc <= dh or n_new * (dc - dh) < dc * dh
        return cheaper and n_new * self.absorb_ratio <= end

    def forward(
        self, x: torch.Tensor, step: Step, cache: dict[str, torch.Tensor] | None = None
    ) -> torch.Tensor:
        mode = step.mode
        if cache is not None:
            naive_cache = "k" in cache
            if naive_cache and mode == "auto":
                mode = "naive"  # a materialised K/V cache has one route
            if naive_cache != (mode == "naive"):
                raise CacheError(
                    f"mode={mode!r} needs "
                    + (
                        "model.new_cache(..., naive=True)"
                        if mode == "naive"
                        else "the compact cache (model.new_cache(..., naive=False))"
                    )
                )
            if mode == "absorbed" or (mode == "auto" and self.prefers_absorbed(step.n_new, step.end)):
                return self.forward_absorbed(x, step, cache)
        q_nope, q_rope = self.query(x, step)
        lat = self.latents(x, step)
        if mode == "naive" and cache is not None:
            k, v = self.expanded_kv(lat)
            k, v = self.write(cache, "k", k, step), self.write(cache, "v", v, step)
            q = torch.cat([q_nope, q_rope], dim=-1) if q_rope is not None else q_nope
            return self.output(attend_padded(q, k, v, step, self.scale), x)
        if cache is not None:  # expand: the whole cached latent back to per-head keys and values
            lat = {n: self.write(cache, n, t, step) for n, t in lat.items()}
        k_nope, v = self.up_project(lat)
        o = attend_split(q_nope, q_rope, k_nope, lat.get("k_rope"), v, step, self.scale)
        return self.output(o, x)

    def forward_absorbed(self, x: torch.Tensor, step: Step, cache: dict[str, torch.Tensor]) -> torch.Tensor:
        """Write the new latents, then attend in latent space (mlra.md Sec. 2.1 Steps 1-3)."""
        aw = self.absorbed_weights()
        q_lat, q_rope = self.absorb_query(x, step, aw)
        lat = {n: self.write(cache, n, t, step) for n, t in self.latents(x, step).items()}
        c_k, c_v = self.latent_kv(lat)
        z = latent_attention(q_lat, q_rope, c_k, lat.get("k_rope"), c_v, step, self.scale)
        return self.absorbed_output(z, x, aw)


# attend_split adds the RoPE scores as a float mask while that (B, h, T, S) tensor stays this small
_BIAS_ELEMENTS = 1 << 22


def attend_split(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor | None,
    k_nope: torch.Tensor,
    k_rope: torch.Tensor | None,
    v: torch.Tensor,
    step: Step,
    scale: float,
) -> torch.Tensor:
    """Attention with per-head keys [k^C_i; k^R] whose RoPE part k^R is one vector shared by all heads (Eq. 44).

    q_nope (B, h, T, d_h), q_rope (B, h, T, d_R) or None, k_nope (B, h, S, d_h) (any strides), k_rope (B, S, d_R)
    (or (B, n_R, S, d_R), shared within groups of h / n_R heads), v (B, h, S, d_h). For decode-sized calls the shared RoPE key is never broadcast into h copies: its scores
    scale q^R k^R^T come from one (B, h T, d_R) x (B, d_R, S) matmul and enter SDPA as an additive mask, while
    the d_h-wide nope part runs in SDPA's fused kernel (5x faster than concatenating K on CPU). Long prefills
    and training (where SDPA with a float mask falls back to its math kernels) concatenate instead.
    """
    if q_rope is None:
        return attend(q_nope, k_nope, v, step, scale)
    B, H, T, _ = q_nope.shape
    S = k_nope.shape[2]
    if T == 1 or (B * H * T * S <= _BIAS_ELEMENTS and not torch.is_grad_enabled()):
        bias = rope_scores(q_rope, k_rope).mul_(scale).view(B, H, T, S)
        mask = step.visible(T, S, q_nope.device)
        if mask is not None:
            bias = bias.masked_fill(~mask, float("-inf"))
        return F.scaled_dot_product_attention(q_nope, k_nope, v, attn_mask=bias, scale=scale)
    k = torch.cat([k_nope, rope_keys_per_head(k_rope, H)], dim=-1)
    return attend_padded(torch.cat([q_nope, q_rope], dim=-1), k, v, step, scale)


def attend_padded(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: Step, scale: float
) -> torch.Tensor:
    """``attend`` for values narrower than queries (d_h vs d_h + d_h^R): zero-pad v to the query width so SDPA's
    fused kernels (O(T) memory, no (T, S) score matrix) run, then drop the padding. Float64 (exact tests) and
    single-query decode keep the plain math path, where padding buys nothing."""
    dv = v.shape[-1]
    if q.shape[-1] == dv or q.dtype == torch.float64 or q.shape[2] == 1:
        return attend(q, k, v, step, scale)
    v = F.pad(v, (0, q.shape[-1] - dv))
    return attend(q, k, v, step, scale)[..., :dv]
