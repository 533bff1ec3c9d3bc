"""Evaluation: perplexity == exp(mean token loss) computed token by token in float64, repetition metrics
on sequences counted by hand, data loading, and the `kvlm eval` command's JSON."""

import importlib.util
import json
import math

import numpy as np
import pytest
import torch
from conftest import tiny_config

from kvlm import build_model
from kvlm.inference.evaluation import EvalError, load_eval_tokens, perplexity, repetition_metrics


def _model(dtype=torch.float64, **overrides):
    torch.manual_seed(0)
    model = build_model(tiny_config("gqa", n_kv_head=2, tie_embeddings=False, max_seq_len=32, **overrides))
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(3.0)  # logits far from uniform, so a wrong context or target shows in the loss
    return model.to(dtype).eval()


def _reference_loss(model, ids, seq_len, stride):
    """Plain loop over targets t = 1..N-1: target t is scored by window k = max(0, ceil((t - L) / s)),
    which starts at k * s, so its context is ids[k * s : t]. float64 log-softmax of the last position."""
    total = 0.0
    for t in range(1, len(ids)):
        k = max(0, math.ceil((t - seq_len) / stride))
        context = torch.tensor([ids[k * stride : t]])
        logp = torch.log_softmax(model(context)[0, -1].double(), -1)
        total -= logp[ids[t]].item()
    return total / (len(ids) - 1)


@pytest.mark.parametrize(
    "n,seq_len,stride,batch_size", [(50, 16, None, 2), (41, 12, 5, 3), (17, 32, None, 1)]
)
def test_perplexity_equals_token_by_token_loss(n, seq_len, stride, batch_size):
    model = _model()
    ids = torch.randint(0, model.cfg.vocab_size, (n,)).tolist()
    res = perplexity(model, np.array(ids), seq_len=seq_len, batch_size=batch_size, stride=stride)
    want = _reference_loss(model, ids, seq_len, stride or seq_len)
    assert res["tokens"] == n - 1
    assert abs(res["loss"] - want) < 1e-10
    assert abs(res["perplexity"] - math.exp(want)) < 1e-8 * math.exp(want)
    assert res["loss"] > 0.5  # a random model: far from zero, so the comparison means something


def test_stderr_with_equal_windows_is_std_of_window_means():
    model = _model()
    ids = torch.randint(0, model.cfg.vocab_size, (49,)).tolist()  # 48 targets: 3 windows of 16
    res = perplexity(model, ids, seq_len=16)
    means = [_reference_loss(model, ids[16 * k : 16 * k + 17], 16, 16) for k in range(3)]
    assert res["stderr"] == pytest.approx(np.std(means, ddof=1) / math.sqrt(3), rel=1e-9)
    assert perplexity(model, ids[:10], seq_len=16)["stderr"] is None  # one window


def test_perplexity_float32_and_inputs():
    model = _model()
    ids = torch.randint(0, model.cfg.vocab_size, (70,))
    want = perplexity(model, ids, seq_len=20)
    got = perplexity(_model(torch.float32), ids.numpy().astype(np.int32), seq_len=20, batch_size=8)
    assert abs(got["loss"] - want["loss"]) < 1e-4
    assert perplexity(model, ids.tolist(), seq_len=20)["loss"] == pytest.approx(want["loss"], abs=1e-12)
    assert want["windows"] == 4  # 69 targets in windows of 20


