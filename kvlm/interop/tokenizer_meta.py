"""What a Hugging Face tokenizer carries beyond tokenizer.json (special-token roles, chat template), kept in a
kvlm checkpoint's meta.json under ``"hf_tokenizer"`` so that ``kvlm import-hf`` then ``kvlm export-hf`` gives
back the same tokenizer: SmolLM2-Instruct's eos ``<|im_end|>`` and its ``chat_template`` survive the trip, and
``apply_chat_template`` works on the export. No transformers import here (kvlm.checkpoint users read it)."""

from __future__ import annotations

META_KEY = "hf_tokenizer"
ROLES = ("eos_token", "bos_token", "pad_token", "unk_token")


def settings_from_hf(hf_tokenizer) -> dict:
    """{role: token string, "chat_template": str, "extra_special_tokens": [...]} of a transformers tokenizer
    (only what it sets)."""
    out = {}
    for role in ROLES:
        value = getattr(hf_tokenizer, role, None)
        if isinstance(value, str) and value:
            out[role] = value
    template = getattr(hf_tokenizer, "chat_template", None)
    if isinstance(template, (str, dict)) and template:
        out["chat_template"] = template
    extra = getattr(hf_tokenizer, "additional_special_tokens", None) or getattr(
        hf_tokenizer, "extra_special_tokens", None
    )
    if isinstance(extra, (list, tuple)) and extra:
        out["extra_special_tokens"] = [str(t) for t in extra]
    return out


__all__ = ["META_KEY", "ROLES", "settings_from_hf"]
