"""The KV cache: the per-token tensors each mechanism's ``cache_spec()`` declares, per layer.

``contiguous``: one preallocated buffer per cached tensor per layer (today's layout).
"""

from kvlm.cache.contiguous import CacheError, KVCache

__all__ = ["CacheError", "KVCache"]