def test_perplexity_runs_on_packed_weights_where_they_measured_faster(monkeypatch):
    """float32 forwards of ``PACK_MIN_PREFILL_ROWS`` rows or more run on oneDNN's packed layout where it measured
    fastest (``prefill_packs``), with the same loss to float32 rounding; dropped after; not where it did not win,
    nor below the threshold."""
    from kvlm.attention import linear
    from kvlm.inference import generation

    if not linear.packing_available(linear.ANY_ROWS):
        pytest.skip("this torch build has no oneDNN packed GEMM")
    model = _model(torch.float32)
    ids = torch.randint(0, model.cfg.vocab_size, (70,))
    plain = perplexity(model, ids, seq_len=20, batch_size=2)
    products = []
    real = linear._packed_product
    monkeypatch.setattr(linear, "_packed_product", lambda x, *a, **k: products.append(x.shape[:-1]) or real(x, *a, **k))
    monkeypatch.setattr(generation, "PACK_MIN_PREFILL_ROWS", 40)  # 2 windows of 20 rows a forward
    for wins, want in ((linear.ANY_ROWS, True), (None, False)):
        products.clear()
        monkeypatch.setattr(generation, "fastest_packing", lambda w, rows, wins=wins: wins)
        got = perplexity(model, ids, seq_len=20, batch_size=2)
        assert got["loss"] == pytest.approx(plain["loss"], rel=1e-5)
        assert bool(products) == want and all(shape[-1] == 20 for shape in products)
        assert all(m._packed is None for m in model.modules() if isinstance(m, linear.Linear))
    products.clear()
    monkeypatch.setattr(generation, "fastest_packing", lambda w, rows: linear.ANY_ROWS)
    perplexity(model, ids, seq_len=20, batch_size=1)  # 20 rows a forward: below the threshold
    assert products == []
    # import-hf's check (interop.convert.window_perplexity, windows of 21 tokens: 20 rows each) packs alike
    from kvlm.interop.convert import window_perplexity

    windows = ids[:63].view(3, 21)
    monkeypatch.setattr(generation, "fastest_packing", lambda w, rows: None)
    want = window_perplexity(model, windows, batch=2)
    assert products == []
    monkeypatch.setattr(generation, "fastest_packing", lambda w, rows: linear.ANY_ROWS)
    assert window_perplexity(model, windows, batch=2) == pytest.approx(want, rel=1e-5) and products
    assert all(m._packed is None for m in model.modules() if isinstance(m, linear.Linear))


def test_uniform_model_has_perplexity_vocab_size():
    model = _model()
    with torch.no_grad():
        model.lm_head.weight.zero_()  # every logit 0: uniform over the vocabulary
    ids = torch.randint(0, model.cfg.vocab_size, (30,))
    assert perplexity(model, ids, seq_len=8)["perplexity"] == pytest.approx(model.cfg.vocab_size, rel=1e-12)


def test_perplexity_errors():
    model = _model()
    with pytest.raises(EvalError, match="at least 2 tokens"):
        perplexity(model, [3])
    with pytest.raises(EvalError, match="seq_len"):
        perplexity(model, list(range(10)), seq_len=33)
    with pytest.raises(EvalError, match="vocabulary"):
        perplexity(model, [1, 2, 97])


def test_repetition_metrics_by_hand():
    m = repetition_metrics([[1, 2, 3, 1, 2, 3]])
    # unigrams 6, unique 3; bigrams 12 23 31 12 23: 3 of 5; trigrams 123 231 312 123: 3 of 4;
    # 4-grams 1231 2312 3123: none seen before
    assert m["distinct_1"] == pytest.approx(3 / 6)
    assert m["distinct_2"] == pytest.approx(3 / 5)
    assert m["distinct_3"] == pytest.approx(3 / 4)
    assert m["rep_4"] == 0
    # a collapsed sequence: 5 5 5 5 5 -> 4-grams 5555 5555, the second repeats the first
    m = repetition_metrics([[1, 2, 3, 1, 2, 3], [5, 5, 5, 5, 5], [7, 8]])
    assert m["distinct_1"] == pytest.approx((3 / 6 + 1 / 5 + 2 / 2) / 3)
    assert m["distinct_3"] == pytest.approx((3 / 4 + 1 / 3) / 2)  # [7, 8] holds no trigram
    assert m["rep_4"] == pytest.approx((0 + 1 / 2) / 2)
    assert (m["sequences"], m["tokens"]) == (3, 13)
    m = repetition_metrics([[1, 2, 1, 2, 1, 2, 1, 2]], rep_order=2)  # 12 21 12 21 12 21 12: 5 of 7 seen
    assert m["rep_2"] == pytest.approx(5 / 7)
    assert repetition_metrics([[4]])["distinct_2"] is None


def _tokenizer():
    from kvlm.data.tokenizer import train_bpe

    return train_bpe(["the cat sat on the mat", "a dog ran in the park", "once upon a time"] * 3, 280)


