"""The per-call step context and the softmax attention every mechanism ends in.

- ``Step``: where the new tokens of one model call sit (positions, cache slots, mask, decode mode), built once
  per call and shared by all layers. Every field is declared here; mechanisms keep no memos on it.
  ``Step.trace``, when a list, collects ``(layer_idx, route)`` for the route each layer actually ran, so tests
  and benchmarks can prove which route was taken.
- ``MODES``: the decode modes a caller may ask for (``"auto"``, ``"naive"``, ``"absorbed"``, ``"expand"``);
  what each means for a mechanism is its ``decode_routes``.
- ``attend``: SDPA over keys shared by groups of query heads (GQA-style), float64 on plain math for exact tests.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

MODES = ("auto", "naive", "absorbed", "expand")


@dataclass(slots=True)  # slots: a field that is not declared here cannot be set (no memos on the step)
class Step:
    """Where the new tokens of one forward call sit. Built once per model call, shared by all layers.

    Cache slots are shared by the batch; a sequence b uses slots [pad[b], end). Its token in slot s has
    position s - pad[b]. ``start`` is the first slot written by this call, ``end`` one past the last.
    """

    positions: torch.Tensor  # (B, T) absolute positions of the new tokens
    start: int = 0
    end: int = 0
    mask: torch.Tensor | None = None  # (B, 1, T, end) bool, True = may attend; None = see `causal`
    causal: bool = True  # with mask None: causal among new tokens (start == 0) or all visible (T == 1)
    token_ids: torch.Tensor | None = None  # (B, T), for mechanisms gated by the token (eg-mla)
    mode: str = "auto"
    cached_token_ids: torch.Tensor | None = None  # (B, end): token ids of every filled slot (eg-mla)
    # when a list: each attention layer appends (layer_idx, route) for the route it ran ("plain", "absorbed", ...)
    trace: list[tuple[int, str]] | None = None
    # RoPE cos/sin of the new tokens' positions, computed once per call and shared by every layer (``cos_sin``)
    rope_angles: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @property
    def n_new(self) -> int:
        return self.positions.shape[1]

    def record(self, layer_idx: int, route: str) -> None:
        """Note that layer ``layer_idx`` ran ``route`` (kept only when ``trace`` is a list)."""
        if self.trace is not None:
            self.trace.append((layer_idx, route))

    def cos_sin(self, rope, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary tables of the new tokens for ``apply_rope`` (``rope.cos_sin(self.positions, dtype,
        full=True)``, whole-width: ``apply_rope``'s short form), computed once per call for all the layers whose
        rotary tables agree (same width, base and device). Every position is below ``end`` (both builders place
        them so), which spares the table's range check a read-back of the positions."""
        key = (rope.dim, rope.theta, dtype, rope.cos_table.device)
        angles = self.rope_angles.get(key)
        if angles is None:
            end = self.end if self.end > 0 else None  # 0: a Step built by hand, positions unchecked
            angles = self.rope_angles[key] = rope.cos_sin(self.positions, dtype, end=end, full=True)
        return angles

    def visible(self, T: int, S: int, device: torch.device) -> torch.Tensor | None:
        """Which of the S keys each of the T new queries may see, (B or 1, 1, T, S) bool, or None for all:
        the explicit mask, else causal with the new tokens last (the rule ``attend`` applies)."""
        if self.mask is not None:
            return self.mask
        if self.causal and T > 1:
            return torch.ones(T, S, dtype=torch.bool, device=device).tril(S - T)[None, None]
        return None

    @staticmethod
    def build(
        token_ids: torch.Tensor,
        start: int = 0,
        pad: torch.Tensor | None = None,
        mode: str = "auto",
        trace: list[tuple[int, str]] | None = None,
        padded: bool | None = None,
    ) -> Step:
        """Positions and mask for new tokens written at slots [start, start + T).

        pad (B,) counts left-padding slots per sequence (None or all zero: no padding); trace: see ``Step.trace``;
        padded: whether any pad is non-zero when the caller knows it on the host (None: read ``pad`` back)."""
        if mode not in MODES:
            raise ValueError(f"unknown attention mode {mode!r}; known: {', '.join(MODES)}")
        B, T = token_ids.shape
        device = token_ids.device
        end = start + T
        slots = torch.arange(start, end, device=device)
        if padded is None:
            padded = pad is not None and bool(pad.any())
        if pad is None or not padded:
            positions = slots.expand(B, T)
            needs_mask = start > 0 and T > 1  # causal among the new tokens, all of the past visible
            mask = None
            if needs_mask:
                key = torch.arange(end, device=device)
                mask = (key[None, :] <= slots[:, None])[None, None].expand(B, 1, T, end)
            return Step(positions, start, end, mask, True, token_ids, mode, trace=trace)
        pad = pad.to(device)
        positions = (slots[None, :] - pad[:, None]).clamp(min=0)
        key = torch.arange(end, device=device)
        causal = key[None, :] <= slots[:, None]  # (T, end)
        valid = key[None, :] >= pad[:, None]  # (B, end)
        mask = causal[None] & valid[:, None, :]  # (B, T, end)
        # a padding query would attend to nothing (NaN); let it see itself, its output is discarded. (By
        # comparison, not an indexed write of True: that copies a host scalar, which a CUDA graph cannot capture.)
        own = key[None, :] == slots[:, None]  # (T, end)
        mask = (mask | (own[None] & ~valid[:, None, :]))[:, None]
        return Step(positions, start, end, mask, False, token_ids, mode, trace=trace)

    @staticmethod
    def build_ragged(
        token_ids: torch.Tensor,
        seq_lens: torch.Tensor | list[int],
        mode: str = "auto",
        trace: list[tuple[int, str]] | None = None,
        n_new: torch.Tensor | list[int] | None = None,
    ) -> Step:
        """Positions and mask for sequences with their own lengths (a paged cache: no shared slots, no padding).

        Sequence b holds seq_lens[b] tokens; its T new tokens take positions len_b .. len_b + T - 1 and its
        keys are logical slots [0, len_b + T). Keys are gathered up to end = max(len_b) + T; key j is visible
        to new token t of sequence b iff j <= len_b + t (the slots past a shorter sequence's end are masked).
        ``start`` is min(len_b): the first slot any sequence writes (layouts index by ``positions``).

        ``n_new`` (B,): rows with fewer new tokens than T (several prefill chunks in one call), each row's
        n_new[b] real tokens last (left padding, so the last column is every row's last token). A padding token
        gets position len_b and sees keys [0, len_b], never an empty row (no NaN); the cache stores none of them
        and no real token sees them, so their outputs are ignored.

        ``seq_lens`` and ``n_new`` may be lists of ints (what a paged cache holds on the host): then ``start``,
        ``end`` and the padding test need no read-back of a tensor."""
        if mode not in MODES:
            raise ValueError(f"unknown attention mode {mode!r}; known: {', '.join(MODES)}")
        B, T = token_ids.shape
        device = token_ids.device
        if isinstance(seq_lens, list):  # host values: the bounds in Python, one host-to-device copy each
            rows = n_new if n_new is not None else [T] * B
            start = min(seq_lens)
            end = max(n + max(r, 1) for n, r in zip(seq_lens, rows))  # last token at len_b + r_b - 1
            padded = any(r != T for r in rows)
            seq_lens = torch.tensor(seq_lens, dtype=torch.long, device=device)
            n_new = torch.tensor(rows, dtype=torch.long, device=device) if padded else None
        else:
            seq_lens = seq_lens.to(device=device, dtype=torch.long)
            padded = n_new is not None and bool((n_new != T).any())
            start = end = None
        offsets = torch.arange(T, device=device)
        if padded:
            offsets = (offsets - (T - n_new.to(device=device, dtype=torch.long))[:, None]).clamp(min=0)
        positions = seq_lens[:, None] + offsets  # (B, T)
        if start is None:
            start = int(seq_lens.min())
            end = int(positions[:, -1].max()) + 1
        mask = None
        # padded, ragged, or a chunk after cached tokens
        if padded or start != end - T or T > 1 and start > 0:
            key = torch.arange(end, device=device)
            mask = (key[None, None, :] <= positions[:, :, None])[:, None]  # (B, 1, T, end)
        return Step(positions, start, end, mask, True, token_ids, mode, trace=trace)


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    step: Step,
    scale: float,
) -> torch.Tensor:
    """Softmax attention of q (B, Hq, T, D) over k (B, Hk, S, D), v (B, Hk, S, Dv), Hk divides Hq.

    Query head i uses key head i // (Hq / Hk) (repeat-interleave, as GQA). Returns (B, Hq, T, Dv).
    With shared key heads the query heads of a group are folded into the query-length axis, so each cached
    key and value is read once per group rather than once per query head: this is what makes MQA-style
    decoding (GQA, absorbed MLA) memory-efficient.
    """
    B, Hq, T, D = q.shape
    Hk, S = k.shape[1], k.shape[2]
    r = Hq // Hk
    mask = step.mask
    is_causal = mask is None and step.causal and T > 1
    if r > 1 and not is_causal:
        qf = q.reshape(B, Hk, r * T, D)
        if mask is not None:
            mask = mask[:, :, None].expand(B, 1, r, T, S).reshape(B, 1, r * T, S)
        out = _sdpa(qf, k, v, mask, False, scale)
        return out.reshape(B, Hq, T, v.shape[-1])
    if r > 1:
        k = k.repeat_interleave(r, dim=1)
        v = v.repeat_interleave(r, dim=1)
    return _sdpa(q, k, v, mask, is_causal, scale)


def _sdpa(q, k, v, mask, is_causal, scale):
    if q.shape[-1] != v.shape[-1] or q.dtype == torch.float64:
        # SDPA's fused CPU kernels need equal q/v widths; float64 gets the plain math for exact tests
        return _math_attention(q, k, v, mask, is_causal, scale)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale)


def _math_attention(q, k, v, mask, is_causal, scale):
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if is_causal:
        T, S = q.shape[-2], k.shape[-2]
        causal = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T)
        scores = scores.masked_fill(~causal, float("-inf"))
    elif mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), v)
