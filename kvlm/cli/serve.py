"""`kvlm serve CHECKPOINT_OR_PRESET`: an OpenAI-compatible HTTP server (kvlm.serve) on uvicorn.

A checkpoint folder is served with its tokenizer (and chat template, if it has one); a preset name
(``tiny/mla``, ``kvlm kv-table`` lists them) or ``bench/<attention>`` (the bench reference shape) is served with
random weights and a byte-level tokenizer, for benchmarking. Ctrl-C or SIGTERM shuts down gracefully: no new
requests, in-flight ones get ``--shutdown-timeout`` seconds to finish, then they are cancelled.

    kvlm serve runs/mla/checkpoint --port 8000 --cache-bytes 2GiB --kv-dtype int8
    curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
        -d '{"prompt": "Once upon a time", "max_tokens": 32, "temperature": 0}'
"""

from __future__ import annotations

import re

import torch

from kvlm.config import ConfigError

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "kib": 2**10, "mib": 2**20, "gib": 2**30}  # fmt: skip


def parse_bytes(text: str) -> int:
    """``"1073741824"``, ``"512MiB"``, ``"2GiB"``, ``"1.5GB"`` -> bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-z]*)\s*", str(text).lower())
    if m is None or m.group(2) not in _UNITS or float(m.group(1)) <= 0:
        raise ConfigError(
            f"--cache-bytes expects a positive size such as 2GiB, 500MB or 1000000, got {text!r}"
        )
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def add_arguments(p) -> None:
    p.add_argument("model", metavar="CHECKPOINT_OR_PRESET",
                   help="checkpoint folder, preset name (random weights) or bench/<attention>")  # fmt: skip
    p.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 exposes the server)")
    p.add_argument("--port", type=int, default=8000, help="TCP port to listen on")
    p.add_argument(
        "--model-name", help="the name clients pass as `model` (default: the folder or preset name)"
    )
    p.add_argument("--max-batch", type=int, default=64, help="most sequences decoded together")
    p.add_argument("--max-waiting", type=int, default=256,
                   help="most requests queued beyond --max-batch; more get HTTP 429")  # fmt: skip
    size = p.add_mutually_exclusive_group()
    size.add_argument("--cache-bytes", help="KV cache pool size, e.g. 2GiB (default: 65536 tokens)")
    size.add_argument("--cache-tokens", type=int, help="KV cache pool size in tokens")
    p.add_argument("--page-size", type=int, default=16, help="tokens per cache page")
    p.add_argument("--kv-dtype", choices=["auto", "int8", "fp8"], default="auto",
                   help="cache storage: auto = the model's dtype; int8/fp8 with a scale per token")  # fmt: skip
    p.add_argument("--prefill-chunk", type=int, default=256, help="most prompt tokens prefilled per step")
    p.add_argument(
        "--no-prefix-cache", action="store_true", help="do not share pages of common prompt prefixes"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of a preset's random weights")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="default: bfloat16 on cuda, float32 on cpu")  # fmt: skip
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--no-access-log", action="store_true", help="do not log every HTTP request")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests get to finish on shutdown before they are cancelled")  # fmt: skip


def main(args) -> int:
    from kvlm.serve.launch import build_server, load_served_model, uvicorn_server
    from kvlm.serve.server import require_server_stack

    require_server_stack()
    for name in ("max_batch", "page_size", "prefill_chunk"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.max_waiting < 0:
        raise ConfigError(f"--max-waiting must be >= 0, got {args.max_waiting}")
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else None)
    served = load_served_model(args.model, seed=args.seed, device=device, dtype=dtype)
    app, _engine = build_server(
        served,
        model_name=args.model_name,
        max_batch=args.max_batch,
        max_waiting=args.max_waiting,
        cache_bytes=parse_bytes(args.cache_bytes) if args.cache_bytes else None,
        cache_tokens=args.cache_tokens,
        page_size=args.page_size,
        kv_dtype=None if args.kv_dtype == "auto" else args.kv_dtype,
        prefill_chunk=args.prefill_chunk,
        enable_prefix_cache=not args.no_prefix_cache,
    )
    # SIGINT / SIGTERM: stop accepting, let in-flight requests finish for --shutdown-timeout seconds, abort the
    # rest, stop the engine thread (kvlm.serve.server.uvicorn_server); uvicorn then re-raises the signal
    server = uvicorn_server(app, host=args.host, port=args.port, graceful_s=args.shutdown_timeout,
                            access_log=not args.no_access_log)  # fmt: skip
    server.run()
    return 0
