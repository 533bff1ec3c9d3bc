"""Perplexity through the quantized paged cache against the unquantized one, on held-out real text.

    python benchmarks/kv_quant_ppl.py CHECKPOINT PREPARED_DATA [--windows 32] [--prefill 32] [--page-size 16]

Each window of the validation tokens (``seq_len`` = the model's context) goes through a ``PagedKVCache``:
``--prefill`` tokens as one chunk (the expand route reads the cached latents back), then the rest one token at a
time (decode: MLA's absorbed route over the cache), so every scored token attends over keys and values read from
the cache, quantized or not. Reports loss and perplexity for the model dtype (the reference), int8 and fp8
(e4m3), bytes per token of each, and the change in perplexity. The full causal forward (no cache) is printed
beside it as a check that the cached path computes the same thing.
"""

import argparse
import json
import math

import torch
import torch.nn.functional as F

from kvlm import load_checkpoint
from kvlm.cache import PagedKVCache
from kvlm.cache.quantized import fp8_dtype
from kvlm.data.prepared import load_prepared


def window_nll(model, cache, tokens, prefill):
    """Summed next-token NLL of ``tokens`` (1-D) through the cache, and the number of targets."""
    cache.add_sequence(0)
    view = cache.batch([0])
    logits = [model(tokens[None, :prefill], cache=view)[0]]
    for t in range(prefill, len(tokens) - 1):
        logits.append(model(tokens[None, t : t + 1], cache=view)[0])
    cache.free(0)
    logits = torch.cat(logits)
    return float(F.cross_entropy(logits, tokens[1:], reduction="sum")), len(tokens) - 1


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint")
    ap.add_argument("data")
    ap.add_argument("--windows", type=int, default=32)
    ap.add_argument("--prefill", type=int, default=32)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, _, _ = load_checkpoint(args.checkpoint)
    model.eval().prepare_for_inference()
    S = model.cfg.max_seq_len
    val = torch.from_numpy(load_prepared(args.data).val_tokens(args.windows * S).astype("int64"))
    windows = [val[i * S : (i + 1) * S] for i in range(len(val) // S)]
    kv_dtypes = [None, "int8"] + (["fp8"] if fp8_dtype() is not None else [])
    rows = {}
    with torch.inference_mode():
        full = sum(float(F.cross_entropy(model(w[None])[0, :-1], w[1:], reduction="sum")) for w in windows)
        n = sum(len(w) - 1 for w in windows)
        rows["no cache (full forward)"] = dict(loss=full / n, bytes_per_token=None)
        for kv in kv_dtypes:
            cache = PagedKVCache.for_model(model, cache_tokens=S, page_size=args.page_size, kv_dtype=kv)
            total = count = 0
            for w in windows:
                nll, k = window_nll(model, cache, w, args.prefill)
                total, count = total + nll, count + k
            rows[f"paged {kv or str(model.embed.weight.dtype).removeprefix('torch.')}"] = dict(
                loss=total / count, bytes_per_token=cache.bytes_per_token
            )
    ref = rows[next(k for k in rows if k.startswith("paged"))]["loss"]
    print(f"{args.checkpoint} on {args.data}: {len(windows)} windows of {S} tokens ({n} targets)")
    print("| cache | KV bytes/token | loss | perplexity | change vs unquantized |")
    print("|---|---|---|---|---|")
    for name, r in rows.items():
        r["perplexity"] = math.exp(r["loss"])
        r["ppl_change_pct"] = 100 * (math.exp(r["loss"] - ref) - 1)
        print(
            f"| {name} | {r['bytes_per_token'] or '-'} | {r['loss']:.4f} | {r['perplexity']:.3f} | "
            f"{r['ppl_change_pct']:+.2f} % |"
        )
    print(json.dumps({"checkpoint": args.checkpoint, "data": args.data, "targets": n, "rows": rows}))


if __name__ == "__main__":
    main()
