"""Tokenizer wrapper: byte-level BPE training, GPT-2 files, save/load, round trips, clear errors."""

import json

import pytest
from conftest import shared_path

from kvlm.data.tokenizer import EOS_TOKEN, TokenizerError, gpt2_tokenizer, load_tokenizer, train_bpe

TRICKY = [
    "Once upon a time, there was a little girl named Lily.",
    "  leading and trailing spaces  ",
    "tabs\tand\nnew\n\nlines\r\n",
    "Unicode: café, naïve, Straße, Ελληνικά, 中文字符, 日本語, emoji 🙂👍🏽",
    "numbers 3.14159 and symbols <>&%$#@!~`",
    "",
]


@pytest.fixture(scope="module")
def bpe():
    corpus = [t * 5 for t in TRICKY] + ["the cat sat on the mat. " * 20] * 10
    return train_bpe(corpus, vocab_size=400)


def test_bpe_round_trips_any_text(bpe):
    for text in TRICKY + ["text the BPE never saw: Ωμέγα ∑ ∫ 🚀 \x00 \x7f"]:
        assert bpe.decode(bpe.encode(text)) == text


def test_bpe_vocabulary_and_eos(bpe):
    assert 257 <= bpe.vocab_size <= 400
    assert bpe.backend.token_to_id(EOS_TOKEN) == bpe.eos_id
    assert bpe.decode([bpe.eos_id]) == EOS_TOKEN
    # a frequent word was merged: fewer tokens than bytes
    assert len(bpe.encode("the cat sat on the mat.")) < len(b"the cat sat on the mat.")


def test_save_and_load_give_the_same_tokenizer(bpe, tmp_path):
    path = bpe.save(tmp_path / "tokenizer.json")
    again = load_tokenizer(path)
    assert again.sha256() == bpe.sha256()
    assert load_tokenizer(tmp_path).sha256() == bpe.sha256()  # a folder holding tokenizer.json
    for text in TRICKY:
        assert again.encode(text) == bpe.encode(text)
    assert again.eos_id == bpe.eos_id and again.vocab_size == bpe.vocab_size


def test_gpt2_files():
    gpt2_dir = shared_path("tokenizers", "gpt2")
    tok = gpt2_tokenizer(gpt2_dir)
    assert tok.vocab_size == 50257 and tok.eos_id == 50256
    # GPT-2's published ids for "Hello world"
    assert tok.encode("Hello world") == [15496, 995]
    for text in TRICKY:
        assert tok.decode(tok.encode(text)) == text
    assert load_tokenizer(gpt2_dir).encode("Hello world") == [15496, 995]


def test_gpt2_saved_as_json_keeps_ids(tmp_path):
    tok = gpt2_tokenizer(shared_path("tokenizers", "gpt2"))
    again = load_tokenizer(tok.save(tmp_path / "tokenizer.json"))
    assert again.kind == "gpt2" and again.encode("Hello world") == [15496, 995]


def test_errors(tmp_path):
    with pytest.raises(TokenizerError, match="no tokenizer"):
        load_tokenizer(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(TokenizerError, match="cannot read"):
        load_tokenizer(bad)
    with pytest.raises(TokenizerError, match="holds no tokenizer"):
        load_tokenizer(tmp_path)
    half = tmp_path / "half"
    half.mkdir()
    (half / "vocab.json").write_text(json.dumps({"a": 0}))
    with pytest.raises(TokenizerError, match="merges.txt is missing"):
        gpt2_tokenizer(half)
    with pytest.raises(TokenizerError, match="too small"):
        train_bpe(["abc"], vocab_size=100)


def test_a_literal_end_of_text_marker_is_ordinary_text(bpe):
    """Decision (kvlm.data.tokenizer's docstring): encode() reads its input as ordinary text, so a document that
    contains "<|endoftext|>" cannot inject a document boundary; allow_special=True matches the marker, as a
    Hugging Face tokenizer does by default."""
    text = "a story <|endoftext|>and more"
    ids = bpe.encode(text)
    assert bpe.eos_id not in ids
    assert bpe.decode(ids) == text
    assert bpe.encode_batch([text]) == [ids]
    assert bpe.encode(EOS_TOKEN) != [bpe.eos_id] and bpe.decode(bpe.encode(EOS_TOKEN)) == EOS_TOKEN
    # opting in: the marker becomes the end-of-text id, the text around it is unchanged
    special = bpe.encode(text, allow_special=True)
    assert special.count(bpe.eos_id) == 1
    assert special == bpe.encode("a story ") + [bpe.eos_id] + bpe.encode("and more")
    assert bpe.encode_batch([text], allow_special=True) == [special]
    # the backend handed to others (checkpoints, the Hugging Face export) is unchanged
    assert bpe.backend.encode(EOS_TOKEN, add_special_tokens=False).ids == [bpe.eos_id]


def test_prepared_data_has_one_end_of_text_per_document(tmp_path):
    """A .jsonl document holding the marker stays one document: exactly one end-of-text id, at its end."""
    from kvlm.data import prepare

    src = tmp_path / "docs.jsonl"
    docs = ["first <|endoftext|> still the first", "second story"] * 30
    src.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    data = prepare(src, tmp_path / "out", vocab_size=300, val_fraction=0.0)
    ids = data.train[: len(data.train)].tolist()
    assert ids.count(data.eos_id) == len(docs) and ids[-1] == data.eos_id
    first = ids[: ids.index(data.eos_id)]
    assert data.tokenizer.decode(first) == docs[0]
