"""The cache interface a mechanism sees: one ``CacheLayer`` per attention layer.

A mechanism appends its new tokens' tensors and reads the cached ones through this object, by the names of its
``cache_spec()``; it never indexes storage itself, so the layout behind the interface (today's contiguous
buffers, later paged or quantized blocks) can change without touching any mechanism.

Tensors are exchanged in the attention layout (B, *lead, tokens, last): a per-token shape (*lead, last) from the
spec, the token axis second to last (for MHA (B, g, S, d_h), what SDPA reads). ``append`` returns every cached
token of the tensor, old and new, ready to attend over.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

import torch

from kvlm.config import spec_numel

if TYPE_CHECKING:
    from kvlm.attention.step import Step


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

    def __init__(self, spec, batch_size, max_seq_len, dtype, naive, token_ids=None, device="cpu"):
        super().__init__(spec, batch_size, max_seq_len, dtype, naive, token_ids)
        self.buffers: dict[str, torch.Tensor] = {}
        for name, shape in self.spec.items():
            *lead, last = shape
            self.buffers[name] = torch.zeros(batch_size, *lead, max_seq_len, last, dtype=dtype, device=device)

    def append(self, name: str, value: torch.Tensor, step: Step) -> torch.Tensor:
        buf = self.buffers[name]
        buf[..., step.start : step.end, :] = value.to(buf.dtype)
        return buf[..., : step.end, :]

    def read(self, name: str, end: int) -> torch.Tensor:
        return self.buffers[name][..., :end, :]

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.buffers[name]

    def fill_random_(self, length: int) -> None:
        """Standard-normal values in slots [0, length), as a prefill would have left them (benchmarks)."""
        for buf in self.buffers.values():
            buf[..., :length, :].normal_()
