"""The KV cache: per layer, exactly the per-token tensors the mechanism's ``cache_spec()`` declares.

A tensor declared with per-token shape (*lead, last) is stored as a buffer (B, *lead, max_seq_len, last):
the sequence axis sits second to last so that the filled part ``buf[..., :n, :]`` is a strided view that
attention kernels read without a copy (for MHA: (B, g, S, d_h), the layout SDPA wants).

Batches of prompts with different lengths are left-padded: slots are shared by the batch and sequence b
starts at slot ``pad[b]``; attention masks slots before it, and positions count from it.
"""

from __future__ import annotations

import torch

from kvlm.config import _numel


class CacheError(ValueError):
    """Misuse of a KV cache: out of capacity, wrong batch, dtype or device."""


class KVCache:
    def __init__(
        self,
        specs: list[dict[str, tuple[int, ...]]],
        batch_size: int,
        max_seq_len: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        store_token_ids: bool = False,
        mode: str = "compact",
    ):
        if batch_size <= 0 or max_seq_len <= 0:
            raise CacheError(f"batch_size and max_seq_len must be positive, got {batch_size}, {max_seq_len}")
        self.batch_size = batch_size
        self.max_seq_len = max_seq_len
        self.dtype = dtype
        self.device = torch.device(device)
        self.mode = mode  # "compact" (the paper's cache) or "naive" (materialised per-head K/V)
        self.specs = specs
        self.layers: list[dict[str, torch.Tensor]] = []
        for spec in specs:
            bufs = {}
            for name, shape in spec.items():
                *lead, last = shape
                bufs[name] = torch.zeros(
                    batch_size, *lead, max_seq_len, last, dtype=dtype, device=self.device
                )
            self.layers.append(bufs)
        # token ids of every cached slot, for mechanisms that rebuild K/V from the token (eg-mla);
        # one int per token for the whole model, not per layer, so not KV accounting.
        self.token_ids = (
            torch.zeros(batch_size, max_seq_len, dtype=torch.long, device=self.device)
            if store_token_ids
            else None
        )
        self.length = 0  # slots filled (shared by the batch)
        self.pad = torch.zeros(batch_size, dtype=torch.long, device=self.device)

    # --- accounting -------------------------------------------------------------------------
    @property
    def elements_per_token(self) -> int:
        return sum(_numel(spec) for spec in self.specs)

    @property
    def nbytes(self) -> int:
        """Bytes of KV held by the preallocated buffers (batch_size * max_seq_len tokens)."""
        return sum(t.numel() * t.element_size() for layer in self.layers for t in layer.values())

    @property
    def nbytes_used(self) -> int:
        """Bytes of the filled slots: batch_size * length tokens."""
        return (
            self.batch_size
            * self.length
            * self.elements_per_token
            * torch.empty((), dtype=self.dtype).element_size()
        )

    @property
    def seq_lengths(self) -> torch.Tensor:
        """Real (unpadded) tokens held per sequence."""
        return self.length - self.pad

    # --- use ----------------------------------------------------------------------------------
    def reset(self) -> None:
        self.length = 0
        self.pad.zero_()

    def set_left_padding(self, pad: torch.Tensor | list[int]) -> None:
        """Declare how many leading slots of each sequence are padding; call before the first prefill."""
        if self.length:
            raise CacheError("set_left_padding must be called on an empty cache")
        pad = torch.as_tensor(pad, dtype=torch.long, device=self.device)
        if pad.shape != (self.batch_size,):
            raise CacheError(f"pad must have shape ({self.batch_size},), got {tuple(pad.shape)}")
        if bool((pad < 0).any()) or bool((pad >= self.max_seq_len).any()):
            raise CacheError(f"pad values must be in [0, max_seq_len={self.max_seq_len}), got {pad.tolist()}")
        self.pad.copy_(pad)

    def check_append(self, batch_size: int, n_new: int, dtype: torch.dtype, device: torch.device) -> None:
        if batch_size != self.batch_size:
            raise CacheError(
                f"batch of {batch_size} sequences does not match the cache's batch_size={self.batch_size}"
            )
        if self.length + n_new > self.max_seq_len:
            raise CacheError(
                f"cache full: {self.length} cached + {n_new} new tokens exceed max_seq_len={self.max_seq_len}"
            )
        if torch.device(device).type != self.device.type:
            raise CacheError(f"inputs on {device} but the cache is on {self.device}")
        if dtype != self.dtype:
            raise CacheError(
                f"model computes in {dtype} but the cache holds {self.dtype}; build it with dtype={dtype}"
            )

    def __repr__(self) -> str:
        return (
            f"KVCache(layers={len(self.layers)}, batch={self.batch_size}, max_seq_len={self.max_seq_len}, "
            f"length={self.length}, dtype={self.dtype}, mode={self.mode}, nbytes={self.nbytes})"
        )
