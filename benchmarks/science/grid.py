"""The science grid of issue 13: every model, the claim it serves, and the one training recipe they share.

Each variant is (label, claim group, ModelConfig). Labels are stable: a run folder is RUNS/<label>/seed<k>.
Sizes (see benchmarks/science.md for the reasons):
- small-lm (claims a, b): mla-small-lm.md Table 2 scaled from 9L-512d to 4L-256d, 4 heads of d_h = 64, GPT-2
  blocks with learned positions (the paper's MHA has no RoPE), K and V with separate latents of rank r
  (kv_latent="separate"), MLA+RoPE adds a decoupled RoPE key of d_h / 2; FFN width matched to MHA.
- eg-mla (claims c, d): eg-mla.md Tables 1 and 3 scaled from 12L-768d to 4L-256d; latent ranks and kv_emb_dim
  divided by 4 (labels keep the paper's numbers: "kv256" is d_c = 64 here), d_h = d_h^R = 64, no query latent.
- mlra (claims e, f): the kvlm presets tiny/{mha,gqa,mla,mlra-4} (4L-192d, 8 heads of 24, Llama blocks, FFN
  width matched to tiny/mha as mlra.md Appendix F does), with and without zero-initialised output projections.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvlm.config import ModelConfig
from kvlm.preset_table import get_preset, match_ffn_dim

SEEDS = (0, 1, 2)
D = 256
# one recipe for every run: 1,000 steps of 32 x 256 tokens = 8.2 M tokens, about 1.6 epochs of the
# 5.0 M-token training split (english-mix without wikipedia, BPE 4096)
TRAIN = dict(
    batch_size=32,
    seq_len=256,
    max_steps=1000,
    lr=1.5e-3,
    warmup_steps=50,
    min_lr_ratio=0.1,
    weight_decay=0.1,
    eval_interval=200,
    eval_iters=20,
    log_interval=25,
)


@dataclass(frozen=True)
class Variant:
    label: str
    group: str  # small-lm | eg-mla | mlra
    cfg: ModelConfig


def _small_lm() -> list[Variant]:
    base = dict(arch="gpt2", n_layer=4, d_model=D, n_head=4, head_dim=64, vocab_size=4096, max_seq_len=256)
    ref = ModelConfig(attention="mha", rope=False, **base)
    out = [Variant("sl-mha", "small-lm", ref)]
    # control added after the first sitting (not yet run): MHA with RoPE on the whole head, to separate
    # "RoPE" from "latent attention" in claim (a)
    out.append(Variant("sl-mha+rope", "small-lm", ModelConfig(attention="mha", rope=True, **base)))
    for rope in (True, False):
        for div in (1, 2, 4, 8, 16, 32):
            cfg = ModelConfig(
                attention="mla",
                kv_lora_rank=D // div,
                kv_latent="separate",
                q_lora_rank=0,
                rope=rope,
                rope_head_dim=32 if rope else 0,
                **base,
            )
            name = f"sl-mla{'+rope' if rope else ''}-r{D // div}"  # r = d / div
            out.append(Variant(name, "small-lm", match_ffn_dim(cfg, ref)))
    return out


def _eg_mla() -> list[Variant]:
    base = dict(
        arch="gpt2",
        n_layer=4,
        d_model=D,
        n_head=4,
        head_dim=64,
        rope_head_dim=64,
        q_lora_rank=0,
        vocab_size=4096,
        max_seq_len=256,
    )
    s = 4  # the paper's 768-wide model scaled to 256 ~ 1/3; powers of two: 1/4
    # MLA at the paper's kv256 and, for claim (c) at equal KV cache, at EG-MLA's kv64
    out = [
        Variant(f"mla-kv{kv}", "eg-mla", ModelConfig(attention="mla", kv_lora_rank=kv // s, **base))
        for kv in (256, 64)
    ]
    emb = 256 // s
    for kv in (256, 128, 64, 16):
        cfg = ModelConfig(attention="eg-mla", kv_lora_rank=kv // s, kv_emb_dim=emb, **base)
        out.append(Variant(f"eg-mla-kv{kv}", "eg-mla", cfg))
    kv64 = 64 // s
    out.append(
        Variant(
            "eg-mla-kv64-noLN",
            "eg-mla",
            ModelConfig(attention="eg-mla", kv_lora_rank=kv64, kv_emb_dim=emb, eg_norm=False, **base),
        )
    )
    out.append(
        Variant(
            "eg-mla-kv64-add",
            "eg-mla",
            ModelConfig(attention="eg-mla", kv_lora_rank=kv64, kv_emb_dim=emb, eg_op="add", **base),
        )
    )
    for e in (64, 128, 512):  # eg-mla.md Figure 1b: kv_emb_dim at a fixed latent (paper numbers; / 4 here)
        cfg = ModelConfig(attention="eg-mla", kv_lora_rank=kv64, kv_emb_dim=e // s, **base)
        out.append(Variant(f"eg-mla-kv64-emb{e}", "eg-mla", cfg))
    return out


def _mlra() -> list[Variant]:
    out = []
    for name in ("mha", "gqa", "mla", "mlra-4"):
        cfg = get_preset(f"tiny/{name}")
        out.append(Variant(f"tiny-{name}", "mlra", cfg))
    for name in ("mha", "mlra-4"):
        cfg = get_preset(f"tiny/{name}").replace(zero_init_out=True)
        out.append(Variant(f"tiny-{name}-zero", "mlra", cfg))
    return out


def variants() -> list[Variant]:
    out = _small_lm() + _eg_mla() + _mlra()
    labels = [v.label for v in out]
    assert len(set(labels)) == len(labels), "duplicate labels"
    return out


def jobs(seeds=SEEDS) -> list[tuple[Variant, int]]:
    """Seed-major order: every variant's first seed before any second seed, so a stopped grid has the most
    claims covered."""
    vs = variants()
    return [(v, s) for s in seeds for v in vs]


def by_label() -> dict[str, Variant]:
    return {v.label: v for v in variants()}
