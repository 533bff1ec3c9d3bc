"""`kvlm import-hf` of a transformers DeepseekV3 folder (dense layers) into kvlm's MLA: same logits as
transformers' own model (its interleaved or half-split RoPE layout, its eps-1e-6 latent norms undone); MoE
layers are refused before any weight is read; import then export gives back the same weights."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="needs transformers (pip install 'kvlm[hf]')")

from transformers import DeepseekV3Config, DeepseekV3ForCausalLM  # noqa: E402

from kvlm.checkpoint import load_checkpoint  # noqa: E402
from kvlm.cli import main  # noqa: E402
from kvlm.interop.hf import export_hf  # noqa: E402

DENSE = dict(vocab_size=120, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             kv_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, first_k_dense_replace=2,
             n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1,
             moe_intermediate_size=32, num_mtp_layers=0, max_position_embeddings=64, rms_norm_eps=1e-5,
             rope_parameters={"rope_type": "default", "rope_theta": 1000.0}, initializer_range=0.1)  # fmt: skip


def save_deepseek(path, seed=0, **overrides):
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**{**DENSE, **overrides})).eval()
    with torch.no_grad():  # norms start at one: make them random, so that a lost norm weight shows
        for name, p in model.named_parameters():
            if "layernorm" in name or name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    model.save_pretrained(path)
    return model


@pytest.mark.parametrize(
    "overrides",
    [
        dict(q_lora_rank=16, rope_interleave=True),
        dict(q_lora_rank=None, rope_interleave=False),
        dict(q_lora_rank=16, rope_interleave=True, tie_word_embeddings=True),
    ],  # fmt: skip
    ids=["q-lora-interleaved", "q-proj-half-split", "tied"],
)
def test_import_deepseek_v3_keeps_logits(tmp_path, overrides):
    hf = save_deepseek(tmp_path / "ds", **overrides)
    assert main(["import-hf", str(tmp_path / "ds"), str(tmp_path / "ck")]) == 0
    model, _, meta = load_checkpoint(tmp_path / "ck")
    assert model.cfg.attention == "mla" and model.cfg.rope_kv_heads == 1
    assert model.cfg.q_lora_rank == (overrides["q_lora_rank"] or 0)
    x = torch.randint(0, 120, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        err32 = (model(x) - hf(x).logits).abs().max().item()
        err64 = (model.double()(x) - hf.double()(x).logits).abs().max().item()
    assert err32 < 1e-5, err32
    # transformers' DeepseekV3 keeps its RMSNorm and RoPE tables in float32 even in float64 (~1e-7 floor)
    assert err64 < 2e-6, err64
    # kvlm's absorbed decode (the point of importing) agrees with transformers' greedy decode
    from kvlm.inference.generation import generate

    ids = x[0, :8].tolist()
    ref = hf.float().generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)[0, 8:].tolist()
    assert generate(model.float(), ids, 8) == ref


def test_import_then_export_gives_back_the_weights(tmp_path):
    hf = save_deepseek(tmp_path / "ds", q_lora_rank=16)
    assert main(["import-hf", str(tmp_path / "ds"), str(tmp_path / "ck")]) == 0
    model, tok, _ = load_checkpoint(tmp_path / "ck")
    export_hf((model, tok), tmp_path / "back", format="deepseek-v3")
    back = DeepseekV3ForCausalLM.from_pretrained(tmp_path / "back").state_dict()
    for name, w in hf.state_dict().items():
        torch.testing.assert_close(back[name], w, rtol=1e-6, atol=1e-7, msg=name)
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert config["rope_parameters"]["rope_theta"] == 1000.0 and config["rms_norm_eps"] == 1e-5


def test_moe_layers_are_refused_before_loading(tmp_path, capsys):
    save_deepseek(tmp_path / "ds", first_k_dense_replace=1, q_lora_rank=16)
    (tmp_path / "ds" / "model.safetensors").write_bytes(b"not read")  # the refusal comes from config.json
    assert main(["import-hf", str(tmp_path / "ds"), str(tmp_path / "ck")]) == 1
    err = capsys.readouterr().err
    assert "mixture-of-experts" in err and "first_k_dense_replace=1" in err, err
    assert not (tmp_path / "ck").exists()


def test_mla_flag_on_a_deepseek_source_is_refused(tmp_path, capsys):
    save_deepseek(tmp_path / "ds", q_lora_rank=16)
    assert main(["import-hf", str(tmp_path / "ds"), str(tmp_path / "ck"), "--mla"]) == 1
    assert "already MLA" in capsys.readouterr().err
