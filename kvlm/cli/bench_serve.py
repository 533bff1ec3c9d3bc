"""`kvlm bench-serve`: throughput, latency and capacity of `kvlm serve`, beside transformers' continuous batching.

For each variant (an attention at the bench reference shape, a preset, or a checkpoint) it starts ``kvlm serve``
in a subprocess with the cache pool fixed in bytes, runs C concurrent streaming clients for each C of
``--concurrency`` (kvlm.bench.serve.run_load), measures how many ``--capacity-context``-token sequences the pool
holds for each ``--kv-dtypes`` (``--capacity-demo`` also admits them), and runs transformers' ``generate_batch``
on the same weights and prompts (in-process: kvlm.bench.serve_inprocess). ``--in-process`` also drives kvlm's
engine in-process, beside the peer, so that neither pays HTTP; ``--hf-serve`` also measures ``transformers serve
--continuous-batching`` over HTTP on the exported folder (kvlm.bench.serve_hf). ``--url`` measures a server that
is already running instead.

    kvlm bench-serve --variants mha,gqa,mla,mlra-4 --concurrency 1,8,32,64 --cache-bytes 2GiB --out runs/serve.json
    kvlm bench-serve --variants mla --concurrency 1,8,32 --in-process --no-http --no-capacity   # engines only
"""

from __future__ import annotations

import json
from pathlib import Path

from kvlm.cli.common import parse_int_list, parse_overrides
from kvlm.cli.serve import parse_bytes
from kvlm.config import ConfigError
from kvlm.logs import get_logger

log = get_logger("kvlm.cli.bench_serve")
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
    p.add_argument("--in-process", action="store_true",
                   help="also run kvlm's engine in-process (no HTTP), beside the in-process peer")  # fmt: skip
    p.add_argument("--no-http", action="store_true", help="skip kvlm serve over HTTP (load rows)")
    p.add_argument("--hf-serve", action="store_true",
                   help="also measure `transformers serve --continuous-batching` over HTTP on the exported folder")  # fmt: skip
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

    from kvlm.bench import serve as sb

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
            result["load"].append({"variant": variant, "engine": f"kvlm ({kv}), HTTP", **row})

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
            if not args.no_load and not args.no_http:
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
            if not args.no_load and (args.in_process or not args.no_peers or args.hf_serve):
                _in_process(spec, variant, conc, load_kw, cache_bytes, kv_dtypes[0], args, result, logs)
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


def _error_row(variant: str, engine: str, c, e: Exception) -> dict:
    return {"variant": variant, "engine": engine, "concurrency": c, "error": f"{type(e).__name__}: {e}"}


def _in_process(spec, variant, conc, load_kw, cache_bytes, kv, args, result, logs) -> None:
    """For each C: kvlm's engine in-process (``--in-process``), then transformers' continuous batching on the
    same weights (unless ``--no-peers``), back to back so that both see the same machine; then transformers
    serve over HTTP (``--hf-serve``)."""
    import torch

    from kvlm.bench import serve_inprocess as ip
    from kvlm.bench.peers import PeerUnavailable, build_peer
    from kvlm.bench.serve import ServeBenchError
    from kvlm.serve.launch import load_served_model

    if args.threads:
        torch.set_num_threads(args.threads)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if torch.device(device).type == "cuda" else None  # what kvlm serve uses
    model = load_served_model(spec, seed=args.seed, device=device, dtype=dtype).model
    peer, peer_error = None, None
    if not args.no_peers or args.hf_serve:
        try:  # before the engine prepares the model for inference: the peer copies its plain weights
            peer = build_peer(model, paged=True)
        except PeerUnavailable as e:
            peer_error = e
    engine_kw = dict(page_size=args.page_size, max_batch=args.max_batch, prefill_chunk=args.prefill_chunk,
                     kv_dtype=None if kv == "auto" else kv)  # fmt: skip
    rows = result["load"]
    for c in conc:
        if args.in_process:
            log.info("%s: %d requests in flight, kvlm in-process", variant, c)
            row = ip.engine_load(model, c, cache_bytes=cache_bytes, **engine_kw, **load_kw)
            rows.append({"variant": variant, "engine": f"kvlm ({kv}), in-process", **row})
        if args.no_peers:
            continue
        if peer is None:
            rows.append(_error_row(variant, "transformers", c, peer_error))
            continue
        log.info("%s: %d requests in flight, transformers in-process", variant, c)
        try:
            row = ip.peer_load(
                model, c, cache_bytes=cache_bytes, page_size=args.page_size, peer=peer, **load_kw
            )
        except (ServeBenchError, RuntimeError) as e:
            rows.append(_error_row(variant, "transformers CB, in-process", c, e))
            continue
        rows.append({"variant": variant, "engine": row.pop("peer") + ", in-process", **row})
    if args.hf_serve:
        _hf_serve(peer, peer_error, model, variant, conc, load_kw, cache_bytes, args, rows, logs, device)
    del model, peer


def _hf_serve(peer, peer_error, model, variant, conc, load_kw, cache_bytes, args, rows, logs, device) -> None:
    import tempfile

    from kvlm.bench import serve_hf
    from kvlm.bench.serve import ServeBenchError, stop_server

    engine = "transformers serve CB"
    if peer is None:
        rows.append(_error_row(variant, engine + ", HTTP", "all", peer_error))
        return
    elem = next(model.parameters()).element_size()
    with tempfile.TemporaryDirectory(prefix="kvlm-hf-serve-") as tmp:
        # the stock export (what `kvlm export-hf` writes); the padded MLA peer cannot be saved (kvlm.bench.serve_hf)
        folder = serve_hf.export_folder(model, Path(tmp) / variant.replace("/", "_"))
        log_path = logs / f"{variant.replace('/', '_')}-transformers-serve.log" if logs else None
        proc, url, model_id = serve_hf.start_hf_server(
            folder, cache_bytes=cache_bytes, page_size=args.page_size, element_size=elem, device=device,
            max_batch_tokens=max(256, args.prompt_len) + max(conc), threads=args.threads, log_path=log_path,
        )  # fmt: skip
        try:
            serve_hf.hf_warmup(url, model_id, prompt_len=args.prompt_len, output_len=args.output_len)
            for c in conc:
                log.info("%s: %d clients, transformers serve", variant, c)
                row = serve_hf.hf_run_load(url, model_id, c, **load_kw)
                rows.append(
                    {"variant": variant, "engine": f"{engine} ({type(peer.model).__name__}), HTTP", **row}
                )
        except ServeBenchError as e:
            rows.append(_error_row(variant, engine + ", HTTP", "all", e))
        finally:
            stop_server(proc)
