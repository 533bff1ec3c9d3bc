"""The `kvlm` command: the only place in kvlm that parses arguments.

Each verb is one thin module, ``kvlm/cli/<verb>.py`` (``kv-table`` -> ``kv_table.py``), that provides
``add_arguments(parser)`` and ``main(args) -> int | None`` and calls the library; this file only dispatches
(``COMMANDS``, ``build_parser``, ``main``). ``kvlm.cli.common`` holds the argument helpers the verbs share
(``parse_overrides`` for ``--set KEY=VALUE``, ``parse_int_list`` for ``--tp 1,2,4``).

``main`` sets up logging once (``kvlm.logs.setup_logging``: the library's progress and notes go to stderr,
rank 0 only), so stdout carries only each command's result and, with ``--json``, its last line is one JSON
object. A ValueError or FileNotFoundError from the library (ConfigError, CacheError, DataError, ...) becomes
one ``kvlm VERB: error: ...`` line and exit status 1.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys

from kvlm import __version__
from kvlm.logs import setup_logging

# verb -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "prepare": (
        "kvlm.cli.prepare",
        "tokenize text (local files, a HF dataset, or built-in synthetic stories) into shards",
    ),
    "train": ("kvlm.cli.train", "train a model from a preset or YAML config"),
    "eval": ("kvlm.cli.eval", "perplexity, repetition and lm-eval tasks for a checkpoint"),
    "generate": ("kvlm.cli.generate", "stream text from a checkpoint"),
    "bench": (
        "kvlm.cli.bench",
        "prefill / decode latency, throughput, memory, against peers and the roofline",
    ),
    "bench-parallel": (
        "kvlm.cli.parallel_bench",
        "tensor-parallel decode and EG-MLA embedding-parallel benchmarks (under torchrun)",
    ),
    "kv-table": ("kvlm.cli.kv_table", "KV cache and parameter accounting of presets (the papers' tables)"),
    "compare": ("kvlm.cli.compare", "train several attention variants and report which is best at what cost"),
    "export-hf": ("kvlm.cli.export_hf", "export a checkpoint as a Hugging Face transformers folder"),
    "import-hf": ("kvlm.cli.import_hf", "import a Llama checkpoint, optionally converting it to MLA"),
}


def build_parser(verb: str | None = None) -> argparse.ArgumentParser:
    """The parser; only the module of ``verb`` is imported (``kvlm --help`` imports none), so a verb's
    heavy or optional dependencies never slow down or break another verb."""
    parser = argparse.ArgumentParser(prog="kvlm", description="Language models with small KV caches.")
    parser.add_argument("--version", action="version", version=f"kvlm {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_) in COMMANDS.items():
        p = sub.add_parser(name, help=help_, description=help_)
        p.set_defaults(_module=module)
        if name == verb:
            importlib.import_module(module).add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    verb = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(verb if verb in COMMANDS else None)
    args = parser.parse_args(argv)
    if not args.command:
        parser.print_help()
        return 2
    setup_logging()
    mod = importlib.import_module(args._module)
    try:
        rc = mod.main(args)
    except (ValueError, FileNotFoundError) as e:  # ConfigError, CacheError, DataError are ValueErrors
        if getattr(args, "json", False):
            print(json.dumps({"error": str(e)}))
        print(f"kvlm {args.command}: error: {e}", file=sys.stderr)
        return 1
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
