"""`kvlm import-hf SOURCE OUT`: import a Llama checkpoint, optionally converting it to MLA (kvlm.interop.convert).

Prints what was done (``key: value`` lines, or one JSON object with ``--json``) and writes a kvlm checkpoint."""

from __future__ import annotations

import argparse
import json

from kvlm.checkpoint import save_checkpoint
from kvlm.interop.convert import (
    ConvertError,
    convert_report,
    gqa_to_mla,
    import_llama,
    kvlm_tokenizer,
    load_hf_llama,
    text_tokens,
    window_perplexity,
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("source", help="Hugging Face Llama folder, or a .gguf file")
    p.add_argument("out", help="kvlm checkpoint folder to write")
    p.add_argument("--gguf-file", default=None, help="GGUF file name inside the source folder")
    p.add_argument(
        "--max-seq-len", type=int, default=None, help="default: the model's max_position_embeddings"
    )
    p.add_argument("--mla", action="store_true", help="convert to MLA (TransMLA / MHA2MLA style)")
    p.add_argument("--kv-lora-rank", type=int, default=None, help="d_c (default: full rank, exact latent)")
    p.add_argument(
        "--rope-head-dim", type=int, default=None, help="d_h^R rotary dims kept (default: head_dim)"
    )
    p.add_argument(
        "--rope-kv-heads",
        type=int,
        default=1,
        help="n_R RoPE key heads, a divisor of the source's kv heads (default 1, DeepSeek's shared k_rope; "
        "the kv head count makes full rank exact)",
    )
    p.add_argument(
        "--calib-data", default=None, help=".jsonl/.txt text for the PCA statistics (default: weights)"
    )
    p.add_argument("--calib-tokens", type=int, default=4096)
    p.add_argument("--eval-data", default=None, help=".jsonl/.txt text: report perplexity before and after")
    p.add_argument("--eval-tokens", type=int, default=4096)
    p.add_argument("--seq-len", type=int, default=256, help="window length for calibration and perplexity")
    p.add_argument("--json", action="store_true", help="the last stdout line is a JSON object")


def main(args) -> int:
    hf_model, hf_tok = load_hf_llama(args.source, args.gguf_file)
    model = import_llama(hf_model, args.max_seq_len)
    del hf_model
    tok = kvlm_tokenizer(hf_tok) if hf_tok is not None else None
    result: dict = {"source": str(args.source), "attention": model.cfg.attention}
    eval_windows = None
    if args.eval_data:
        if tok is None:
            raise ConvertError("--eval-data needs the source's tokenizer")
        eval_windows = text_tokens(args.eval_data, tok, args.eval_tokens, args.seq_len)
        result["perplexity_before"] = window_perplexity(model, eval_windows)
    if args.mla:
        calib = None
        if args.calib_data:
            if tok is None:
                raise ConvertError("--calib-data needs the source's tokenizer")
            calib = text_tokens(args.calib_data, tok, args.calib_tokens, args.seq_len)
        src_cfg = model.cfg
        model = gqa_to_mla(
            model, args.kv_lora_rank, args.rope_head_dim, calib, rope_kv_heads=args.rope_kv_heads
        )
        result.update(convert_report(src_cfg, model.cfg))
        result["attention"] = "mla"
        if eval_windows is not None:
            result["perplexity_after"] = window_perplexity(model, eval_windows)
    save_checkpoint(args.out, model, tok, meta={"imported_from": str(args.source)})
    result["out"] = str(args.out)
    if args.json:
        print(json.dumps(result))
    else:
        for k, v in result.items():
            print(f"{k}: {v}")
    return 0
