"""Generation: greedy decode with the cache == argmax of the full forward re-run at every step, ragged
batches == each prompt alone, seeded sampling, top-k / top-p filtering, stop tokens, streaming, errors."""

import json

import pytest
import torch
from conftest import all_variants, tiny_config

from kvlm import CacheError, build_model
from kvlm.attention import registry
from kvlm.inference.generation import TextStream, generate
from kvlm.inference.sampling import filter_logits, sample


def _model(attention="mha", dtype=torch.float64, scale=1.0, **overrides):
    """A random model whose greedy output varies: an untied LM head (a tied one, at init, mostly predicts
    the input token again), random norms; scale > 1 widens the gaps between logits (float32 tests)."""
    torch.manual_seed(0)
    overrides.setdefault("tie_embeddings", False)
    model = build_model(tiny_config(attention, **overrides)).to(dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
            else:
                p.mul_(scale)
    return model.eval()


def _one_variant_per_mechanism():
    """The first configuration each mechanism's author lists in tests/variants_*.py (so mechanisms written
    later are picked up), for every mechanism that is registered."""
    seen, out = set(), []
    for param in all_variants():
        attention, overrides = param.values
        if attention not in seen and attention in registry():
            seen.add(attention)
            out.append(pytest.param(attention, overrides, id=attention))
    return out


def _greedy_reference(model, prompt, n):
    """No cache: re-run the whole sequence at every step and take the argmax of the last position."""
    seq = list(prompt)
    for _ in range(n):
        logits = model(torch.tensor([seq]))[0, -1]
        seq.append(int(logits.argmax()))
    return seq[len(prompt) :]


def _modes(model):
    return ["auto", "naive", "absorbed", "expand"] if model.layers[0].attn.has_naive_cache else ["auto"]


PROMPTS = [[5, 17, 3, 88, 42, 9, 61], [12], [7, 7, 30, 2]]


@pytest.mark.parametrize("attention,overrides", _one_variant_per_mechanism())
def test_greedy_equals_full_forward_argmax(attention, overrides):
    model = _model(attention, **overrides)
    want = [_greedy_reference(model, p, 8) for p in PROMPTS]
    assert any(len(set(w)) > 2 for w in want), "degenerate model: the comparison would prove little"
    for mode in _modes(model):
        assert generate(model, PROMPTS, 8, mode=mode) == want, mode  # ragged batch, left-padded
        assert generate(model, PROMPTS[0], 8, mode=mode) == want[0], mode  # one prompt alone


def test_ragged_batch_equals_each_prompt_alone_float32():
    model = _model("gqa", dtype=torch.float32, scale=3.0, n_kv_head=2)
    batched = generate(model, PROMPTS, 10)
    assert batched == [generate(model, p, 10) for p in PROMPTS]
    assert [len(b) for b in batched] == [10, 10, 10]


def test_tensor_prompts():
    model = _model()
    batch = torch.tensor([PROMPTS[0][:4], PROMPTS[2]])
    assert generate(model, batch, 5) == [generate(model, p.tolist(), 5) for p in batch]
    assert generate(model, torch.tensor(PROMPTS[1]), 5) == generate(model, PROMPTS[1], 5)


def test_seeded_sampling_reproduces_and_differs_across_seeds():
    model = _model()
    a = generate(model, PROMPTS, 20, temperature=1.0, seed=1)
    b = generate(model, PROMPTS, 20, temperature=1.0, seed=1)
    c = generate(model, PROMPTS, 20, temperature=1.0, seed=2)
    assert a == b
    assert a != c
    assert a != generate(model, PROMPTS, 20)  # sampling is not greedy


def test_top_k_1_equals_greedy():
    model = _model()
    assert generate(model, PROMPTS, 10, temperature=1.5, top_k=1, seed=3) == generate(model, PROMPTS, 10)
    # a tiny nucleus keeps only the most likely token as well
    assert generate(model, PROMPTS, 10, temperature=0.7, top_p=1e-6, seed=3) == generate(model, PROMPTS, 10)


def test_filter_logits_by_hand():
    probs = torch.tensor([[0.1, 0.5, 0.15, 0.25]])
    logits = probs.log()
    kept = lambda lg: torch.isfinite(lg)[0].tolist()  # noqa: E731
    assert kept(filter_logits(logits, top_k=2)) == [False, True, False, True]
    # nucleus: 0.5 < 0.7 <= 0.5 + 0.25: the two most likely tokens
    assert kept(filter_logits(logits, top_p=0.7)) == [False, True, False, True]
    assert kept(filter_logits(logits, top_p=0.76)) == [False, True, True, True]
    # top-k first, then top-p of the renormalised rest: (0.5, 0.25, 0.15) / 0.9 -> 0.556 < 0.6 <= 0.833
    assert kept(filter_logits(logits, top_k=3, top_p=0.6)) == [False, True, False, True]
    assert kept(filter_logits(logits, top_k=0, top_p=1.0)) == [True] * 4


def test_sample_frequencies_follow_filtered_distribution():
    logits = torch.tensor([0.1, 0.5, 0.15, 0.25]).log().repeat(20000, 1)
    gen = torch.Generator().manual_seed(0)
    draws = sample(logits, 1.0, None, 0.7, gen)
    freq = torch.bincount(draws, minlength=4).double() / draws.numel()
    want = torch.tensor([0.0, 2 / 3, 0.0, 1 / 3], dtype=torch.float64)
    assert (freq - want).abs().max() < 0.015
    # temperature 2 flattens: p_i proportional to sqrt(p_i)
    draws = sample(logits, 2.0, generator=gen)
    freq = torch.bincount(draws, minlength=4).double() / draws.numel()
    want = torch.tensor([0.1, 0.5, 0.15, 0.25], dtype=torch.float64).sqrt()
    assert (freq - want / want.sum()).abs().max() < 0.015


def test_stop_tokens_stop_each_sequence():
    model = _model()
    greedy = generate(model, PROMPTS, 12)
    g = greedy[0]
    i = next(i for i in range(1, 12) if g[i] not in g[:i])  # first token not seen earlier
    out, stats = generate(model, PROMPTS, 12, stop_tokens=[g[i]], return_stats=True)
    assert out[0] == g[:i]
    assert stats["finish_reasons"][0] == "stop"
    for b in (1, 2):  # the others stop at the same token if they emit it, else run to the length
        want = greedy[b][: greedy[b].index(g[i])] if g[i] in greedy[b] else greedy[b]
        assert out[b] == want
    assert generate(model, PROMPTS[0], 12, stop_tokens=g[0]) == []


def test_streaming_callback_sees_every_token():
    model = _model()
    steps = []
    out = generate(model, PROMPTS, 9, temperature=1.0, seed=5, callback=steps.append)
    assert len(steps) == 9 and all(len(s) == 3 for s in steps)
    for b in range(3):
        assert [s[b] for s in steps] == out[b]
    # with a stop: None from the step the sequence stopped
    steps = []
    stop = out[0][4]
    out2 = generate(model, PROMPTS, 9, temperature=1.0, seed=5, callback=steps.append, stop_tokens=[stop])
    for b in range(3):
        seen = [s[b] for s in steps]
        assert [t for t in seen if t is not None] == out2[b]
        if len(out2[b]) < 9:
            assert all(t is None for t in seen[len(out2[b]) :])


def test_stats_and_training_mode_restored():
    model = _model().train()
    out, stats = generate(model, PROMPTS, 6, return_stats=True)
    assert model.training
    assert stats["prefill_tokens"] == sum(map(len, PROMPTS))
    assert stats["new_tokens"] == 18
    assert stats["decode_tokens"] == 3 * 5  # the first new token comes from the prefill
    assert stats["decode_tokens_per_s"] > 0
    assert generate(model, PROMPTS, 0) == [[], [], []]


def test_capacity_error_says_by_how_much():
    model = _model()  # max_seq_len 64
    prompt = list(range(1, 61))
    assert len(generate(model, prompt, 4)) == 4  # exactly full is fine
    with pytest.raises(CacheError, match="by 6"):
        generate(model, [prompt, [1, 2]], 10)


def test_bad_inputs():
    model = _model()
    with pytest.raises(ValueError, match="empty"):
        generate(model, [], 3)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        generate(model, [[1, 2], []], 3)
    with pytest.raises(ValueError, match="vocabulary"):
        generate(model, [1, 2, 97], 3)
    with pytest.raises(ValueError, match="unknown attention mode"):
        generate(model, [1, 2], 3, mode="fast")
    with pytest.raises(ValueError, match="top_p"):
        generate(model, [1, 2], 3, temperature=1.0, top_p=0.0)
    with pytest.raises(ValueError, match="temperature"):
        generate(model, [1, 2], 3, temperature=-1.0)


# --- text: tokenizer, streaming detokenisation, CLI -------------------------------------------------------
SENTENCES = [
    "Once upon a time there was a little robot who loved to read.",
    "The cat sat on the mat and looked at the moon.",
    "Café au lait, naïve façade, and 日本語 in one sentence.",
] * 5


def _tokenizer():
    from kvlm.data.tokenizer import train_bpe

    return train_bpe(SENTENCES, vocab_size=300)  # byte-level BPE, like the checkpoints' tokenizers


def test_text_stream_multibyte_characters():
    tok = _tokenizer()
    text = "Hi 🙂 naïve 日本語 — ok"  # emoji and CJK span several byte tokens
    ids = tok.encode(text)
    assert len(ids) > len(text.split())
    stream = TextStream(tok)
    pieces = [stream.push(i) for i in ids] + [stream.flush()]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from kvlm.checkpoint import save_checkpoint

    tok = _tokenizer()
    torch.manual_seed(0)
    model = build_model(tiny_config("gqa", n_kv_head=2, vocab_size=tok.vocab_size, max_seq_len=128))
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(5.0)
    path = tmp_path_factory.mktemp("gen") / "ckpt"
    save_checkpoint(path, model, tokenizer=tok)
    return path


def _cli(argv, capsys):
    from kvlm.cli import main

    rc = main(argv)
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_cli_generate_json_and_stream(checkpoint, capsys):
    from kvlm.checkpoint import load_checkpoint

    args = ["generate", str(checkpoint), "--prompt", "The cat", "--max-new-tokens", "12", "--no-stop"]
    rc, out, err = _cli(args + ["--json"], capsys)
    assert rc == 0
    res = json.loads(out.strip().splitlines()[-1])
    model, tok, _ = load_checkpoint(checkpoint)
    want = generate(model, tok.encode("The cat"), 12)
    assert res["token_ids"] == [want]
    assert res["completions"] == [tok.decode(want)]
    assert res["new_tokens"] == 12 and "prefill_s" in res
    rc, out, err = _cli(args, capsys)  # streaming: the same text
    assert rc == 0
    assert out == "The cat" + tok.decode(want) + "\n"
    assert "tokens/s" in err


def test_cli_generate_errors(checkpoint, capsys, tmp_path):
    rc, out, err = _cli(
        ["generate", str(checkpoint), "--prompt", "x", "--max-new-tokens", "500", "--json"], capsys
    )
    assert rc == 1 and "max_seq_len" in json.loads(out.strip().splitlines()[-1])["error"]
    rc, out, err = _cli(["generate", str(tmp_path / "nope"), "--prompt", "x"], capsys)
    assert rc == 1 and "no checkpoint" in err


def test_public_name_is_the_function():
    import importlib

    import kvlm

    importlib.import_module("kvlm.inference.generation")  # as the CLI does: must not rebind kvlm.generate
    from kvlm import generate as g

    assert kvlm.generate is generate and g is generate


def test_cli_generate_compiled_prints_the_eager_tokens(checkpoint, capsys):
    from kvlm.checkpoint import load_checkpoint

    torch._dynamo.reset()
    args = ["generate", str(checkpoint), "--prompt", "The cat", "--max-new-tokens", "8", "--no-stop", "--json"]
    rc, out, err = _cli(args + ["--compile"], capsys)
    assert rc == 0
    res = json.loads(out.strip().splitlines()[-1])
    model, tok, _ = load_checkpoint(checkpoint)
    assert res["token_ids"] == [generate(model, tok.encode("The cat"), 8)]
    assert res["compile_s"] > 0 and "compiling" in err
