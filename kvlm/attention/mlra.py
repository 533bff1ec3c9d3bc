"""GLA-2/4 (Zadouri et al.; mlra.md Sec. 2.2, App. C.6) and MLRA-2/4 (mlra.md Sec. 3): latent-block attention.

The latent family's base (kvlm/attention/latent.py) holds the parameters, the query path (App. C.3: optional
low-rank query d'_c with RMSNorm and alpha_q, decoupled RoPE query of d_h^R per head), the latent path, the
routes and the "auto" rule. All four cache what MLA caches, d_c + d_h^R per token per layer: the KV latent, split
into ``n_blocks`` blocks c_kv (n_blocks, d_c / n_blocks), each with its own RMSNorm (kv_norm's rows), and one RoPE
key k_rope shared by every head and block. They differ in which heads a block serves and how outputs combine:

    name    blocks  heads per block r   block b serves        output of head i
    gla-g   g       h / g               head group b          one softmax over its block         (App. C.6)
    mlra-4  4       h                   all heads             sum of 4 branch softmaxes          (Eq. 5)
    mlra-2  4       h / 2               head group b // 2     sum of 2 branch softmaxes          (Eq. 6)

A (block, head) pair is a *unit*: unit u = b * r + j is head (b // bpg) * r + j (bpg = blocks per head group)
attending over block b; each unit is an MLA head over a latent of d_c / n_blocks, and the output of head i sums
the units of its group (times alpha_attn = 1/sqrt(bpg), Eq. 10, under attn_out_scaling).

Up-projections: wkv_b is one bias-free linear map per block, weight (n_blocks, r 2 d_h, d_lat), the rows of unit
(b, j) [W^UK_(b),(i) (d_h rows); W^UV_(b),(i)^T (d_h rows)]. The absorbed route multiplies by views of that
parameter (``up_weights``): there is no derived weight to prepare, nor one that can go stale.

Routes: "expand" re-expands the cached latent into per-unit K/V and runs SDPA (prefill, training); "absorbed" folds
W^UK into the query and W^UV after attention, so attention runs MQA-style over each block's latent (mlra.md
Sec. 2.1 Steps 1-3, per block, ``split_score_attention``; at decode the fused kernel
``kvlm.kernels.latent_block_decode`` instead, its group axis the blocks, reading the contiguous or paged / int8
cache in place); "naive" caches the materialised per-unit K/V; "auto"
follows the family's rule (``LatentAttention.prefers_absorbed``).
"""

from __future__ import annotations

import torch

from kvlm import kernels
from kvlm.attention import register
from kvlm.attention.base import Step, require
from kvlm.attention.latent import LatentAttention
from kvlm.attention.latent_ops import split_score_attention
from kvlm.config import ModelConfig


