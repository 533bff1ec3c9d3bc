"""Generation: prefill the prompt into the KV cache, then decode one token per step.

    from kvlm import generate
    out = generate(model, [[5, 7, 9], [3]], 20, temperature=0.8, top_p=0.9, seed=0)

Prompts of different lengths are left-padded into one batch (``KVCache.set_left_padding``): every sequence
then writes its new token into the same cache slot each step. Prefill computes logits for the last prompt
token only (``last_only=True``); each decode step feeds the previous token and reads the whole cache.

Sampling (temperature, top-k, top-p, a seeded generator) and stop handling live in
``kvlm.inference.sampling``. A stop token ends its sequence; it is not part of the returned ids
(``stats["finish_reasons"]`` says "stop" or "length" per sequence). ``TextStream`` turns ids into text
as they arrive (for streaming output).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence

import torch

from kvlm.attention.base import MODES
from kvlm.attention.linear import ANY_ROWS, PANEL_MIN_ROWS, fastest_packing
from kvlm.cache import CacheError
from kvlm.inference.sampling import StopTracker, check_sampling, sample
from kvlm.kernels.few_rows import few_rows_available
from kvlm.logs import get_logger

logger = get_logger(__name__)

Prompt = Sequence[int] | torch.Tensor


def generate(
    model,
    prompt_ids: Prompt | Sequence[Prompt],
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    stop_tokens: Sequence[int] | int | None = None,
    callback: Callable[[list[int | None]], None] | None = None,
    mode: str = "auto",
    return_stats: bool = False,
    pack_weights: bool | None = None,
    compile: bool = False,
):
    """Generate up to ``max_new_tokens`` tokens after each prompt.

    prompt_ids: one prompt (list of ids or 1-D tensor) or a batch (list of such lists, or a 2-D tensor).
    Returns the new ids (prompt excluded): one list for one prompt, a list of lists for a batch; with
    ``return_stats=True`` a pair (ids, stats) where stats has prefill_s, prefill_tokens, decode_s,
    decode_tokens, decode_tokens_per_s, new_tokens, finish_reasons.

    callback(tokens) is called once per step with one entry per sequence: the new id, or None for a
    sequence that has already stopped (or stops at this step on a stop token).
    mode is passed to the model ("naive" builds the materialised per-head K/V cache). The cache has the
    model's dtype and device.
    pack_weights: decode with the weights in MKL's packed GEMM layout for this batch (``KVLM.pack_for_decode``;
    CPU float32 only; a second copy of the weights while it runs). None: in the layout ``packs_for`` names, where
    it names one (from batch 2 where the few-row kernel's panels, MKL's or oneDNN's layout measured faster than
    the unpacked product; from batch 4 without the kernel), with at least ``PACK_MIN_STEPS`` decode steps on CPU
    float32; and for the prefill of a long prompt (``prefill_packs``: from ``PACK_MIN_PREFILL_ROWS`` rows, where
    oneDNN's layout measured faster), repacked for the decode steps after it. Weights the caller packed beforehand
    are used and kept.
    compile: run the decode steps through ``torch.compile`` (the prefill stays eager): kvlm's CPU kernels and
    packed products enter its graph as custom operators (``kvlm.kernels.library``), so a step loses most of its
    Python and dispatch time. Compiling takes seconds to a minute, once per model class and batch (the first
    two steps: a fixed cache length, then a dynamic one); ``stats["compile_s"]`` is the time of the steps that
    compiled, left out of decode_s and decode_tokens. torch keeps at most ``torch._dynamo.config.recompile_limit``
    (8) compiled versions of the forward per process (a model configuration or batch size takes one or two):
    past it the steps run eager, with torch's warning, and compile_s stays 0. Worth it only for long generations:
    on this project's 2-core machine, at the bench reference shape, decoding ran 1.02-1.08x faster at batch 1
    (``benchmarks/step_compiled.py --generate``) and a step alone 1.03-1.06x at batch 1 / 8192 cached tokens and
    batch 8 / 4096 (most of what remains outside the kernels is torch's guard check, ~0.35 ms a step).
    """
    single, prompts = _as_prompts(prompt_ids)
    vocab = model.cfg.vocab_size
    for i, p in enumerate(prompts):
        if not p:
            raise ValueError(f"prompt {i} is empty: generation needs at least one prompt token")
        bad = [t for t in p if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt {i} has token ids outside the vocabulary [0, {vocab}): {bad[:5]}")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if mode not in MODES:
        raise ValueError(f"unknown attention mode {mode!r}; known: {', '.join(MODES)}")
    check_sampling(temperature, top_k, top_p)

    B = len(prompts)
    P = max(len(p) for p in prompts)
    capacity = model.cfg.max_seq_len
    if P + max_new_tokens > capacity:
        raise CacheError(
            f"longest prompt ({P} tokens) + max_new_tokens={max_new_tokens} = {P + max_new_tokens} exceeds "
            f"the model's max_seq_len={capacity} by {P + max_new_tokens - capacity}"
        )
    out: list[list[int]] = [[] for _ in range(B)]
    stats = {
        "prefill_s": 0.0,
        "prefill_tokens": sum(len(p) for p in prompts),
        "decode_s": 0.0,
        "decode_tokens": 0,
        "compile_s": 0.0,
    }
    stops = StopTracker(B, stop_tokens)
    if max_new_tokens == 0:
        return _result(single, out, stats, stops.reasons, return_stats)

    param = model.embed.weight
    device = param.device
    pad = [P - len(p) for p in prompts]
    tokens = torch.tensor([[0] * n + list(p) for n, p in zip(pad, prompts)], dtype=torch.long, device=device)
    # the last generated token is never fed back, so the cache needs P + max_new_tokens - 1 slots
    cache = model.new_cache(B, P + max_new_tokens - 1 if max_new_tokens > 1 else P, naive=(mode == "naive"))
    if any(pad):
        cache.set_left_padding(pad)
    gen = None
    if seed is not None:
        gen = torch.Generator(device=device)
        gen.manual_seed(seed)

    was_training = model.training
    # derived decode weights (absorbed MLA weights, EG-MLA gate tables) built once for this call, not per step;
    # train(True) below drops them again
    model.eval().prepare_for_inference()
    packed_here, decode_layout = _pack(model, B, B * P, max_new_tokens, pack_weights)
    decode_call = _compiled_forward(model) if compile else None
    try:
        with torch.inference_mode():
            t0 = _now(device)
            logits = model(tokens, cache=cache, mode=mode, last_only=True)[:, -1]
            nxt = sample(logits, temperature, top_k, top_p, gen)
            stats["prefill_s"] = _now(device) - t0
            if decode_layout is not _KEEP:  # packed for the prefill in another layout than decode's
                model.pack_for_decode(decode_layout)
            t0 = _now(device)
            for step in range(max_new_tokens):
                emitted = stops.step(nxt.tolist())
                for b, t in enumerate(emitted):
                    if t is not None:
                        out[b].append(t)
                if callback is not None:
                    callback(emitted)
                if stops.all_done or step == max_new_tokens - 1:
                    break
                if decode_call is None:
                    logits = model(nxt[:, None], cache=cache, mode=mode)[:, -1]
                    stats["decode_tokens"] += stops.active
                else:
                    graphs, t_step = _graphs_compiled(), _now(device)
                    logits = _run_compiled(decode_call, model, nxt[:, None], cache, mode)[:, -1]
                    if _graphs_compiled() != graphs:
                        stats["compile_s"] += _now(device) - t_step
                    else:
                        stats["decode_tokens"] += stops.active
                nxt = sample(logits, temperature, top_k, top_p, gen)
            stats["decode_s"] = _now(device) - t0 - stats["compile_s"]
    finally:
        if packed_here:
            model.pack_for_decode(None)
        model.train(was_training)
    logger.debug("generate: batch %d, %d prompt tokens, %d decode tokens", B, stats["prefill_tokens"],
                 stats["decode_tokens"])  # fmt: skip
    return _result(single, out, stats, stops.reasons, return_stats)


# --- helpers --------------------------------------------------------------------------------------------
PACK_MIN_STEPS = 16  # packing the reference shape's 260 MB of weights takes ~0.35 s: a few steps' savings
PACK_MIN_PREFILL_ROWS = 512  # prompt rows from which packing for the prefill alone repays itself (prefill_packs)
PREFILL_PROBE_ROWS = 64  # rows at which prefill_packs times the layouts (compute-dense like a prefill, quick)


def _packable(model) -> bool:
    """A model whose weights ``KVLM.pack_for_decode`` packs: a kvlm model on CPU in float32."""
    p = model.embed.weight
    return hasattr(model, "pack_for_decode") and p.device.type == "cpu" and p.dtype == torch.float32


def _packed_already(model) -> bool:
    """Packed beforehand (for a batch by the caller, or for any rows by a serving engine), or not a kvlm model:
    left as it is."""
    return not hasattr(model, "pack_for_decode") or model.lm_head._packed is not None


def packs_for(model, batch: int) -> int | str | None:
    """What decode steps of ``batch`` rows (sequences x new tokens) pack the weights for
    (``KVLM.pack_for_decode``), or None where it does not gain: a kvlm model on CPU in float32, from
    ``PANEL_MIN_ROWS`` (2) rows where the few-row kernel (kvlm.kernels.few_rows) is (at 1 row its panels were a
    near tie with the plain weight), from 4 where it is missing
    (below 4 rows F.linear streams the weights as fast, benchmarks/decode_limit.py "GEMMs alone"); the fastest of
    the unpacked product (the kernel up to ``MAX_ROWS`` rows, torch's beyond), the kernel's panels (as far), MKL's
    layout for ``batch`` rows and oneDNN's for any (up to 8 rows the panels alone, where the kernel is ahead of the
    libraries; ``fastest_packing``, on the LM head: once per process and row count)."""
    if not _packable(model):
        return None
    lowest = PANEL_MIN_ROWS if few_rows_available() else 4
    return fastest_packing(model.lm_head.weight, batch) if batch >= lowest else None


def prefill_packs(model, rows: int) -> bool:
    """Whether a prefill of ``rows`` rows (batch x longest prompt) runs with the weights packed in oneDNN's
    layout for any rows: a kvlm model on CPU in float32, from ``PACK_MIN_PREFILL_ROWS`` rows, where that layout
    measured fastest at ``PREFILL_PROBE_ROWS`` rows (``fastest_packing``, on the LM head, once per process). On
    AMD CPUs torch's own product runs MKL off its AVX-512 paths; on this project's AMD EPYC the reference shape's
    1024-token prefill took 300-330 ms packed against 500-590 unpacked, and packing took 45-85 ms."""
    if rows < PACK_MIN_PREFILL_ROWS or not _packable(model):
        return False
    return fastest_packing(model.lm_head.weight, PREFILL_PROBE_ROWS) == ANY_ROWS


@contextlib.contextmanager
def packed_for_rows(model, rows: int):
    """Within it, the weights packed in oneDNN's layout for forwards of ``rows`` rows where that measured faster
    (``prefill_packs``; evaluation's full-sequence forwards) and the caller has not packed them; dropped after.
    Yields whether it packed them."""
    packed = not _packed_already(model) and prefill_packs(model, rows) and model.pack_for_decode(ANY_ROWS) > 0
    try:
        yield packed
    finally:
        if packed:
            model.pack_for_decode(None)


_KEEP = object()  # _pack: the decode steps keep the prefill's packing


def _pack(model, batch: int, prompt_rows: int, max_new_tokens: int, pack_weights: bool | None):
    """Pack the weights for the prefill (``prompt_rows`` rows) and the decode steps (``batch`` rows). Returns
    (packed, decode): whether this call packed them (it drops them at its end), and the layout to repack for
    after the prefill (``KVLM.pack_for_decode``), or ``_KEEP``. Weights packed beforehand are left as they are
    (for this batch, or for any rows by a serving engine)."""
    if _packed_already(model):
        return False, _KEEP
    if pack_weights is None:
        decode = packs_for(model, batch) if max_new_tokens >= PACK_MIN_STEPS else None
        prefill = ANY_ROWS if prefill_packs(model, prompt_rows) else decode
    else:
        decode = prefill = batch if pack_weights else None
    if prefill is None or model.pack_for_decode(prefill) == 0:
        return False, _KEEP
    return True, (_KEEP if decode == prefill else decode)


_COMPILED: dict[type, Callable] = {}  # per model class: torch.compile's cache then holds one entry per batch size


def _compiled_forward(model) -> Callable:
    forward = _COMPILED.get(type(model))
    if forward is None:
        forward = _COMPILED[type(model)] = torch.compile(type(model).forward)
    return forward


def _graphs_compiled() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def _run_compiled(forward, model, tokens, cache, mode):
    try:
        return forward(model, tokens, cache=cache, mode=mode)
    except torch._dynamo.exc.BackendCompilerFailed as e:
        raise RuntimeError(
            f"generate(compile=True): torch.compile could not build the decode step ({str(e).splitlines()[0]}); "
            "on CPU its Inductor backend needs a C++ compiler. Generate without compile."
        ) from e


def _as_prompts(prompt_ids) -> tuple[bool, list[list[int]]]:
    if isinstance(prompt_ids, torch.Tensor):
        if prompt_ids.dim() == 1:
            return True, [prompt_ids.tolist()]
        if prompt_ids.dim() == 2:
            return False, prompt_ids.tolist()
        raise ValueError(f"prompt tensor must be 1-D or 2-D, got shape {tuple(prompt_ids.shape)}")
    prompt_ids = list(prompt_ids)
    if not prompt_ids:
        raise ValueError("no prompt given (empty list)")
    if all(isinstance(p, int) or (isinstance(p, torch.Tensor) and p.dim() == 0) for p in prompt_ids):
        return True, [[int(t) for t in prompt_ids]]
    prompts = []
    for p in prompt_ids:
        if isinstance(p, int):
            raise ValueError("mixed prompt: give one list of ids or a list of lists of ids")
        prompts.append([int(t) for t in (p.tolist() if isinstance(p, torch.Tensor) else p)])
    return False, prompts


def _now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _result(single, out, stats, reasons, return_stats):
    stats["new_tokens"] = sum(len(o) for o in out)
    stats["decode_tokens_per_s"] = (
        stats["decode_tokens"] / stats["decode_s"] if stats["decode_s"] > 0 else None
    )
    stats["finish_reasons"] = reasons[0] if single else reasons
    ids = out[0] if single else out
    return (ids, stats) if return_stats else ids


class TextStream:
    """Incremental detokenisation: ``push(id)`` returns the text that is now final.

    Decoding token by token breaks characters whose UTF-8 bytes span several byte-level BPE tokens, and
    some decoders treat a word-initial token differently on its own. So the new text is the difference
    between decoding a short window that ends at the new token and the same window without it, and text
    is held back while it ends in an incomplete character (U+FFFD)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix_offset = 0  # start of the context window
        self.read_offset = 0  # tokens before this are already emitted

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset])
        text = self.tokenizer.decode(self.ids[self.prefix_offset :])
        if len(text) > len(prefix) and not text.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return text[len(prefix) :]
        return ""

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character at the very end)."""
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset])
        text = self.tokenizer.decode(self.ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.ids)
        return text[len(prefix) :]


__all__ = ["TextStream", "generate", "packed_for_rows", "packs_for", "prefill_packs"]
