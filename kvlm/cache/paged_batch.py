"""One model call's view of a ``PagedKVCache``: which sequences its rows are and how many new tokens each brings.

- ``PagedBatch`` (``PagedKVCache.batch(ids, n_new)``): row b of tokens (B, T) is sequence ids[b]; with ``n_new``
  the rows are left-padded chunks of different lengths (the padding is never stored).
- ``PackedBatch`` (``PackedBatch(cache, ids, n_new)``): tokens (sum n_new, 1), one row per new token, a
  sequence's tokens in consecutive rows: decodes and prompt chunks of any lengths in one call with no padding.

``model(tokens, cache=view)`` calls ``begin_step`` before the layers (book the pages, place the new tokens, build
the ragged ``Step``) and ``commit`` after them (the sequences' lengths and their full pages' prefix keys).
``KVLM.forward_parts`` runs several views of one cache (disjoint sequences) in one forward: every view begins
before the layers, and ``activate`` makes a view's index the cache's current one before its attention runs.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

import torch

from kvlm.cache.pages import OutOfPages
from kvlm.errors import CacheError

if TYPE_CHECKING:
    from kvlm.attention.step import Step
    from kvlm.cache.paged import PagedKVCache


def _check(
    cache: PagedKVCache, seq_ids: list, n_new: list[int], tokens: torch.Tensor, dtype, fits, view
) -> list:
    """The checks every view makes before it writes anything (dtype, device, lengths, free pages); the
    sequences' states, in the order of ``seq_ids``."""
    if dtype != cache.dtype:
        raise CacheError(f"model computes in {dtype} but the cache holds {cache.dtype}")
    if torch.device(tokens.device).type != cache.device.type:
        raise CacheError(f"inputs on {tokens.device} but the cache is on {cache.device}")
    if not cache.fits_checked and fits is not None:
        fits(view)
        cache.fits_checked = True
    seqs = [cache.seqs[s] for s in seq_ids]
    for sid, seq, n in zip(seq_ids, seqs, n_new):
        if seq.length + n > cache.max_seq_len:
            raise CacheError(
                f"sequence {sid!r}: {seq.length} cached + {n} new tokens exceed max_seq_len={cache.max_seq_len}"
            )
    need = sum(cache.pages_needed(s, n) for s, n in zip(seq_ids, n_new))
    if need > cache.num_free_pages:
        raise OutOfPages(f"this step needs {need} new pages, {cache.num_free_pages} are free")
    return seqs


class _View:
    """What both views share: the cache whose layers, specs and mode the model reads through them, the
    sequences and their new tokens, and the ``_Index`` of the view's call once ``begin_step`` built it."""

    def __init__(self, cache: PagedKVCache, seq_ids: list, n_new: list[int] | None):
        self.cache = cache
        self.seq_ids = seq_ids
        self.n_new = n_new
        self.layers = cache.layers
        self.specs = cache.specs
        self.mode = cache.mode
        self.index = None

    def activate(self) -> None:
        """Make this view's index the one the cache's layers read (``KVLM.forward_parts``: several views, one
        forward)."""
        if self.index is None:
            raise CacheError("this view has not begun a step: begin_step() builds its index")
        self.cache.index = self.index


class PagedBatch(_View):
    """Sequences ``seq_ids`` of a ``PagedKVCache`` as one model call's cache (row b of tokens is seq_ids[b]);
    ``n_new``: real new tokens per row (the last ones; the rest is padding), None: all T."""

    def __init__(self, cache: PagedKVCache, seq_ids: list, n_new: list[int] | None = None):
        super().__init__(cache, seq_ids, n_new)

    def begin_step(self, tokens: torch.Tensor, dtype: torch.dtype, mode: str = "auto", trace=None, fits=None):
        """Take the pages the new tokens (B, T) need (all or nothing: ``OutOfPages`` before any write), place
        them, and build the call's ragged ``Step``."""
        from kvlm.attention.step import Step  # the attention layer sits above the cache in the layering

        cache = self.cache
        B, T = tokens.shape
        if B != len(self.seq_ids):
            raise CacheError(
                f"batch of {B} sequences does not match the {len(self.seq_ids)} ids of this view"
            )
        n_new = self.n_new if self.n_new is not None else [T] * B
        if max(n_new) > T:
            raise CacheError(f"n_new={n_new} counts more new tokens than the {T} columns of tokens")
        seqs = _check(cache, self.seq_ids, n_new, tokens, dtype, fits, self)
        for seq, n in zip(seqs, n_new):
            cache._reserve(seq, n)
        cache.index = self.index = idx = cache._build_index(seqs, T, self.n_new)
        if mode == "auto" and cache.mode == "naive":
            mode = "naive"  # a materialised K/V cache has one route
        # host lists: build_ragged takes its bounds from them with no read-back
        step = Step.build_ragged(tokens, [seq.length for seq in seqs], mode, trace, n_new=self.n_new)
        if cache.token_pool is not None:
            flat = tokens.reshape(-1)
            if idx.write_rows is not None:
                flat = flat.index_select(0, idx.write_rows)
            cache.token_pool[idx.write_pages, idx.write_offs] = flat
            step.cached_token_ids = cache.layers[0].token_ids(idx.end)
        return step

    def commit(self, step: Step) -> None:
        rows = step.token_ids.tolist()
        n_new = self.n_new if self.n_new is not None else [len(rows[0])] * len(rows)
        for sid, row, n in zip(self.seq_ids, rows, n_new):
            seq = self.cache.seqs[sid]
            seq.length += n
            seq.tokens.extend(row[len(row) - n :])
            self.cache._register_full_pages(seq)


