"""`kvlm import-hf SOURCE OUT`: import a Llama checkpoint, optionally converting it to MLA (kvlm.interop.convert).

Prints what was done (``key: value`` lines, or one JSON object with ``--json``) and writes a kvlm checkpoint."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from kvlm.checkpoint import foreign_files, save_checkpoint
from kvlm.files import check_replaceable
from kvlm.interop import deepseek_v3
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
from kvlm.interop.tokenizer_meta import META_KEY, settings_from_hf


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("source", help="Hugging Face Llama or (dense) DeepseekV3 folder, or a .gguf file")
    p.add_argument(
        "out", help="kvlm checkpoint folder to write (new or empty; --force replaces a previous import)"
    )
    p.add_argument("--gguf-file", default=None, help="GGUF file name inside the source folder")
    p.add_argument("--mlra-code", choices=["mla", "mlra_2", "mlra_4"], default=None,
                   help="SOURCE is a checkpoint of the MLRA authors' code (github.com/SongtaoLiu0823/MLRA), "
                   "written by their model/<this>.py (kvlm.interop.mlra_import)")  # fmt: skip
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
    p.add_argument("--calib-tokens", type=int, default=4096, help="tokens of --calib-data used")
    p.add_argument("--eval-data", default=None, help=".jsonl/.txt text: report perplexity before and after")
    p.add_argument("--eval-tokens", type=int, default=4096, help="tokens of --eval-data scored")
    p.add_argument("--seq-len", type=int, default=256, help="window length for calibration and perplexity")
    p.add_argument("--force", action="store_true",
                   help="replace OUT if it holds a kvlm checkpoint without training state (never anything else)")  # fmt: skip
    p.add_argument("--json", action="store_true", help="the last stdout line is a JSON object")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bars or lines (calibration, conversion, perplexity)")  # fmt: skip


def main(args) -> int:
    # before the minutes of loading and converting: OUT must be new, empty or a previous import (with --force);
    # a training run's checkpoint (trainer_state.pt) is not replaced: its run could no longer resume
    check_replaceable(
        args.out,
        force=args.force,
        foreign=lambda folder: foreign_files(folder, training=False),
        kind="kvlm checkpoint (an import)",
        protect=[args.source],
    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    if args.mlra_code:
        if args.mla:
            raise ConvertError(f"--mla: an MLRA-code {args.mlra_code} checkpoint is imported as it is")
        from kvlm.interop.mlra_import import import_mlra_authors

        model = import_mlra_authors(args.source, args.mlra_code, args.max_seq_len)
        save_checkpoint(args.out, model, None, meta={"imported_from": str(args.source)})
        result = {"source": str(args.source), "attention": model.cfg.attention, "out": str(args.out)}
        print(json.dumps(result) if args.json else "\n".join(f"{k}: {v}" for k, v in result.items()))
        return 0
    deepseek = deepseek_v3.source_model_type(args.source) == deepseek_v3.MODEL_TYPE
    if deepseek:
        deepseek_v3.check_source(args.source)  # MoE layers and the like: refused before loading the weights
        if args.mla:
            raise ConvertError("--mla: a DeepseekV3 source is already MLA (it imports as kvlm's mla)")
    hf_model, hf_tok = load_hf_llama(args.source, args.gguf_file)
    model = (deepseek_v3.import_deepseek_v3 if deepseek else import_llama)(hf_model, args.max_seq_len)
    generation_config = getattr(hf_model, "generation_config", None)  # its eos ids: stop tokens
    del hf_model
    tok = kvlm_tokenizer(hf_tok, generation_config) if hf_tok is not None else None
    result: dict = {"source": str(args.source), "attention": model.cfg.attention}
    eval_windows = None
    if args.eval_data:
        if tok is None:
            raise ConvertError("--eval-data needs the source's tokenizer")
        eval_windows = text_tokens(args.eval_data, tok, args.eval_tokens, args.seq_len)
        result["perplexity_before"] = window_perplexity(model, eval_windows, progress=not args.no_progress)
    if args.mla:
        calib = None
        if args.calib_data:
            if tok is None:
                raise ConvertError("--calib-data needs the source's tokenizer")
            calib = text_tokens(args.calib_data, tok, args.calib_tokens, args.seq_len)
        src_cfg = model.cfg
        model = gqa_to_mla(
            model, args.kv_lora_rank, args.rope_head_dim, calib, rope_kv_heads=args.rope_kv_heads,
            progress=not args.no_progress,
        )
        result.update(convert_report(src_cfg, model.cfg))
        result["attention"] = "mla"
        if eval_windows is not None:
            result["perplexity_after"] = window_perplexity(model, eval_windows, progress=not args.no_progress)
    meta = {"imported_from": str(args.source)}
    if hf_tok is not None:  # special-token roles, chat template: for export-hf (kvlm.interop.tokenizer_meta)
        meta[META_KEY] = settings_from_hf(hf_tok, generation_config)
    save_checkpoint(args.out, model, tok, meta=meta)
    result["out"] = str(args.out)
    if args.json:
        print(json.dumps(result))
    else:
        for k, v in result.items():
            print(f"{k}: {v}")
    return 0
