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


# --- stop tokens: a chat model ends its reply with <|im_end|>, not <|endoftext|> ------------------------------
CHAT_TEMPLATE = (  # SmolLM2-Instruct's, shortened
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n'}}{% endfor %}"
)


@pytest.fixture(scope="module")
def chat_backend():
    """A byte-level BPE whose special tokens are SmolLM2-Instruct's: <|endoftext|> 0, <|im_start|> 1,
    <|im_end|> 2."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers, trainers

    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok.train_from_iterator(
        ["the cat sat on the mat"] * 20, trainers.BpeTrainer(vocab_size=300, special_tokens=specials)
    )
    return tok


def test_stop_tokens_hold_the_eos_first_and_are_checked(chat_backend):
    from kvlm.data.tokenizer import Tokenizer

    plain = Tokenizer(chat_backend)
    assert plain.stop_ids == [0] and plain.stop_tokens == [EOS_TOKEN]  # the old single eos, unchanged
    tok = Tokenizer(chat_backend, stop_tokens=["<|im_end|>", EOS_TOKEN])
    assert tok.eos_id == 0 and tok.stop_ids == [0, 2]
    with pytest.raises(TokenizerError, match="no stop token '<\\|eot_id\\|>'"):
        Tokenizer(chat_backend, stop_tokens=["<|eot_id|>"])


def test_end_of_turn_tokens_of_chat_templates():
    from kvlm.data.tokenizer import end_of_turn_tokens

    specials = [
        "<|endoftext|>",
        "<|im_start|>",
        "<|im_end|>",
        "<|eot_id|>",
        "<|start_header_id|>",
        "<|end_header_id|>",
    ]
    assert end_of_turn_tokens(CHAT_TEMPLATE, specials) == ["<|im_end|>"]
    llama3 = "{{'<|start_header_id|>' + m['role'] + '<|end_header_id|>' + m['content'] + '<|eot_id|>'}}"
    assert end_of_turn_tokens(llama3, specials) == ["<|eot_id|>"]
    assert end_of_turn_tokens(None, specials) == [] and end_of_turn_tokens("", specials) == []


def test_load_tokenizer_reads_the_stop_tokens_its_folder_declares(chat_backend, tmp_path):
    """A kvlm checkpoint's meta.json (what import-hf keeps), or a Hugging Face folder's generation_config.json
    (an id list) and tokenizer_config.json (eos, chat template) beside tokenizer.json."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    chat_backend.save(str(ckpt / "tokenizer.json"))
    assert load_tokenizer(ckpt).stop_ids == [0]  # no declaration: the end-of-text token alone
    meta = {"format": "kvlm-checkpoint", "version": 1, "hf_tokenizer": {"eos_token": "<|im_end|>"}}
    (ckpt / "meta.json").write_text(json.dumps(meta))
    assert load_tokenizer(ckpt / "tokenizer.json").stop_ids == [0, 2]
    # another format's meta.json (a prepared-data folder) declares nothing
    (ckpt / "meta.json").write_text(json.dumps({**meta, "format": "kvlm-data"}))
    assert load_tokenizer(ckpt).stop_ids == [0]

    hf = tmp_path / "hf"
    hf.mkdir()
    chat_backend.save(str(hf / "tokenizer.json"))
    # an id list, as Llama-3's; 99999 is not in the vocabulary: skipped
    (hf / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 99999]}))
    assert load_tokenizer(hf).stop_ids == [0, 2]
    (hf / "generation_config.json").unlink()
    (hf / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))
    assert load_tokenizer(hf).stop_ids == [0, 2]
    (hf / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<|im_start|>"}}))
    assert load_tokenizer(hf).stop_ids == [0, 1]


def test_a_folder_without_endoftext_uses_its_declared_eos(tmp_path):
    """A Llama-style vocabulary (</s>, no <|endoftext|>) loads when its folder declares the eos; without the
    declaration it is refused as before."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers, trainers

    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(
        ["a b c"] * 5, trainers.BpeTrainer(vocab_size=280, special_tokens=["<s>", "</s>"])
    )
    tok.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(TokenizerError, match="no end-of-text token"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    loaded = load_tokenizer(tmp_path)
    assert loaded.eos_token == "</s>" and loaded.eos_id == 1 and loaded.stop_ids == [1]
