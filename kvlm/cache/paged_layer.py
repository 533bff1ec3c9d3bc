"""One layer's pools of the paged cache (kvlm.cache.paged): where a call's new tokens are written and its keys
gathered from, through the ``_Index`` that ``PagedKVCache.batch(...).begin_step`` builds once per call."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvlm.cache.layer import BlockView, CacheLayer
from kvlm.cache.quantized import (
    SCALE_DTYPE,
    bytes_per_token,
    dequantize,
    is_quantized_name,
    quantize,
    storage_dtype,
)
from kvlm.hugepages import zeros_in_huge_pages

if TYPE_CHECKING:
    from kvlm.attention.step import Step
    from kvlm.cache.paged import PagedKVCache


class PagedLayer(CacheLayer):
    """One layer's pools. ``append`` / ``read`` index them through the current call's ``_Index``."""

    def __init__(self, cache: PagedKVCache, spec: dict[str, tuple[int, ...]]):
        super().__init__(spec, 0, cache.max_seq_len, cache.dtype, cache.mode == "naive", None)
        self.cache = cache
        self.pools: dict[str, torch.Tensor] = {}
        self.scales: dict[str, torch.Tensor] = {}  # per-token scales of the quantized tensors
        N, P, dev = cache.num_pages, cache.page_size, cache.device
        for name, shape in self.spec.items():
            *lead, last = shape
            quantized = is_quantized_name(name, cache.kv_dtype)
            dtype = storage_dtype(cache.kv_dtype, cache.dtype) if quantized else cache.dtype
            self.pools[name] = zeros_in_huge_pages(
                (N, *lead, P, last), dtype, dev
            )  # streamed each step: 2 MiB pages
            if quantized:
                self.scales[name] = torch.zeros(N, *lead, P, 1, dtype=SCALE_DTYPE, device=dev)

    # --- storage access -------------------------------------------------------------------------
    def _write(self, pool: torch.Tensor, value: torch.Tensor) -> None:
        idx = self.cache.index
        rows = value.movedim(-2, 1).reshape(idx.B * idx.T, *value.shape[1:-2], value.shape[-1])
        if idx.write_rows is not None:  # padding tokens are never stored
            rows = rows.index_select(0, idx.write_rows)
        pool.movedim(-2, 1)[idx.write_pages, idx.write_offs] = rows.to(pool.dtype)

    def _gather(self, pool: torch.Tensor, end: int, key: str | None = None) -> torch.Tensor:
        """(B, *lead, end, last) copy of slots [0, end) of the call's sequences. With ``key``, a latent (no lead
        axis) is gathered into the cache's reused workspace of that key (see ``PagedKVCache.workspace``)."""
        idx = self.cache.index
        pages, offs = idx.read_pages[:, :end], idx.read_offs[:, :end]
        if pool.dim() == 3:  # no lead axis (a latent): one index_select over the flattened pages
            N, P, last = pool.shape
            flat = (pages * P + offs).reshape(-1)
            if key is None or torch.is_grad_enabled():  # out= does not record autograd
                return pool.view(N * P, last).index_select(0, flat).view(idx.B, end, last)
            out = self.cache.workspace(key, (idx.B * end, last), pool.dtype)
            return torch.index_select(pool.view(N * P, last), 0, flat, out=out).view(idx.B, end, last)
        return pool.movedim(-2, 1)[pages, offs].movedim(1, -2)

    # --- what mechanisms call -------------------------------------------------------------------
    def store(self, name: str, value: torch.Tensor, step: Step) -> None:
        pool = self.pools[name]
        if name in self.scales:
            codes, scale = quantize(value, pool.dtype)
            self._write(pool, codes)
            self._write(self.scales[name], scale)
        else:
            self._write(pool, value)

    def read(self, name: str, end: int) -> torch.Tensor:
        """The gathered (and dequantized) tensor; a latent's lives in a workspace that the next layer's read of
        the same name reuses (a mechanism attends over it within its own layer)."""
        if name not in self.scales:
            return self._gather(self.pools[name], end, key=name)
        codes = self._gather(self.pools[name], end, key="codes:" + name)
        scale = self._gather(self.scales[name], end).to(self.dtype)
        if codes.dim() == 3 and codes.dtype == torch.int8 and not torch.is_grad_enabled():
            # int8 * scale promotes in one pass, into a workspace
            out = self.cache.workspace("values:" + name, tuple(codes.shape), self.dtype)
            return torch.mul(codes, scale, out=out)
        return dequantize(codes, scale, self.dtype)

    def append(self, name: str, value: torch.Tensor, step: Step) -> torch.Tensor:
        self.store(name, value, step)
        return self.read(name, step.end)

    def token_ids(self, end: int) -> torch.Tensor:
        pool = self.cache.token_pool
        if pool is None:
            raise KeyError("this paged cache stores no token ids: build it with store_token_ids=True")
        idx = self.cache.index
        return pool[idx.read_pages[:, :end], idx.read_offs[:, :end]]

    def block_view(self, name: str, step: Step) -> BlockView:
        """The call's index as a view: the same table / start / end tensors for every layer and name (built once
        per call; a kernel sees by identity that K and V lie on the same pages), host totals included."""
        idx = self.cache.index
        return BlockView(
            pool=self.pools[name],
            block_table=idx.block_table,
            start=idx.seq_start,
            end=idx.seq_end,
            page_size=self.cache.page_size,
            scale=self.scales.get(name),
            keys=idx.keys,
            longest=idx.longest,
            shortest=idx.shortest,
            padded=idx.write_rows is not None,
        )

    # --- accounting -----------------------------------------------------------------------------
    @property
    def bytes_per_token(self) -> int:
        return bytes_per_token(self.spec, self.dtype, self.cache.kv_dtype)

    @property
    def nbytes(self) -> int:
        """Bytes of this layer's pools (codes and scales), all pages."""
        return sum(t.numel() * t.element_size() for t in (*self.pools.values(), *self.scales.values()))

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.pools[name]
