"""The paged cache: pools of fixed-size pages per cached tensor, a block table per sequence (vLLM's layout).

    cache = PagedKVCache.for_model(model, cache_tokens=4096, page_size=16)   # or cache_bytes=..., kv_dtype="int8"
    cache.add_sequence("a"); cache.add_sequence("b")
    model(prompt_a, cache=cache.batch(["a"]))                 # prefill (one sequence, or several of equal length)
    model(next_tokens, cache=cache.batch(["a", "b"]))         # one decode step over sequences of different lengths
    cache.free("a")                                            # its pages go back to the pool

Each layer's tensor of per-token shape (*lead, last) (the mechanism's ``cache_spec()``) lives in a pool
(N_pages, *lead, P, last); sequence s's logical slot j is row j % P of page ``pages[s][j // P]``. Pages are taken
as tokens arrive and returned when a sequence is freed. Each sequence has its own length: a call builds its
``Step`` with ``Step.build_ragged`` (positions from each length, keys past a shorter sequence masked), so no slots
are shared and nothing is padded. Mechanisms still call ``append`` and get the gathered (B, *lead, end, last)
tensor (dequantized), so every mechanism and route runs unchanged; a kernel can instead ``store`` and read the
pages in place through ``block_view``.

Prefix reuse: every full page gets a chained key of its tokens (``pages.page_hash``); ``match_prefix`` lets a
new sequence take the pages of an equal prompt prefix (reference counted) instead of recomputing them, and a
released page keeps its key until the pool needs it back. ``fork`` shares every page of a sequence, its partly
filled last page too; a sequence about to write into a page it shares copies it first (copy on write).

Quantized storage (``kv_dtype`` "int8" / "fp8"): kvlm.cache.quantized.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvlm.cache.paged_batch import PagedBatch
from kvlm.cache.paged_layer import PagedLayer
from kvlm.cache.pages import OutOfPages, PageAllocator, page_hash
from kvlm.cache.quantized import (
    bytes_per_token,
    storage_dtype,
)
from kvlm.errors import CacheError


class _Seq:
    __slots__ = ("keys", "length", "pages", "tokens")

    def __init__(self):
        self.pages: list[int] = []
        self.length = 0  # tokens stored
        self.tokens: list[int] = []  # their ids (for the prefix keys)
        self.keys: list[bytes] = []  # the key of each full page, in order


@dataclass
class _Index:
    """Where one model call's tokens go and where its keys are, computed once and shared by every layer."""

    B: int
    T: int
    end: int
    write_pages: torch.Tensor  # (B * T,) page of each new token, row-major (b, t)
    write_offs: torch.Tensor  # (B * T,) its row in the page
    read_pages: (
        torch.Tensor
    )  # (B, end) page of each logical slot (slots past a sequence's end: page 0, masked)
    read_offs: torch.Tensor  # (B, end)
    block_table: torch.Tensor  # (B, max_blocks) int32
    seq_end: torch.Tensor  # (B,) int32 length after the call
    seq_start: torch.Tensor  # (B,) int32 zeros: a sequence's keys start at its slot 0
    keys: int  # sum of the lengths after the call (host), for the kernels' FLOP count
    longest: int  # their maximum (host), for the kernels' split of the key axis
    shortest: int  # their minimum (host): below the call's width T the kernels decline (a padded short row)
    write_rows: torch.Tensor | None = None  # padded rows: which of the B * T new tokens are real (stored)


