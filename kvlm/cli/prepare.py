"""`kvlm prepare`: tokenize text (local files, a HF dataset, or built-in synthetic stories) into shards
(kvlm.data)."""

from __future__ import annotations

import json

from kvlm.data import prepare


def add_arguments(p) -> None:
    p.add_argument(
        "sources",
        nargs="*",
        default=["synthetic"],
        help="files/folders (.txt .jsonl .parquet), 'synthetic' (generated stories, not real text), "
        "hf:NAME or 'tinystories' (default: synthetic)",
    )
    p.add_argument("--out", "-o", required=True, help="output folder")
    p.add_argument(
        "--val", nargs="+", help="validation sources (default: the sources' val files or every N-th doc)"
    )
    p.add_argument(
        "--tokenizer",
        default="bpe",
        help="'bpe' (train one), 'gpt2', or a path to tokenizer.json / a folder with vocab.json + merges.txt",
    )
    p.add_argument("--vocab-size", type=int, default=4096, help="BPE vocabulary size (default 4096)")
    p.add_argument("--max-tokens", type=int, help="cap on training tokens (synthetic default 1,000,000)")
    p.add_argument("--val-tokens", type=int, help="cap on validation tokens")
    p.add_argument("--val-fraction", type=float, default=0.05, help="share of documents for validation")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic stories")
    p.add_argument(
        "--text-field", default="text", help="field of .jsonl / parquet / HF rows holding the text"
    )
    p.add_argument("--force", action="store_true", help="replace an existing output folder")
    p.add_argument("--no-progress", action="store_true", help="no progress bar or progress lines")
    p.add_argument("--json", action="store_true", help="print a JSON summary as the last line")


def main(args) -> int:
    data = prepare(
        args.sources,
        args.out,
        val=args.val,
        tokenizer=args.tokenizer,
        vocab_size=args.vocab_size,
        max_tokens=args.max_tokens,
        val_tokens=args.val_tokens,
        val_fraction=args.val_fraction,
        seed=args.seed,
        text_field=args.text_field,
        force=args.force,
        progress=not args.no_progress,
    )
    if args.json:
        print(json.dumps(data.summary()))
    return 0
