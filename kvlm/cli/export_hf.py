"""`kvlm export-hf CHECKPOINT OUT`: export a checkpoint as a Hugging Face transformers folder (kvlm.interop.hf).

Prints the folder and its files (one JSON object with ``--json``)."""

from __future__ import annotations

import argparse
import importlib.util
import json

import torch


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", help="kvlm checkpoint folder")
    p.add_argument("out", help="output folder (new or empty; --force replaces a previous export)")
    p.add_argument("--format", choices=["kvlm", "deepseek-v3", "llama"], default="kvlm",
                   help="kvlm: model_type kvlm, any mechanism (with its remote code); deepseek-v3 (MLA) / llama "
                   "(MHA/GQA/MQA): transformers' own classes, served by vLLM and SGLang (default: kvlm)")  # fmt: skip
    p.add_argument("--no-remote-code", action="store_true",
                   help="do not copy kvlm's source into the folder (loading then needs kvlm installed)")  # fmt: skip
    p.add_argument(
        "--dtype", choices=["float32", "bfloat16", "float16"], default=None, help="default: as saved"
    )
    p.add_argument("--force", action="store_true",
                   help="replace OUT if it holds a previous kvlm export (never anything else, nor the checkpoint)")  # fmt: skip
    p.add_argument("--json", action="store_true", help="the last stdout line is a JSON object")


def main(args) -> int:
    if importlib.util.find_spec("transformers") is None:
        raise ValueError("export-hf needs transformers: pip install 'kvlm[hf]'")
    # imported here, once transformers is known to be installed: it is an optional dependency (kvlm[hf])
    from kvlm.interop.hf import export_hf

    dtype = getattr(torch, args.dtype) if args.dtype else None
    out = export_hf(
        args.checkpoint, args.out, remote_code=not args.no_remote_code, dtype=dtype, force=args.force,
        format=args.format,
    )  # fmt: skip
    files = sorted(p.name for p in out.iterdir())
    if args.json:
        print(json.dumps({"out": str(out), "files": files}))
    else:
        print(f"wrote {out}: {', '.join(files)}")
    return 0
