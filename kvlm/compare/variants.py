"""What a comparison trains: ``Variant`` (a label and a ModelConfig) and the comparison presets.

Presets (``COMPARE_PRESETS``): ``tiny`` (kvlm presets tiny/*), ``small-lm`` (mla-small-lm.md Table 2),
``eg-mla`` (eg-mla.md Tables 1 and 3), ``mlra`` (mlra.md Table 3's variants at matched parameters); each scaled
down by default and at the papers' sizes with ``paper_sizes=True``. A YAML file can list variants instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from kvlm.config import ConfigError, ModelConfig
from kvlm.preset_table import get_preset, match_ffn_dim


@dataclass
class Variant:
    """One model of a comparison: its label in the report, its config, and an optional note."""

    label: str
    cfg: ModelConfig
    note: str = ""


def _tiny() -> tuple[list[Variant], str]:
    names = ["mha", "gqa", "mla", "mla-norope", "eg-mla", "mlra-4"]
    return [
        Variant(n, get_preset(f"tiny/{n}")) for n in names
    ], "tiny models (kvlm presets tiny/*), FFN width matched to tiny/mha"


def _small_lm(paper_sizes: bool) -> tuple[list[Variant], str]:
    """mla-small-lm.md Table 2: MHA, MLA and MLA+RoPE at r = d, d/2, d/4, d/8, d/16 (9L-512d in the paper).

    Reading of the paper: K and V have separate latents of rank r each (its Eqs. 2-3), so r = d caches as
    much as MHA (its Table 2 lists the same KV memory); kv_latent="separate". MLA+RoPE adds a decoupled RoPE
    key of d_h/2. Scaled: 4 layers, d = 128 (the same r/d ratios and heads-to-width ratio)."""
    if paper_sizes:
        base = dict(n_layer=9, d_model=512, n_head=8, max_seq_len=512, vocab_size=50304)
        note = "paper sizes: 9L-512d (mla-small-lm.md Table 2)"
    else:
        base = dict(n_layer=4, d_model=128, n_head=4, max_seq_len=512)
        note = "scaled from the paper's 9L-512d to 4L-128d; r/d ratios and RoPE dims kept"
    base.update(arch="gpt2", tie_embeddings=True, dropout=0.0)
    ref = ModelConfig(attention="mha", **base)
    d = base["d_model"]
    out = [Variant("mha", ref)]
    for rope in (False, True):
        for div in (1, 2, 4, 8, 16):
            r = d // div
            cfg = ModelConfig(
                attention="mla",
                kv_lora_rank=r,
                kv_latent="separate",
                rope=rope,
                rope_head_dim=(d // base["n_head"]) // 2 if rope else 0,
                **base,
            )
            label = (
                f"mla{'+rope' if rope else ''}-r=d/{div}" if div > 1 else f"mla{'+rope' if rope else ''}-r=d"
            )
            out.append(Variant(label, match_ffn_dim(cfg, ref)))
    return out, note


def _eg_mla(paper_sizes: bool) -> tuple[list[Variant], str]:
    """eg-mla.md Tables 1 and 3: MLA-kv256 against EG-MLA kv256/128/64/16, and EG-MLA-kv64 without
    LayerNorm and with addition instead of the product. Paper: 12L-768d, kv_emb_dim 256.
    Scaled: 4L-192d, latent ranks and kv_emb_dim scaled by 192/768 = 1/4."""
    if paper_sizes:
        scale, base = 1, dict(n_layer=12, d_model=768, n_head=12, vocab_size=50304, max_seq_len=1024)
        note = "paper sizes: Base 12L-768d (eg-mla.md Appendix A)"
    else:
        scale, base = 4, dict(n_layer=4, d_model=192, n_head=3, max_seq_len=512)
        note = "scaled from the paper's 12L-768d to 4L-192d; kv_lora_rank and kv_emb_dim divided by 4"
    base.update(arch="gpt2", head_dim=64, rope_head_dim=64, q_lora_rank=0)
    emb = 256 // scale
    out = [Variant(f"mla-kv{256}", ModelConfig(attention="mla", kv_lora_rank=256 // scale, **base))]
    for kv in (256, 128, 64, 16):
        cfg = ModelConfig(attention="eg-mla", kv_lora_rank=max(1, kv // scale), kv_emb_dim=emb, **base)
        out.append(Variant(f"eg-mla-kv{kv}", cfg))
    kv64 = max(1, 64 // scale)
    out.append(
        Variant(
            "eg-mla-kv64-noLN",
            ModelConfig(attention="eg-mla", kv_lora_rank=kv64, kv_emb_dim=emb, eg_norm=False, **base),
        )
    )
    out.append(
        Variant(
            "eg-mla-kv64-add",
            ModelConfig(attention="eg-mla", kv_lora_rank=kv64, kv_emb_dim=emb, eg_op="add", **base),
        )
    )
    return out, note + " (labels keep the paper's kv sizes)"


def _mlra(paper_sizes: bool) -> tuple[list[Variant], str]:
    """mlra.md Table 3's variants at matched parameters (FFN width matched to MHA, as the paper does)."""
    names = ["mha", "mqa", "gqa", "mla", "mfa", "tpa", "gla-2", "gla-4", "gta", "mlra-2", "mlra-4"]
    if paper_sizes:
        return [
            Variant(n, get_preset(f"mlra-2.9b/{n}")) for n in names
        ], "paper sizes: 2.9B (mlra.md Tables 7-17)"
    ref = get_preset("tiny/mha")
    return [Variant(n, match_ffn_dim(get_preset(f"tiny/{n}"), ref)) for n in names], (
        "tiny models (kvlm presets tiny/*), FFN width matched to tiny/mha as mlra.md Appendix F does at 2.9B"
    )


