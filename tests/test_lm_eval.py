"""lm-evaluation-harness on kvlm models, offline: the registered "kvlm" model and the local WinoGrande task."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from conftest import shared_path

pytest.importorskip("lm_eval", reason="needs lm-evaluation-harness (pip install 'kvlm[eval]')")
pytest.importorskip("transformers", reason="needs transformers (pip install 'kvlm[hf]')")

ROOT = Path(__file__).resolve().parents[1]
TASKS = ROOT / "kvlm" / "interop" / "lm_eval_tasks"
LIMIT = 16


@pytest.fixture(scope="module")
def winogrande():
    """The local WinoGrande file the winogrande_local task reads (every test here needs it), handed to the task
    through its environment variable (the example has no default location)."""
    path = shared_path("eval", "winogrande-bb", "test.jsonl")
    before = os.environ.get("KVLM_WINOGRANDE_PATH")
    os.environ["KVLM_WINOGRANDE_PATH"] = str(path)
    yield path
    if before is None:
        os.environ.pop("KVLM_WINOGRANDE_PATH", None)
    else:
        os.environ["KVLM_WINOGRANDE_PATH"] = before


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, winogrande):
    from kvlm import ModelConfig, build_model
    from kvlm.checkpoint import save_checkpoint
    from kvlm.data.tokenizer import train_bpe

    docs = [json.loads(line) for line in winogrande.read_text().splitlines()[:300]]
    tok = train_bpe([d["sentence"] for d in docs], vocab_size=400)
    torch.manual_seed(0)
    cfg = ModelConfig(attention="mla", n_layer=2, d_model=64, n_head=4, kv_lora_rank=32, rope_head_dim=8,
                      vocab_size=tok.vocab_size, max_seq_len=128, init_std=0.2)  # fmt: skip
    path = tmp_path_factory.mktemp("lm_eval") / "ck"
    save_checkpoint(path, build_model(cfg), tok)
    return path


def reference_logliks(model, tok, doc) -> list[float]:
    """WinoGrande partial scoring from its definition: log p(" " + text after the blank | sentence up to the
    blank with option k), summed over the continuation's tokens (lm-eval's context/continuation split)."""
    blank = doc["sentence"].index("_")
    continuation = " " + doc["sentence"][blank + 1 :].strip()
    out = []
    for option in (doc["option1"], doc["option2"]):
        context = doc["sentence"][:blank] + option
        whole, ctx = tok.encode(context + continuation), tok.encode(context)
        cont = whole[len(ctx) :]
        x = torch.tensor([whole])
        with torch.no_grad():
            logp = torch.log_softmax(model(x[:, :-1]).double(), dim=-1)[0]
        out.append(sum(float(logp[len(ctx) - 1 + i, t]) for i, t in enumerate(cont)))
    return out


def test_local_winogrande_matches_the_definition(checkpoint, winogrande):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from kvlm.checkpoint import load_checkpoint
    from kvlm.interop.lm_eval import KVLMEvalLM, summarize

    lm = KVLMEvalLM(checkpoint=str(checkpoint), batch_size=4)
    res = simple_evaluate(model=lm, tasks=["winogrande_local"], limit=LIMIT, log_samples=True,
                          task_manager=TaskManager(include_path=[str(TASKS)], include_defaults=False))  # fmt: skip
    model, tok, _ = load_checkpoint(checkpoint)
    docs = [json.loads(line) for line in winogrande.read_text().splitlines()[:LIMIT]]
    samples = res["samples"]["winogrande_local"]
    assert len(samples) == LIMIT
    correct = 0
    for s in samples:
        doc = docs[s["doc_id"]]
        ref = reference_logliks(model, tok, doc)
        got = [r[0][0] for r in s["resps"]]
        assert got == pytest.approx(ref, abs=1e-3)
        correct += int(max(range(2), key=lambda k: ref[k]) == int(doc["answer"]) - 1)
    assert summarize(res)["winogrande_local"]["acc"] == pytest.approx(correct / LIMIT)


def test_run_lm_eval_from_a_checkpoint_or_a_model(checkpoint):
    from kvlm.checkpoint import load_checkpoint
    from kvlm.interop.lm_eval import run_lm_eval

    by_path = run_lm_eval(checkpoint, ["winogrande_local"], limit=8)
    model, tok, _ = load_checkpoint(checkpoint)
    by_model = run_lm_eval(model, tok, ["winogrande_local"], limit=8, batch_size=2)  # kvlm eval's call
    assert by_path == by_model
    row = by_path["winogrande_local"]
    assert row["samples"] == 8 and 0.0 <= row["acc"] <= 1.0 and "acc_stderr" in row
    json.dumps(by_path)  # JSON-ready for `kvlm eval --json`


@pytest.mark.slow  # lm_eval's CLI indexes its ~15k built-in task files first (~20 s)
def test_lm_eval_cli_wrapper(checkpoint, tmp_path, monkeypatch, capsys):
    """`python -m kvlm.interop.lm_eval ...` is lm_eval's CLI with --model kvlm registered."""
    from kvlm.interop.lm_eval import cli

    monkeypatch.chdir(tmp_path)
    cli(["--model", "kvlm", "--model_args", f"checkpoint={checkpoint}", "--tasks", "winogrande_local",
         "--limit", "4", "--batch_size", "2", "--output_path", str(tmp_path / "out")])  # fmt: skip
    assert "winogrande_local" in capsys.readouterr().out
    assert list((tmp_path / "out").rglob("results_*.json"))


def test_local_task_without_a_data_file_says_how_to_give_one(monkeypatch):
    import importlib.util

    spec = importlib.util.spec_from_file_location("wg_utils", TASKS / "winogrande_local" / "utils.py")
    utils = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(utils)
    monkeypatch.delenv("KVLM_WINOGRANDE_PATH", raising=False)
    with pytest.raises(FileNotFoundError, match="KVLM_WINOGRANDE_PATH"):
        utils.load_local()
    with pytest.raises(FileNotFoundError, match="no data file at"):
        utils.load_local(data_path="/nonexistent/wg.jsonl")
