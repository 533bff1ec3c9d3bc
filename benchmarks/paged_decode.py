"""Decode step time through the paged cache against the contiguous cache, at the bench reference point.

    python benchmarks/paged_decode.py                      # reference shape, batch 8, 4096 cached tokens, 2 threads
    python benchmarks/paged_decode.py --variants mlra-4 --kernels on,off   # the kernel against the plain path
    python benchmarks/paged_decode.py --variants mla --context 1024 --steps 4 --repeats 2   # a quick look

For each variant: the median time of one decode step (all layers, logits included) with the contiguous cache
(``model.new_cache``) and with the paged cache (``PagedKVCache``, page size 16, every sequence's pages
scattered over the pool), and the time of the gather alone (``PagedLayer.read`` of every cached tensor of
every layer for the batch: the copy the paged layout costs when no kernel reads the pages in place through
``CacheLayer.block_view``). int8 rows add the dequantization. ``--kernels on,off`` times every configuration
with the decode kernels (kvlm.kernels) and without them (``KVLM_KERNELS=0``: the plain PyTorch path).

The configurations of one variant are timed interleaved (each repeat runs every configuration once, in turn),
so a load change on a shared machine hits all of them alike; the medians over the repeats are reported. Prints
a markdown table and one JSON line.
"""

import argparse
import json
import os
import statistics
import time

import torch

from kvlm import ModelConfig, build_model, kernels
from kvlm.bench.suites import REFERENCE_SHAPE
from kvlm.cache import PagedKVCache
from kvlm.kernels import cpu as kernels_cpu


def timed(fn, steps):
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    return (time.perf_counter() - t0) / steps


def interleaved_medians(fns: dict, steps: int, warmup: int, repeats: int) -> dict:
    """{name: (fn, kernels_on)} -> {name: median seconds per call}, the configurations timed in turn."""
    runs = {name: [] for name in fns}
    for fn, on in fns.values():
        os.environ[kernels_cpu.ENV] = "1" if on else "0"
        for _ in range(warmup):
            fn()
    for _ in range(repeats):
        for name, (fn, on) in fns.items():
            os.environ[kernels_cpu.ENV] = "1" if on else "0"
            runs[name].append(timed(fn, steps))
    os.environ[kernels_cpu.ENV] = "1"
    return {name: statistics.median(r) for name, r in runs.items()}


def paged_cache(model, B, S, P, kv, vocab):
    pcache = PagedKVCache.for_model(model, cache_tokens=B * (S + 2 * P), page_size=P, kv_dtype=kv)
    ids = list(range(B))
    for i in ids:  # interleave the sequences' pages, as a busy server leaves them
        pcache.add_sequence(i)
    for k in range(1, pcache.pages_for(S) + 1):
        for i in ids:
            pcache.reserve(i, min(k * P, S))  # one more page each, round robin
    for i in ids:
        pcache.fill_random_(i, S, vocab)
    return pcache, ids


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default="mla,mha,gqa,mlra-4")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--kv-dtypes", default="none,int8")
    ap.add_argument("--kernels", default="on", help="on, off or on,off (A/B against the plain path)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    B, S, P = args.batch, args.context, args.page_size
    modes = [m.strip() == "on" for m in args.kernels.split(",")]
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

        fns, paged = {}, {}
        for on in modes:
            fns[("contiguous", "float32", on)] = (contiguous_step, on)
        for kv in args.kv_dtypes.split(","):
            kv = None if kv == "none" else kv
            pcache, ids = paged_cache(model, B, S, P, kv, cfg.vocab_size)
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

            paged[kv or "float32"] = pcache
            for on in modes:
                fns[("paged", kv or "float32", on)] = (paged_step, on)
            fns[("gather", kv or "float32", False)] = (gather_only, False)
        calls_before = sum(kernels.CALLS.values())
        with torch.inference_mode():
            t = interleaved_medians(fns, args.steps, args.warmup, args.repeats)
        ran_kernels = sum(kernels.CALLS.values()) > calls_before
        for kv, pcache in paged.items():
            for on in modes:
                t_contig, t_paged = t[("contiguous", "float32", on)], t[("paged", kv, on)]
                rows.append(
                    dict(
                        variant=variant,
                        kv_dtype=kv,
                        kernels="on" if on else "off",
                        contiguous_ms=1e3 * t_contig,
                        paged_ms=1e3 * t_paged,
                        gather_ms=1e3 * t[("gather", kv, False)],
                        paged_over_contiguous=t_paged / t_contig,
                        bytes_per_token=pcache.bytes_per_token,
                    )
                )
        if any(modes) and not ran_kernels:
            print(f"warning: {variant}: no decode kernel ran with kernels on ({kernels_cpu.build_error()})")
    print(f"batch {B}, {S} cached tokens, page size {P}, {args.threads} threads, float32 model")
    print(
        "| variant | cache | kernels | contiguous ms/step | paged ms/step | paged / contiguous | gather ms "
        "| bytes/token |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['variant']} | {r['kv_dtype']} | {r['kernels']} | {r['contiguous_ms']:.1f} | "
            f"{r['paged_ms']:.1f} | {r['paged_over_contiguous']:.2f} | {r['gather_ms']:.1f} | "
            f"{r['bytes_per_token']} |"
        )
    print(json.dumps({"batch": B, "context": S, "page_size": P, "threads": args.threads, "rows": rows}))


if __name__ == "__main__":
    main()
