"""The cache interface a mechanism sees: one ``CacheLayer`` per attention layer.

A mechanism appends its new tokens' tensors and reads the cached ones through this object, by the names of its
``cache_spec()``; it never indexes storage itself, so the layout behind the interface (today's contiguous
buffers, later paged or quantized blocks) can change without touching any mechanism.

Tensors are exchanged in the attention layout (B, *lead, tokens, last): a per-token shape (*lead, last) from the
spec, the token axis second to last (for MHA (B, g, S, d_h), what SDPA reads). ``append`` returns every cached
token of the tensor, old and new, ready to attend over (for the paged layout a gathered, dequantized copy).

A kernel that reads the storage in place calls ``store`` (write only) and then ``block_view``: the pages, the
block table and each sequence's [start, end) (``BlockView``); the contiguous buffer is the one-page-per-sequence
case, so one kernel serves both layouts.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvlm.config import spec_numel
from kvlm.hugepages import zeros_in_huge_pages

if TYPE_CHECKING:
    from kvlm.attention.step import Step


@dataclass(frozen=True, slots=True)
class BlockView:
    """Where one cached tensor's keys of a batch lie, for a kernel that reads them in place (no gather).

    ``pool`` (N_pages, *lead, P, last) holds pages of ``page_size`` P tokens; sequence b's logical slot j is
    page ``block_table[b, j // P]``, row ``j % P``; its keys are the slots [start[b], end[b]) after this step's
    tokens are stored. The contiguous buffer (B, *lead, max_seq_len, last) is the case N = B, P = max_seq_len,
    block_table = arange(B)[:, None], start = left padding. ``scale`` (N_pages, *lead, P, 1) holds per-token
    scales when the pool is quantized (value = pool * scale), else None."""

    pool: torch.Tensor
    block_table: torch.Tensor  # (B, max_blocks) int32
    start: torch.Tensor  # (B,) int32
    end: torch.Tensor  # (B,) int32
    page_size: int
    scale: torch.Tensor | None = None
    # end - start summed over the sequences and its maximum, when the cache knows them on the host: a kernel
    # needs them (FLOP count, split of the key axis) and reading the tensors back costs a sync per layer
    keys: int | None = None
    longest: int | None = None
    # the minimum of end - start on the host, where a row may hold fewer slots than the call's new tokens (a
    # paged row left-padded in its call): a kernel reads each row's last T slots as its new tokens, so it declines
    shortest: int | None = None
    # rows with fewer new tokens than the call's T, left-padded (a paged call's chunks): the padding is never
    # stored, so a kernel that writes a row's last T slots itself (the block kernels) declines
    padded: bool = False


class CacheLayer(Mapping[str, torch.Tensor]):
    """One layer's cache: the tensors of ``spec`` for ``batch_size`` sequences of up to ``max_seq_len`` slots.

    ``naive`` says which of a mechanism's two specs it holds: the compact one (the paper's cache) or the
    materialised per-head K/V (``cache_spec(naive=True)``). As a Mapping it lists the spec's names; the value
    of a name is the layout's storage for it (a (B, *lead, max_seq_len, last) buffer in the contiguous layout).
    """

    def __init__(
        self,
        spec: dict[str, tuple[int, ...]],
        batch_size: int,
        max_seq_len: int,
        dtype: torch.dtype,
        naive: bool,
        token_ids: torch.Tensor | None = None,
    ):
        self.spec = dict(spec)
        self.batch_size = batch_size
        self.max_seq_len = max_seq_len
        self.dtype = dtype
        self.naive = naive
        self._token_ids = token_ids  # (B, max_seq_len), shared by the layers of one model cache

    # --- what mechanisms call -------------------------------------------------------------------
    def append(self, name: str, value: torch.Tensor, step: Step) -> torch.Tensor:
        """Store value (B, *lead, T, last), the new tokens' ``name`` tensor, in slots [step.start, step.end);
        return the tensor for every filled slot, (B, *lead, step.end, last)."""
        raise NotImplementedError

    def read(self, name: str, end: int) -> torch.Tensor:
        """The cached ``name`` tensor of slots [0, end), (B, *lead, end, last)."""
        raise NotImplementedError

    def store(self, name: str, value: torch.Tensor, step: Step) -> None:
        """Write value (B, *lead, T, last), the new tokens' ``name`` tensor, without gathering anything back
        (for a kernel that then reads the keys through ``block_view``)."""
        raise NotImplementedError

    def block_view(self, name: str, step: Step) -> BlockView:
        """The storage of ``name`` as pages and a block table, valid after this step's tokens are stored."""
        raise NotImplementedError

    def token_ids(self, end: int) -> torch.Tensor:
        """Token ids of slots [0, end), (B, end), for mechanisms that rebuild keys from the token (eg-mla,
        ``needs_token_ids``); the model stores them before the layers run."""
        if self._token_ids is None:
            raise KeyError("this cache stores no token ids: build it with model.new_cache()")
        return self._token_ids[:, :end]

    # --- accounting: from the spec alone ------------------------------------------------------------
    @property
    def elements_per_token(self) -> int:
        return spec_numel(self.spec)

    @property
    def nbytes(self) -> int:
        """Bytes this layer holds for its batch_size x max_seq_len slots."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return self.batch_size * self.max_seq_len * self.elements_per_token * itemsize

    # --- Mapping: the spec's names ----------------------------------------------------------------
    def __iter__(self) -> Iterator[str]:
        return iter(self.spec)

    def __len__(self) -> int:
        return len(self.spec)

    def __contains__(self, name: object) -> bool:
        return name in self.spec

    def __getitem__(self, name: str) -> torch.Tensor:
        raise NotImplementedError


class StepSlots:
    """What the ``block_view``s of every layer of one contiguous cache share in a step: the block table
    arange(B)[:, None] (fixed), each sequence's first key (its left padding) and last, and their host totals.
    Built on the first ``block_view`` of a step and kept for the others (one small tensor op per step, not
    per layer, and no read-back of the padding per layer). Keyed by the ``Step`` object, which every model
    call builds anew, so values of an earlier step (another end, another padding) are never served."""

    def __init__(self, batch_size: int, device, pad: torch.Tensor | None):
        self.batch_size = batch_size
        self.pad = pad  # (B,) left padding (the model cache's tensor, mutable between steps)
        self.table = torch.arange(batch_size, dtype=torch.int32, device=device)[:, None]
        self._step: Step | None = None
        self._slots: tuple | None = None
        self._host_pad: tuple | None = None  # (step, pads as ints) noted by the cache when it built the step

    def begin(self, step: Step, pads: list[int] | None) -> None:
        """A new step: nothing built for an earlier one is served; ``pads``, the padding ``step`` was built
        with, already read to the host by the caller (spares a read-back), or None (a traced step: the views
        then carry no host totals, and the kernels read theirs from the tensors)."""
        self._step = self._slots = None
        self._host_pad = (step, pads)

    def get(self, step: Step) -> tuple[torch.Tensor, torch.Tensor, int | None, int | None]:
        """(start, end) int32 tensors and the host (keys, longest) of ``step`` (None, None when traced)."""
        if self._step is not step:
            B, device = self.batch_size, self.table.device
            if self._host_pad is not None and self._host_pad[0] is step:
                pads = self._host_pad[1]
            elif torch.compiler.is_compiling():
                pads = None
            else:
                pads = self.pad.tolist() if self.pad is not None else [0] * B
            start = (
                self.pad.to(torch.int32)
                if self.pad is not None
                else torch.zeros(B, dtype=torch.int32, device=device)
            )
            end = torch.full((B,), step.end, dtype=torch.int32, device=device)
            if pads is None:
                self._slots = (start, end, None, None)
            else:
                self._slots = (start, end, B * step.end - sum(pads), step.end - min(pads, default=0))
            self._step = step
        return self._slots


class ContiguousLayer(CacheLayer):
    """Today's layout: one preallocated (B, *lead, max_seq_len, last) buffer per cached tensor. The filled
    part ``buf[..., :end, :]`` is a strided view, so attention reads the cache without a copy."""

    def __init__(
        self, spec, batch_size, max_seq_len, dtype, naive, token_ids=None, device="cpu", pad=None, slots=None
    ):
        super().__init__(spec, batch_size, max_seq_len, dtype, naive, token_ids)
        # block_view's per-step table / start / end, shared by the layers of one model cache (``StepSlots``)
        self._slots = slots if slots is not None else StepSlots(batch_size, device, pad)
        self.buffers: dict[str, torch.Tensor] = {}
        for name, shape in self.spec.items():
            *lead, last = shape
            self.buffers[name] = zeros_in_huge_pages((batch_size, *lead, max_seq_len, last), dtype, device)

    def append(self, name: str, value: torch.Tensor, step: Step) -> torch.Tensor:
        buf = self.buffers[name]
        buf[..., step.start : step.end, :] = value  # copy_ casts to the buffer's dtype
        return buf[..., : step.end, :]

    def store(self, name: str, value: torch.Tensor, step: Step) -> None:
        self.buffers[name][..., step.start : step.end, :] = value

    def block_view(self, name: str, step: Step) -> BlockView:
        """One page per sequence, as long as the cache: its keys are slots [left pad, step.end). The block table,
        starts and ends are built once per step and shared by the cache's layers and tensors (``StepSlots``;
        a kernel also sees by identity that K and V lie on the same pages)."""
        start, end, keys, longest = self._slots.get(step)
        return BlockView(
            pool=self.buffers[name],
            block_table=self._slots.table,
            start=start,
            end=end,
            page_size=self.max_seq_len,
            keys=keys,
            longest=longest,
        )

    def read(self, name: str, end: int) -> torch.Tensor:
        return self.buffers[name][..., :end, :]

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.buffers[name]

    def fill_random_(self, length: int) -> None:
        """Standard-normal values in slots [0, length), as a prefill would have left them (benchmarks)."""
        for buf in self.buffers.values():
            buf[..., :length, :].normal_()