COMPARE_PRESETS = {
    "tiny": lambda paper: _tiny(),
    "small-lm": _small_lm,
    "eg-mla": _eg_mla,
    "mlra": _mlra,
}


MATCH_MODES = {
    "preset": "as the preset sizes them",
    "params": "FFN width re-matched so total parameters (gate tables included) equal the baseline's",
    "activated": "FFN width re-matched so activated parameters (gate tables excluded) equal the baseline's",
}


def match_variants(variants: list[Variant], baseline: str, match: str = "preset") -> list[Variant]:
    """``match="params"`` / ``"activated"``: every variant but ``baseline`` gets the FFN width (a multiple of 8)
    whose total / activated parameter count is closest to the baseline's (``match_ffn_dim``); the width is
    the one knob every mechanism has, and the one mlra.md Sec. 4.1 turns. ``"preset"``: unchanged."""
    if match not in MATCH_MODES:
        raise ConfigError(f"unknown --match {match!r}; known: {', '.join(MATCH_MODES)}")
    if match == "preset":
        return variants
    base = next(v for v in variants if v.label == baseline)
    key = "total" if match == "params" else "activated"
    out = []
    for v in variants:
        if v is base:
            out.append(v)
            continue
        cfg = match_ffn_dim(v.cfg, base.cfg, key=key)
        note = f"ffn_dim {v.cfg.ffn_dim} -> {cfg.ffn_dim} to match {base.label}'s {key} parameters"
        out.append(Variant(v.label, cfg, f"{v.note}; {note}" if v.note else note))
    return out


def load_variants(
    preset: str | None, variants_file: str | None, paper_sizes: bool = False
) -> tuple[list[Variant], str]:
    """(variants, a note on how the models were sized) of a comparison preset, or of a YAML variants file."""
    if variants_file:
        return _load_list(variants_file), f"variants from {variants_file}"
    if preset not in COMPARE_PRESETS:
        raise ConfigError(f"unknown compare preset {preset!r}; known: {', '.join(COMPARE_PRESETS)}")
    return COMPARE_PRESETS[preset](paper_sizes)


def _load_list(path: str) -> list[Variant]:
    """YAML: a list of {label, preset?, ...ModelConfig overrides}, or {variants: [...], base: {...}}."""
    raw = yaml.safe_load(Path(path).read_text())
    base: dict[str, Any] = {}
    if isinstance(raw, dict):
        base = raw.get("base", {}) or {}
        raw = raw.get("variants")
    if not isinstance(raw, list) or not raw:
        raise ConfigError(f"{path}: expected a non-empty list of variants (or a mapping with 'variants:')")
    out = []
    for i, item in enumerate(raw):
        if not isinstance(item, dict):
            raise ConfigError(f"{path}: variant {i} is not a mapping")
        item = dict(item)
        label = str(item.pop("label", item.get("attention", f"variant{i}")))
        preset = item.pop("preset", None)
        fields = {**base, **item}
        cfg = get_preset(preset, **fields) if preset else ModelConfig.from_dict(fields)
        out.append(Variant(label, cfg))
    labels = [v.label for v in out]
    if len(set(labels)) != len(labels):
        raise ConfigError(f"{path}: variant labels must be unique, got {labels}")
    return out