class PagedKVCache:
    """The paged cache of a model for any number of sequences (by id); ``batch(ids)`` is what forward takes."""

    def __init__(
        self,
        specs: list[dict[str, tuple[int, ...]]],
        num_pages: int,
        page_size: int = 16,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        kv_dtype: str | None = None,
        store_token_ids: bool = False,
        mode: str = "compact",
        max_seq_len: int | None = None,
        enable_prefix_cache: bool = True,
    ):
        if not isinstance(page_size, int) or page_size < 1:
            raise CacheError(f"page_size must be an integer >= 1, got {page_size!r}")
        self.specs = specs
        self.num_pages = num_pages
        self.page_size = page_size
        self.dtype = dtype
        self.device = torch.device(device)
        self.kv_dtype = None if kv_dtype in (None, "auto", "none") else kv_dtype
        storage_dtype(self.kv_dtype, dtype)  # an unknown kv_dtype fails here, before allocating
        self.mode = mode
        self.max_seq_len = max_seq_len or num_pages * page_size
        self.enable_prefix_cache = enable_prefix_cache
        self.allocator = PageAllocator(num_pages)
        # one token id per slot for the whole model (eg-mla rebuilds K/V from them); not KV accounting
        self.token_pool = (
            torch.zeros(num_pages, page_size, dtype=torch.long, device=self.device)
            if store_token_ids
            else None
        )
        self.layers = [PagedLayer(self, spec) for spec in specs]
        self.seqs: dict[object, _Seq] = {}
        self.index: _Index | None = None
        self._workspaces: dict[str, torch.Tensor] = {}
        self.fits_checked = False

    @classmethod
    def for_model(
        cls,
        model,
        *,
        cache_bytes: int | None = None,
        cache_tokens: int | None = None,
        page_size: int = 16,
        kv_dtype: str | None = None,
        naive: bool = False,
        enable_prefix_cache: bool = True,
    ) -> PagedKVCache:
        """A pool for ``model`` (a KVLM) of ``cache_bytes`` (whole pages that fit) or ``cache_tokens`` (rounded
        up to whole pages), in the model's dtype and device."""
        if (cache_bytes is None) == (cache_tokens is None):
            raise CacheError("give the pool size as exactly one of cache_bytes or cache_tokens")
        p = model.embed.weight
        specs = model.cache_specs(naive=naive)
        if not isinstance(page_size, int) or page_size < 1:
            raise CacheError(f"page_size must be an integer >= 1, got {page_size!r}")
        page_bytes = page_size * sum(bytes_per_token(s, p.dtype, kv_dtype) for s in specs)
        if cache_bytes is not None:
            num_pages = int(cache_bytes) // page_bytes
            if num_pages < 1:
                raise CacheError(f"cache_bytes={cache_bytes} is less than one page ({page_bytes} bytes)")
        else:
            if cache_tokens < 1:
                raise CacheError(f"cache_tokens must be >= 1, got {cache_tokens}")
            num_pages = math.ceil(cache_tokens / page_size)
        return cls(
            specs,
            num_pages,
            page_size,
            dtype=p.dtype,
            device=p.device,
            kv_dtype=kv_dtype,
            store_token_ids=model.layers[0].attn.needs_token_ids,
            mode="naive" if naive else "compact",
            max_seq_len=model.cfg.max_seq_len,
            enable_prefix_cache=enable_prefix_cache,
        )

    # --- accounting -----------------------------------------------------------------------------
    @property
    def bytes_per_token(self) -> int:
        """KV bytes per token, all layers (codes, scales, unquantized tensors), from the specs and dtypes."""
        return sum(layer.bytes_per_token for layer in self.layers)

    @property
    def page_nbytes(self) -> int:
        return self.bytes_per_token * self.page_size

    @property
    def nbytes(self) -> int:
        """Bytes of KV storage allocated (all pools), excluding the token ids."""
        return sum(layer.nbytes for layer in self.layers)

    @property
    def num_free_pages(self) -> int:
        return self.allocator.num_free

    @property
    def num_used_pages(self) -> int:
        return self.allocator.num_used

    def pages_for(self, n_tokens: int) -> int:
        return math.ceil(n_tokens / self.page_size)

    # --- sequences ------------------------------------------------------------------------------
    def add_sequence(self, seq_id) -> None:
        if seq_id in self.seqs:
            raise CacheError(f"sequence {seq_id!r} is already in the cache")
        self.seqs[seq_id] = _Seq()

    def has_sequence(self, seq_id) -> bool:
        return seq_id in self.seqs

    def seq_len(self, seq_id) -> int:
        return self._seq(seq_id).length

    def seq_pages(self, seq_id) -> list[int]:
        return list(self._seq(seq_id).pages)

    def free(self, seq_id) -> None:
        """Release the sequence's pages (shared ones stay with their other holders)."""
        seq = self.seqs.pop(seq_id, None)
        if seq is None:
            return
        for page in seq.pages:
            self.allocator.decref(page)

    def match_prefix(self, seq_id, token_ids: list[int]) -> int:
        """Give an empty sequence the cached pages of the longest prefix of ``token_ids`` made of full pages
        (at least one token is left to compute, whose logits the caller needs); returns the tokens reused."""
        seq = self._seq(seq_id)
        if seq.length or not self.enable_prefix_cache:
            return 0
        P = self.page_size
        parent = None
        for i in range((len(token_ids) - 1) // P):
            page_tokens = list(token_ids[i * P : (i + 1) * P])
            key = page_hash(parent, page_tokens)
            page = self.allocator.lookup(key)
            if page is None:
                break
            self.allocator.incref(page)
            seq.pages.append(page)
            seq.keys.append(key)
            seq.tokens.extend(page_tokens)
            seq.length += P
            parent = key
        return seq.length

    def fork(self, src, dst) -> None:
        """``dst`` starts as a copy of ``src`` sharing all its pages (copied on the first write)."""
        self.add_sequence(dst)
        s, d = self._seq(src), self.seqs[dst]
        for page in s.pages:
            self.allocator.incref(page)
        d.pages, d.length, d.tokens, d.keys = list(s.pages), s.length, list(s.tokens), list(s.keys)

    def pages_needed(self, seq_id, n_new: int) -> int:
        """New pages that appending ``n_new`` tokens to the sequence takes (a shared partial page counts once,
        for its copy)."""
        seq = self._seq(seq_id)
        need = self.pages_for(seq.length + n_new) - len(seq.pages)
        if n_new and seq.length % self.page_size and self.allocator.refs[seq.pages[-1]] > 1:
            need += 1
        return max(need, 0)

    def reserve(self, seq_id, n_new: int) -> None:
        """Take now the pages that appending ``n_new`` tokens needs (a scheduler books a step's pages before
        running it); ``OutOfPages`` with nothing taken when the pool is short."""
        need = self.pages_needed(seq_id, n_new)
        if need > self.num_free_pages:
            raise OutOfPages(f"sequence {seq_id!r} needs {need} new pages, {self.num_free_pages} are free")
        self._reserve(self.seqs[seq_id], n_new)

    def batch(self, seq_ids: list, n_new: list[int] | None = None) -> PagedBatch:
        """The view that ``model(tokens, cache=...)`` takes for these sequences, one per row of tokens.
        ``n_new``: each row's count of real new tokens when rows differ (several prefill chunks in one call):
        row b's tokens are left-padded to the call's T, its last n_new[b] are stored, the padding never is."""
        for s in seq_ids:
            self._seq(s)
        if len(set(seq_ids)) != len(seq_ids):
            raise CacheError(f"a sequence appears twice in one batch: {list(seq_ids)}")
        if n_new is not None:
            n_new = [int(n) for n in n_new]
            if len(n_new) != len(seq_ids) or min(n_new, default=1) < 1:
                raise CacheError(f"n_new needs one count >= 1 per sequence, got {n_new} for {len(seq_ids)}")
        return PagedBatch(self, list(seq_ids), n_new)

    def fill_random_(self, seq_id, length: int, vocab_size: int) -> None:
        """Make an empty sequence hold ``length`` random tokens, as a prefill would have left it (benchmarks);
        its pages get no prefix keys."""
        seq = self._seq(seq_id)
        if seq.length:
            raise CacheError(f"fill_random_ needs an empty sequence; {seq_id!r} holds {seq.length} tokens")
        if length > self.max_seq_len:
            raise CacheError(f"length={length} exceeds max_seq_len={self.max_seq_len}")
        self.reserve(seq_id, length)
        for layer in self.layers:
            for pool in layer.pools.values():
                for page in seq.pages:
                    pool[page] = torch.randn(pool[page].shape).to(pool.dtype)
            for scale in layer.scales.values():
                for page in seq.pages:
                    scale[page].fill_(1.0 / 64)
        tokens = torch.randint(0, vocab_size, (length,)).tolist()
        if self.token_pool is not None:
            for i, page in enumerate(seq.pages):
                chunk = tokens[i * self.page_size : (i + 1) * self.page_size]
                self.token_pool[page, : len(chunk)] = torch.tensor(chunk)
        seq.length, seq.tokens = length, tokens
        seq.keys = [b""] * (length // self.page_size)  # not keyed: random pages are never reused

    def workspace(self, key: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A reused buffer of ``shape`` for gathered pages. Allocating a fresh tensor as large as a layer's cache
        every layer and step costs page faults comparable to the copy itself; the buffer of a key is only grown."""
        numel = math.prod(shape)
        buf = self._workspaces.get(key)
        inference = (
            torch.is_inference_mode_enabled()
        )  # an inference tensor cannot be written outside that mode
        if buf is None or buf.dtype != dtype or buf.numel() < numel or buf.is_inference() != inference:
            buf = self._workspaces[key] = torch.empty(numel + numel // 4, dtype=dtype, device=self.device)
        return buf[:numel].view(shape)

    # --- internals ------------------------------------------------------------------------------
    def _seq(self, seq_id) -> _Seq:
        try:
            return self.seqs[seq_id]
        except KeyError:
            raise CacheError(f"unknown sequence {seq_id!r}: add_sequence() it first") from None

    def _reserve(self, seq: _Seq, n_new: int) -> None:
        """Copy a shared partial last page, then take pages for slots up to length + n_new."""
        P = self.page_size
        if n_new and seq.length % P and self.allocator.refs[seq.pages[-1]] > 1:
            old, new = seq.pages[-1], self.allocator.allocate()
            self._copy_page(old, new)
            self.allocator.decref(old)
            seq.pages[-1] = new
        while len(seq.pages) < self.pages_for(seq.length + n_new):
            seq.pages.append(self.allocator.allocate())

    def _copy_page(self, src: int, dst: int) -> None:
        for layer in self.layers:
            for pool in (*layer.pools.values(), *layer.scales.values()):
                pool[dst] = pool[src]
        if self.token_pool is not None:
            self.token_pool[dst] = self.token_pool[src]

    def _register_full_pages(self, seq: _Seq) -> None:
        P = self.page_size
        while len(seq.keys) < seq.length // P:
            i = len(seq.keys)
            key = page_hash(seq.keys[-1] if seq.keys else None, seq.tokens[i * P : (i + 1) * P])
            seq.keys.append(key)
            if self.enable_prefix_cache:
                self.allocator.register(seq.pages[i], key)

    def _build_index(self, seqs: list[_Seq], T: int, n_new: list[int] | None = None) -> _Index:
        B, P, dev = len(seqs), self.page_size, self.device
        # the lengths after the call on the host (no read-back of a tensor, on any device)
        ends = [s.length + k for s, k in zip(seqs, n_new if n_new is not None else [T] * B)]
        lens = torch.tensor([s.length for s in seqs], dtype=torch.long)
        n = torch.tensor(n_new, dtype=torch.long) if n_new is not None else torch.full((B,), T)
        end = max(ends)
        width = self.pages_for(end)
        table = torch.tensor([s.pages + [0] * (width - len(s.pages)) for s in seqs], dtype=torch.long)
        slots = torch.arange(end)
        read_pages = table[:, slots // P]
        # the real tokens are the last n[b] of row b (left padding); a padding token's slot is clamped to
        # len_b only to keep the index in range, and write_rows drops it
        offsets = torch.arange(T)[None, :] - (T - n)[:, None]
        positions = lens[:, None] + offsets.clamp(min=0)
        write_rows = None
        if n_new is not None and any(k != T for k in n_new):
            write_rows = (offsets >= 0).reshape(-1).nonzero().squeeze(1)
            positions = positions.reshape(-1)[write_rows]
            table_rows = torch.arange(B).repeat_interleave(n)
            write_pages = table[table_rows, positions // P]
        else:
            write_pages = table.gather(1, positions // P).reshape(-1)
        return _Index(
            B=B,
            T=T,
            end=end,
            write_pages=write_pages.to(dev),
            write_offs=(positions % P).reshape(-1).to(dev),
            read_pages=read_pages.to(dev),
            read_offs=(slots % P).expand(B, end).to(dev),
            block_table=table.to(device=dev, dtype=torch.int32),
            seq_end=torch.tensor(ends, dtype=torch.int32, device=dev),
            seq_start=torch.zeros(B, dtype=torch.int32, device=dev),
            keys=sum(ends),
            longest=end,
            shortest=min(ends),
            write_rows=write_rows.to(dev) if write_rows is not None else None,
        )

    def __repr__(self) -> str:
        return (
            f"PagedKVCache(layers={len(self.layers)}, pages={self.num_pages}x{self.page_size}, "
            f"used={self.num_used_pages}, sequences={len(self.seqs)}, kv_dtype={self.kv_dtype or self.dtype}, "
            f"bytes_per_token={self.bytes_per_token})"
        )


__all__ = ["OutOfPages", "PagedBatch", "PagedKVCache", "PagedLayer"]
