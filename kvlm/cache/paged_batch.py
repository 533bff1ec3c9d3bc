"""One model call's view of a ``PagedKVCache``: the sequences of the batch's rows (``PagedKVCache.batch(ids)``).

``model(tokens, cache=view)`` calls ``begin_step`` before the layers (book the pages, place the new tokens, build
the ragged ``Step``) and ``commit`` after them (the sequences' lengths and their full pages' prefix keys).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvlm.cache.pages import OutOfPages
from kvlm.errors import CacheError

if TYPE_CHECKING:
    from kvlm.attention.step import Step
    from kvlm.cache.paged import PagedKVCache


class PagedBatch:
    """Sequences ``seq_ids`` of a ``PagedKVCache`` as one model call's cache (row b of tokens is seq_ids[b])."""

    def __init__(self, cache: PagedKVCache, seq_ids: list, n_new: list[int] | None = None):
        self.cache = cache
        self.seq_ids = seq_ids
        self.n_new = n_new  # real new tokens per row (the last ones; the rest is padding), None: all T
        self.layers = cache.layers
        self.specs = cache.specs
        self.mode = cache.mode

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
        if dtype != cache.dtype:
            raise CacheError(f"model computes in {dtype} but the cache holds {cache.dtype}")
        if torch.device(tokens.device).type != cache.device.type:
            raise CacheError(f"inputs on {tokens.device} but the cache is on {cache.device}")
        if not cache.fits_checked and fits is not None:
            fits(self)
            cache.fits_checked = True
        seqs = [cache.seqs[s] for s in self.seq_ids]
        n_new = self.n_new if self.n_new is not None else [T] * B
        if max(n_new) > T:
            raise CacheError(f"n_new={n_new} counts more new tokens than the {T} columns of tokens")
        for sid, seq, n in zip(self.seq_ids, seqs, n_new):
            if seq.length + n > cache.max_seq_len:
                raise CacheError(
                    f"sequence {sid!r}: {seq.length} cached + {n} new tokens exceed max_seq_len={cache.max_seq_len}"
                )
        need = sum(cache.pages_needed(s, n) for s, n in zip(self.seq_ids, n_new))
        if need > cache.num_free_pages:
            raise OutOfPages(f"this step needs {need} new pages, {cache.num_free_pages} are free")
        for seq, n in zip(seqs, n_new):
            cache._reserve(seq, n)
        cache.index = idx = cache._build_index(seqs, T, self.n_new)
        if mode == "auto" and cache.mode == "naive":
            mode = "naive"  # a materialised K/V cache has one route
        lens = torch.tensor([seq.length for seq in seqs], dtype=torch.long)
        n_rows = torch.tensor(n_new, dtype=torch.long) if self.n_new is not None else None
        step = Step.build_ragged(tokens, lens, mode, trace, n_new=n_rows)
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


__all__ = ["PagedBatch"]
