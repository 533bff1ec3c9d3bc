"""kvlm prepare: sources, splits, shards, metadata, round trips and clear errors."""

import json
import sys

import numpy as np
import pytest
from conftest import shared_path

from kvlm.data import DataError, TokenStream, load_prepared, prepare, synthetic, token_dtype
from kvlm.data.tokenizer import gpt2_tokenizer


def documents(stream: TokenStream, tok) -> list[str]:
    """Decode a split back into its documents (each ends with the end-of-text token)."""
    ids = stream[: len(stream)]
    cuts = np.flatnonzero(ids == tok.eos_id)
    out, start = [], 0
    for c in cuts:
        out.append(tok.decode(ids[start:c]))
        start = c + 1
    return out


def write_jsonl(path, texts):
    path.write_text("".join(json.dumps({"text": t, "source": "test"}) + "\n" for t in texts))


# --- the synthetic source --------------------------------------------------------------------------
def test_synthetic_stories_are_seeded_and_refer_back():
    assert synthetic.story(3, 17) == synthetic.story(3, 17)
    assert synthetic.story(3, 17) != synthetic.story(3, 18)
    assert synthetic.story(3, 17) != synthetic.story(4, 17)
    for i in range(50):
        text = synthetic.story(0, i)
        sentences = text.split(". ")
        # the protagonist named early is named again in the last part: long-range recall
        name = next(w.strip(".,!") for w in sentences[0].split() + sentences[1].split() if w[:1].isupper()
                    and w.strip(".,!") in synthetic.GIRLS + synthetic.BOYS + [a[1] for a in synthetic.ANIMALS])  # fmt: skip
        assert name in " ".join(sentences[len(sentences) // 2 :]), text


def test_prepare_synthetic(tmp_path):
    data = prepare("synthetic", tmp_path / "d", max_tokens=20_000, vocab_size=512, seed=5)
    meta = json.loads((tmp_path / "d" / "meta.json").read_text())
    assert meta["source"] == "synthetic-stories (generated, not real text)"
    assert meta["synthetic"] is True and meta["sources"][0]["label"] == meta["source"]
    assert meta["dtype"] == "uint16" and data.train.shards[0].dtype == np.uint16
    assert len(data.train) == meta["splits"]["train"]["tokens"] == 20_000
    assert len(data.val) == meta["splits"]["val"]["tokens"] == 1_000  # val_fraction 0.05 of the cap
    assert data.vocab_size <= 512
    # the stored tokens decode to exactly the generated stories, in order (the last one is cut by the cap)
    docs = documents(data.train, data.tokenizer)
    assert len(docs) >= 50
    assert docs == [synthetic.story(5, i) for i in range(len(docs))]
    val_docs = documents(data.val, data.tokenizer)
    assert val_docs and not set(val_docs) & set(docs)
    assert load_prepared(tmp_path / "d", verify=True).content_hash == meta["content_hash"]


def test_prepare_reuses_identical_and_refuses_different(tmp_path):
    first = prepare("synthetic", tmp_path / "d", max_tokens=5_000, vocab_size=300)
    stamp = (tmp_path / "d" / "meta.json").stat().st_mtime_ns
    again = prepare("synthetic", tmp_path / "d", max_tokens=5_000, vocab_size=300)
    assert again.content_hash == first.content_hash
    assert (tmp_path / "d" / "meta.json").stat().st_mtime_ns == stamp  # not rewritten
    with pytest.raises(DataError, match="force"):
        prepare("synthetic", tmp_path / "d", max_tokens=6_000, vocab_size=300)
    other = prepare("synthetic", tmp_path / "d", max_tokens=6_000, vocab_size=300, force=True)
    assert len(other.train) == 6_000


# --- local files -----------------------------------------------------------------------------------
def test_local_folder_splits_and_round_trip(tmp_path):
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    train_docs = [f"Doc {i}: naïve café 🙂 {'word ' * i}\nline two\ttab" for i in range(30)]
    write_jsonl(src / "train.jsonl", train_docs[:20])
    (src / "sub" / "more.txt").write_text("\n<|endoftext|>\n".join(train_docs[20:]) + "\n")
    write_jsonl(src / "val.jsonl", ["held-out one", "held-out two"])
    write_jsonl(src / "test.jsonl", ["never used"])
    data = prepare(str(src), tmp_path / "out", vocab_size=320)
    assert documents(data.train, data.tokenizer) == [t.strip() for t in train_docs[20:]] + train_docs[:20]
    assert documents(data.val, data.tokenizer) == ["held-out one", "held-out two"]
    assert data.meta["synthetic"] is False and data.meta["source"].startswith("local:")
    files = data.meta["sources"][0]["files"]
    assert files["val.jsonl"]["split"] == "val" and "test.jsonl" not in files


def test_every_nth_document_goes_to_validation(tmp_path):
    write_jsonl(tmp_path / "all.jsonl", [f"document number {i}" for i in range(40)])
    data = prepare(tmp_path / "all.jsonl", tmp_path / "out", vocab_size=300, val_fraction=0.1)
    val = documents(data.val, data.tokenizer)
    assert val == [f"document number {i}" for i in (5, 15, 25, 35)]
    assert len(documents(data.train, data.tokenizer)) == 36


def test_single_document_validation_from_the_tail(tmp_path):
    text = "A single long book. " * 300
    (tmp_path / "book.txt").write_text(text)
    data = prepare(tmp_path / "book.txt", tmp_path / "out", vocab_size=300, val_fraction=0.1)
    whole = np.concatenate([data.train[: len(data.train)], data.val[: len(data.val)]])
    assert data.tokenizer.decode(whole[:-1]) == text.strip() and whole[-1] == data.eos_id
    assert len(data.val) == int((len(data.train) + len(data.val)) * 0.1)


def test_gpt2_tokenizer_on_real_text_with_caps(tmp_path):
    english, gpt2_dir = shared_path("data", "english-mix"), shared_path("tokenizers", "gpt2")
    data = prepare(english, tmp_path / "out", tokenizer=gpt2_dir, max_tokens=3_000, val_tokens=700)
    assert (len(data.train), len(data.val)) == (3_000, 700)
    assert data.vocab_size == 50257 and data.meta["dtype"] == "uint16"
    first = json.loads((english / "train.jsonl").open().readline())["text"]
    tok = gpt2_tokenizer(gpt2_dir)
    ids = tok.encode(first)
    assert len(ids) < 3_000 and data.train[: len(ids) + 1].tolist() == ids + [50256]
    first_val = json.loads((english / "val.jsonl").open().readline())["text"]
    assert data.val[:700].tolist() == tok.encode(first_val)[:700]


def test_shards_and_windows_across_boundaries(tmp_path):
    data = prepare("synthetic", tmp_path / "d", max_tokens=2_500, vocab_size=300, shard_tokens=1_000)
    assert [s["tokens"] for s in data.meta["splits"]["train"]["shards"]] == [1_000, 1_000, 500]
    flat = np.concatenate(
        [np.fromfile(tmp_path / "d" / f"train-0000{i}.bin", dtype=np.uint16) for i in range(3)]
    )
    assert np.array_equal(data.train.window(990, 30), flat[990:1020].astype(np.int64))
    assert np.array_equal(data.train.windows([0, 1_995], 10)[1], flat[1_995:2_005])
    with pytest.raises(IndexError):
        data.train.window(2_495, 10)


def test_token_dtype_boundary():
    assert token_dtype(50257) == np.uint16
    assert token_dtype(65536) == np.uint16  # ids 0..65535
    assert token_dtype(65537) == np.uint32


def test_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["first parquet doc", "second one"]}), tmp_path / "t.parquet")
    data = prepare(tmp_path / "t.parquet", tmp_path / "out", vocab_size=300, val_fraction=0.0)
    assert documents(data.train, data.tokenizer) == ["first parquet doc", "second one"]


