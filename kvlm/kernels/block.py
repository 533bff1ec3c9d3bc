"""The decoder block in one call of the extension at T new tokens a sequence (csrc/decode_block.h): RMSNorm,
the few-row weight products, RoPE, the new tokens' cache writes, attention over the cache, the residuals and
SwiGLU, for up to ``FEW_ROWS`` rows (B T; ``MAX_ROWS`` where no weight of the block is packed in a library's
layout: ``BlockCall.wide``) in float32 on an AVX-512 or AVX2 + FMA CPU (on AVX2 without panels).

``gqa_block_call`` / ``mla_block_call`` check the block's weights once and return the call a decode step makes
(``call(x, rope, views...)``, a ``BlockCall``), which checks only what changes from step to step (the input, the
RoPE tables, the cache's views, autograd, torch.compile, kernels switched off); a caller that keeps the call must
drop it when the weights change (``kvlm.model.Block.kept_plan`` does, through ``kvlm.attention.watch.Bound``).
``block_stack`` takes the calls of all of a model's blocks and runs them in one call of the extension
(csrc/decode_stack.h). Each part returns None where it does not apply; the caller then runs the blocks one by
one, or their operators one by one, which compute the same. The extension checks every tensor again
(``check_block_call``) before it writes anything."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

import kvlm.kernels.cpu as cpu  # cpu.extension() looked up at each call, as in kvlm.kernels
import kvlm.kernels.few_rows as few_rows  # FEW_ROWS / MAX_ROWS read at each call (tests turn them off)
from kvlm.kernels.shared import CALLS, LINEAR_CALLS, count_flops
from kvlm.kernels.views import _check_pool, _check_rope, _keys, _same_pages, _splits, _too_short

if TYPE_CHECKING:
    from kvlm.cache.layer import BlockView

Rope = tuple[torch.Tensor, torch.Tensor]


def _extension_for(name: str, x: torch.Tensor, rope: Rope, a: BlockView, wide: bool):
    """The extension when its block kernel ``name`` takes x (B, T, d), the RoPE tables and the cache view ``a``
    now: a built extension with the kernel, no autograd, not traced, x a contiguous float32 CPU tensor of T new
    tokens for B sequences, B T at most ``FEW_ROWS`` (its products' rows; ``MAX_ROWS`` when ``wide``), the tables
    plain contiguous float32 CPU tensors, and each sequence's last T slots its new tokens (not a paged row
    left-padded to T: the kernel writes them, and that padding is never stored); else None."""
    ext = cpu.extension()
    if ext is None or not hasattr(ext, name) or torch.is_grad_enabled() or torch.compiler.is_compiling():
        return None
    if type(x) is not torch.Tensor or not few_rows._plain(x) or x.dim() != 3:
        return None
    most = few_rows.MAX_ROWS if wide else few_rows.FEW_ROWS
    if not 0 < x.shape[0] * x.shape[1] <= most or not (few_rows._plain(rope[0]) and few_rows._plain(rope[1])):
        return None
    if x.shape[1] > 1 and (a.padded or _too_short(a, x.shape[1])):
        return None
    return ext


def _count_products(panels: list) -> None:
    """A block kernel's weight products in the few-row kernel's call counters: on panels or the plain weights."""
    for p in panels:
        LINEAR_CALLS["panels" if p is not None else "few_rows"] += 1


class BlockCall:
    """One decoder block's kernel call with its weights checked (``gqa_block_call``, ``mla_block_call``):
    ``call(x, rope, a, b)`` for a step's input, RoPE tables and the layer's two cache views, or None where the
    step does not apply. ``weights``: the extension's arguments before the RoPE tables (x excluded); ``after``:
    those between the page table's ends and the split count; ``panels`` last."""

    kind = ""  # "gqa" or "mla": the extension's {kind}_block and BlockStack.add_{kind}
    # up to MAX_ROWS rows, not only FEW_ROWS: set by the block (``kvlm.model.Block.one_call_plan``) where none of
    # its weights is packed in a library's layout, which its modules would run from 9 rows instead
    # (``kvlm.attention.linear.library_packed``); there the modules run the few-row kernel too, on the panels
    # or the plain weights, as the block does
    wide = False

    def __init__(self, weights: tuple, after: tuple, panels: list, weight_elements: int):
        self.weights, self.after, self.panels, self.weight_elements = weights, after, panels, weight_elements

    def check(self, x: torch.Tensor, rope: Rope, a: BlockView, b: BlockView) -> int | None:
        """The split count of the key axis for this step, or None where it does not apply."""
        raise NotImplementedError

    def count(self, x: torch.Tensor, a: BlockView) -> None:
        """The call in the kernel counters (calls, products, FLOPs)."""
        raise NotImplementedError

    def __call__(self, x: torch.Tensor, rope: Rope, a: BlockView, b: BlockView) -> torch.Tensor | None:
        n_split = self.check(x, rope, a, b)
        if n_split is None:
            return None
        self.count(x, a)
        return getattr(cpu.extension(), f"{self.kind}_block")(
            x, *self.weights, *rope, a.pool, b.pool, a.block_table, a.start, a.end, *self.after, n_split, self.panels
        )


