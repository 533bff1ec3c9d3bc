"""Decode step time through the paged cache against the contiguous cache, at the bench reference point.

    python benchmarks/paged_decode.py                      # reference shape, batch 8, 4096 cached tokens, 2 threads
    python benchmarks/paged_decode.py --variants mla --context 1024 --steps 4 --repeats 2   # a quick look

For each variant: the median time of one decode step (all layers, logits included) with the contiguous cache
(``model.new_cache``) and with the paged cache (``PagedKVCache``, page size 16, every sequence's pages
scattered over the pool), and the time of the gather alone (``PagedLayer.read`` of every cached tensor of
every layer for the batch: the copy the paged layout costs until a kernel reads the pages in place through
``CacheLayer.block_view``). int8 rows add the dequantization. Prints a markdown table and one JSON line.
"""

import argparse
import json
import statistics
import time

import torch

from kvlm import ModelConfig, build_model
from kvlm.bench.suites import REFERENCE_SHAPE
from kvlm.cache import PagedKVCache


def median_time(fn, steps, warmup, repeats):
    for _ in range(warmup):
        fn()
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(steps):
            fn()
        runs.append((time.perf_counter() - t0) / steps)
    return statistics.median(runs)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default="mla,mha,gqa,mlra-4")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--kv-dtypes", default="none,int8")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    B, S, P = args.batch, args.context, args.page_size
    rows = []
    for variant in args.variants.split(","):
        extra = {"n_kv_head": 4} if variant == "gqa" else {}
        cfg = ModelConfig(attention=variant, max_seq_len=S + 64, **REFERENCE_SHAPE, **extra)
        torch.manual_seed(0)
        model = build_model(cfg).eval().prepare_for_inference()
        tok = torch.randint(0, cfg.vocab_size, (B, 1))

        cache = model.new_cache(B, S + 1)
        cache.fill_random_(S, cfg.vocab_size)

        def contiguous_step(model=model, cache=cache, tok=tok):
            cache.length = S  # the same step again: write slot S, read S + 1 keys
            model(tok, cache=cache)

        with torch.inference_mode():
            t_contig = median_time(contiguous_step, args.steps, args.warmup, args.repeats)
        for kv in args.kv_dtypes.split(","):
            kv = None if kv == "none" else kv
            pcache = PagedKVCache.for_model(model, cache_tokens=B * (S + 2 * P), page_size=P, kv_dtype=kv)
            ids = list(range(B))
            for i in ids:  # interleave the sequences' pages, as a busy server leaves them
                pcache.add_sequence(i)
            for k in range(1, pcache.pages_for(S) + 1):
                for i in ids:
                    pcache.reserve(i, min(k * P, S))  # one more page each, round robin
            for i in ids:
                pcache.fill_random_(i, S, cfg.vocab_size)
            view = pcache.batch(ids)

            def paged_step(model=model, pcache=pcache, view=view, tok=tok, ids=ids):
                for i in ids:
                    pcache.seqs[i].length = S
                    del pcache.seqs[i].tokens[S:]
                model(tok, cache=view)

            def gather_only(pcache=pcache):
                for layer in pcache.layers:
                    for name in layer.spec:
                        layer.read(name, S + 1)

            with torch.inference_mode():
                t_paged = median_time(paged_step, args.steps, args.warmup, args.repeats)
                t_gather = median_time(gather_only, args.steps, args.warmup, args.repeats)
            rows.append(
                dict(
                    variant=variant,
                    kv_dtype=kv or "float32",
                    contiguous_ms=1e3 * t_contig,
                    paged_ms=1e3 * t_paged,
                    gather_ms=1e3 * t_gather,
                    paged_over_contiguous=t_paged / t_contig,
                    bytes_per_token=pcache.bytes_per_token,
                )
            )
    print(f"batch {B}, {S} cached tokens, page size {P}, {args.threads} threads, float32 model")
    print(
        "| variant | cache | contiguous ms/step | paged ms/step | paged / contiguous | gather ms | bytes/token |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['variant']} | {r['kv_dtype']} | {r['contiguous_ms']:.1f} | {r['paged_ms']:.1f} | "
            f"{r['paged_over_contiguous']:.2f} | {r['gather_ms']:.1f} | {r['bytes_per_token']} |"
        )
    print(json.dumps({"batch": B, "context": S, "page_size": P, "threads": args.threads, "rows": rows}))


if __name__ == "__main__":
    main()
