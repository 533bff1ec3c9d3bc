"""The KV cache: the cache interface mechanisms write and read through, and its layouts.

- ``CacheLayer`` (layer.py): one attention layer's cache. A mechanism calls ``append(name, value, step)``
  for its new tokens' tensors (the names of its ``cache_spec()``) and gets back every cached token's tensor,
  (B, *lead, end, last); ``read(name, end)`` and ``token_ids(end)`` read without writing; ``naive`` tells the
  compact cache from the materialised per-head K/V one. Mechanisms never index storage themselves.
- ``ContiguousLayer`` (layer.py): today's layout, one preallocated buffer per cached tensor whose filled part
  is a strided view. A paged or quantized layout is another ``CacheLayer`` behind the same calls.
- ``KVCache`` (contiguous.py): the model's cache: ``layers[i]``, the filled ``length``, left padding, the token
  ids of every slot (for ``needs_token_ids`` mechanisms), and ``nbytes`` / ``elements_per_token`` derived
  from the cache specs alone.
- ``BlockView`` (layer.py): a cached tensor as pages + block table + per-sequence [start, end), so that a kernel
  reads keys in place (``CacheLayer.block_view``; ``store`` writes without gathering).
- ``PagedKVCache`` (paged.py): pools of fixed-size pages, a block table per sequence, per-sequence lengths,
  prefix reuse and copy on write (pages.py), optional int8 / fp8 storage (quantized.py); ``cache.batch(ids)``
  is what the model takes.
- ``CacheError``: misuse (out of capacity, wrong batch, dtype, device or layout).
"""

from kvlm.cache.contiguous import KVCache
from kvlm.cache.layer import BlockView, CacheLayer, ContiguousLayer
from kvlm.cache.paged import PagedBatch, PagedKVCache
from kvlm.cache.paged_layer import PagedLayer
from kvlm.cache.pages import OutOfPages
from kvlm.errors import CacheError

__all__ = [
    "BlockView",
    "CacheError",
    "CacheLayer",
    "ContiguousLayer",
    "KVCache",
    "OutOfPages",
    "PagedBatch",
    "PagedKVCache",
    "PagedLayer",
]
