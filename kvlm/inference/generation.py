"""Generation: prefill the prompt into the KV cache, then decode one token per step.

    from kvlm import generate
    out = generate(model, [[5, 7, 9], [3]], 20, temperature=0.8, top_p=0.9, seed=0)

Prompts of different lengths are left-padded into one batch (``KVCache.set_left_padding``): every sequence
then writes its new token into the same cache slot each step. Prefill computes logits for the last prompt
token only (``last_only=True``); each decode step feeds the previous token and reads the whole cache.

Sampling order: temperature, then top-k, then top-p (nucleus) on what top-k kept, then a draw from a
seeded ``torch.Generator`` so that a seed reproduces a run. ``temperature=0`` is greedy (argmax).

A stop token ends its sequence; it is not part of the returned ids (``stats["finish_reasons"]`` says
"stop" or "length" per sequence).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Sequence

import torch

from kvlm.attention.base import MODES
from kvlm.cache import CacheError

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
    _check_sampling(temperature, top_k, top_p)
    stops = _as_stop_set(stop_tokens)

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
    }
    reasons = ["length"] * B
    if max_new_tokens == 0:
        return _result(single, out, stats, reasons, return_stats)

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
    model.eval()
    try:
        with torch.inference_mode():
            t0 = _now(device)
            logits = model(tokens, cache=cache, mode=mode, last_only=True)[:, -1]
            nxt = sample(logits, temperature, top_k, top_p, gen)
            stats["prefill_s"] = _now(device) - t0
            t0 = _now(device)
            done = [False] * B
            for step in range(max_new_tokens):
                ids = nxt.tolist()
                emitted: list[int | None] = []
                for b, t in enumerate(ids):
                    if done[b] or t in stops:
                        emitted.append(None)
                        if not done[b]:
                            reasons[b] = "stop"
                            done[b] = True
                        continue
                    out[b].append(t)
                    emitted.append(t)
                if callback is not None:
                    callback(emitted)
                if all(done) or step == max_new_tokens - 1:
                    break
                logits = model(nxt[:, None], cache=cache, mode=mode)[:, -1]
                stats["decode_tokens"] += B - sum(done)
                nxt = sample(logits, temperature, top_k, top_p, gen)
            stats["decode_s"] = _now(device) - t0
    finally:
        model.train(was_training)
    return _result(single, out, stats, reasons, return_stats)


def sample(
    logits: torch.Tensor,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """logits (B, V) -> next ids (B,). temperature 0: argmax; else filter (top-k, top-p) and draw."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # bf16 -> fp32, fp64 stays
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = filter_logits(logits / temperature, top_k, top_p)
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


def filter_logits(logits: torch.Tensor, top_k: int | None = None, top_p: float | None = None) -> torch.Tensor:
    """Set to -inf every logit outside the top_k largest, then outside the smallest set of tokens whose
    probability reaches top_p (the token that crosses top_p is kept, so at least one token survives)."""
    V = logits.shape[-1]
    if top_k and top_k < V:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        before = probs.cumsum(dim=-1) - probs  # probability mass of the tokens ranked above
        drop_sorted = before >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


# --- helpers --------------------------------------------------------------------------------------------
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


def _as_stop_set(stop_tokens) -> set[int]:
    if stop_tokens is None:
        return set()
    if isinstance(stop_tokens, int):
        return {stop_tokens}
    return {int(t) for t in stop_tokens}


def _check_sampling(temperature, top_k, top_p) -> None:
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if top_k is not None and top_k < 0:
        raise ValueError(f"top_k must be >= 1 (or 0/None to disable), got {top_k}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")


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


# --- command line ---------------------------------------------------------------------------------------
def add_arguments(p) -> None:
    p.add_argument("checkpoint", help="checkpoint folder (with tokenizer.json)")
    p.add_argument("--prompt", action="append", required=True, help="prompt text; repeat for a batch")
    p.add_argument("--max-new-tokens", type=int, default=100)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--mode", choices=MODES, default="auto", help="attention route for prefill and decode")
    p.add_argument("--no-stop", action="store_true", help="do not stop at the tokenizer's end-of-text token")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="default: bfloat16 on cuda, float32 on cpu")  # fmt: skip
    p.add_argument("--json", action="store_true", help="no streaming; the last stdout line is a JSON object")
    p.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel degree N, under `torchrun --nproc-per-node N -m kvlm.cli generate ...` "
                   "(each rank holds its shard of every layer and of the KV cache; kvlm/distributed.py)")  # fmt: skip


def main(args) -> int:
    from kvlm.checkpoint import CheckpointError, load_checkpoint

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    tp = None
    if getattr(args, "tp", 1) > 1:  # join torchrun's group; rank 0 alone prints (kvlm/distributed.py)
        from kvlm.parallel.tensor_parallel import shard_model, tp_setup

        tp = tp_setup(args.tp, device.type)
        device = tp.device
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else None)
    model, tokenizer, _meta = load_checkpoint(args.checkpoint, device=device, dtype=dtype)
    if tp is not None:
        model = shard_model(model, tp.rank, tp.world, inplace=True)
    if tokenizer is None:
        raise CheckpointError(
            f"checkpoint {args.checkpoint} has no tokenizer.json: cannot encode a text prompt"
        )
    eos = getattr(tokenizer, "eos_id", None)
    prompts = []
    for text in args.prompt:
        ids = tokenizer.encode(text)
        if not ids and eos is not None:
            ids = [eos]  # an empty prompt starts from end-of-text, as GPT-2 does unconditioned sampling
        prompts.append(ids)
    stream = len(prompts) == 1 and not args.json
    streamer = TextStream(tokenizer) if stream else None
    if stream:
        sys.stdout.write(args.prompt[0])
        sys.stdout.flush()

    def on_step(tokens):
        if tokens[0] is not None:
            sys.stdout.write(streamer.push(tokens[0]))
            sys.stdout.flush()

    try:
        out, stats = generate(
            model,
            prompts,
            args.max_new_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            seed=args.seed,
            stop_tokens=None if args.no_stop or eos is None else [eos],
            callback=on_step if stream else None,
            mode=args.mode,
            return_stats=True,
        )
    except BrokenPipeError:  # stdout closed early (`kvlm generate ... | head`): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    texts = [tokenizer.decode(ids) for ids in out]
    if stream:
        sys.stdout.write(streamer.flush() + "\n")
    elif not args.json:
        for prompt, text in zip(args.prompt, texts):
            print(prompt + text)
    tps = stats["decode_tokens_per_s"]
    print(
        f"prefill {stats['prefill_tokens']} tokens in {stats['prefill_s'] * 1e3:.1f} ms; "
        f"decode {stats['decode_tokens']} tokens" + (f" at {tps:.1f} tokens/s" if tps else ""),
        file=sys.stderr,
    )
    if args.json:
        result = {"prompts": args.prompt, "completions": texts, "token_ids": out, **stats}
        print(json.dumps(result))
    return 0