# --- errors ----------------------------------------------------------------------------------------
def test_missing_and_empty_sources(tmp_path):
    with pytest.raises(DataError, match="not found"):
        prepare(tmp_path / "nope.jsonl", tmp_path / "out")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="no .txt/.jsonl/.parquet files"):
        prepare(tmp_path / "empty", tmp_path / "out")
    (tmp_path / "blank.jsonl").write_text("\n\n")
    with pytest.raises(DataError, match="empty data"):
        prepare(tmp_path / "blank.jsonl", tmp_path / "out")
    (tmp_path / "blank.txt").write_text("   \n")
    with pytest.raises(DataError, match="empty data"):
        prepare(tmp_path / "blank.txt", tmp_path / "out", vocab_size=300)
    write_jsonl(tmp_path / "ok.jsonl", ["fine"])
    (tmp_path / "ok.jsonl").open("a").write('{"body": "no text field"}\n')
    with pytest.raises(DataError, match=r"ok.jsonl:2: no 'text' field"):
        prepare(tmp_path / "ok.jsonl", tmp_path / "out")
    assert not (tmp_path / "out").exists()  # nothing half-written is left behind
    assert not list(tmp_path.glob(".out.tmp-*"))


def test_empty_source_with_gpt2_tokenizer(tmp_path):
    (tmp_path / "blank.txt").write_text("   \n")
    with pytest.raises(DataError, match="empty data"):
        prepare(tmp_path / "blank.txt", tmp_path / "out", tokenizer=shared_path("tokenizers", "gpt2"))
    assert not (tmp_path / "out").exists()
    assert not list(tmp_path.glob(".out.tmp-*"))


def test_partial_or_corrupt_prepared_folder(tmp_path):
    prepare("synthetic", tmp_path / "d", max_tokens=3_000, vocab_size=300)
    shard = tmp_path / "d" / "train-00000.bin"
    shard.write_bytes(shard.read_bytes()[:-10])
    with pytest.raises(DataError, match="partial"):
        load_prepared(tmp_path / "d")
    shard.unlink()
    with pytest.raises(DataError, match="missing"):
        load_prepared(tmp_path / "d")
    (tmp_path / "d" / "meta.json").write_text("{")
    with pytest.raises(DataError, match="corrupt"):
        load_prepared(tmp_path / "d")
    with pytest.raises(DataError, match="no prepared data"):
        load_prepared(tmp_path / "elsewhere")


def test_hugging_face_source_needs_datasets(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets -> ImportError
    with pytest.raises(DataError, match="needs the `datasets` package"):
        prepare("tinystories", tmp_path / "out")


def test_hugging_face_source_wiring(tmp_path, monkeypatch):
    """The datasets calls, with a stand-in module (these machines are offline)."""
    import types

    rows = {
        "train": [{"text": f"train story {i}"} for i in range(30)],
        "validation": [{"text": "a val story"}],
    }
    calls = []

    def load_dataset(name, config=None, split=None, streaming=False):
        calls.append((name, config, split, streaming))
        return iter(rows[split])

    fake = types.SimpleNamespace(
        get_dataset_split_names=lambda name, config=None: list(rows), load_dataset=load_dataset
    )
    monkeypatch.setitem(sys.modules, "datasets", fake)
    data = prepare("tinystories", tmp_path / "out", vocab_size=300)
    assert documents(data.train, data.tokenizer) == [f"train story {i}" for i in range(30)]
    assert documents(data.val, data.tokenizer) == ["a val story"]
    assert ("roneneldan/TinyStories", None, "validation", True) in calls
    assert data.meta["source"] == "hf:roneneldan/TinyStories"
