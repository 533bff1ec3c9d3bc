"""`kvlm bench-serve`: throughput, latency and capacity of `kvlm serve`, beside transformers' continuous batching.

For each variant (an attention at the bench reference shape, a preset, or a checkpoint) it starts ``kvlm serve``
in a subprocess with the cache pool fixed in bytes, runs C concurrent streaming clients for each C of
``--concurrency`` (kvlm.bench.serve.run_load), measures how many ``--capacity-context``-token sequences the pool
holds for each ``--kv-dtypes`` (``--capacity-demo`` also admits them), and runs transformers' ``generate_batch``
on the same weights and prompts. ``--url`` measures a server that is already running instead.

    kvlm bench-serve --variants mha,gqa,mla,mlra-4 --concurrency 1,8,32,64 --cache-bytes 2GiB --out runs/serve.json
"""

from __future__ import annotations

import json
from pathlib import Path

from kvlm.cli.common import parse_int_list, parse_overrides
from kvlm.cli.serve import parse_bytes
from kvlm.config import ConfigError

CAPACITY_BATCH = 4096  # max batch / queue of the capacity servers: larger than any pool's sequence count


def add_arguments(p) -> None:
    p.add_argument("--url", help="measure this running server (http://host:port) instead of starting one")
    p.add_argument("--variants", default="mha,gqa,mla,mlra-4",
                   help="attentions (at the bench reference shape), presets or checkpoint folders, comma-separated")  # fmt: skip
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="model field for attention variants, e.g. --set n_layer=2 (repeatable)")  # fmt: skip
    p.add_argument("--concurrency", default="1,8,32,64", help="concurrent clients, comma-separated")
    p.add_argument("--prompt-len", type=int, default=128, help="prompt tokens per request")
    p.add_argument("--output-len", type=int, default=64, help="generated tokens per request")
    p.add_argument("--rounds", type=int, default=2, help="requests per client")
    p.add_argument(
        "--cache-bytes", default="2GiB", help="the KV cache pool of every server (same bytes for all)"
    )
    p.add_argument("--page-size", type=int, default=16, help="tokens per cache page of the servers started")
    p.add_argument("--max-batch", type=int, default=64, help="most sequences a server decodes together")
    p.add_argument(
        "--prefill-chunk", type=int, default=256, help="prompt tokens prefilled per scheduler step"
    )
    p.add_argument(
        "--kv-dtypes", default="auto,int8", help="cache storages for the capacity table; load uses the first"
    )
    p.add_argument(
        "--capacity-context", type=int, default=4096, help="tokens per sequence in the capacity table"
    )
    p.add_argument("--capacity-demo", action="store_true",
                   help="admit the computed number of sequences at once and record the peak (prefills them all)")  # fmt: skip
    p.add_argument("--no-peers", action="store_true", help="skip transformers' continuous batching")
    p.add_argument("--no-load", action="store_true", help="capacity only")
    p.add_argument("--no-capacity", action="store_true", help="throughput and latency only")
    p.add_argument("--device", default=None, help="server device (default: cuda if available, else cpu)")
    p.add_argument("--threads", type=int, help="torch CPU threads of the server and the peer")
    p.add_argument(
        "--seed", type=int, default=0, help="random weights of the variants (server and peer alike)"
    )
    p.add_argument("--out", help="write the result JSON here")
    p.add_argument("--markdown", help="write the tables here")
    p.add_argument("--logs", help="folder for the servers' logs (default: next to --out, else none)")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object on the last line")


def _spec(variant: str, fields: dict, context: int) -> str:
    """An attention name -> ``bench/<name>:key=value...``; anything else is passed to kvlm serve as is."""
    from kvlm.attention import registry

    name, *pairs = variant.split(":")
    if name not in registry():
        return variant
    fields = {"max_seq_len": context, **fields}
    return "bench/" + ":".join([name, *pairs, *(f"{k}={v}" for k, v in fields.items())])