def test_load_eval_tokens_txt_and_jsonl(tmp_path):
    tok = _tokenizer()
    docs = ["the cat sat", "a dog ran in the park"]
    (tmp_path / "v.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    (tmp_path / "v.txt").write_text(docs[0])
    got = load_eval_tokens(tmp_path / "v.jsonl", tok)
    assert got.tolist() == tok.encode(docs[0]) + [tok.eos_id] + tok.encode(docs[1]) + [tok.eos_id]
    assert load_eval_tokens(tmp_path / "v.jsonl", tok, max_tokens=3).tolist() == got[:3].tolist()
    assert load_eval_tokens(tmp_path / "v.txt", tok).tolist() == tok.encode(docs[0])
    (tmp_path / "bad.jsonl").write_text('{"txt": 1}\n')
    with pytest.raises(EvalError, match="bad.jsonl:1"):
        load_eval_tokens(tmp_path / "bad.jsonl", tok)
    with pytest.raises(FileNotFoundError):
        load_eval_tokens(tmp_path / "missing.txt", tok)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from kvlm.checkpoint import save_checkpoint

    tok = _tokenizer()
    torch.manual_seed(0)
    model = build_model(tiny_config("mha", vocab_size=tok.vocab_size, max_seq_len=48))
    path = tmp_path_factory.mktemp("eval")
    save_checkpoint(path / "ckpt", model, tokenizer=tok)
    text = " ".join(["the cat sat on the mat and a dog ran in the park"] * 8)
    (path / "held.txt").write_text(text)
    (path / "train.txt").write_text("once upon a time a cat sat\n" * 4)
    return path


def test_cli_eval_prepared_folder(checkpoint, capsys):
    from kvlm.checkpoint import load_checkpoint, save_checkpoint
    from kvlm.data import prepare

    model, tok, _ = load_checkpoint(checkpoint / "ckpt")
    data = prepare(
        checkpoint / "train.txt", checkpoint / "prepared", val=checkpoint / "held.txt", tokenizer=tok
    )
    argv = ["eval", str(checkpoint / "ckpt"), "--data", str(data.path), "--samples", "0", "--json"]
    rc, out, err = _cli(argv, capsys)
    assert rc == 0, err
    res = json.loads(out.strip().splitlines()[-1])["perplexity"]
    val = data.val[:]
    assert res["tokens"] == len(val) - 1 > 100
    assert res["loss"] == pytest.approx(perplexity(model, val)["loss"], rel=1e-6)
    rc, out, err = _cli(argv[:-1] + ["--split", "train", "--max-tokens", "20", "--json"], capsys)
    assert json.loads(out.strip().splitlines()[-1])["perplexity"]["tokens"] == 19
    # without --data: the validation split recorded by training in meta.json
    save_checkpoint(checkpoint / "trained", model, tokenizer=tok, meta={"data": data.summary()})
    rc, out, err = _cli(["eval", str(checkpoint / "trained"), "--samples", "0", "--json"], capsys)
    res2 = json.loads(out.strip().splitlines()[-1])["perplexity"]
    assert res2["data"] == str(data.path) and res2["tokens"] == res["tokens"]
    other = prepare(
        checkpoint / "train.txt", checkpoint / "other", val=checkpoint / "held.txt", vocab_size=270
    )
    rc, out, err = _cli(
        ["eval", str(checkpoint / "ckpt"), "--data", str(other.path), "--samples", "0"], capsys
    )
    assert rc == 1 and "different tokenizer" in err


def _cli(argv, capsys):
    from kvlm.cli import main

    rc = main(argv)
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_cli_eval_json(checkpoint, capsys):
    from kvlm.checkpoint import load_checkpoint

    ckpt, data = str(checkpoint / "ckpt"), str(checkpoint / "held.txt")
    argv = ["eval", ckpt, "--data", data] + "--seq-len 16 --samples 3 --sample-tokens 6 --json".split()
    rc, out, err = _cli(argv, capsys)
    assert rc == 0
    res = json.loads(out.strip().splitlines()[-1])
    model, tok, _ = load_checkpoint(ckpt)
    want = perplexity(model, load_eval_tokens(data, tok), seq_len=16)
    assert (
        res["perplexity"]["tokens"]
        == want["tokens"]
        == len(tok.encode((checkpoint / "held.txt").read_text())) - 1
    )
    assert res["perplexity"]["loss"] == pytest.approx(want["loss"], rel=1e-6)
    assert res["repetition"]["sequences"] == 3 and res["repetition"]["tokens"] == 18
    assert 0 < res["repetition"]["distinct_1"] <= 1
    assert len(res["samples"]) == 3 and all(isinstance(s["text"], str) for s in res["samples"])
    rc, out, err = _cli(argv[:-1], capsys)  # human-readable
    assert rc == 0 and "perplexity" in out and "distinct_1" in out


def test_cli_eval_errors(checkpoint, capsys):
    ckpt = str(checkpoint / "ckpt")
    rc, out, err = _cli(["eval", ckpt, "--samples", "0", "--json"], capsys)
    assert rc == 1 and "nothing to evaluate" in json.loads(out.strip().splitlines()[-1])["error"]
    if importlib.util.find_spec("lm_eval") is None:
        rc, out, err = _cli(["eval", ckpt, "--samples", "0", "--tasks", "hellaswag"], capsys)
        assert rc == 1 and "lm-eval" in err
