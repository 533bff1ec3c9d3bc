"""What a Hugging Face tokenizer carries beyond tokenizer.json (special-token roles, chat template), kept in a
kvlm checkpoint's meta.json under ``"hf_tokenizer"`` so that ``kvlm import-hf`` then ``kvlm export-hf`` gives
back the same tokenizer: SmolLM2-Instruct's eos ``<|im_end|>`` and its ``chat_template`` survive the trip, and
``apply_chat_template`` works on the export. ``stop_tokens`` lists every token that ends the model's output
(generation_config's eos ids, the chat template's end-of-turn token, the eos), which
``kvlm.data.tokenizer.load_tokenizer`` reads back from meta.json for ``generate`` and ``serve``. No transformers
import here (kvlm.checkpoint users read it)."""

from __future__ import annotations

from kvlm.data.tokenizer import end_of_turn_tokens

META_KEY = "hf_tokenizer"
ROLES = ("eos_token", "bos_token", "pad_token", "unk_token")


def stop_tokens_from_hf(hf_tokenizer, generation_config=None) -> list[str]:
    """The tokens that end a model's output: its tokenizer's eos, generation_config's ``eos_token_id`` (an id or a
    list) and the chat template's end-of-turn token (kvlm.data.tokenizer.end_of_turn_tokens), without repeats."""
    names = [getattr(hf_tokenizer, "eos_token", None)]
    ids = getattr(generation_config, "eos_token_id", None)
    for i in ids if isinstance(ids, (list, tuple)) else [ids]:
        if isinstance(i, int) and not isinstance(i, bool):
            names.append(hf_tokenizer.convert_ids_to_tokens(i))
    special = list(getattr(hf_tokenizer, "all_special_tokens", []) or [])
    added = (getattr(hf_tokenizer, "added_tokens_decoder", None) or {}).values()
    special += [t.content for t in added if getattr(t, "special", False)]
    names += end_of_turn_tokens(getattr(hf_tokenizer, "chat_template", None), dict.fromkeys(special))
    return [t for t in dict.fromkeys(names) if isinstance(t, str) and t]


def settings_from_hf(hf_tokenizer, generation_config=None) -> dict:
    """{role: token string, "chat_template": str, "extra_special_tokens": [...], "stop_tokens": [...]} of a
    transformers tokenizer (only what it sets); ``generation_config``: the model's, for its eos ids."""
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
    stops = stop_tokens_from_hf(hf_tokenizer, generation_config)
    if stops:
        out["stop_tokens"] = stops
    return out


__all__ = ["META_KEY", "ROLES", "settings_from_hf", "stop_tokens_from_hf"]
