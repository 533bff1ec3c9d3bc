"""The bad-input battery of the `kvlm` command (issue 14): every case runs ``kvlm.cli.main`` in-process and asserts
the exit status (1 for an error, 2 for a usage error), that stderr is one ``kvlm VERB: error:`` line naming the
problem (the field, option, file or value), and that no traceback is printed without --debug.

A few cases run ``python -m kvlm.cli`` in a subprocess for the real exit status and stderr. The Python API and
the data readers have their own battery in test_bad_inputs_api.py.
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvlm.checkpoint import save_checkpoint
from kvlm.cli import main
from kvlm.config import ModelConfig
from kvlm.data import prepare
from kvlm.model import build_model

REPO = Path(__file__).resolve().parent.parent


# --- fixtures: one tiny prepared dataset and checkpoint for the whole module -------------------------------
@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad_inputs")
    data = prepare("synthetic", root / "data", max_tokens=3000, vocab_size=300)
    cfg = ModelConfig(n_layer=1, d_model=32, n_head=2, vocab_size=data.vocab_size, max_seq_len=32)
    ckpt = root / "ckpt"
    save_checkpoint(ckpt, build_model(cfg), tokenizer=data.tokenizer, meta={"step": 0})
    bare = root / "ckpt_no_tokenizer"
    save_checkpoint(bare, build_model(cfg), meta={"step": 0})
    files = root / "files"
    files.mkdir()
    (files / "random.txt").write_bytes(bytes(range(128, 256)) * 4)
    (files / "nul.txt").write_bytes(b"text\x00\x00\x01binary")
    (files / "binary.jsonl").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\xff\xfe")
    (files / "number.jsonl").write_text('{"text": "fine"}\n{"text": 5}\n')
    (files / "list.jsonl").write_text('{"text": ["a", "b"]}\n')
    (files / "dict.jsonl").write_text('{"text": {"a": 1}}\n')
    (files / "bool.jsonl").write_text('{"text": true}\n')
    (files / "badjson.jsonl").write_text('{"text": "ok"}\n{"text": \n')
    (files / "nofield.jsonl").write_text('{"body": "no text field"}\n')
    (files / "row_list.jsonl").write_text('["not", "an", "object"]\n')
    (files / "data.csv").write_text("a,b\n1,2\n")
    (files / "empty.txt").write_text("   \n")
    (files / "good.txt").write_text("Once upon a time there was a small cat. " * 40)
    (files / "val_small.jsonl").write_text(
        "".join(json.dumps({"text": f"A val story {i}."}) + "\n" for i in range(5))
    )
    (files / "onlyval").mkdir()
    (files / "onlyval" / "val.txt").write_text("validation only")
    (files / "emptydir").mkdir()
    (files / "a_file").write_text("I am a file, not a folder")
    (files / "list.yaml").write_text("- 1\n- 2\n")
    (files / "model5.yaml").write_text("model: 5\n")
    (files / "trainlist.yaml").write_text("train: [1, 2]\n")
    (files / "badyaml.yaml").write_text("n_layer: [1, 2\n")
    (files / "four.yaml").write_text("n_layer: four\n")
    (files / "ropeno.yaml").write_text("rope: maybe\n")
    (files / "unknown.yaml").write_text("n_layers: 4\n")
    (files / "lr_str.yaml").write_text("lr: 1e-3\n")
    return {"root": root, "data": root / "data", "ckpt": ckpt, "bare": bare, "files": files}


def broken_checkpoint(world, name: str, config_text: str) -> Path:
    """A copy of the tiny checkpoint whose config.json is ``config_text``."""
    import shutil

    dst = world["root"] / name
    if not dst.exists():
        shutil.copytree(world["ckpt"], dst)
    (dst / "config.json").write_text(config_text)
    return dst


def run(argv: list[str], capsys, code: int, *fragments: str) -> str:
    """kvlm ARGV in-process: assert the exit status, one error line naming every fragment, no traceback."""
    try:
        rc = main([str(a) for a in argv])
    except SystemExit as e:  # argparse's usage errors
        rc = e.code
    out, err = capsys.readouterr()
    assert rc == code, f"exit {rc}, expected {code}; stderr: {err[-800:]}"
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1, f"expected one error line, got: {err[-800:]}"
    low = lines[0].lower()
    for fragment in fragments:
        assert fragment.lower() in low, f"{fragment!r} not in {lines[0]!r}"
    if code == 1:
        assert lines[0].startswith(f"kvlm {argv[0]}: error: "), lines[0]
        assert "run with --debug" not in lines[0], f"an expected error reported as unexpected: {lines[0]}"
    return lines[0]


def train_args(world, *extra) -> list:
    # a tiny model, so that a case that wrongly succeeds fails its assertion in a second, not a minute
    tiny = ["--n-layer", "1", "--d-model", "32", "--n-head", "2", "--batch-size", "2", "--seq-len", "8"]
    return ["train", "--data", world["data"], "--out", world["root"] / "never_written", "--steps", "1", *tiny,
            *extra]  # fmt: skip


# --- train: config values of the wrong type or out of range (--set, flags, files) ----------------------------
SET_BAD = [
    ("n_layer=four", ["n_layer", "four"]),
    ("n_layer=true", ["n_layer", "true"]),
    ("n_layer=4.5", ["n_layer", "4.5"]),
    ("n_layer=[1]", ["n_layer", "[1]"]),
    ("n_layer={a: 1}", ["n_layer"]),
    ("n_layer=0", ["n_layer", "positive"]),
    ("n_layer=-2", ["n_layer", "-2"]),
    ("d_model=abc", ["d_model", "abc"]),
    ("d_model=99", ["d_model=99", "n_head=2"]),
    ("n_head=0", ["n_head"]),
    ("attention=gqa --set n_kv_head=3", ["n_kv_head=3"]),
    ("head_dim=x", ["head_dim", "x"]),
    ("vocab_size=0", ["vocab_size"]),
    ("vocab_size=1e9x", ["vocab_size"]),
    ("max_seq_len=-5", ["max_seq_len"]),
    ("ffn_dim=[64]", ["ffn_dim"]),
    ("rope=maybe", ["rope", "maybe"]),
    ("rope=2", ["rope", "2"]),
    ("rope_theta=[1,2]", ["rope_theta", "[1, 2]"]),
    ("rope_theta=.nan", ["rope_theta", "nan"]),
    ("rope_theta=.inf", ["rope_theta", "inf"]),
    ("rope_theta=ten", ["rope_theta", "ten"]),
    ("attention=[mla]", ["attention", "['mla']"]),
    ("attention=5", ["attention", "5"]),
    ("attention=nosuch", ["nosuch"]),
    ("arch=bert", ["arch", "bert"]),
    ("dropout=1.5", ["dropout", "1.5"]),
    ("dropout=lots", ["dropout", "lots"]),
    ("kv_latent=both", ["kv_latent", "both"]),
    ("eg_op=div", ["eg_op", "div"]),
    ("q_lora_rank=-1", ["q_lora_rank", "-1"]),
    ("rope_kv_heads=0", ["rope_kv_heads"]),
    ("tie_embeddings=perhaps", ["tie_embeddings", "perhaps"]),
    ("bias=[]", ["bias"]),
    ("norm_eps=small", ["norm_eps", "small"]),
    ("init_std=null", ["init_std", "none"]),
    ("extra=5", ["extra", "5"]),
    ("note=[1, 2]", ["note"]),
    ("no_such_field=1", ["no_such_field"]),
    ("lr=abc", ["lr", "abc"]),
    ("lr=.nan", ["lr", "nan"]),
    ("lr=.inf", ["lr", "inf"]),
    ("lr=inf", ["lr", "inf"]),
    ("lr=-1", ["lr", "-1"]),
    ("lr=true", ["lr", "true"]),
    ("batch_size=0", ["batch_size"]),
    ("batch_size=2.5", ["batch_size", "2.5"]),
    ("grad_accum=3", ["grad_accum", "3"]),
    ("seq_len=0", ["seq_len"]),
    ("warmup_steps=-1", ["warmup_steps", "-1"]),
    ("min_lr_ratio=2", ["min_lr_ratio"]),
    ("dtype=float8", ["dtype", "float8"]),
    ("device=tpu", ["device", "tpu"]),
    ("compile=maybe", ["compile", "maybe"]),
    ("seed=x", ["seed", "x"]),
    ("eval_interval=0", ["eval_interval"]),
    ("log_interval=0", ["log_interval"]),
    ("grad_clip=[1]", ["grad_clip"]),
    ("weight_decay=lots", ["weight_decay", "lots"]),
    ("beta1=x", ["beta1", "x"]),
    ("checkpoint_interval=0", ["checkpoint_interval"]),
    ("eval_iters=2.5", ["eval_iters", "2.5"]),
]


@pytest.mark.parametrize("item,fragments", SET_BAD, ids=[s for s, _ in SET_BAD])
def test_train_set_bad_value(world, capsys, item, fragments):
    sets = [a for one in item.split(" --set ") for a in ("--set", one)]
    run(train_args(world, *sets), capsys, 1, *fragments)


FLAG_BAD = [
    (["--device", "tpu"], 1, ["tpu"]),
    (["--lr", "nan"], 1, ["lr", "nan"]),
    (["--lr", "inf"], 1, ["lr", "inf"]),
    (["--lr", "0"], 1, ["lr"]),
    (["--minutes", "-1"], 1, ["max_minutes", "-1"]),
    (["--dtype", "int4"], 1, ["dtype", "int4"]),
    (["--n-layer", "four"], 2, ["--n-layer", "four"]),
    (["--batch-size", "1.5"], 2, ["--batch-size"]),
    (["--set", "novalue"], 1, ["--set", "novalue"]),
    (["--set", "lr=[1"], 1, ["lr"]),
    (["--preset", "nosuch"], 1, ["nosuch"]),
]


@pytest.mark.parametrize("extra,code,fragments", FLAG_BAD, ids=[" ".join(e) for e, _, _ in FLAG_BAD])
def test_train_bad_flag(world, capsys, extra, code, fragments):
    run(train_args(world, *extra), capsys, code, *fragments)


CONFIG_FILES = [
    ("list.yaml", ["list.yaml", "mapping"]),
    ("model5.yaml", ["model5.yaml", "model", "mapping"]),
    ("trainlist.yaml", ["trainlist.yaml", "train", "mapping"]),
    ("badyaml.yaml", ["badyaml.yaml", "yaml"]),
    ("four.yaml", ["n_layer", "four"]),
    ("ropeno.yaml", ["rope", "maybe"]),
    ("unknown.yaml", ["n_layers"]),
    ("missing.yaml", ["missing.yaml"]),
]


@pytest.mark.parametrize("name,fragments", CONFIG_FILES, ids=[n for n, _ in CONFIG_FILES])
def test_train_bad_config_file(world, capsys, name, fragments):
    # no model flags here: they would override the file's fields
    argv = ["train", "--data", world["data"], "--out", world["root"] / "never_written", "--steps", "1"]
    run([*argv, "--config", world["files"] / name], capsys, 1, *fragments)


def test_train_yaml_scientific_lr_is_read_as_a_float(world, capsys):
    """`lr: 1e-3` (a string to PyYAML) and `--set lr=1e-3` configure lr = 0.001 instead of crashing."""
    import argparse

    from kvlm.cli.train import add_arguments, configs_from_args

    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(
        ["--data", "x", "--out", "y", "--config", str(world["files"] / "lr_str.yaml"), "--set", "rope=no"]
    )
    model, trn, _ = configs_from_args(args)
    assert trn.lr == 0.001 and isinstance(trn.lr, float)
    assert model.rope is False and model.rope_head_dim == 0  # "no" means off, not a truthy string
    args = p.parse_args(["--data", "x", "--out", "y", "--set", "lr=1e-3", "--set", "n_layer='4'"])
    model, trn, _ = configs_from_args(args)
    assert trn.lr == 0.001 and model.n_layer == 4


@pytest.mark.parametrize(
    "data,fragments",
    [
        ("missing_dir", ["missing_dir"]),
        ("random.txt", ["random.txt", "utf-8"]),
        ("binary.jsonl", ["binary.jsonl"]),
    ],
)
def test_train_bad_data(world, capsys, data, fragments):
    path = world["files"] / data if data != "missing_dir" else world["root"] / data
    out = world["root"] / f"train_out_{data}"
    run(["train", "--data", path, "--out", out, "--steps", "1"], capsys, 1, *fragments)


def test_train_missing_required_option(capsys):
    run(["train", "--out", "x"], capsys, 2, "--data")


# --- prepare ------------------------------------------------------------------------------------------------
PREPARE_BAD = [
    (["random.txt"], ["random.txt", "utf-8"]),
    (["nul.txt"], ["nul.txt", "nul"]),
    (["binary.jsonl"], ["binary.jsonl", "utf-8"]),
    (["number.jsonl"], ["number.jsonl:2", "int"]),
    (["list.jsonl"], ["list.jsonl:1", "list"]),
    (["dict.jsonl"], ["dict.jsonl:1", "dict"]),
    (["bool.jsonl"], ["bool.jsonl:1", "bool"]),
    (["badjson.jsonl"], ["badjson.jsonl:2", "json"]),
    (["nofield.jsonl"], ["nofield.jsonl:1", "text"]),
    (["row_list.jsonl"], ["row_list.jsonl:1", "text"]),
    (["data.csv"], ["data.csv", ".csv"]),
    (["empty.txt"], ["empty.txt", "no training text"]),
    (["does_not_exist.txt"], ["does_not_exist.txt", "not found"]),
    (["emptydir"], ["emptydir"]),
    (["onlyval"], ["onlyval", "validation"]),
    (["good.txt", "--vocab-size", "100"], ["vocab_size=100"]),
    (["good.txt", "--val-fraction", "1.5"], ["val_fraction", "1.5"]),
    (["good.txt", "--max-tokens", "-1"], ["max_tokens", "-1"]),
    (["good.txt", "--tokenizer", "no_such_tokenizer.json"], ["no_such_tokenizer.json"]),
    (["good.txt", "--text-field", "body"], []),  # .txt ignores the field: no error expected -> see below
    (["number.jsonl", "--text-field", "missing"], ["number.jsonl:1", "missing"]),
    (["good.txt", "--val", "random.txt"], ["random.txt", "utf-8"]),
]


@pytest.mark.parametrize("argv,fragments", [c for c in PREPARE_BAD if c[1]], ids=lambda v: str(v))
def test_prepare_bad_input(world, capsys, tmp_path, argv, fragments):
    files = world["files"]
    argv = [str(files / a) if (files / a).exists() or a.endswith((".txt", ".jsonl")) else a for a in argv]
    run(["prepare", *argv, "--out", tmp_path / "out", "--no-progress"], capsys, 1, *fragments)
    assert not (tmp_path / "out").exists(), "a failed prepare left an output folder"


def test_prepare_out_is_a_file(world, capsys):
    run(["prepare", world["files"] / "good.txt", "--out", world["files"] / "a_file", "--no-progress"], capsys, 1,
        "a_file")  # fmt: skip
    assert (world["files"] / "a_file").read_text() == "I am a file, not a folder"


def test_prepare_out_not_empty_without_force(world, capsys, tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("mine")
    run(["prepare", world["files"] / "good.txt", "--out", tmp_path / "out"], capsys, 1, "out", "--force")
    assert (tmp_path / "out" / "notes.txt").read_text() == "mine"


def test_prepare_val_file_named_val_is_accepted(world, capsys, tmp_path):
    """`--val data/val_small.jsonl` is validation because it was passed as such, whatever its name."""
    rc = main(["prepare", str(world["files"] / "good.txt"), "--val", str(world["files"] / "val_small.jsonl"),
               "--out", str(tmp_path / "out"), "--vocab-size", "300", "--no-progress", "--json"])  # fmt: skip
    out, err = capsys.readouterr()
    assert rc == 0, err
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["val_tokens"] > 0


@pytest.mark.parametrize("argv,fragments", [
    (["--vocab-size", "many"], ["--vocab-size", "many"]),
    (["--max-tokens", "1e6x"], ["--max-tokens"]),
    (["--seed", "s"], ["--seed"]),
    ([], ["--out"]),
])  # fmt: skip
def test_prepare_usage_errors(capsys, argv, fragments):
    out = [] if not argv else ["--out", "x"]
    run(["prepare", "synthetic", *out, *argv], capsys, 2, *fragments)


# --- eval ---------------------------------------------------------------------------------------------------
def eval_args(world, *extra):
    return ["eval", world["ckpt"], "--data", world["data"], "--samples", "0", *extra]


EVAL_USAGE = [
    ["--seq-len", "0"],
    ["--seq-len", "-1"],
    ["--stride", "0"],
    ["--stride", "abc"],
    ["--batch-size", "0"],
    ["--max-tokens", "0"],
    ["--samples", "-1"],
    ["--sample-tokens", "0"],
    ["--temperature", "nan"],
    ["--temperature", "inf"],
    ["--top-k", "-3"],
    ["--top-p", "nan"],
    ["--limit", "0"],
    ["--dtype", "int8"],
]


@pytest.mark.parametrize("extra", EVAL_USAGE, ids=lambda e: " ".join(e))
def test_eval_usage_errors(world, capsys, extra):
    run(eval_args(world, *extra), capsys, 2, extra[0], extra[1])


def test_eval_bad_values(world, capsys, tmp_path):
    run(eval_args(world, "--seq-len", "1000"), capsys, 1, "seq_len=1000", "max_seq_len=32")
    run(eval_args(world, "--seq-len", "8", "--stride", "9"), capsys, 1, "stride=9")
    run(eval_args(world, "--split", "test"), capsys, 1, "test")
    run(eval_args(world, "--device", "tpu"), capsys, 1, "--device", "tpu")
    run(
        ["eval", world["ckpt"], "--samples", "2", "--top-p", "1.5", "--data", world["data"]],
        capsys,
        1,
        "top_p",
    )
    run(["eval", world["ckpt"], "--samples", "2", "--temperature", "-1", "--data", world["data"]], capsys, 1,
        "temperature")  # fmt: skip
    run(
        ["eval", world["ckpt"], "--samples", "1", "--prompts", "caf\udce9"], capsys, 1, "--prompts 1", "utf-8"
    )
    run(["eval", world["ckpt"], "--samples", "0"], capsys, 1, "nothing to evaluate")
    run(["eval", world["bare"], "--samples", "2", "--data", world["data"]], capsys, 1, "tokenizer")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_eval_cuda_without_cuda(world, capsys):
    run(eval_args(world, "--device", "cuda"), capsys, 1, "cuda", "not available")


@pytest.mark.parametrize(
    "data,fragments",
    [
        ("missing.txt", ["missing.txt"]),
        ("random.txt", ["random.txt", "utf-8"]),
        ("number.jsonl", ["number.jsonl:2", "int"]),
        ("binary.jsonl", ["binary.jsonl", "utf-8"]),
        ("row_list.jsonl", ["row_list.jsonl:1", "text"]),
        ("badjson.jsonl", ["badjson.jsonl:2", "json"]),
    ],
)
def test_eval_bad_data_file(world, capsys, data, fragments):
    run(["eval", world["ckpt"], "--data", world["files"] / data, "--samples", "0"], capsys, 1, *fragments)


CKPT_CONFIGS = [
    ('{"n_layer": "four"}', ["n_layer", "four"]),
    ('{"n_layer": true}', ["n_layer", "true"]),
    ('{"attention": ["mla"]}', ["attention"]),
    ('{"rope": "maybe"}', ["rope", "maybe"]),
    ("[1, 2, 3]", ["mapping"]),
    ('{"n_layer": 1,', ["corrupt"]),
    ('{"no_such_field": 1}', ["no_such_field"]),
]


@pytest.mark.parametrize("text,fragments", CKPT_CONFIGS, ids=[t for t, _ in CKPT_CONFIGS])
def test_checkpoint_with_bad_config_json(world, capsys, text, fragments):
    ckpt = broken_checkpoint(world, f"broken_{CKPT_CONFIGS.index((text, fragments))}", text)
    run(["eval", ckpt, "--data", world["data"], "--samples", "0"], capsys, 1, *fragments)


def test_checkpoint_config_json_with_string_number_loads(world, capsys):
    """A hand-edited config.json with `"n_layer": "1"` is read as 1, not a crash in range()."""
    cfg = json.loads((world["ckpt"] / "config.json").read_text())
    cfg["n_layer"], cfg["max_seq_len"] = "1", "32"
    ckpt = broken_checkpoint(world, "string_numbers", json.dumps(cfg))
    assert main(["eval", str(ckpt), "--data", str(world["data"]), "--samples", "0", "--json"]) == 0
    assert "perplexity" in json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.mark.parametrize("target", ["missing_ckpt", "files/a_file", "data"])
def test_eval_not_a_checkpoint(world, capsys, target):
    run(["eval", world["root"] / target, "--samples", "0"], capsys, 1, Path(target).name)


# --- generate -----------------------------------------------------------------------------------------------
def gen_args(world, *extra):
    return ["generate", world["ckpt"], "--prompt", "Once", "--max-new-tokens", "3", *extra]


GEN_USAGE = [
    ["--temperature", "nan"],
    ["--temperature", "inf"],
    ["--temperature", "hot"],
    ["--top-p", "nan"],
    ["--top-k", "-1"],
    ["--max-new-tokens", "-1"],
    ["--mode", "bogus"],
    ["--tp", "0"],
    ["--seed", "x"],
]


@pytest.mark.parametrize("extra", GEN_USAGE, ids=lambda e: " ".join(e))
def test_generate_usage_errors(world, capsys, extra):
    run(gen_args(world, *extra), capsys, 2, extra[0])


@pytest.mark.parametrize("extra,fragments", [
    (["--temperature", "-1"], ["temperature", "-1"]),
    (["--top-p", "0"], ["top_p", "0"]),
    (["--top-p", "1.5"], ["top_p", "1.5"]),
    (["--max-new-tokens", "1000"], ["max_seq_len=32"]),
    (["--device", "tpu"], ["--device", "tpu"]),
    (["--device", "cuda:99"], ["cuda:99"]),
])  # fmt: skip
def test_generate_bad_values(world, capsys, extra, fragments):
    run(gen_args(world, *extra), capsys, 1, *fragments)


def test_generate_prompt_not_utf8(world, capsys):
    """A prompt with bytes that are not UTF-8 (kept by Python as lone surrogates) is refused by name."""
    run(
        ["generate", world["ckpt"], "--prompt", "ok", "--prompt", "caf\udce9"],
        capsys,
        1,
        "--prompt 2",
        "utf-8",
    )


def test_generate_without_tokenizer(world, capsys):
    run(["generate", world["bare"], "--prompt", "x"], capsys, 1, "tokenizer.json")


def test_generate_missing_checkpoint(world, capsys):
    run(["generate", world["root"] / "nope", "--prompt", "x"], capsys, 1, "nope")


# --- compare, kv-table --------------------------------------------------------------------------------------
@pytest.mark.parametrize("extra,code,fragments", [
    (["--contexts", "100000"], 1, ["--contexts 100000", "max_seq_len"]),
    (["--contexts", "8,100000"], 1, ["100000"]),
    (["--contexts", "0"], 1, ["--contexts"]),
    (["--contexts", "a,b"], 1, ["--contexts", "a,b"]),
    (["--steps", "0"], 1, ["--steps"]),
    (["--seeds", "-1"], 1, ["--seeds"]),
    (["--preset", "nosuch"], 1, ["nosuch"]),
    (["--steps", "x"], 2, ["--steps"]),
])  # fmt: skip
def test_compare_bad_input(world, capsys, tmp_path, extra, code, fragments):
    run(["compare", "--out", tmp_path / "cmp", "--data", world["data"], *extra], capsys, code, *fragments)
    assert not (tmp_path / "cmp" / "runs").exists(), "a refused comparison trained something"


@pytest.mark.parametrize("extra,code,fragments", [
    (["--preset", "nosuch"], 1, ["nosuch"]),
    (["--preset", "tiny", "--tp", "0"], 1, ["--tp"]),
    (["--preset", "tiny", "--tp", "two"], 1, ["--tp", "two"]),
    (["--config", "missing.yaml"], 1, ["missing.yaml"]),
    (["--preset", "tiny", "--dtype", "int3"], 2, ["--dtype"]),
])  # fmt: skip
def test_kv_table_bad_input(capsys, extra, code, fragments):
    run(["kv-table", *extra], capsys, code, *fragments)


def test_unknown_verb_and_option(capsys):
    run(["frobnicate"], capsys, 2, "frobnicate")
    run(["eval", "x", "--no-such-option"], capsys, 2, "--no-such-option")


# --- the error boundary: environment failures, unexpected errors, --debug, Ctrl-C -------------------------
def _raiser(exc):
    def fail(*a, **k):
        raise exc

    return fail


BOUNDARY = [
    (
        OSError(errno.ENOSPC, "No space left on device", "/data/out/train-00000.bin"),
        ["no space left", "train-00000"],
    ),
    (
        PermissionError(errno.EACCES, "Permission denied", "/root/secret"),
        ["permission denied", "/root/secret"],
    ),
    (OSError(errno.EROFS, "Read-only file system", "/mnt/ro/out"), ["read-only", "/mnt/ro/out"]),
    (IsADirectoryError(errno.EISDIR, "Is a directory", "/x/out.json"), ["folder", "/x/out.json"]),
    (NotADirectoryError(errno.ENOTDIR, "Not a directory", "/x/file/out"), ["not a folder", "/x/file/out"]),
    (RuntimeError("[enforce fail at inline_container.cc:659] . unexpected pos 1088 vs 1024"), ["disk"]),
    (RuntimeError("PytorchStreamWriter failed writing file data/0: file write failed"), ["writing"]),
    (
        pickle.UnpicklingError("Weights only load failed. ... set weights_only=False ..."),
        ["pickle", "safetensors"],
    ),
    (UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte"), ["utf-8"]),
    (MemoryError(), ["out of memory"]),
    (
        RuntimeError("Expected one of cpu, cuda, xla device type at start of device string: tpu"),
        ["device", "'tpu'"],
    ),
    (AssertionError("Torch not compiled with CUDA enabled"), ["cuda is not available"]),
]


@pytest.mark.parametrize(
    "exc,fragments", BOUNDARY, ids=[type(e).__name__ + str(i) for i, (e, _) in enumerate(BOUNDARY)]
)
def test_boundary_environment_errors(monkeypatch, capsys, exc, fragments):
    import kvlm.cli.prepare as verb

    monkeypatch.setattr(verb, "prepare", _raiser(exc))
    line = run(["prepare", "synthetic", "--out", "x"], capsys, 1, *fragments)
    assert "weights_only=False" not in line  # never suggest running a pickle's code


class _Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_boundary_real_unknown_device(monkeypatch, capsys):
    """A verb that hands --device to torch unchecked (bench) still gets one line naming the device."""
    import kvlm.cli.prepare as verb

    monkeypatch.setattr(verb, "prepare", lambda *a, **k: torch.zeros(1, device="tpu"))
    run(["prepare", "synthetic", "--out", "x"], capsys, 1, "unknown device 'tpu'")


def test_boundary_real_malicious_pickle(monkeypatch, capsys, tmp_path):
    """A weights file whose pickle would run code: torch refuses (weights_only), kvlm says so in one line and
    never suggests weights_only=False; the code did not run."""
    import kvlm.cli.prepare as verb

    marker = tmp_path / "PWNED"
    with open(tmp_path / "pytorch_model.bin", "wb") as f:
        pickle.dump({"w": _Evil(marker)}, f)
    monkeypatch.setattr(
        verb, "prepare", lambda *a, **k: torch.load(tmp_path / "pytorch_model.bin", weights_only=True)
    )
    line = run(["prepare", "synthetic", "--out", "x"], capsys, 1, "refusing to load a pickle", "safetensors")
    assert "weights_only=False" not in line and not marker.exists()


def test_boundary_unexpected_error_hints_debug(monkeypatch, capsys):
    import kvlm.cli.prepare as verb

    monkeypatch.setattr(verb, "prepare", _raiser(ZeroDivisionError("division by zero")))
    assert main(["prepare", "synthetic", "--out", "x"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.strip().splitlines() == [
        "kvlm prepare: error: unexpected ZeroDivisionError: division by zero "
        "(run with --debug or KVLM_DEBUG=1 for the traceback)"
    ]


@pytest.mark.parametrize("how", ["flag-after", "flag-before", "env"])
def test_boundary_debug_prints_traceback(monkeypatch, capsys, how):
    import kvlm.cli.prepare as verb

    monkeypatch.setattr(verb, "prepare", _raiser(ZeroDivisionError("division by zero")))
    argv = ["prepare", "synthetic", "--out", "x"]
    if how == "flag-after":
        argv.append("--debug")
    elif how == "flag-before":
        argv.insert(0, "--debug")
    else:
        monkeypatch.setenv("KVLM_DEBUG", "1")
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and "ZeroDivisionError" in err
    assert err.strip().splitlines()[-1].startswith("kvlm prepare: error: unexpected ZeroDivisionError")


def test_boundary_keyboard_interrupt_is_quiet(monkeypatch, capsys):
    import kvlm.cli.prepare as verb

    monkeypatch.setattr(verb, "prepare", _raiser(KeyboardInterrupt()))
    assert main(["prepare", "synthetic", "--out", "x"]) == 130
    err = capsys.readouterr().err
    assert "Traceback" not in err and "error" not in err


def test_boundary_training_interrupted_says_what_was_saved(monkeypatch, capsys):
    import kvlm.cli.prepare as verb
    from kvlm.errors import TrainingInterrupted

    monkeypatch.setattr(verb, "prepare", _raiser(TrainingInterrupted(7, "runs/x/checkpoint")))
    assert main(["prepare", "synthetic", "--out", "x"]) == 130
    err = capsys.readouterr().err
    assert "Traceback" not in err and "step 7" in err and "runs/x/checkpoint" in err


def test_boundary_json_error_line(monkeypatch, capsys):
    """With --json the last stdout line is still one JSON object, holding the error."""
    run(["eval", "missing_ckpt", "--json"], capsys, 1, "missing_ckpt")
    assert main(["eval", "missing_ckpt", "--json"]) == 1
    out = capsys.readouterr().out
    assert "missing_ckpt" in json.loads(out.strip().splitlines()[-1])["error"]


# --- a few through a real process: exit status and stderr as a shell sees them ---------------------------
def _cli(*argv: str | bytes) -> subprocess.CompletedProcess:
    """``python -m kvlm.cli ARGV`` (bytes passed as the shell would pass them), stdout/stderr as bytes."""
    env = {k: v for k, v in os.environ.items() if k != "KVLM_DEBUG"}
    argv = [a if isinstance(a, bytes) else str(a) for a in argv]
    return subprocess.run([sys.executable, "-m", "kvlm.cli", *argv], capture_output=True, cwd=REPO, timeout=120,
                          env={**env, "OMP_NUM_THREADS": "1"})  # fmt: skip


def test_subprocess_exit_code_and_one_line(world):
    r = _cli("train", "--data", world["data"], "--out", world["root"] / "sub", "--set", "n_layer=four")
    err = r.stderr.decode()
    assert r.returncode == 1 and "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("kvlm train: error: ModelConfig.n_layer")


def test_subprocess_prompt_with_invalid_utf8(world):
    """The shell hands over raw bytes: a prompt holding 0xff is refused in one line."""
    r = _cli("generate", world["ckpt"], "--prompt", b"caf\xff")
    err = r.stderr.decode("utf-8", "replace")
    assert r.returncode == 1 and "Traceback" not in err
    assert "--prompt 1" in err and "UTF-8" in err


# --- resume: a checkpoint without tokenizer.json is checked through meta.json, or refused ------------------
def test_resume_without_tokenizer_json(world, capsys, tmp_path):
    tiny = ["--n-layer", "1", "--d-model", "32", "--n-head", "2", "--batch-size", "2", "--seq-len", "8",
            "--eval-iters", "1", "--no-progress"]  # fmt: skip
    out = tmp_path / "run"
    assert main(["train", "--data", str(world["data"]), "--out", str(out), "--steps", "1", *tiny]) == 0
    capsys.readouterr()
    ckpt = out / "checkpoint"
    (ckpt / "tokenizer.json").unlink()
    other = prepare("synthetic", tmp_path / "other", max_tokens=3000, vocab_size=280)
    resume = ["train", "--out", out, "--resume", "--steps", "2", *tiny]
    # the sha256 that meta.json recorded still tells another tokenizer apart
    run([*resume, "--data", other.path], capsys, 1, "different tokenizer")
    # with neither tokenizer.json nor a recorded sha256 the check is not skipped: resuming is refused
    meta = json.loads((ckpt / "meta.json").read_text())
    meta["data"].pop("tokenizer")
    (ckpt / "meta.json").write_text(json.dumps(meta))
    run([*resume, "--data", world["data"]], capsys, 1, "tokenizer.json", str(ckpt))