class _GqaCall(BlockCall):
    kind = "gqa"

    def __init__(self, weights: tuple, after: tuple, panels: list, weight_elements: int):
        super().__init__(weights, after, panels, weight_elements)
        self.n_head = after[0]

    def check(self, x, rope, k, v):
        if _extension_for("gqa_block", x, rope, k, self.wide) is None or k.scale is not None or v.scale is not None:
            return None
        if k.pool.dtype is not torch.float32 or v.pool.dtype is not torch.float32:
            return None
        if _check_pool(x, k, "k") or _check_pool(x, v, "v") or k.pool.dim() != 4 or k.pool.shape != v.pool.shape:
            return None
        B, D = x.shape[0], k.pool.shape[-1]
        if not _same_pages(k, v) or rope[0].numel() != B * x.shape[1] * D or D > 512:  # RoPE's buffer
            return None
        return _splits(B * k.pool.shape[1], k)

    def count(self, x, k):
        CALLS["gqa_block"] += 1  # one call, its attention gqa_decode's kernel
        _count_products(self.panels)
        T = x.shape[1]  # T queries a sequence over its keys, as kvlm.kernels.gqa_decode counts them
        count_flops("attention", 2 * self.n_head * T * 2 * k.pool.shape[-1] * _keys(k))
        count_flops("linear", 2 * x.shape[0] * T * self.weight_elements)


class _MlaCall(BlockCall):
    kind = "mla"

    def __init__(self, weights: tuple, after: tuple, panels: list, weight_elements: int):
        super().__init__(weights, after, panels, weight_elements)
        w_uk = weights[8]
        self.n_head, self.d_c = w_uk.shape[0], w_uk.shape[2]
        # W^Q and W^DKV run as one product on the plain weights
        self.counted = panels[1:] if panels[0] is None and panels[1] is None else panels

    def check(self, x, rope, c_kv, k_rope):
        if _extension_for("mla_block", x, rope, c_kv, self.wide) is None or k_rope.pool.shape[-1] > 512:  # RoPE's buffer
            return None
        for view in (c_kv, k_rope):
            if view.scale is not None or view.pool.dtype is not torch.float32 or view.pool.dim() != 3:
                return None
        if _check_pool(x, c_kv, "c_kv") or _check_rope(x, k_rope, c_kv, "c_kv"):
            return None
        return _splits(x.shape[0], c_kv)

    def count(self, x, c_kv):
        CALLS["mla_block"] += 1  # one call, its attention latent_decode's kernel
        _count_products(self.counted)
        LINEAR_CALLS["head_products"] += 2
        d_r, T = self.weights[4].shape[0] - self.d_c, x.shape[1]  # W^DKV's rows: d_c + d_R
        count_flops("attention", 2 * self.n_head * T * (2 * self.d_c + d_r) * _keys(c_kv))
        count_flops("linear", 2 * x.shape[0] * T * self.weight_elements)


def gqa_block_call(
    norms: tuple[torch.Tensor, torch.Tensor, float],
    w_qkv: list[torch.Tensor],
    w_o: torch.Tensor,
    mlp: tuple[list[torch.Tensor], torch.Tensor],
    n_head: int,
    scale: float,
    panels: list[torch.Tensor | None] | None = None,
) -> BlockCall | None:
    """One pre-norm MHA / GQA / MQA decoder block with a SwiGLU MLP at T new tokens a sequence, in one call of
    the extension (csrc/decode_block.h): x (B, T, d) -> x1 + MLP(RMSNorm(x1)), x1 = x + attention(RMSNorm(x)),
    the new tokens' K and V written into the pools at their slots first (each sequence's last T, where the
    attention kernel reads them; causal among them).
    norms: (attention norm weight, MLP norm weight, eps); w_qkv [W^Q, W^K, W^V]; mlp ([W_1, W_2], W_O); panels:
    of the 4 products ([W^Q; W^K; W^V], W^O, [W_1; W_2], W_O of the MLP), each the weights' panels
    (``few_rows.pack_panels``) or None (the plain weights).

    Returns the step's call ``call(x, rope, k, v)`` (rope: the whole-width tables (B, 1, T, D) of
    ``Step.cos_sin``; k, v the layer's views: float32 pools, one page table), or None (kernels unavailable,
    weights that are not plain contiguous float32 CPU tensors). The call returns None where the step does not
    apply: more B T rows than ``_extension_for`` allows, a paged row left-padded to T, another dtype or device,
    tensor subclasses, autograd on, quantized or bf16 pools, kernels off, under torch.compile; the caller then runs the block's operators one by one, which
    compute the same."""
    w_up, w_down = mlp
    weights = (*w_qkv, w_o, *w_up, w_down)
    if not cpu.has("gqa_block") or not all(few_rows._plain(t) for t in (*weights, norms[0], norms[1])):
        return None
    panels = list(panels) if panels is not None else [None] * 4
    return _GqaCall(
        (norms[0], norms[1], norms[2], list(w_qkv), w_o, list(w_up), w_down), (n_head, scale), panels,
        sum(w.numel() for w in weights),
    )  # fmt: skip


