"""Checkpoints of the MLRA authors' code (github.com/SongtaoLiu0823/MLRA, ``model/{mla,mlra_2,mlra_4}.py``; weights
published as Soughing/MLRA) -> kvlm models with the same outputs.

Their files are nanoGPT-style: ``GPT.save_pretrained`` writes config.json (``GPTConfig``: n_layer, n_head, n_embd,
intermediate_size, q_lora_rank, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, vocab_size, block_size; its
model_type says "gpt2" whatever the mechanism, so the mechanism is an argument) and pytorch_model.bin (or
model.safetensors). Names per layer ``transformer.h.{i}.``::

    attn.q_a_proj, q_a_layernorm, q_b_proj      -> attn.wq_a, q_norm, wq_b
    attn.kv_a_proj_with_mqa                      -> attn.wkv_a
    attn.kv_a_layernorm (mla) | kv_a_layernorms.{j} (mlra: one RMSNorm per latent block) -> attn.kv_norm
    attn.kv_b_proj (mla: Linear; mlra: a Parameter (blocks, d_lat, out), used as x @ W) -> attn.wkv_b
    attn.c_proj, mlp.c_fc1 (SiLU side), c_fc2, c_proj -> attn.wo, mlp.w1, w2, wo
    input_layernorm, post_attention_layernorm    -> attn_norm, mlp_norm;  transformer.wte, layernorm, lm_head

Their math is kvlm's with latent_scaling (q_scale = sqrt(d / d'_c), kv_scale = sqrt(d / d_lat)), RMSNorm eps 1e-6,
RoPE base 10000 in the half-split layout (no permutation), softmax scale 1/sqrt(d_h + d_h^R), tied embeddings and
(MLRA) branch outputs scaled by 1/sqrt(blocks per head) (attn_out_scaling). One difference: their MLRA-2 gives
head group 0 (heads 0..h/2-1) latent blocks 0 and 2 and group 1 blocks 1 and 3 (branch A = blocks 0, 1 split over
the two head halves, branch B = blocks 2, 3), where the paper's Eq. 6 and kvlm pair blocks (0, 1) and (2, 3). The
blocks are renumbered (``BLOCK_ORDER``): kvlm block b is their block order[b], in wkv_a's latent rows, kv_norm
and wkv_b alike, so kvlm's cache holds the same latents in the paper's order.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from kvlm.config import ModelConfig
from kvlm.interop.deepseek_v3 import FormatError

# their model file -> (kvlm mechanism, kvlm block b = their block BLOCK_ORDER[b])
MECHANISMS = {"mla": "mla", "mlra_2": "mlra-2", "mlra_4": "mlra-4"}
BLOCK_ORDER = {"mla": [0], "mlra_2": [0, 2, 1, 3], "mlra_4": [0, 1, 2, 3]}
EPS = 1e-6
ROPE_BASE = 10000.0


def _kind(kind: str) -> str:
    kind = kind.replace("-", "_")
    if kind not in MECHANISMS:
        raise FormatError(f"unknown MLRA-code model {kind!r}; known: {', '.join(MECHANISMS)}")
    return kind


def kvlm_config(kind: str, their: dict, max_seq_len: int | None = None) -> ModelConfig:
    """Their GPTConfig fields -> kvlm ModelConfig of mechanism ``kind`` ("mla", "mlra_2", "mlra_4")."""
    kind = _kind(kind)
    missing = [k for k in ("n_layer", "n_head", "n_embd", "intermediate_size", "q_lora_rank", "kv_lora_rank",
                           "qk_nope_head_dim", "qk_rope_head_dim", "vocab_size") if k not in their]  # fmt: skip
    if missing:
        raise FormatError(f"the MLRA-code config lacks {missing}")
    if their.get("bias"):
        raise FormatError(
            "bias=True: the authors' models have no biases (and kvlm's bias covers every projection)"
        )
    return ModelConfig(
        attention=MECHANISMS[kind],
        n_layer=their["n_layer"],
        d_model=their["n_embd"],
        n_head=their["n_head"],
        head_dim=their["qk_nope_head_dim"],
        vocab_size=their["vocab_size"],
        max_seq_len=max_seq_len or their.get("block_size", 2048),
        arch="llama",
        ffn_dim=their["intermediate_size"],
        tie_embeddings=True,
        norm_eps=EPS,
        rope_theta=ROPE_BASE,
        rope_head_dim=their["qk_rope_head_dim"],
        q_lora_rank=their["q_lora_rank"],
        kv_lora_rank=their["kv_lora_rank"],
        latent_scaling=True,
        attn_out_scaling=kind != "mla",
        note=f"imported from the MLRA authors' model/{kind}.py",
    )


def kvlm_state(kind: str, cfg: ModelConfig, their: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Their state dict -> kvlm's (blocks renumbered for MLRA-2, see the module docstring)."""
    kind = _kind(kind)
    order = BLOCK_ORDER[kind]
    nb, dc = len(order), cfg.kv_lora_rank
    d_lat = dc // nb
    out = {"embed.weight": their["transformer.wte.weight"], "norm.weight": their["layernorm.weight"]}
    for i in range(cfg.n_layer):
        t, k = f"transformer.h.{i}.", f"layers.{i}."
        out[k + "attn_norm.weight"] = their[t + "input_layernorm.weight"]
        out[k + "mlp_norm.weight"] = their[t + "post_attention_layernorm.weight"]
        for mine, theirs in (("w1", "c_fc1"), ("w2", "c_fc2"), ("wo", "c_proj")):
            out[f"{k}mlp.{mine}.weight"] = their[f"{t}mlp.{theirs}.weight"]
        a, b = t + "attn.", k + "attn."
        out[b + "wq_a.weight"] = their[a + "q_a_proj.weight"]
        out[b + "q_norm.weight"] = their[a + "q_a_layernorm.weight"]
        out[b + "wq_b.weight"] = their[a + "q_b_proj.weight"]
        out[b + "wo.weight"] = their[a + "c_proj.weight"]
        w = their[a + "kv_a_proj_with_mqa.weight"]
        if kind == "mla":
            out[b + "wkv_a.weight"] = w
            out[b + "kv_norm.weight"] = their[a + "kv_a_layernorm.weight"]
            out[b + "wkv_b.weight"] = their[a + "kv_b_proj.weight"]
            continue
        blocks = w[:dc].view(nb, d_lat, -1)
        out[b + "wkv_a.weight"] = torch.cat([blocks[order].reshape(dc, -1), w[dc:]])
        out[b + "kv_norm.weight"] = torch.stack([their[f"{a}kv_a_layernorms.{j}.weight"] for j in order])
        out[b + "wkv_b.weight"] = their[a + "kv_b_proj"][order].transpose(
            1, 2
        )  # x @ W -> F.linear's (out, in)
    # float32 (bf16 checkpoints upcast); float64 kept, for exact comparisons
    dtype = lambda v: torch.float64 if v.dtype == torch.float64 else torch.float32  # noqa: E731
    return {name: v.detach().to(dtype(v)).clone().contiguous() for name, v in out.items()}


