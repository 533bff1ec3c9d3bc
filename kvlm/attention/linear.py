"""The few-row ``Linear`` of decode, and its packed weights (``PackedGroup`` / ``GroupPacking``).

Decode multiplies a handful of rows (batch x new tokens) by every weight, so it is bound by reading the weights,
and how the product reads them matters more than the arithmetic. In order of preference on CPU float32 without
autograd:

- Up to ``FEW_ROWS`` (8) rows, the few-row kernel (``kvlm.kernels.few_rows``) on the plain weight: no copy, and
  faster than every library path measured (2-4x on AMD EPYC, where MKL streams these shapes at 10-17 GB/s;
  equal to 1.25x on Intel). Groups of Linears that read one input (``GroupPacking``) run as one call.
- A packed copy, made once at decode time (parameters and state dict untouched, dropped by ``train(True)``,
  moves, casts or any write to the weight):
  - ``pack_for_decode(rows)``, rows an int: MKL's packed sgemm layout for products of exactly ``rows`` rows
    (what Inductor's freezing uses for a static batch). Other row counts take the unpacked path.
  - ``pack_for_decode(ANY_ROWS)``: oneDNN's blocked layout, which serves any row count (what Inductor uses for a
    dynamic batch): the serving engine, whose steps have any number of rows. Measured on this project's 2-core
    Intel machine, the reference shape's weights at 1 thread: 8 / 16 / 32 rows 51 / 61 / 101 ms against
    104 / 96 / 149 ms unpacked and 41 / 50 / 89 ms for MKL's layout packed for exactly that count.
  - ``pack_for_decode(PAST_KERNEL)``: oneDNN's layout serving only the products past ``MAX_ROWS`` rows, the few-row
    kernel those up to them: the serving engine where the kernel measured faster at ``MAX_ROWS`` rows
    (``kernel_leads``; on the Zen 3 EPYC decode steps of 12-16 rows 1.74-1.89x faster, benchmarks/serve.md).
  - ``pack_for_decode(PANELS)``: the few-row kernel's panels (``kvlm.kernels.few_rows.pack_panels``: 32 weight
    rows column by column, read as one sequential stream), which serve 1 to ``MAX_ROWS`` rows and go before the
    plain-weight kernel: on this project's AMD EPYC 1.06-1.29x faster than it at 2-8 rows (level at 1), 1.14-1.17x
    faster than oneDNN's layout at 12-16 rows (benchmarks/decode-limit.md).
  ``generate`` packs from batch 2 where the kernel is built (from 4 where it is missing) in whichever of the
  layouts measured fastest on this machine, or not at all where the unpacked product did (``fastest_packing``).
- Up to ``MAX_ROWS`` rows that no packed copy serves (16; 64 where the kernel is its AVX2 micro-kernel), the
  few-row kernel again.
- Unpacked, 4-16 rows run as W x^T, which MKL streams faster than x W^T (the 32000 x 768 LM head at batch 8:
  12.4 ms against 25.6 ms on Intel); others F.linear.

Under ``torch.compile`` the few-row and packed products run as the custom operator ``kvlm::packed_linear``
(``kvlm.kernels.library``): the graph holds the plain weights, and the operator takes the same path as the eager
step when it runs (the compiler can neither lower the libraries' packed products nor take a packed copy as an
input).
"""

from __future__ import annotations

import math
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import register_flop_formula

from kvlm.attention.watch import Watched, hooked, touch
from kvlm.attention.watch import version as _version
from kvlm.kernels.few_rows import (
    FEW_ROWS,
    MAX_ROWS,
    few_rows_available,
    few_rows_fit,
    few_rows_linear,
    pack_panels,
    panel_product,
    panels_available,
)
from kvlm.kernels.library import packed_linear, register_packed