def mla_block_call(
    norms: tuple[torch.Tensor, torch.Tensor, float],
    w_q: torch.Tensor,
    w_kv_a: torch.Tensor,
    latent_norm: tuple[torch.Tensor | None, float, float],
    absorbed: tuple[torch.Tensor, torch.Tensor],
    w_o: torch.Tensor,
    mlp: tuple[list[torch.Tensor], torch.Tensor],
    scale: float,
    panels: list[torch.Tensor | None] | None = None,
) -> BlockCall | None:
    """``gqa_block_call`` for MLA's absorbed route (csrc/decode_block.h): W^Q and W^DKV, RoPE, c_kv = alpha
    RMSNorm(c) into the cache with k^R, q^C W~^UK, attention over the latent, z W~^UV, W^O, then the residual
    and SwiGLU half. latent_norm: (kv_norm weight or None, its eps, alpha_kv); absorbed: (W~^UK (h, d_h, d_c),
    W~^UV (h, d_c, d_h)); panels: of its 5 products (W^Q, W^DKV, W^O, [W_1; W_2], W_O of the MLP). Returns
    ``call(x, rope, c_kv, k_rope)``, or None (as ``gqa_block_call``, and head widths not multiples of 16)."""
    (w_up, w_down), (w_uk, w_uv), (kv_norm, kv_eps, alpha) = mlp, absorbed, latent_norm
    weights = (w_q, w_kv_a, w_uk, w_uv, w_o, *w_up, w_down)
    tensors = (*weights, norms[0], norms[1], *(() if kv_norm is None else (kv_norm,)))
    if not cpu.has("mla_block") or not all(few_rows._plain(t) for t in tensors):
        return None
    if w_uk.shape[1] % 16 or w_uk.shape[2] % 16:  # the head products' widths
        return None
    panels = list(panels) if panels is not None else [None] * 5
    return _MlaCall(
        (norms[0], norms[1], norms[2], w_q, w_kv_a, kv_norm, kv_eps, alpha, w_uk, w_uv, w_o, list(w_up), w_down),
        (scale,), panels, sum(w.numel() for w in weights),
    )  # fmt: skip


def _same_table(view: BlockView, first: BlockView) -> bool:
    """Whether ``view`` reads the page table, starts and ends of ``first`` (one model cache's layers share them,
    ``StepSlots``), unquantized, at its page size."""
    return (
        view.block_table is first.block_table and view.start is first.start and view.end is first.end
        and view.scale is None and view.page_size == first.page_size
    )  # fmt: skip


def _like(view: BlockView, first: BlockView) -> bool:
    """Whether ``view``'s pool is read as ``first``'s is: of the same dtype, shape, strides and device."""
    p, q = view.pool, first.pool
    return p.dtype is q.dtype and p.shape == q.shape and p.stride() == q.stride() and p.device == q.device


class StackCall:
    """A model's blocks in one call of the extension (``block_stack``): ``call(x, inputs)``, inputs the (rope, a,
    b) of every layer, or None where the step does not apply; then each block runs on its own."""

    def __init__(self, calls: Sequence[BlockCall], stack):
        self.calls, self.stack = tuple(calls), stack
        self.wide = all(c.wide for c in self.calls)  # the first layer's rows are checked as every layer's
        self.pools: tuple = ()  # the last step's pools, each checked as the first layer's (``_like``) then

    def __call__(self, x: torch.Tensor, inputs: Sequence[tuple[Rope, BlockView, BlockView]]) -> torch.Tensor | None:
        if len(inputs) != len(self.calls):
            return None
        rope, a0, b0 = inputs[0]
        n_split = self.calls[0].check(x, rope, a0, b0)  # the first layer in full, the others as it
        if n_split is None or (not self.wide and x.shape[0] * x.shape[1] > few_rows.FEW_ROWS):
            return None
        pools = tuple(v.pool for _, a, b in inputs for v in (a, b))
        same = len(pools) == len(self.pools) and all(p is q for p, q in zip(pools, self.pools))
        for r, a, b in inputs[1:]:
            if r is not rope or not (_same_table(a, a0) and _same_table(b, b0)):
                return None
            if not same and not (_like(a, a0) and _like(b, b0)):
                return None
        self.pools = pools
        for call, (_, a, _) in zip(self.calls, inputs):
            call.count(x, a)
        CALLS["block_stack"] += 1
        return self.stack.run(x, *rope, pools[0::2], pools[1::2], a0.block_table, a0.start, a0.end, n_split)


def block_stack(calls: Sequence[BlockCall]) -> StackCall | None:
    """The blocks of ``calls`` (one per layer, in order, each of ``gqa_block_call`` / ``mla_block_call``) in one
    call of the extension (csrc/decode_stack.h), their weights held there; None without the extension's stack
    or without calls."""
    if not calls or not cpu.has("BlockStack"):
        return None
    stack = cpu.extension().BlockStack()
    for call in calls:
        getattr(stack, f"add_{call.kind}")(*call.weights, *call.after, call.panels)
    return StackCall(calls, stack)
