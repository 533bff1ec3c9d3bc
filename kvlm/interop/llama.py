"""kvlm MHA / GQA / MQA -> transformers' own ``LlamaForCausalLM`` (model_type "llama"): ``kvlm export-hf CKPT OUT
--format llama``, a folder that stock transformers, vLLM, SGLang and llama.cpp's converter read.

The weights map one to one, the inverse of the import in kvlm.interop.convert (``_LAYER_MAP``): kvlm's RoPE is
already Llama's half-split ``rotate_half`` layout, so no row is permuted. kvlm's ``bias`` puts a bias on every
projection: Llama's attention_bias and mlp_bias together. What Llama cannot hold is refused (``FormatError``):
another mechanism, arch "gpt2", rope = False, gated outputs.
"""

from __future__ import annotations

import torch

from kvlm.config import ModelConfig
from kvlm.interop.convert import _LAYER_MAP
from kvlm.interop.deepseek_v3 import FormatError

MODEL_TYPE = "llama"
MECHANISMS = ("mha", "gqa", "mqa")


def check_exportable(cfg: ModelConfig) -> None:
    """Raise FormatError naming the first option of ``cfg`` that Llama's format cannot represent."""
    problems = [
        (
            cfg.attention not in MECHANISMS,
            f"attention={cfg.attention!r} (llama holds {', '.join(MECHANISMS)})",
        ),
        (cfg.arch != "llama", f"arch={cfg.arch!r} (Llama is RMSNorm + SwiGLU + RoPE)"),
        (not cfg.rope, "rope=False (Llama needs RoPE)"),
        (cfg.gated, "gated=True (Llama has no attention output gate)"),
    ]
    for bad, what in problems:
        if bad:
            raise FormatError(f"cannot export to llama: {what}")


def hf_config(cfg: ModelConfig) -> dict:
    """LlamaConfig keyword arguments for a kvlm MHA / GQA / MQA config."""
    check_exportable(cfg)
    return dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.d_model,
        intermediate_size=cfg.ffn_dim,
        num_hidden_layers=cfg.n_layer,
        num_attention_heads=cfg.n_head,
        num_key_value_heads=cfg.n_kv_head,
        head_dim=cfg.head_dim,
        hidden_act="silu",
        max_position_embeddings=cfg.max_seq_len,
        rms_norm_eps=cfg.norm_eps,
        tie_word_embeddings=cfg.tie_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        attention_bias=cfg.bias,
        mlp_bias=cfg.bias,
    )


def to_hf_state(cfg: ModelConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """kvlm state dict -> LlamaForCausalLM state dict (names only; values copied)."""
    check_exportable(cfg)
    back = {mine: theirs for theirs, mine in _LAYER_MAP.items()}
    out = {}
    for name, t in state.items():
        if name == "embed.weight":
            out["model.embed_tokens.weight"] = t
        elif name == "norm.weight":
            out["model.norm.weight"] = t
        elif name == "lm_head.weight":
            out["lm_head.weight"] = t
        else:
            _, i, rest = name.split(".", 2)
            for mine, theirs in back.items():
                if rest.startswith(mine):
                    out[f"model.layers.{i}.{theirs}{rest[len(mine) :]}"] = t
                    break
            else:
                raise FormatError(f"cannot export to llama: no Llama place for kvlm weight {name}")
    out.setdefault("lm_head.weight", state["embed.weight"])
    return {k: v.detach().clone().contiguous() for k, v in out.items()}


__all__ = ["MODEL_TYPE", "check_exportable", "hf_config", "to_hf_state"]
