"""Page bookkeeping of the paged cache: which pages are free, who holds each, and the prefix table.

- ``PageAllocator``: ``num_pages`` pages with reference counts. A page is *used* while a sequence holds it,
  *cached* when no sequence holds it but it still has the hash of a full page of tokens (a later prompt with the
  same prefix can take it back without recomputing), and *free* otherwise. Allocation takes a free page first,
  then evicts the least recently released cached page (vLLM's prefix caching keeps freed blocks the same way).
- ``page_hash``: the key of a full page, chained over the pages before it (sha256 of the parent's digest and
  this page's token ids), so equal keys mean equal token prefixes, hence equal cached tensors (positions and
  keys of a page depend on every token before it).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

from kvlm.errors import CacheError


class OutOfPages(CacheError):
    """The pool has fewer free pages than a step needs (the scheduler preempts or queues)."""


def page_hash(parent: bytes | None, token_ids: list[int]) -> bytes:
    """The chained key of a full page holding ``token_ids`` after the pages whose last key is ``parent``."""
    h = hashlib.sha256(parent or b"root")
    h.update(b",".join(str(t).encode() for t in token_ids))
    return h.digest()


class PageAllocator:
    def __init__(self, num_pages: int):
        if num_pages <= 0:
            raise CacheError(f"a paged cache needs at least one page, got num_pages={num_pages}")
        self.num_pages = num_pages
        self.refs = [0] * num_pages
        self._free: list[int] = list(range(num_pages - 1, -1, -1))  # a stack: page 0 is handed out first
        self._cached: OrderedDict[int, None] = OrderedDict()  # unreferenced pages with a hash, oldest first
        self._hash_of: dict[int, bytes] = {}
        self._page_of: dict[bytes, int] = {}

    # --- counts ---------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Pages an allocation can take now (free + cached-but-unreferenced)."""
        return len(self._free) + len(self._cached)

    @property
    def num_used(self) -> int:
        return self.num_pages - self.num_free

    # --- allocation -----------------------------------------------------------------------------
    def allocate(self) -> int:
        if self._free:
            page = self._free.pop()
        elif self._cached:
            page, _ = self._cached.popitem(last=False)  # evict the least recently released prefix page
            del self._page_of[self._hash_of.pop(page)]
        else:
            raise OutOfPages(f"all {self.num_pages} cache pages are in use")
        self.refs[page] = 1
        return page

    def incref(self, page: int) -> None:
        if self.refs[page] == 0:
            self._cached.pop(page)  # taken back from the prefix cache
        self.refs[page] += 1

    def decref(self, page: int) -> None:
        if self.refs[page] <= 0:
            raise CacheError(f"page {page} released more often than it was taken")
        self.refs[page] -= 1
        if self.refs[page] == 0:
            if page in self._hash_of:
                self._cached[page] = None
            else:
                self._free.append(page)

    # --- the prefix table -----------------------------------------------------------------------
    def lookup(self, key: bytes) -> int | None:
        return self._page_of.get(key)

    def register(self, page: int, key: bytes) -> None:
        """Record that ``page`` holds the full page of tokens with ``key`` (first holder wins)."""
        if key not in self._page_of and page not in self._hash_of:
            self._page_of[key] = page
            self._hash_of[page] = key

    def clear_prefix_cache(self) -> None:
        """Forget every page key; unreferenced cached pages become free."""
        self._page_of.clear()
        self._hash_of.clear()
        self._free.extend(self._cached)
        self._cached.clear()


__all__ = ["OutOfPages", "PageAllocator", "page_hash"]
