"""`kvlm generate CHECKPOINT --prompt TEXT`: stream text from a checkpoint (kvlm.inference.generation).

One prompt streams its continuation to stdout as it is decoded; several prompts (or ``--json``) print the
completions at the end. The prefill / decode timing goes to stderr."""

from __future__ import annotations

import json
import os
import sys

import torch

from kvlm.attention.base import MODES
from kvlm.checkpoint import CheckpointError
from kvlm.cli.common import check_utf8, finite_float, nonnegative_int, positive_int, resolve_device
from kvlm.inference.generation import TextStream, generate
from kvlm.interop.hf_folder import load_model_folder


def add_arguments(p) -> None:
    p.add_argument("checkpoint", help="checkpoint folder (with tokenizer.json), or a Hugging Face folder: a "
                   "`kvlm export-hf` export (any --format), a Llama or dense DeepseekV3 model")  # fmt: skip
    p.add_argument("--prompt", action="append", required=True, help="prompt text; repeat for a batch")
    p.add_argument("--max-new-tokens", type=nonnegative_int, default=100, help="tokens to generate at most")
    p.add_argument("--temperature", type=finite_float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=nonnegative_int, default=None, help="sample among the k likeliest tokens (default: all)")
    p.add_argument("--top-p", type=finite_float, default=None, help="nucleus sampling mass (default: off)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (default: unseeded)")
    p.add_argument("--mode", choices=MODES, default="auto", help="attention route for prefill and decode")
    p.add_argument("--no-stop", action="store_true", help="do not stop at the model's stop tokens (end of text, a chat model's end of turn)")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="default: bfloat16 on cuda, float32 on cpu")  # fmt: skip
    p.add_argument("--compile", action="store_true",
                   help="decode through torch.compile: faster steps after tens of seconds of compiling (long outputs)")  # fmt: skip
    p.add_argument("--json", action="store_true", help="no streaming; the last stdout line is a JSON object")
    p.add_argument("--tp", type=positive_int, default=1,
                   help="tensor-parallel degree N, under `torchrun --nproc-per-node N -m kvlm.cli generate ...` "
                   "(each rank holds its shard of every layer and of the KV cache; kvlm/parallel/)")  # fmt: skip


def main(args) -> int:
    prompts_text = [check_utf8(text, f"--prompt {i + 1}") for i, text in enumerate(args.prompt)]
    device = resolve_device(args.device)
    tp = None
    if args.tp > 1:  # join torchrun's group; rank 0 alone prints
        # imported here: only a tensor-parallel run needs torch.distributed's process groups
        from kvlm.parallel.mesh import tp_setup

        tp = tp_setup(args.tp, device.type)
        device = tp.device
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else None)
    model, tokenizer, _meta = load_model_folder(args.checkpoint, device=device, dtype=dtype)
    if tp is not None:
        from kvlm.parallel.tensor_parallel import shard_model

        model = shard_model(model, tp.rank, tp.world, inplace=True)
    if tokenizer is None:
        raise CheckpointError(
            f"checkpoint {args.checkpoint} has no tokenizer.json: cannot encode a text prompt"
        )
    eos = getattr(tokenizer, "eos_id", None)
    prompts = []
    for text in prompts_text:
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
            stop_tokens=None if args.no_stop or eos is None else getattr(tokenizer, "stop_ids", [eos]),
            callback=on_step if stream else None,
            mode=args.mode,
            return_stats=True,
            compile=args.compile,
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
        f"decode {stats['decode_tokens']} tokens" + (f" at {tps:.1f} tokens/s" if tps else "")
        + (f"; compiling {stats['compile_s']:.1f} s" if stats["compile_s"] else ""),
        file=sys.stderr,
    )
    if args.json:
        result = {"prompts": args.prompt, "completions": texts, "token_ids": out, **stats}
        print(json.dumps(result))
    return 0
