"""The `kvlm` command: the only place in kvlm that parses arguments.

Each verb is one thin module, ``kvlm/cli/<verb>.py`` (``kv-table`` -> ``kv_table.py``), that provides
``add_arguments(parser)`` and ``main(args) -> int | None`` and calls the library; this file only dispatches
(``COMMANDS``, ``build_parser``, ``main``). ``kvlm.cli.common`` holds the argument helpers the verbs share
(``parse_overrides`` for ``--set KEY=VALUE``, ``parse_int_list`` for ``--tp 1,2,4``).

``main`` sets up logging once (``kvlm.logs.setup_logging``: the library's progress and notes go to stderr,
rank 0 only), so stdout carries only each command's result and, with ``--json``, its last line is one JSON
object. ``main`` is also the one error boundary (``kvlm.cli.boundary``): whatever a verb raises becomes one
``kvlm VERB: error: MESSAGE`` line on stderr and exit status 1 (argparse's usage errors: 2; Ctrl-C: 130, quietly);
an unexpected exception adds "run with --debug for the traceback". ``--debug`` (anywhere on the line) or
``KVLM_DEBUG=1`` prints the traceback too.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import traceback

from kvlm import __version__
from kvlm.cli.common import HelpFormatter
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
    "serve": (
        "kvlm.cli.serve",
        "an OpenAI-compatible HTTP server (continuous batching, paged compact cache)",
    ),
    "bench-serve": (
        "kvlm.cli.bench_serve",
        "load generator for kvlm serve: tokens/s, latency, capacity, peers",
    ),
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
        p = sub.add_parser(name, help=help_, description=help_, formatter_class=HelpFormatter)
        p.set_defaults(_module=module)
        if name == verb:
            importlib.import_module(module).add_arguments(p)
    return parser


DEBUG_FLAG = "--debug"
DEBUG_ENV = "KVLM_DEBUG"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    # --debug is global: accepted anywhere before a `--` (so `kvlm train ... --debug` works like `kvlm --debug train`)
    end = argv.index("--") if "--" in argv else len(argv)
    debug = DEBUG_FLAG in argv[:end] or os.environ.get(DEBUG_ENV, "") not in ("", "0", "false", "no")
    argv = [a for a in argv[:end] if a != DEBUG_FLAG] + argv[end:]
    verb = next((a for a in argv if not a.startswith("-")), None)
    command = verb if verb in COMMANDS else None
    try:
        parser = build_parser(command)
        parser.add_argument(DEBUG_FLAG, action="store_true", help="print the traceback of an error")
        args = parser.parse_args(argv)
        if not args.command:
            parser.print_help()
            return 2
        command = args.command
        setup_logging()
        mod = importlib.import_module(args._module)
        return int(mod.main(args) or 0)
    except (
        KeyboardInterrupt
    ) as e:  # Ctrl-C: the user knows; no traceback (train saves first, see kvlm.training)
        if debug:
            traceback.print_exc()
        step, saved = (
            getattr(e, "step", None),
            getattr(e, "checkpoint", None),
        )  # kvlm.errors.TrainingInterrupted
        where = f" at step {step}" if step is not None else ""
        print(f"\nkvlm {command or ''}: interrupted{where}" + (f"; checkpoint saved in {saved}" if saved else ""),
              file=sys.stderr)  # fmt: skip
        return 130
    except BrokenPipeError:  # stdout closed early (`kvlm ... | head`): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except Exception as e:
        # imported here: the boundary is needed only when something failed
        from kvlm.cli.boundary import describe

        message, expected = describe(e)
        if debug:
            traceback.print_exc()
        elif not expected:
            message += f" (run with {DEBUG_FLAG} or {DEBUG_ENV}=1 for the traceback)"
        if "--json" in argv:
            print(json.dumps({"error": message}))
        print(f"kvlm {command or 'error'}: error: {message}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
