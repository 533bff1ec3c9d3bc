"""Load a Hugging Face folder as a kvlm model: what lets ``kvlm generate`` and ``kvlm eval`` take a ``kvlm
export-hf`` folder (any format) or a Llama / dense DeepseekV3 download as well as a kvlm checkpoint.

``load_model_folder(path)`` -> (model, tokenizer or None, meta) like ``kvlm.checkpoint.load_checkpoint``: a
folder with meta.json is a kvlm checkpoint; one whose config.json names model_type "kvlm" is read back through
``KVLMForCausalLM`` (kvlm.interop.hf registers it), "llama" / "mistral" through ``import_llama`` and
"deepseek_v3" through ``import_deepseek_v3`` (same logits; transformers is imported only then). The
tokenizer's special-token roles and chat template go into meta as ``import-hf`` records them."""

from __future__ import annotations

import json
from pathlib import Path

from kvlm.checkpoint import load_checkpoint

HF_MODEL_TYPES = ("kvlm", "llama", "mistral", "deepseek_v3")


def hf_model_type(path: str | Path) -> str | None:
    """model_type of a Hugging Face folder (config.json, no meta.json), else None."""
    path = Path(path)
    if (path / "meta.json").is_file() or not (path / "config.json").is_file():
        return None
    try:
        model_type = json.loads((path / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None
    return model_type if isinstance(model_type, str) else None


def load_model_folder(path: str | Path, device="cpu", dtype=None):
    """-> (model, tokenizer or None, meta) of a kvlm checkpoint or a Hugging Face folder kvlm reads."""
    model_type = hf_model_type(path)
    if model_type is None:
        return load_checkpoint(path, device=device, dtype=dtype)
    if model_type not in HF_MODEL_TYPES:
        raise ValueError(
            f"{path} is a Hugging Face {model_type!r} folder; kvlm reads {', '.join(HF_MODEL_TYPES)} folders "
            "(others: `kvlm import-hf` a Llama-architecture model first)"
        )
    import kvlm.interop.hf  # noqa: F401  (registers model_type "kvlm" with the Auto classes)
    from kvlm.interop.convert import import_llama, kvlm_tokenizer, load_hf_llama
    from kvlm.interop.deepseek_v3 import import_deepseek_v3
    from kvlm.interop.tokenizer_meta import META_KEY, settings_from_hf

    hf, hf_tok = load_hf_llama(path)
    if model_type == "kvlm":
        model = hf.model
    elif model_type == "deepseek_v3":
        model = import_deepseek_v3(hf)
    else:
        model = import_llama(hf)
    meta = {"imported_from": str(path)}
    tokenizer = None
    if hf_tok is not None:
        generation_config = getattr(hf, "generation_config", None)  # its eos ids end generation too
        tokenizer = kvlm_tokenizer(hf_tok, generation_config)
        meta[META_KEY] = settings_from_hf(hf_tok, generation_config)
    model = model.to(device=device, dtype=dtype) if dtype is not None else model.to(device)
    return model.eval(), tokenizer, meta


__all__ = ["HF_MODEL_TYPES", "hf_model_type", "load_model_folder"]
