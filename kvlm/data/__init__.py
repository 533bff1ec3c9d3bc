"""Data: text -> tokenizer -> token shards on disk, and the handle that reads them back for training.

``prepare(sources, out_dir)`` tokenizes documents into a folder (``kvlm prepare``); ``load_prepared(out_dir)``
opens it as a ``PreparedData``: ``.train`` / ``.val`` (``TokenStream``: one sequence of token ids over
memory-mapped shards, read as ``windows(starts, length)``), ``.tokenizer`` and ``.meta``.
``load_or_prepare(spec)`` opens a prepared folder or prepares anything else ('synthetic', files, hf:NAME).

Modules, in dependency order:
    tokenizer.py   byte-level BPE (trained here) or GPT-2's, behind ``Tokenizer``; text encodes as ordinary text
    synthetic.py   generated children's stories (NOT real text) so everything works without a download
    format.py      the folder format: names, ``token_dtype``, ``content_hash``, ``DataError``
    shards.py      ``ShardWriter`` (append documents to <split>-NNNNN.bin) and ``TokenStream`` (read them)
    prepared.py    ``PreparedData`` and ``load_prepared``
    sources.py     ``Source`` / ``resolve_source``: synthetic, local .txt/.jsonl/.parquet, Hugging Face datasets
    pipeline.py    ``prepare`` and ``load_or_prepare``
Bad data (missing, empty, partial, corrupt) raises ``DataError``, a ValueError naming the file or source.
"""

from kvlm.data.format import DataError, token_dtype
from kvlm.data.pipeline import load_or_prepare, prepare
from kvlm.data.prepared import PreparedData, load_prepared
from kvlm.data.shards import TokenStream
from kvlm.data.sources import Source, read_documents, resolve_source
from kvlm.data.tokenizer import EOS_TOKEN, Tokenizer, TokenizerError, load_tokenizer, train_bpe

__all__ = [
    "EOS_TOKEN",
    "DataError",
    "PreparedData",
    "Source",
    "TokenStream",
    "Tokenizer",
    "TokenizerError",
    "load_or_prepare",
    "load_prepared",
    "load_tokenizer",
    "prepare",
    "read_documents",
    "resolve_source",
    "token_dtype",
    "train_bpe",
]