def main(args) -> int:
    import torch

    from kvlm.bench import serve as sb
    from kvlm.bench.peers import PeerUnavailable
    from kvlm.logs import get_logger

    log = get_logger("kvlm.cli.bench_serve")
    conc = parse_int_list(args.concurrency, "concurrency")
    kv_dtypes = [k.strip() for k in args.kv_dtypes.split(",") if k.strip()]
    if not kv_dtypes:
        raise ConfigError("--kv-dtypes needs at least one of auto, int8, fp8")
    cache_bytes = parse_bytes(args.cache_bytes)
    fields = parse_overrides(args.set)
    context = max(args.capacity_context, args.prompt_len + args.output_len)
    load_kw = dict(prompt_len=args.prompt_len, output_len=args.output_len, rounds=args.rounds, seed=args.seed)
    result = {
        "settings": {k: v for k, v in vars(args).items() if not k.startswith("_")},
        "env": sb.env_note(),
    }
    result["load"], result["capacity"] = [], []
    logs = Path(args.logs) if args.logs else (Path(args.out).parent / "serve-logs" if args.out else None)
    if logs:
        logs.mkdir(parents=True, exist_ok=True)

    def load(url: str, variant: str, kv: str):
        for c in conc:
            log.info("%s: %d clients", variant, c)
            row = sb.run_load(url, c, **load_kw)
            result["load"].append({"variant": variant, "engine": f"kvlm ({kv})", **row})

    def cap(url: str, variant: str, kv: str):
        log.info("%s: capacity (%s)", variant, kv)
        row = sb.capacity(url, args.capacity_context, demonstrate=args.capacity_demo)
        result["capacity"].append({"variant": variant, "kv_dtype": kv, **row})

    def server(spec: str, variant: str, kv: str, max_batch: int, max_waiting: int, tag: str):
        options = ["--cache-bytes", str(cache_bytes), "--page-size", str(args.page_size), "--max-batch", str(max_batch),
                   "--max-waiting", str(max_waiting), "--prefill-chunk", str(args.prefill_chunk), "--kv-dtype", kv,
                   "--seed", str(args.seed), "--no-access-log"]  # fmt: skip
        options += ["--device", args.device] if args.device else []
        options += ["--threads", str(args.threads)] if args.threads else []
        log_path = logs / f"{variant.replace('/', '_')}-{kv}-{tag}.log" if logs else None
        return sb.start_server(spec, options=options, log_path=log_path)

    if args.url:
        name = sb.model_name(args.url)
        if not args.no_load:
            load(args.url, name, "server's")
        if not args.no_capacity:
            cap(args.url, name, "server's")
    else:
        for variant in [v.strip() for v in args.variants.split(",") if v.strip()]:
            spec = _spec(variant, fields, context)
            if not args.no_load:
                proc, url = server(
                    spec, variant, kv_dtypes[0], args.max_batch, max(conc) * args.rounds + 8, "load"
                )
                try:
                    sb.warmup(url, prompt_len=args.prompt_len, output_len=args.output_len)
                    load(url, variant, kv_dtypes[0])
                finally:
                    sb.stop_server(proc)
            for kv in [] if args.no_capacity else kv_dtypes:
                # no batch or queue limit here: the cache pool alone decides how many sequences run together
                proc, url = server(spec, variant, kv, CAPACITY_BATCH, CAPACITY_BATCH, "capacity")
                try:
                    cap(url, variant, kv)
                finally:
                    sb.stop_server(proc)
            if not args.no_peers and not args.no_load:
                _peers(sb, spec, variant, conc, load_kw, cache_bytes, args, result, PeerUnavailable, torch)
    text = sb.markdown(result)
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2))
    if args.json:
        print(json.dumps(result))
    return 0


def _peers(sb, spec, variant, conc, load_kw, cache_bytes, args, result, PeerUnavailable, torch) -> None:
    from kvlm.serve.launch import load_served_model

    if args.threads:
        torch.set_num_threads(args.threads)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if torch.device(device).type == "cuda" else None  # what kvlm serve uses
    model = load_served_model(spec, seed=args.seed, device=device, dtype=dtype).model
    for c in conc:
        try:
            row = sb.peer_load(model, c, cache_bytes=cache_bytes, page_size=args.page_size, **load_kw)
        except (PeerUnavailable, sb.ServeBenchError, RuntimeError) as e:
            result["load"].append({"variant": variant, "engine": "transformers", "concurrency": c,
                                   "error": f"{type(e).__name__}: {e}"})  # fmt: skip
            if isinstance(e, PeerUnavailable):
                break
            continue
        result["load"].append({"variant": variant, "engine": row.pop("peer"), **row})
    del model