ANY_ROWS = "any"  # pack_for_decode(ANY_ROWS): one layout for products of any number of rows (oneDNN)
# pack_for_decode(PAST_KERNEL): oneDNN's layout for the products past the few-row kernel's MAX_ROWS rows, the kernel
# on the plain weight up to them (the serving engine, where the kernel measured faster at MAX_ROWS: kernel_leads)
PAST_KERNEL = "past_kernel"
PANELS = "panels"  # pack_for_decode(PANELS): the few-row kernel's panels, 1 to MAX_ROWS rows, before the kernel
_ONEDNN_LAYOUTS = (ANY_ROWS, PAST_KERNEL)  # the layouts oneDNN's blocked copy stands behind
_KERNEL_ROWS_KEPT = (PANELS, PAST_KERNEL)  # layouts that leave a block kernel its rows (up to MAX_ROWS)
# rows from which fastest_packing times the panels: at 1 row they streamed level with the kernel on the plain weight
# or up to 1.10x faster and the decode step at batch 1 ran 1.00-1.05x (benchmarks/step_panels.py), not worth a second
# copy of the weights, and a near tie that flipped between processes
PANEL_MIN_ROWS = 2


def packing_available(rows: int | str) -> bool:
    """Whether this torch build has the library behind ``pack_for_decode(rows)``: MKL for a fixed row count,
    oneDNN for ``ANY_ROWS``, the few-row kernel's panels (AVX-512, kernels built) for ``PANELS``."""
    if rows == PANELS:
        return panels_available()
    if rows in _ONEDNN_LAYOUTS:
        return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")


def _check_rows(rows) -> None:
    if rows not in (ANY_ROWS, PANELS, PAST_KERNEL) and (
        not isinstance(rows, int) or isinstance(rows, bool) or rows < 1
    ):
        raise ValueError(f"rows must be an integer >= 1, {ANY_ROWS!r}, {PAST_KERNEL!r} or {PANELS!r}, got {rows!r}")


def _reorder(w: torch.Tensor, rows: int | str) -> torch.Tensor:
    if rows == PANELS:
        return pack_panels(w)
    if rows in _ONEDNN_LAYOUTS:
        return torch.ops.mkldnn._reorder_linear_weight(w, None)
    return torch.ops.mkl._mkl_reorder_linear_weight(w, rows)


def _packed_product(x, packed, shape_weight, bias, rows: int | str, count: bool = True) -> torch.Tensor:
    if rows == PANELS:  # the libraries' products are counted by torch's FLOP counter, the kernel's here
        return panel_product(x, packed, shape_weight.shape[0], bias, count)
    if rows in _ONEDNN_LAYOUTS:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return torch.ops.mkl._mkl_linear(x, packed, shape_weight, bias, rows)


_FASTEST: dict[tuple, int | str | None] = {}  # fastest_packing's answers, by (rows, weight shape, threads)
PACK_GAIN = 1.1  # fastest_packing names a packed layout only when it is at least this much faster than none


def fastest_packing(weight: torch.Tensor, rows: int, rounds: int = 5) -> int | str | None:
    """What to pack for so that products of ``rows`` rows by ``weight`` run fastest on this machine: ``rows``
    (MKL's layout for exactly that count), ``ANY_ROWS`` (oneDNN's blocked layout), ``PANELS`` (the few-row
    kernel's, ``PANEL_MIN_ROWS`` to ``MAX_ROWS`` rows; the only candidate up to ``FEW_ROWS``, where the kernel on
    the plain weight is ahead of the libraries) or None (no copy: the plain
    weight as ``Linear`` takes it unpacked, by the few-row kernel up to ``MAX_ROWS`` rows, by torch's product
    beyond; also where no library is available). The candidates this build and CPU have are timed on ``weight``
    (a decode step passes its LM head, the largest product) in ``rounds`` interleaved rounds, once per process for
    each (rows, shape, threads); a packed layout is named only when its median beats the unpacked one by
    ``PACK_GAIN``. From 9 rows on the winner depends on the CPU: on this project's AMD EPYC oneDNN's
    layout was 1.2-1.3x ahead of the kernel at 12-16 rows and 2.2-2.6x ahead of torch's unpacked product (MKL,
    which keeps off AVX-512 on AMD) at 24-512 rows, MKL's packed layout 2-3x behind (benchmarks/decode-limit.md);
    on Intel MKL's layouts were ahead."""
    key = (rows, tuple(weight.shape), torch.get_num_threads())
    if key not in _FASTEST:
        with torch.no_grad():
            w = weight.detach().contiguous()
            x = torch.randn(rows, w.shape[1], dtype=w.dtype)
            arms: dict = {None: lambda: _unpacked_product(x, w, None, count=False)}
            # up to 8 rows the AVX-512 kernel (it has panels) was ahead of the libraries; the AVX2 one races them
            few = rows <= FEW_ROWS and panels_available()
            for layout in (PANELS,) if few else (rows, ANY_ROWS, PANELS):
                if packing_available(layout) and _applies(layout, rows) and (layout != PANELS or rows >= PANEL_MIN_ROWS):
                    packed = _reorder(w, layout)
                    arms[layout] = lambda packed=packed, layout=layout: _packed_product(
                        x, packed, w, None, layout, count=False
                    )
            median = _race(arms, rounds if len(arms) > 1 else 0)
        best = min(median, key=median.get)
        # a copy of the weights only for a clear gain: near-ties would flip with the machine's noise from one
        # process to the next (and with them the last bits of the products)
        _FASTEST[key] = best if best is None or median[best] * PACK_GAIN <= median[None] else None
    return _FASTEST[key]


