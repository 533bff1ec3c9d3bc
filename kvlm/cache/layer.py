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


class ContiguousLayer(CacheLayer):
    """Today's layout: one preallocated (B, *lead, max_seq_len, last) buffer per cached tensor. The filled
    part ``buf[..., :end, :]`` is a strided view, so attention reads the cache without a copy."""

    def __init__(self, spec, batch_size, max_seq_len, dtype, naive, token_ids=None, device="cpu", pad=None):
        super().__init__(spec, batch_size, max_seq_len, dtype, naive, token_ids)
        self._pad = pad  # (B,) left padding, shared with the model cache (the start of each sequence's keys)
        # block_view's block table, arange(B)[:, None] int32 (one page per sequence, never changes), and the
        # (step, start, end) of its last step, shared by the layer's tensors
        self._table: torch.Tensor | None = None
        self._view_step: tuple | None = None
        self.buffers: dict[str, torch.Tensor] = {}
        for name, shape in self.spec.items():
            *lead, last = shape
            self.buffers[name] = torch.zeros(batch_size, *lead, max_seq_len, last, dtype=dtype, device=device)

    def append(self, name: str, value: torch.Tensor, step: Step) -> torch.Tensor:
        buf = self.buffers[name]
        buf[..., step.start : step.end, :] = value.to(buf.dtype)
        return buf[..., : step.end, :]

    def store(self, name: str, value: torch.Tensor, step: Step) -> None:
        buf = self.buffers[name]
        buf[..., step.start : step.end, :] = value.to(buf.dtype)

    def block_view(self, name: str, step: Step) -> BlockView:
        """One page per sequence, as long as the cache: its keys are slots [left pad, step.end). The block table,
        starts and ends are built once per step and shared by the layer's tensors (fewer small ops per decode
        step; a kernel sees by identity that K and V lie on the same pages)."""
        buf = self.buffers[name]
        B, device = buf.shape[0], buf.device
        if self._table is None:
            self._table = torch.arange(B, dtype=torch.int32, device=device)[:, None]
        if self._view_step is None or self._view_step[0] is not step:
            start = self._pad if self._pad is not None else torch.zeros(B, dtype=torch.long, device=device)
            end = torch.full((B,), step.end, dtype=torch.int32, device=device)
            self._view_step = (step, start.to(torch.int32), end)
        _, start, end = self._view_step
        return BlockView(pool=buf, block_table=self._table, start=start, end=end, page_size=self.max_seq_len)

    def read(self, name: str, end: int) -> torch.Tensor:
        return self.buffers[name][..., :end, :]

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.buffers[name]

    def fill_random_(self, length: int) -> None:
        """Standard-normal values in slots [0, length), as a prefill would have left them (benchmarks)."""
        for buf in self.buffers.values():
            buf[..., :length, :].normal_()
