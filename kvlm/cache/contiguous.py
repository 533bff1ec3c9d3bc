"""The KV cache of a model: per layer, exactly the per-token tensors the mechanism's ``cache_spec()`` declares.

``KVCache`` holds one ``CacheLayer`` per attention layer (``cache.layers[i]``), today ``ContiguousLayer``: a
tensor declared with per-token shape (*lead, last) is stored as a buffer (B, *lead, max_seq_len, last), the
sequence axis second to last so that the filled part is a strided view that attention kernels read without a
copy (for MHA: (B, g, S, d_h), the layout SDPA wants). Mechanisms reach it only through ``CacheLayer``.

Batches of prompts with different lengths are left-padded: slots are shared by the batch and sequence b
starts at slot ``pad[b]``; attention masks slots before it, and positions count from it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvlm.cache.layer import ContiguousLayer, StepSlots
from kvlm.errors import CacheError

if TYPE_CHECKING:
    from kvlm.attention.step import Step


class KVCache:
    """The model's cache: ``layers[i]`` is layer i's ``CacheLayer``; ``length`` slots are filled, shared by
    the batch; ``pad`` counts each sequence's left-padding slots; ``token_ids`` (or None) the token of every
    slot, for mechanisms that read it (``needs_token_ids``). ``mode``: "compact" or "naive" (materialised K/V).
    """

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
        # token ids of every cached slot, for mechanisms that rebuild K/V from the token (eg-mla);
        # one int per token for the whole model, not per layer, so not KV accounting.
        self.token_ids = (
            torch.zeros(batch_size, max_seq_len, dtype=torch.long, device=self.device)
            if store_token_ids
            else None
        )
        self.length = 0  # slots filled (shared by the batch)
        self.pad = torch.zeros(batch_size, dtype=torch.long, device=self.device)
        # the padding's values on the host, kept beside ``pad`` by the methods that change it (set_left_padding,
        # reorder_, reset; never write ``pad`` directly): a step reads these, not the tensor, so a decode step on
        # a GPU waits for nothing and can be captured in a CUDA graph
        self.host_pad: list[int] = [0] * batch_size
        # per step, the block views' start / end and their host totals, built once for all layers
        self.slots = StepSlots(batch_size, self.device, self.pad)
        self.layers: list[ContiguousLayer] = [
            ContiguousLayer(
                spec,
                batch_size,
                max_seq_len,
                dtype,
                mode == "naive",
                self.token_ids,
                self.device,
                pad=self.pad,
                slots=self.slots,
            )
            for spec in specs
        ]

    # --- accounting -------------------------------------------------------------------------
    @property
    def elements_per_token(self) -> int:
        return sum(layer.elements_per_token for layer in self.layers)

    @property
    def nbytes(self) -> int:
        """Bytes of KV held for batch_size * max_seq_len tokens (from the cache specs)."""
        return sum(layer.nbytes for layer in self.layers)

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

    # --- one model call -------------------------------------------------------------------------
    def begin_step(self, tokens: torch.Tensor, dtype: torch.dtype, mode: str = "auto", trace=None, fits=None):
        """Check and place the new tokens (B, T) of one model call: the ``Step`` every layer shares (slots
        [length, length + T), left padding masked) with the tokens' ids stored. ``fits(cache)`` checks on
        first use that the cache was built for the calling model. ``commit(step)`` after the layers."""
        from kvlm.attention.step import Step  # the attention layer sits above the cache in the layering

        B, T = tokens.shape
        self.check_append(B, T, dtype, tokens.device)
        if (
            self.length == 0 and fits is not None
        ):  # a cache built for another model fails obscurely deep inside
            fits(self)
        if mode == "auto" and self.mode == "naive":
            mode = "naive"  # a materialised K/V cache has one route
        # eagerly the padding is read to the host once per call: Step.build then needs no read-back of its own,
        # and the layers' block views take their key counts from it (``StepSlots``), not one read-back each.
        # Traced, nothing is read back (it would break the graph and leave the step's end a constant of the graph
        # after it: a recompile every step); the masks then allow for padding, and the kernels count keys.
        pads = None if torch.compiler.is_compiling() else self.host_pad
        step = Step.build(tokens, self.length, self.pad, mode, trace, padded=pads is None or any(pads))
        self.slots.begin(step, pads)
        step.cached_token_ids = self.append_token_ids(tokens, step)
        return step

    def commit(self, step: Step) -> None:
        """The layers have stored the step's tokens: they are now cached."""
        self.length = step.end

    # --- use ----------------------------------------------------------------------------------
    def append_token_ids(self, tokens: torch.Tensor, step: Step) -> torch.Tensor | None:
        """Store the new tokens' ids (B, T) in slots [step.start, step.end) when this cache keeps ids; return
        the ids of every filled slot (B, step.end), else None."""
        if self.token_ids is None:
            return None
        self.token_ids[:, step.start : step.end] = tokens
        return self.token_ids[:, : step.end]

    def fill_random_(self, length: int, vocab_size: int) -> None:
        """Make the cache hold ``length`` random tokens, as a prefill would have left it (benchmarks)."""
        if not 0 <= length <= self.max_seq_len:
            raise CacheError(f"length={length} is outside [0, max_seq_len={self.max_seq_len}]")
        for layer in self.layers:
            layer.fill_random_(length)
        if self.token_ids is not None:
            self.token_ids[:, :length].random_(0, vocab_size)
        self.length = length

    def reset(self) -> None:
        self.length = 0
        self.pad.zero_()
        self.host_pad = [0] * self.batch_size

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
        self.host_pad = pad.tolist()

    def reorder_(self, index: torch.Tensor) -> None:
        """Sequence b continues sequence ``index[b]`` (beam search): its cached tensors, padding and token ids."""
        index = index.to(self.device)
        for layer in self.layers:
            for buf in layer.values():
                buf.copy_(buf.index_select(0, index))
        self.pad.copy_(self.pad.index_select(0, index))
        self.host_pad = self.pad.tolist()
        if self.token_ids is not None:
            self.token_ids.copy_(self.token_ids.index_select(0, index))

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
