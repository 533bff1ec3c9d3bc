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
- ``CacheError``: misuse (out of capacity, wrong batch, dtype, device or layout).
"""

from kvlm.cache.contiguous import KVCache
from kvlm.cache.layer import CacheLayer, ContiguousLayer
from kvlm.errors import CacheError

__all__ = ["CacheError", "CacheLayer", "ContiguousLayer", "KVCache"]
