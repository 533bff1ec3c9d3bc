"""The bad-input battery of the Python API (issue 14): configs of the wrong type, token ids outside the vocabulary,
a cache of another model, sampling settings out of range, data files that are not text, and tokenizer training on
long runs without whitespace. Each case asserts the exception's type and that its message names the problem.
The command-line battery is test_bad_inputs.py.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from kvlm import ModelConfig, build_model, generate
from kvlm.cache import CacheError
from kvlm.config import ConfigError
from kvlm.data import DataError, prepare, read_documents, train_bpe
from kvlm.data.tokenizer import MAX_PRETOKEN_CHARS, PIECE_CHARS, text_pieces
from kvlm.inference.evaluation import EvalError, load_eval_tokens, perplexity
from kvlm.inference.sampling import check_sampling
from kvlm.training import TrainConfig

TINY = dict(n_layer=2, d_model=32, n_head=2, vocab_size=50, max_seq_len=32)


@pytest.fixture(scope="module")
def model():
    return build_model(ModelConfig(**TINY)).eval()


# --- configs: coerced to the declared type or one ConfigError naming field and value ------------------------
MODEL_BAD = [
    (dict(n_layer="four"), ["ModelConfig.n_layer", "'four'", "integer"]),
    (dict(n_layer=True), ["n_layer", "True", "boolean"]),
    (dict(n_layer=2.5), ["n_layer", "2.5"]),
    (dict(n_layer=[2]), ["n_layer", "[2]"]),
    (dict(n_layer=None), ["n_layer", "None"]),
    (dict(d_model="big"), ["d_model", "'big'"]),
    (dict(attention=["mla"]), ["attention", "['mla']", "string"]),
    (dict(attention=5), ["attention", "5"]),
    (dict(rope="maybe"), ["rope", "'maybe'"]),
    (dict(rope=2), ["rope", "2"]),
    (dict(rope=None), ["rope", "None"]),
    (dict(rope_theta=[1, 2]), ["rope_theta", "[1, 2]"]),
    (dict(rope_theta=float("nan")), ["rope_theta", "nan", "finite"]),
    (dict(rope_theta=float("inf")), ["rope_theta", "inf"]),
    (dict(rope_theta="1e4x"), ["rope_theta", "1e4x"]),
    (dict(dropout="0.1.2"), ["dropout"]),
    (dict(head_dim="x"), ["head_dim", "'x'", "null"]),
    (dict(kv_lora_rank=[16]), ["kv_lora_rank"]),
    (dict(gated="sometimes"), ["gated", "sometimes"]),
    (dict(extra=[1]), ["extra", "[1]", "mapping"]),
    (dict(note=3), ["note", "3"]),
    (dict(tpa_q_rank=False), ["tpa_q_rank", "boolean"]),
]


@pytest.mark.parametrize("kw,fragments", MODEL_BAD, ids=[str(k) for k, _ in MODEL_BAD])
def test_model_config_bad_type(kw, fragments):
    with pytest.raises(ConfigError) as e:
        ModelConfig(**{**TINY, **kw})
    for f in fragments:
        assert f in str(e.value), (f, str(e.value))


TRAIN_BAD = [
    (dict(lr="fast"), ["TrainConfig.lr", "'fast'"]),
    (dict(lr=float("nan")), ["lr", "nan"]),
    (dict(lr=math.inf), ["lr", "inf"]),
    (dict(lr=True), ["lr", "boolean"]),
    (dict(batch_size="32x"), ["batch_size", "32x"]),
    (dict(batch_size=1.5), ["batch_size", "1.5"]),
    (dict(max_steps="many"), ["max_steps", "many"]),
    (dict(compile="maybe"), ["compile", "maybe"]),
    (dict(device="tpu"), ["device", "tpu"]),
    (dict(device=3), ["device", "3"]),
    (dict(seed=[0]), ["seed", "[0]"]),
    (dict(max_minutes=float("nan")), ["max_minutes", "nan"]),
]


@pytest.mark.parametrize("kw,fragments", TRAIN_BAD, ids=[str(k) for k, _ in TRAIN_BAD])
def test_train_config_bad_type(kw, fragments):
    with pytest.raises(ConfigError) as e:
        TrainConfig(**kw)
    for f in fragments:
        assert f in str(e.value), (f, str(e.value))


def test_configs_coerce_what_a_reader_means():
    """YAML / JSON / --set strings of the right kind become the declared type (exactly, not just truthy)."""
    cfg = ModelConfig(
        **{**TINY, "n_layer": "3", "rope_theta": "5e5", "rope": "no", "tie_embeddings": "false"}
    )
    assert (cfg.n_layer, cfg.rope_theta, cfg.rope, cfg.tie_embeddings) == (3, 500000.0, False, False)
    assert type(cfg.n_layer) is int and type(cfg.rope_theta) is float and cfg.rope_head_dim == 0
    t = TrainConfig(lr="1e-3", batch_size="8", max_steps=10.0, compile="off")
    assert (t.lr, t.batch_size, t.max_steps, t.compile) == (0.001, 8, 10, False)
    assert type(t.max_steps) is int


@pytest.mark.parametrize("data", [[1, 2], "n_layer: 2", 5, None])
def test_config_from_dict_needs_a_mapping(data):
    with pytest.raises(ConfigError, match="mapping"):
        ModelConfig.from_dict(data)
    with pytest.raises(ConfigError, match="mapping"):
        TrainConfig.from_dict(data)


def test_config_from_dict_string_numbers_as_in_a_hand_edited_json():
    cfg = ModelConfig.from_dict(json.loads(json.dumps({**TINY, "n_layer": "4"})))
    assert cfg.n_layer == 4 and len(build_model(cfg).layers) == 4


# --- the model: token ids and caches ----------------------------------------------------------------------
@pytest.mark.parametrize("bad", [50, 51, 10_000, -1, -50])
def test_token_id_outside_vocab(model, bad):
    with pytest.raises(ValueError) as e:
        model(torch.tensor([[1, bad, 2]]))
    assert not isinstance(e.value, IndexError)
    assert f"token id {bad}" in str(e.value) and "50" in str(e.value)


@pytest.mark.parametrize("shape", ["long", "strided"])
def test_token_id_outside_vocab_in_many_or_strided_ids(model, shape):
    """Both ways of reading the ids back: over 64 ids (one reduction) and a few in a strided view (a list)."""
    if shape == "long":
        tokens = torch.ones(3, 30, dtype=torch.long)
        tokens[2, 17] = 61
    else:
        tokens = torch.tensor([[1, 2], [3, 61]]).t()
        assert not tokens.is_contiguous()
    with pytest.raises(ValueError, match="token id 61"):
        model(tokens)


def test_token_id_outside_vocab_with_cache(model):
    cache = model.new_cache(1, 16)
    with pytest.raises(ValueError, match="token id 77"):
        model(torch.tensor([[3, 77]]), cache=cache)
    model(torch.tensor([[3, 4]]), cache=cache)
    with pytest.raises(ValueError, match="token id 99"):
        model(torch.tensor([[99]]), cache=cache)  # a decode step on CPU is checked too


@pytest.mark.parametrize("tokens,fragment", [
    (torch.tensor([[1.0, 2.0]]), "dtype"),
    (torch.tensor([[True, False]]), "dtype"),
    (torch.tensor([1, 2]), "shape"),
    (torch.zeros(1, 0, dtype=torch.long), "empty"),
    (torch.ones(1, 33, dtype=torch.long), "max_seq_len"),
])  # fmt: skip
def test_bad_token_tensors(model, tokens, fragment):
    with pytest.raises(ValueError, match=fragment):
        model(tokens)


OTHER_MODELS = [
    ("more layers", dict(TINY, n_layer=3), False),
    ("other mechanism", dict(TINY, attention="mqa"), False),
    ("other width", dict(TINY, d_model=64, n_head=4), False),
    ("mla compact", dict(TINY, attention="mla", kv_lora_rank=16), False),
    ("mla naive", dict(TINY, attention="mla", kv_lora_rank=16), True),
]


@pytest.mark.parametrize("why,other,naive", OTHER_MODELS, ids=[w for w, _, _ in OTHER_MODELS])
def test_used_cache_of_another_model_is_refused_on_every_call(model, why, other, naive):
    """A cache filled by another model (or in the other mode) fails with CacheError, not a shape error or
    silently wrong attention, on the first call *and* after the cache has been used."""
    donor = build_model(ModelConfig(**other)).eval()
    cache = donor.new_cache(1, 16, naive=naive)
    with torch.no_grad():
        donor(torch.tensor([[1, 2, 3]]), cache=cache, mode="naive" if naive else "auto")
        assert cache.length == 3
        for _ in range(2):  # every call, not only the first use
            with pytest.raises(CacheError, match="not built for this model"):
                model(torch.tensor([[4]]), cache=cache)
        assert cache.length == 3  # the refused call wrote nothing


@pytest.mark.parametrize("naive,mode", [(False, "naive"), (True, "absorbed")])
def test_cache_in_the_other_mode_is_refused(naive, mode):
    mla = build_model(ModelConfig(**dict(TINY, attention="mla", kv_lora_rank=16))).eval()
    cache = mla.new_cache(1, 16, naive=naive)
    with torch.no_grad():
        mla(torch.tensor([[1, 2]]), cache=cache)
        with pytest.raises(CacheError, match="naive" if naive else "materialised"):
            mla(torch.tensor([[3]]), cache=cache, mode=mode)


def test_cache_of_an_identical_model_is_accepted(model):
    """The check compares specs, not identity: a twin model may continue a cache (and the memo stays small)."""
    twin = build_model(ModelConfig(**TINY)).eval()
    cache = model.new_cache(1, 16)
    with torch.no_grad():
        model(torch.tensor([[1, 2]]), cache=cache)
        twin(torch.tensor([[3]]), cache=cache)
        for _ in range(20):
            model(torch.tensor([[1]]), cache=model.new_cache(1, 4))
    assert cache.length == 3 and len(model._fitting_specs) <= 8


# --- generation and sampling ----------------------------------------------------------------------------
@pytest.mark.parametrize("kw,fragment", [
    (dict(temperature=float("nan")), "temperature"),
    (dict(temperature=float("inf")), "temperature"),
    (dict(temperature=-0.5), "temperature"),
    (dict(temperature="hot"), "temperature"),
    (dict(top_p=float("nan")), "top_p"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-1), "top_k"),
    (dict(top_k=2.5), "top_k"),
    (dict(mode="bogus"), "bogus"),
])  # fmt: skip
def test_generate_bad_sampling(model, kw, fragment):
    with pytest.raises(ValueError, match=fragment):
        generate(model, [1, 2], 2, **kw)


@pytest.mark.parametrize("prompt,n,fragment", [
    ([1, 50], 2, "vocabulary"),
    ([-3], 2, "vocabulary"),
    ([], 2, "empty"),
    ([[1], []], 2, "empty"),
    ([1, 2], -1, "max_new_tokens"),
    ([1, 2], 40, "max_seq_len"),
])  # fmt: skip
def test_generate_bad_prompts(model, prompt, n, fragment):
    with pytest.raises(ValueError, match=fragment):
        generate(model, prompt, n)


def test_check_sampling_accepts_numpy_and_torch_numbers():
    import numpy as np

    check_sampling(np.float32(0.7), np.int64(5), np.float64(0.9))


# --- evaluation ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kw,fragment", [
    (dict(seq_len=0), "seq_len=0"),
    (dict(stride=0), "stride=0"),
    (dict(seq_len=-4), "seq_len=-4"),
    (dict(seq_len=64), "max_seq_len=32"),
    (dict(seq_len=8, stride=9), "stride=9"),
    (dict(batch_size=0), "batch_size"),
])  # fmt: skip
def test_perplexity_bad_windows(model, kw, fragment):
    with pytest.raises(EvalError, match=fragment):
        perplexity(model, list(range(40)), **kw)


def test_perplexity_token_outside_vocab(model):
    with pytest.raises(EvalError, match="token id 60"):
        perplexity(model, [1, 2, 60, 3])


# --- data files: strict text ------------------------------------------------------------------------------
DOCS_BAD = [
    ("r.txt", bytes(range(128, 256)), ["r.txt", "UTF-8", "0x80"]),
    ("n.txt", b"abc\x00def", ["n.txt", "NUL"]),
    ("b.jsonl", b"\xff\xd8\xff\xe0JFIF", ["b.jsonl:1", "UTF-8"]),
    ("num.jsonl", b'{"text": 3.5}\n', ["num.jsonl:1", "float"]),
    ("lst.jsonl", b'{"text": []}\n', ["lst.jsonl:1", "list"]),
    ("obj.jsonl", b'{"text": {}}\n', ["obj.jsonl:1", "dict"]),
    ("zero.jsonl", b'{"text": 0}\n', ["zero.jsonl:1", "int"]),
    ("nan.jsonl", b'{"text": NaN}\n', ["nan.jsonl:1", "float"]),
    ("trunc.jsonl", b'{"text": "a"}\n{"te', ["trunc.jsonl:2", "JSON"]),
]


@pytest.mark.parametrize("name,raw,fragments", DOCS_BAD, ids=[n for n, _, _ in DOCS_BAD])
def test_read_documents_refuses_what_is_not_text(tmp_path, name, raw, fragments):
    path = tmp_path / name
    path.write_bytes(raw)
    with pytest.raises(DataError) as e:
        list(read_documents(path))
    for f in fragments:
        assert f in str(e.value), (f, str(e.value))


def test_jsonl_null_and_empty_text_are_skipped_not_refused(tmp_path):
    path = tmp_path / "ok.jsonl"
    path.write_text('{"text": null}\n{"text": ""}\n\n{"text": "real"}\n')
    assert list(read_documents(path)) == ["real"]


def test_eval_tokens_refuse_non_text(tmp_path):
    tok = train_bpe(["hello world, a small text"] * 3, vocab_size=260)
    (tmp_path / "n.jsonl").write_text('{"text": "ok"}\n{"text": 7}\n')
    with pytest.raises(DataError, match=r"n.jsonl:2.*int"):
        load_eval_tokens(tmp_path / "n.jsonl", tok)
    (tmp_path / "r.txt").write_bytes(b"\xfe\xff" * 10)
    with pytest.raises(DataError, match="r.txt.*UTF-8"):
        load_eval_tokens(tmp_path / "r.txt", tok)
    with pytest.raises(EvalError, match="max_tokens"):
        load_eval_tokens(tmp_path / "n.jsonl", tok, max_tokens=0)


def test_prepare_val_source_is_validation_whatever_its_name(tmp_path):
    (tmp_path / "train.txt").write_text("The cat sat on the mat. " * 50)
    (tmp_path / "val_small.jsonl").write_text(json.dumps({"text": "A dog ran in the park."}) + "\n")
    data = prepare(tmp_path / "train.txt", tmp_path / "out", val=tmp_path / "val_small.jsonl", vocab_size=280)
    assert len(data.val) == len(data.tokenizer.encode("A dog ran in the park.")) + 1


# --- tokenizer: long runs without whitespace ------------------------------------------------------------
def test_bpe_on_a_multi_megabyte_word_finishes(tmp_path):
    """A 3 MB 'word' (no whitespace) trained past 10 minutes before the pre-token bound; it now takes seconds
    (not a timed assertion: the size is what would hang). Round trip exact, long runs split."""
    word = "xyz" * 1_000_000
    (tmp_path / "w.txt").write_text(word)
    data = prepare(tmp_path / "w.txt", tmp_path / "out", vocab_size=300)
    tok = data.tokenizer
    sample = word[:10_000]
    assert tok.decode(tok.encode(sample)) == sample
    pieces = tok.backend.pre_tokenizer.pre_tokenize_str(sample)
    assert max(len(p) for p, _ in pieces) <= MAX_PRETOKEN_CHARS


def test_prepare_stops_encoding_a_huge_line_at_max_tokens(tmp_path, monkeypatch):
    """--max-tokens 500 on a 4 MB line encodes a few pieces, not the whole line."""
    from kvlm.data.tokenizer import Tokenizer

    (tmp_path / "line.txt").write_text(("abc def ghi " * 350_000)[:4_000_000])
    encoded = []
    real = Tokenizer.encode_pieces

    def counting(self, text, allow_special=False):
        for ids in real(self, text, allow_special):
            encoded.append(len(ids))
            yield ids

    monkeypatch.setattr(Tokenizer, "encode_pieces", counting)
    data = prepare(tmp_path / "line.txt", tmp_path / "out", vocab_size=300, max_tokens=500, val_tokens=0)
    assert len(data.train) == 500
    assert 0 < len(encoded) <= 2, f"{len(encoded)} pieces of {PIECE_CHARS} characters encoded for 500 tokens"


@pytest.mark.parametrize("text", [
    "plain words and  double  spaces\n\nnew paragraph\ttab " * 4000,
    ("w" * 300 + " ") * 700,
    "x" * 200_000,
    "  " + "é日本" * 40_000 + " end",
])  # fmt: skip
def test_piecewise_encoding_equals_whole(text):
    """Text longer than a piece is encoded in pieces cut where a pre-token starts: the ids are the whole's."""
    tok = train_bpe([text[:50_000]], vocab_size=300)
    pieces = list(text_pieces(text))
    assert "".join(pieces) == text and max(map(len, pieces)) <= PIECE_CHARS
    whole = tok._encoder(False).encode(text, add_special_tokens=False).ids
    assert tok.encode(text) == whole
    assert tok.encode_batch([text, "short"]) == [whole, tok.encode("short")]


def test_prepare_stops_reading_a_big_txt_at_max_tokens(tmp_path):
    """A .txt is read in chunks as documents are needed: with --max-tokens 500, a 17 MB file whose last bytes
    are not UTF-8 prepares without ever reading them (while reading it whole names the bad byte)."""
    from kvlm.data import EOS_TOKEN

    story = "The little fox ran home before the rain. " * 4 + EOS_TOKEN
    path = tmp_path / "big.txt"
    path.write_bytes((story * (17_000_000 // len(story))).encode() + b"\xff\xfe")
    data = prepare(path, tmp_path / "out", vocab_size=300, max_tokens=500, val_tokens=50)
    assert len(data.train) == 500
    with pytest.raises(DataError, match="big.txt.*UTF-8"):
        prepare(path, tmp_path / "whole", vocab_size=300)