class LatentBlockAttention(LatentAttention):
    """The shared latent-block mechanism; subclasses fix the head groups and blocks per group."""

    block_layout = True

    # --- configuration ----------------------------------------------------------------------
    @classmethod
    def check_config(cls, cfg: ModelConfig) -> None:
        nb = cls._blocks(cfg)
        require(
            cfg.kv_lora_rank > 0 and cfg.kv_lora_rank % nb == 0,
            f"{cfg.attention} splits kv_lora_rank (d_c) into {nb} latent blocks: "
            f"kv_lora_rank={cfg.kv_lora_rank} must be a positive multiple of {nb}",
        )
        require(
            cfg.n_head % cls.n_groups == 0,
            f"{cfg.attention} splits the heads into {cls.n_groups} groups: "
            f"n_head={cfg.n_head} is not divisible by {cls.n_groups}",
        )
        require(
            cfg.kv_latent == "joint",
            f"{cfg.attention} up-projects keys and values from one latent: kv_latent must be 'joint', "
            f"got {cfg.kv_latent!r}",
        )

    @classmethod
    def spec_for(cls, cfg, layer_idx=0, naive=False):
        nb = cls._blocks(cfg)
        if naive:  # materialised per-unit keys and values (h units for GLA, 2h for MLRA-2, 4h for MLRA-4)
            units = cls.blocks_per_group * cfg.n_head
            return {"k": (units, cfg.head_dim + cfg.rope_head_dim), "v": (units, cfg.head_dim)}
        spec = {"c_kv": (nb, cfg.kv_lora_rank // nb)}
        if cfg.rope_head_dim:
            spec["k_rope"] = (cfg.rope_head_dim,)
        return spec

    @classmethod
    def tp_shards(cls, cfg):
        # each block's heads live on the device that holds the block: only k_rope is loaded by every device
        return {"c_kv": "blocks", "k_rope": "replicated"}

    @classmethod
    def tp_max_degree(cls, cfg):
        return cls._blocks(cfg)

    # --- the absorbed route ----------------------------------------------------------------------
    def units_of(self, t: torch.Tensor) -> torch.Tensor:
        """Per-head (B, h, T, D) -> per-unit (B, n_blocks, r, T, D)."""
        B, _, T, D = t.shape
        t = t.view(B, self.G, 1, self.r, T, D).expand(B, self.G, self.bpg, self.r, T, D)
        return t.reshape(B, self.n_blocks, self.r, T, D)

    def forward_absorbed(self, x: torch.Tensor, step: Step, cache, cs) -> torch.Tensor:
        """Attention per unit without materialising K/V (Sec. 2.1 Steps 1-3, block by block)."""
        q_nope, q_rope = self.query(x, cs)
        lat = self.latents(x, cs)
        B, _, T, _ = q_nope.shape
        w_uk, w_uv = self.up_weights()  # (n_blocks, r, d_h, d_lat) views of wkv_b
        # Step 1: q~_(b),i = Q^NoPE_i (W^UK_(b),i)^T, one latent-space query per unit
        q_lat = torch.einsum("bnrtp,nrpl->bnrtl", self.units_of(q_nope), w_uk)
        # Step 2: MQA-style attention of the r units of block b over [c_b, k_rope]
        z = self.attend_kernel(q_lat, q_rope, lat, step, cache)
        if z is None:  # the plain path: the RoPE logits computed once per head, shared by its bpg branches
            lat = self.write_latents(lat, step, cache)
            z = split_score_attention(
                q_lat, lat["c_kv"], lat["c_kv"], q_rope, lat.get("k_rope"), step, self.scale
            )
        # Step 3: O_(b),i = Z_(b),i W^UV_(b),i
        o = torch.einsum("bnrtl,nrpl->bnrtp", z, w_uv).reshape(B, self.n_units, T, -1)
        return self.output(self.combine(o), x)

    def attend_kernel(self, q_lat, q_rope, lat, step: Step, cache) -> torch.Tensor | None:
        """Step 2 through the fused decode kernel (kvlm.kernels.latent_block_decode) over the cache in place: the
        contiguous buffer or the pages of a paged / int8 cache, no gather. Stores the new latents when it runs;
        None (nothing stored) when no kernel applies, e.g. prefill-sized calls or autograd."""
        if cache is None or not kernels.ready(q_lat, step.n_new, latent=True):
            return None
        for name, t in lat.items():
            cache.store(name, t, step)
        view = {name: cache.block_view(name, step) for name in lat}
        # per unit: the kernel scores each (block, head) row against k_rope on its own (d_R more multiply-adds
        # per unit and key than sharing a head's RoPE logits across its branches, against no gathered copy)
        qr_units = self.units_of(q_rope) if q_rope is not None else None
        z = kernels.latent_block_decode(
            q_lat, qr_units, view["c_kv"], view.get("k_rope"), step.n_new, self.scale
        )
        if z is None:  # declined (e.g. an fp8 pool): the plain path over what was just stored
            c = cache.read("c_kv", step.end)
            k_rope = cache.read("k_rope", step.end) if "k_rope" in lat else None
            return split_score_attention(q_lat, c, c, q_rope, k_rope, step, self.scale)
        return z

    def tp_plan(self, rank: int, world: int) -> dict:
        """By latent block (mlra.md Sec. 3.2-3.4): a rank holds whole blocks of the KV latent with the up-projections
        of the heads they serve, caches only those blocks (plus the shared k_rope), and its partial W^O output sums
        with the other ranks'. MLRA's branches of one head may sit on different ranks: the per-branch outputs are
        linear in W^O, so the all-reduce completes the branch sum of Eqs. 5-6. Beyond one block per rank (degree >
        n_blocks) a block is replicated on world / n_blocks ranks that split its heads. All slices: blocks are
        interleaved with the RoPE rows in wkv_a, and a head's W^O columns may be on several ranks."""
        cfg, name = self.cfg, self.cfg.attention
        bpg, nb, r, d_lat = self.bpg, self.n_blocks, self.r, self.d_lat
        dh, dr, dc = self.head_dim, self.rope_head_dim, cfg.kv_lora_rank
        if world <= nb:
            require(
                nb % world == 0,
                f"{name} has {nb} latent blocks, not divisible by the tensor-parallel degree {world}",
            )
            k = nb // world
            blocks, within = list(range(rank * k, (rank + 1) * k)), list(range(r))  # every head of each block
            require(
                k < bpg or k % bpg == 0,
                f"{name}: {k} blocks per rank would split a head group of {bpg} blocks",
            )
            # whole head groups, or some branches of one head group
            n_groups, bpg_loc = (k // bpg, bpg) if k >= bpg else (1, k)
        else:
            per = world // nb
            require(
                world % nb == 0 and r % per == 0,
                f"{name}: tensor-parallel degree {world} must be a multiple of its {nb} latent blocks "
                f"and split the {r} heads of a block evenly",
            )
            blocks, r_loc = [rank // per], r // per
            within = list(range((rank % per) * r_loc, (rank % per + 1) * r_loc))
            n_groups, bpg_loc = 1, 1
        groups = sorted({b // bpg for b in blocks})
        heads = [g * r + j for g in groups for j in within]  # global heads, in the local head order
        slices = self.tp_output_slices(heads, dh)
        for w in ("wq", "wq_b"):
            slices[f"{w}.weight"] = slices[f"{w}.bias"] = ("rows", dh + dr, heads)
        latent_rows = [b * d_lat + i for b in blocks for i in range(d_lat)] + list(range(dc, dc + dr))
        slices["wkv_a.weight"] = slices["wkv_a.bias"] = ("rows", 1, latent_rows)
        slices["kv_norm.weight"] = ("rows", 1, blocks)
        bl, wi = torch.as_tensor(blocks), torch.as_tensor(within)

        def up_rows(t):  # wkv_b (n_blocks, r 2 d_h, d_lat): the rank's blocks, their heads' rows [W^UK; W^UV]
            t = t.view(nb, r, 2 * dh, d_lat)[bl.to(t.device)][:, wi.to(t.device)]
            return t.reshape(len(blocks), -1, d_lat)

        slices["wkv_b.weight"] = up_rows
        return {
            "config": {"n_head": n_groups * len(within), "kv_lora_rank": len(blocks) * d_lat},
            "slices": slices,
            "class_attrs": {"n_groups": n_groups, "blocks_per_group": bpg_loc},
            # Eq. 10 scales by the full branch count, not the rank's; sqrt(d / d_lat) is unchanged (same d_lat)
            "inherit": ("alpha_attn", "alpha_kv"),
            "holds": {"latent_blocks": blocks, "query_heads": heads, "k_rope": "replicated"},
        }


@register("gla-2")
class GLA2(LatentBlockAttention):
    name = "gla-2"
    n_groups, blocks_per_group = 2, 1


@register("gla-4")
class GLA4(LatentBlockAttention):
    name = "gla-4"
    n_groups, blocks_per_group = 4, 1


@register("mlra-2")
class MLRA2(LatentBlockAttention):
    name = "mlra-2"
    n_groups, blocks_per_group = 2, 2


@register("mlra-4")
class MLRA4(LatentBlockAttention):
    name = "mlra-4"
    n_groups, blocks_per_group = 1, 4