class _Row:
    """One row of a packed call as ``PagedKVCache._build_index`` sees a sequence: the tokens before it and the
    page list of its sequence (shared by all that sequence's rows)."""

    __slots__ = ("length", "pages")

    def __init__(self, length: int, pages: list[int]):
        self.length = length
        self.pages = pages


class PackedBatch(_View):
    """The new tokens of several sequences as one call of one-token rows: tokens (sum n_new, 1), sequence
    ``seq_ids[i]`` in ``n_new[i]`` consecutive rows, one per new token, in order.

    This is the flat varlen batch of vLLM V1 and SGLang written as a batch of one-token rows, so decodes (one
    token) and prompt chunks (n tokens) of any lengths run in one forward with no padding, and every mechanism
    and decode kernel runs its one-token route unchanged: row r of sequence s sits at position len_s + r and
    sees keys [0, len_s + r]; these include the earlier rows of s because each layer stores all rows' tensors
    before it attends (``append`` = store, then read; the kernels ``store``, then read in place). The logits
    come out per row; a sequence's next token is read from its last row (``last_rows``)."""

    def __init__(self, cache: PagedKVCache, seq_ids: list, n_new: list[int]):
        for s in seq_ids:
            cache._seq(s)
        if len(set(seq_ids)) != len(seq_ids):
            raise CacheError(f"a sequence appears twice in one packed batch: {list(seq_ids)}")
        n_new = [int(n) for n in n_new]
        if len(n_new) != len(seq_ids) or min(n_new, default=1) < 1:
            raise CacheError(f"n_new needs one count >= 1 per sequence, got {n_new} for {len(seq_ids)}")
        super().__init__(cache, list(seq_ids), n_new)

    @property
    def last_rows(self) -> list[int]:
        """The row of each sequence's last new token, in the order of ``seq_ids``."""
        return [end - 1 for end in itertools.accumulate(self.n_new)]

    def begin_step(self, tokens: torch.Tensor, dtype: torch.dtype, mode: str = "auto", trace=None, fits=None):
        """As ``PagedBatch.begin_step``, for tokens of shape (sum n_new, 1)."""
        from kvlm.attention.step import Step  # the attention layer sits above the cache in the layering

        cache = self.cache
        R = sum(self.n_new)
        if tuple(tokens.shape) != (R, 1):
            raise CacheError(
                f"a packed batch of {self.n_new} new tokens takes tokens of shape ({R}, 1), "
                f"got {tuple(tokens.shape)}"
            )
        seqs = _check(cache, self.seq_ids, self.n_new, tokens, dtype, fits, self)
        for seq, n in zip(seqs, self.n_new):
            cache._reserve(seq, n)  # before the rows take their page lists (a copy on write replaces a page)
        rows = [_Row(seq.length + r, seq.pages) for seq, n in zip(seqs, self.n_new) for r in range(n)]
        cache.index = self.index = idx = cache._build_index(rows, 1)
        if mode == "auto" and cache.mode == "naive":
            mode = "naive"
        step = Step.build_ragged(tokens, [row.length for row in rows], mode, trace)
        if cache.token_pool is not None:
            cache.token_pool[idx.write_pages, idx.write_offs] = tokens.reshape(-1)
            step.cached_token_ids = cache.layers[0].token_ids(idx.end)
        return step

    def commit(self, step: Step) -> None:
        ids = step.token_ids.reshape(-1).tolist()
        i = 0
        for sid, n in zip(self.seq_ids, self.n_new):
            seq = self.cache.seqs[sid]
            seq.length += n
            seq.tokens.extend(ids[i : i + n])
            i += n
            self.cache._register_full_pages(seq)


__all__ = ["PackedBatch", "PagedBatch"]