def _race(arms: dict, rounds: int) -> dict:
    """The median time of each of ``arms`` (functions of no arguments) over ``rounds`` interleaved rounds (0.0 for
    none)."""
    times: dict = {k: [] for k in arms}
    for _ in range(rounds):
        for k, f in arms.items():
            t0 = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) if v else 0.0 for k, v in times.items()}


def kernel_leads(weight: torch.Tensor, rows: int = MAX_ROWS, rounds: int = 5) -> bool:
    """Whether the few-row kernel on the plain weight computes ``rows``-row products by ``weight`` at least
    ``PACK_GAIN`` times faster than oneDNN's layout (``ANY_ROWS``) on this machine, timed in ``rounds`` interleaved
    rounds (False where either is missing). The serving engine packs ``PAST_KERNEL`` where it does: on this project's Zen 3 EPYC (AVX2) the
    kernel ran the reference shape's weights at 8 / 12 / 16 rows in 13.0 / 14.6 / 16.8 ms against oneDNN's 20.8 /
    24.8 / 27.4 (benchmarks/decode-limit.md); on the AVX-512 EPYC oneDNN was ahead at 12-16 rows."""
    if not 0 < rows <= MAX_ROWS or not packing_available(ANY_ROWS) or not _plain_cpu_float32(weight):
        return False
    with torch.no_grad():
        w = weight.detach().contiguous()
        x = torch.randn(rows, w.shape[1], dtype=w.dtype)
        if few_rows_linear(x, [w], [None], count=False, first=False) is None:
            return False  # no kernel here (not built, disabled, not AVX2 / AVX-512)
        packed = _reorder(w, ANY_ROWS)
        median = _race(
            {
                "kernel": lambda: few_rows_linear(x, [w], [None], count=False, first=False),
                "oneDNN": lambda: _packed_product(x, packed, w, None, ANY_ROWS, count=False),
            },
            rounds,
        )
    # a clear lead only, as fastest_packing asks of a packed layout: a near tie would flip from one process to the
    # next, and with it the last bits of a server's products
    return median["kernel"] * PACK_GAIN <= median["oneDNN"]


def _applies(rows: int | str, n: int) -> bool:
    """Whether weights packed for ``rows`` serve a product of n rows."""
    if rows == PANELS:
        return 1 <= n <= MAX_ROWS
    if rows == PAST_KERNEL:  # up to MAX_ROWS the few-row kernel (oneDNN's copy where it is missing)
        return n > MAX_ROWS or (n >= Linear.min_rows and not few_rows_available())
    return n >= Linear.min_rows if rows == ANY_ROWS else n == rows


def _plain_cpu_float32(w: torch.Tensor) -> bool:
    """A plain float32 CPU tensor (not a tensor-parallel shard's DTensor, not float64: the reference path)."""
    return type(w.data) is torch.Tensor and w.device.type == "cpu" and w.dtype == torch.float32


