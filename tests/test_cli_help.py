"""`kvlm VERB --help`: every option of every verb has help text and shows its default; train's overrides show
TrainConfig's value (introspects the real parsers, so a new option without help fails here)."""

import argparse
import dataclasses
import re

import pytest

from kvlm.cli import COMMANDS, build_parser
from kvlm.training import TrainConfig


def verb_parser(verb: str) -> argparse.ArgumentParser:
    parser = build_parser(verb)
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[verb]


def parsers(verb: str):
    """(name, parser) of the verb and of its own sub-verbs (bench-parallel tp-bench ...)."""
    todo = [(verb, verb_parser(verb))]
    while todo:
        name, p = todo.pop()
        yield name, p
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction):
                todo += [(f"{name} {k}", sp) for k, sp in a.choices.items()]


def options(p: argparse.ArgumentParser):
    return [a for a in p._actions if not isinstance(a, argparse._HelpAction)]


def shown(value) -> bool:
    """Defaults worth showing: not None / False / an empty list (the help says what happens then)."""
    return value is not None and value is not False and value != [] and value is not argparse.SUPPRESS


def paragraph(p: argparse.ArgumentParser, action: argparse.Action) -> str:
    """The option's own --help entry, on one line (argparse wraps long help)."""
    return " ".join(p._get_formatter()._format_action(action).split())


@pytest.mark.parametrize("verb", sorted(COMMANDS))
def test_every_option_has_help_and_shows_its_default(verb):
    for name, p in parsers(verb):
        missing = [a.dest for a in options(p) if not (a.help or "").strip()]
        assert not missing, f"kvlm {name}: options without help: {missing}"
        p.format_help()  # renders (a stray % in a help text raises here)
        for a in options(p):
            if shown(a.default) and (a.option_strings or a.nargs in ("?", "*")):
                d = " ".join(map(str, a.default)) if isinstance(a.default, list) else str(a.default)
                text = paragraph(p, a)
                # "default 1e-3" for 0.001 is fine too: compare numbers as numbers where the text has one
                assert " ".join(d.split()) in text or _number_in(a.default, text), (
                    f"kvlm {name} {a.option_strings}: default {a.default!r} not in its help: {text}"
                )


def _number_in(value, text: str) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    nums = re.findall(r"-?\d[\d_,]*\.?\d*(?:e-?\d+)?", text)
    return any(float(n.replace(",", "").replace("_", "")) == value for n in nums if n.strip("-"))


def test_train_overrides_show_trainconfig_defaults():
    text = " ".join(verb_parser("train").format_help().split())
    defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
    for flag, field in (("--lr", "lr"), ("--weight-decay", "weight_decay"), ("--eval-interval", "eval_interval"),
                        ("--batch-size", "batch_size"), ("--seq-len", "seq_len")):  # fmt: skip
        m = re.search(re.escape(flag) + r" [A-Z_]+ (.*?)(?= --|$)", text)
        assert m, flag
        assert f"default {defaults[field]}" in m.group(1) or f"default: {defaults[field]}" in m.group(1), (
            flag,
            m.group(1),
        )


def test_help_formatter_appends_defaults_once():
    from kvlm.cli.common import HelpFormatter

    p = argparse.ArgumentParser(formatter_class=HelpFormatter)
    p.add_argument("--a", type=int, default=7, help="an int")
    p.add_argument("--b", default=None, help="b (default: the model's)")
    p.add_argument("--c", action="store_true", help="a switch")
    text = " ".join(p.format_help().split())
    assert "an int (default: 7)" in text
    assert "b (default: the model's)" in text and "(default: None)" not in text
    assert "(default: False)" not in text


def _api_docs():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "tools" / "api_docs.py"
    spec = importlib.util.spec_from_file_location("api_docs", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_public_api_has_docstrings_and_docs_api_md_is_up_to_date():
    api = _api_docs()
    for path, methods in api.API:
        obj = api.resolve(path)
        assert (obj.__doc__ or "").strip() and not obj.__doc__.startswith(obj.__name__ + "("), (
            f"{path}: no docstring"
        )
        for name in methods:
            if name not in ("step", "has_unfinished"):  # self-explaining names
                assert (getattr(obj, name).__doc__ or "").strip(), f"{path}.{name}: no docstring"
    assert api.OUT.read_text() == api.render(), "docs/api.md is out of date: run python tools/api_docs.py"
