"""The CPU decode kernel and the packed weight products as ``torch.library`` custom operators, for compiled
decode steps.

Eager calls go straight to the extension (``kvlm.kernels``: no dispatcher in between). Under ``torch.compile``
the extension's pybind function would break the graph, and the kernels' host-side work (the call and FLOP
counters, the thread count that sets the splits) would be traced and guarded on; ``kvlm::decode_attention``
does that work inside, opaque to the compiler, with a fake implementation that gives the output's shape.

``kvlm::packed_linear`` does the same for decode's weight products: the few-row kernel's (``kvlm.kernels.few_rows``)
and those on weights packed for decode (``kvlm.attention.linear``: the GEMM libraries' layouts), which the
compiler can neither lower nor take as graph inputs (a packed copy is no parameter). The graph holds the plain weights; the operator looks up the packed
copy made of them (``register_packed``) when it runs, and takes the plain product where there is none or it is
stale, so the graph needs no guard on packing and a repack recompiles nothing.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

from kvlm.kernels.cpu import extension
from kvlm.kernels.few_rows import few_rows_linear
from kvlm.kernels.shared import CALLS, count_flops, split_count, visible_keys

# Defined with torch.library's low-level API (a schema, a Python kernel, a fake), not ``torch.library.custom_op``:
# a call then costs ~3 us of dispatch instead of ~10 (custom_op's Python wrapper), which a compiled decode step
# pays ~30 times a step (measured, 2 threads). Neither has a backward: they run only with gradients off.
_LIB = torch.library.Library("kvlm", "DEF")
_LIB.define(
    "decode_attention(Tensor q, Tensor? q_rope, Tensor k_pool, Tensor? k_scale, Tensor v_pool, Tensor? v_scale, "
    "Tensor? kr_pool, Tensor block_table, Tensor start, Tensor end, int page_size, int n_new, float scale, "
    "int items, int? longest, str name, int flops_per_key) -> Tensor"
)
_LIB.define("packed_linear(Tensor x, Tensor[] weights, Tensor?[] biases) -> Tensor")


def _decode_attention(q, q_rope, k_pool, k_scale, v_pool, v_scale, kr_pool, block_table, start, end, page_size,
                      n_new, scale, items, longest, name, flops_per_key):  # fmt: skip
    CALLS[name] += 1
    count_flops("attention", flops_per_key * visible_keys(start, end))
    return extension().decode_attention(
        q, q_rope, k_pool, k_scale, v_pool, v_scale, kr_pool, block_table, start, end, page_size, n_new, scale,
        split_count(items, longest, start, end),
    )  # fmt: skip


_LIB.impl("decode_attention", _decode_attention, "CompositeExplicitAutograd")


@torch.library.register_fake("kvlm::decode_attention", lib=_LIB)
def _(q, q_rope, k_pool, k_scale, v_pool, v_scale, kr_pool, block_table, start, end, page_size, n_new, scale,
      items, longest, name, flops_per_key):  # fmt: skip
    return q.new_empty((*q.shape[:-1], v_pool.shape[-1]))


decode_attention = torch.ops.kvlm.decode_attention.default

# the owners of packed copies (a Linear, a PackedGroup), by the data pointers of the weights they were made of
_PACKED: dict[tuple[int, ...], weakref.ref] = {}


def register_packed(weights: list[torch.Tensor], owner) -> None:
    """``owner.packed_outputs(weights, x)`` serves products of x with ``weights`` (concatenated on the last axis),
    or returns None (stale, other rows). Held by weak reference: an owner dropped, its entry serves nothing."""
    for key in [k for k, ref in _PACKED.items() if ref() is None]:
        del _PACKED[key]
    _PACKED[tuple(w.data_ptr() for w in weights)] = weakref.ref(owner)


def _packed_linear(
    x: torch.Tensor, weights: list[torch.Tensor], biases: list[torch.Tensor | None]
) -> torch.Tensor:
    """[x W_1^T + b_1, ..., x W_n^T + b_n] (concatenated on the last axis) as the eager step computes it: by the
    few-row kernel up to 8 rows, else through the packed copy registered for these weights, else by the kernel
    up to ``MAX_ROWS`` rows, else through F.linear (the same values to float32 rounding); a copy in the few-row kernel's
    panels goes first, as in the eager step. Its FLOPs are counted by the formula registered for it."""
    ref = _PACKED.get(tuple(w.data_ptr() for w in weights))
    owner = ref() if ref is not None else None
    first = owner is not None and owner.packed_first()
    y = owner.packed_outputs(weights, x, count=False) if first else None
    if y is None:
        y = few_rows_linear(x, weights, biases, count=False)
    if y is not None:
        return y
    y = owner.packed_outputs(weights, x, count=False) if owner is not None and not first else None
    if y is None:  # 9 to MAX_ROWS rows that no packed copy serves
        y = few_rows_linear(x, weights, biases, count=False, first=False)
    if y is None:
        ys = [F.linear(x, w, b) for w, b in zip(weights, biases)]
        y = ys[0] if len(ys) == 1 else torch.cat(ys, dim=-1)
    return y


_LIB.impl("packed_linear", _packed_linear, "CompositeExplicitAutograd")


@torch.library.register_fake("kvlm::packed_linear", lib=_LIB)
def _(x, weights, biases):
    return x.new_empty((*x.shape[:-1], sum(w.shape[0] for w in weights)))


packed_linear = torch.ops.kvlm.packed_linear.default