def load_authors_checkpoint(folder: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config.json dict, state dict) of a folder their ``GPT.save_pretrained`` wrote."""
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise FormatError(f"{folder} has no config.json (not a checkpoint of the MLRA authors' code)")
    their = json.loads((folder / "config.json").read_text())
    if (folder / "model.safetensors").is_file():
        from safetensors.torch import load_file

        state = load_file(str(folder / "model.safetensors"))
    elif (folder / "pytorch_model.bin").is_file():
        state = torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True)
    else:
        raise FormatError(f"{folder} holds neither model.safetensors nor pytorch_model.bin")
    return their, state


def import_mlra_authors(source, kind: str, max_seq_len: int | None = None):
    """A checkpoint folder of the MLRA authors' code (or a ``(config dict, state dict)`` pair) of their model
    file ``kind`` -> kvlm model (float32, eval) with the same logits."""
    from kvlm.model import build_model

    their_cfg, their_state = source if isinstance(source, tuple) else load_authors_checkpoint(source)
    cfg = kvlm_config(kind, their_cfg, max_seq_len)
    state = kvlm_state(kind, cfg, their_state)
    model = build_model(cfg)
    expected = set(model.state_dict()) - {"lm_head.weight"}
    if set(state) != expected:
        raise FormatError(
            f"weights do not fit kvlm's {cfg.attention}: missing {sorted(expected - set(state))[:4]}, "
            f"extra {sorted(set(state) - expected)[:4]}"
        )
    model = model.to(next(iter(state.values())).dtype)
    model.load_state_dict(state, strict=False)
    return model.eval()


__all__ = [
    "BLOCK_ORDER",
    "MECHANISMS",
    "import_mlra_authors",
    "kvlm_config",
    "kvlm_state",
    "load_authors_checkpoint",
]