class Linear(Watched, nn.Linear):
    """nn.Linear whose few-row products (decode) run on packed weights (``pack_for_decode``) or as W x^T (see
    the module docstring). Same parameters and state dict as nn.Linear."""

    small_rows = 16
    min_rows = 4  # fewer rows: F.linear (benchmarks/decode_limit.py, "GEMMs alone")
    _packed: tuple | None = None  # ((data_ptr, version, rows), packed weight)

    def pack_for_decode(self, rows: int | str) -> bool:
        """Reorder the weight once into the packed layout for products of ``rows`` rows (an int: MKL, exactly
        that count; ``ANY_ROWS``: oneDNN, any count). float32 CPU weights with the library only (returns False
        otherwise)."""
        _check_rows(rows)
        w = self.weight
        if not _plain_cpu_float32(w) or not packing_available(rows):
            self._packed = None
            return False
        key = (w.data_ptr(), _version(w), rows)
        if self._packed is None or self._packed[0] != key:
            with torch.no_grad():
                self._packed = (key, _reorder(w.detach(), rows))
            register_packed([w], self)  # what a compiled step's kvlm::packed_linear finds
        return True

    def unpack(self) -> None:
        self._packed = None

    def packed_first(self) -> bool:
        """Whether the packed copy goes before the few-row kernel on the plain weight (``PANELS``)."""
        return self._packed is not None and self._packed[0][2] == PANELS

    def first_panels(self) -> tuple[bool, torch.Tensor | None]:
        """For a product in C++ (kvlm.kernels.gqa_block_call): (True, the panels) where they go first, (True, None)
        where the plain weight does, stale panels included (written or copied since packing: ``forward`` then runs
        the few-row kernel on the plain weight too), (False, None) where panels go first with a bias."""
        if not self.packed_first():
            return True, None
        if self.bias is not None:
            return False, None
        w = self.weight
        return True, self._packed[1] if self._packed[0] == (w.data_ptr(), _version(w), PANELS) else None

    def train(self, mode: bool = True):
        if mode:
            self._packed = None
        return super().train(mode)

    def _apply(self, fn, recurse=True):
        self._packed = None
        return super()._apply(fn, recurse)

    def _packed_for(self, x: torch.Tensor, n: int, count: bool = True) -> torch.Tensor | None:
        key, packed = self._packed
        w = self.weight
        rows = key[2]
        if not _applies(rows, n) or key != (w.data_ptr(), _version(w), rows) or x.dtype != torch.float32:
            return None
        if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad):
            return None  # the packed product has no backward through the packed weight
        return _packed_product(x, packed, w, self.bias, rows, count)

    def packed_outputs(self, weights: list[torch.Tensor], x: torch.Tensor, count: bool = True) -> torch.Tensor | None:
        """x W^T + b through the packed copy (``kvlm::packed_linear``, which counts its FLOPs itself: ``count``
        False), or None where it does not serve."""
        if self._packed is None or len(weights) != 1 or weights[0].shape != self.weight.shape:
            return None
        return self._packed_for(x, x.numel() // x.shape[-1] if x.numel() else 0, count)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.numel() else 0
        if x.device.type == "cpu":
            if torch.compiler.is_compiling():
                if not torch.is_grad_enabled() and (self._packed is not None or few_rows_fit(x, first=False)):
                    return packed_linear(x, [self.weight], [self.bias])  # no backward: no grad only
            else:
                first = self.packed_first()
                y = self._packed_for(x, rows) if first else None
                if y is None:
                    y = few_rows_linear(x, [self.weight], [self.bias])
                if y is None and self._packed is not None and not first:
                    y = self._packed_for(x, rows)
                if y is not None:
                    return y
        return _unpacked_product(x, self.weight, self.bias)


def _unpacked_product(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, count: bool = True) -> torch.Tensor:
    """x W^T + b as ``Linear`` computes it without a packed copy: the few-row kernel up to ``MAX_ROWS`` rows (from 9
    rows: those no packed copy serves), else on CPU W x^T at ``min_rows``-``small_rows`` rows, else F.linear."""
    rows = x.numel() // x.shape[-1] if x.numel() else 0
    y = few_rows_linear(x, [w], [bias], count=count, first=False)
    if y is not None:
        return y
    if rows < Linear.min_rows or rows > Linear.small_rows or x.device.type != "cpu":
        return F.linear(x, w, bias)
    y = torch.mm(w, x.reshape(rows, -1).t()).t()
    if bias is not None:
        y = y + bias
    return y.contiguous().view(*x.shape[:-1], w.shape[0])


def _packed_linear_flops(input_shape, packed_shape, weight_shape, *args, out_shape=None, **kwargs) -> int:
    """FLOPs of MKL's packed linear, as of the matmul it replaces (torch's FLOP counter lacks the op)."""
    return 2 * math.prod(input_shape[:-1]) * input_shape[-1] * weight_shape[0]


def _pointwise_linear_flops(input_shape, weight_shape, *args, out_shape=None, **kwargs) -> int:
    """FLOPs of oneDNN's linear on packed weights (out_features x in_features), as of the matmul it replaces."""
    return 2 * math.prod(input_shape[:-1]) * input_shape[-1] * weight_shape[0]


def _register_flops(op, formula) -> None:
    try:
        register_flop_formula(op)(formula)
    except RuntimeError:  # registered already (a reload of this module)
        pass


if hasattr(torch.ops.mkl, "_mkl_linear"):
    _register_flops(torch.ops.mkl._mkl_linear, _packed_linear_flops)
if hasattr(torch.ops.mkldnn, "_linear_pointwise"):
    _register_flops(torch.ops.mkldnn._linear_pointwise, _pointwise_linear_flops)


def _group_linear_flops(input_shape, weights_shape, *args, out_shape=None, **kwargs) -> int:
    """FLOPs of ``kvlm::packed_linear``, as of the matmuls it replaces."""
    return 2 * math.prod(input_shape[:-1]) * input_shape[-1] * sum(s[0] for s in weights_shape)


if hasattr(torch.ops, "kvlm") and hasattr(torch.ops.kvlm, "packed_linear"):
    _register_flops(torch.ops.kvlm.packed_linear, _group_linear_flops)


def library_packed(modules) -> bool:
    """Whether any of ``modules`` holds a packed copy in a library's layout (MKL's for its rows, oneDNN's for any):
    its products at 9 to ``MAX_ROWS`` rows run on that copy, which ``generate`` packs where it measured faster than
    the few-row kernel (``fastest_packing``), so a block kernel, whose products are the few-row kernel's, declines
    those rows (``kvlm.kernels.block.BlockCall.wide``)."""
    for m in modules:
        if isinstance(m, Linear) and m._packed is not None and m._packed[0][2] not in _KERNEL_ROWS_KEPT:
            return True
        if any(g.rows not in _KERNEL_ROWS_KEPT for g in m.__dict__.get("_decode_groups", {}).values()):
            return True
    return False


class PackedGroup:
    """Linears that read the same input (q/k/v, SwiGLU's gate and up), packed at decode as one GEMM
    [W_1; ...; W_n] for products of ``rows`` rows (as ``Linear.pack_for_decode``): one weight stream and one call
    instead of n. A decode-time copy only: the parameters, the state dict and the unpacked path are untouched,
    and each output equals its own packed product exactly (the library computes every output column the same
    way). ``outputs`` returns None when it does not apply (other rows, a weight written since, autograd, not
    float32 CPU)."""

    def __init__(self, linears: list[Linear], rows: int | str):
        ws = [m.weight for m in linears]
        self.key = self._key(ws, rows)
        self.rows = rows
        self.sizes = [w.shape[0] for w in ws]
        with torch.no_grad():
            w = torch.cat([w.detach() for w in ws])
            self.packed = _reorder(w, rows)
            if any(m.bias is not None for m in linears):
                zero = w.new_zeros
                self.bias = torch.cat(
                    [m.bias if m.bias is not None else zero(n) for m, n in zip(linears, self.sizes)]
                )
            else:
                self.bias = None
        # MKL reads only the packed copy at ``rows`` rows; the op takes the unpacked weight for its shape, so a
        # zero-stride stand-in keeps the group from holding a third copy of the weights
        self.shape_weight = w.new_zeros(()).expand(w.shape)
        register_packed(ws, self)  # what a compiled step's kvlm::packed_linear finds

    def packed_first(self) -> bool:
        """Whether the packed copy goes before the few-row kernel on the plain weight (``PANELS``)."""
        return self.rows == PANELS

    def first_panels(self, linears: list[Linear]) -> tuple[bool, torch.Tensor | None]:
        """As ``Linear.first_panels``, for the group's one product (stale: its Linears' plain weights)."""
        if not self.packed_first():
            return True, None
        if self.bias is not None:
            return False, None
        return True, self.packed if self._key([m.weight for m in linears], PANELS) == self.key else None

    @staticmethod
    def _key(weights: list[torch.Tensor], rows: int | str) -> tuple:
        return tuple((w.data_ptr(), _version(w)) for w in weights) + (rows,)

    @staticmethod
    def build(linears: list[Linear], rows: int | str | None) -> PackedGroup | None:
        """The group for ``rows``-row products, or None (rows None, not float32 CPU weights, or no library)."""
        if rows is None:
            return None
        _check_rows(rows)
        if not packing_available(rows) or not all(_plain_cpu_float32(m.weight) for m in linears):
            return None
        return PackedGroup(linears, rows)

    def outputs(self, linears: list[Linear], x: torch.Tensor) -> list[torch.Tensor] | None:
        y = self.packed_outputs([m.weight for m in linears], x)
        return None if y is None else list(y.split(self.sizes, dim=-1))

    def packed_outputs(self, weights: list[torch.Tensor], x: torch.Tensor, count: bool = True) -> torch.Tensor | None:
        """The outputs concatenated (``kvlm::packed_linear``: ``count`` False), or None where the packed copy does
        not serve."""
        n = x.numel() // x.shape[-1] if x.numel() else 0
        if not _applies(self.rows, n) or x.dtype != torch.float32 or x.device.type != "cpu":
            return None
        if torch.is_grad_enabled() and (x.requires_grad or any(w.requires_grad for w in weights)):
            return None
        if self._key(weights, self.rows) != self.key:
            return None  # a weight was written or replaced since packing: the unfused path is exact
        return _packed_product(x, self.packed, self.shape_weight, self.bias, self.rows, count)


class GroupPacking(Watched, nn.Module):
    """A module whose decode may run groups of its Linears (``packed_groups``: tuples of attribute names, each
    reading the same input) as one ``PackedGroup`` each. ``pack_for_decode(rows)`` packs them (rows None drops
    them) and returns the Linears it covered, which ``KVLM.pack_for_decode`` then leaves unpacked on their own;
    train(True), moves and casts drop them."""

    packed_groups: tuple[tuple[str, ...], ...] = ()

    def pack_for_decode(self, rows: int | str | None) -> list[Linear]:
        groups, covered = {}, []
        for names in self.packed_groups:
            linears = [getattr(self, n) for n in names]
            group = PackedGroup.build(linears, rows)
            if group is not None:
                groups[names] = group
                covered += linears
        touch()  # the groups go in __dict__ directly: plans built on the old ones are stale
        self.__dict__["_decode_groups"] = groups
        return covered

    def group_panels(self, names: tuple[str, ...]) -> tuple[bool, torch.Tensor | None]:
        """``PackedGroup.first_panels`` of the group ``names`` ((True, None) where it is not packed)."""
        group = self.__dict__.get("_decode_groups", {}).get(names)
        return (True, None) if group is None else group.first_panels([getattr(self, n) for n in names])

    def group_outputs(self, names: tuple[str, ...], x: torch.Tensor) -> list[torch.Tensor] | None:
        """The outputs of the Linears ``names`` on x as one product: by the few-row kernel where it applies, else
        through their packed group (first, where it is in ``PANELS``), or None (neither applies: the caller runs
        them one by one, which gives the same values)."""
        group = self.__dict__.get("_decode_groups", {}).get(names)
        linears = [getattr(self, n) for n in names]
        if hooked(*linears):  # one product would skip their hooks: one by one, so that they fire
            return None
        weights, biases = [m.weight for m in linears], [m.bias for m in linears]
        if torch.compiler.is_compiling():
            if x.device.type != "cpu" or torch.is_grad_enabled():  # the operator has no backward
                return None
            if group is None and not few_rows_fit(x, first=False):
                return None
            y = packed_linear(x, weights, biases)
        else:
            first = group is not None and group.packed_first()
            ys = group.outputs(linears, x) if first else None
            if ys is not None:
                return ys
            y = few_rows_linear(x, weights, biases)
            if y is None and group is not None and not first:
                ys = group.outputs(linears, x)
                if ys is not None:
                    return ys
            if y is None:
                y = few_rows_linear(x, weights, biases, first=False)
            if y is None:
                return None
        return list(y.split([w.shape[0] for w in weights], dim=-1))

    def train(self, mode: bool = True):
        if mode:
            self.__dict__["_decode_groups"] = {}
        return super().train(mode)

    def _apply(self, fn, recurse=True):
        self.__dict__["_decode_groups"] = {}
        return super()._apply(fn, recurse)
