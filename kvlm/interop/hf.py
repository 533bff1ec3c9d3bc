"""kvlm models in Hugging Face transformers: Auto-class registration, ``to_hf``, and ``export_hf`` (``kvlm
export-hf CHECKPOINT OUT``).

Importing this module registers model_type "kvlm" with ``AutoConfig`` and ``AutoModelForCausalLM`` (importing
``kvlm`` alone does not, and never imports transformers):

    import kvlm.interop.hf                        # registers "kvlm" with the Auto classes
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(OUT)

    # without kvlm installed: the folder carries its own code (configuration_kvlm.py, modeling_kvlm.py, kvlm_*.py)
    model = AutoModelForCausalLM.from_pretrained(OUT, trust_remote_code=True)

An exported folder holds config.json (model_type "kvlm"), model.safetensors, generation_config.json, the
tokenizer (tokenizer.json + tokenizer_config.json) and, unless ``remote_code=False``, the remote code that
kvlm.interop.remote_code writes. The folder is written beside ``out`` and renamed into place, so a failed
export leaves any previous folder intact.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

from kvlm.checkpoint import load_checkpoint
from kvlm.files import replace_folder
from kvlm.interop.hf_modeling import KVLMConfig, KVLMForCausalLM
from kvlm.interop.remote_code import AUTO_MAP, write_remote_code
from kvlm.logs import get_logger

MODEL_TYPE = KVLMConfig.model_type
logger = get_logger(__name__)


class ExportError(ValueError):
    """A checkpoint that cannot be exported, or an output path that cannot be written."""


def register_auto_classes() -> None:
    """Register model_type "kvlm" with AutoConfig and AutoModelForCausalLM (idempotent). Runs when this module
    is imported."""
    AutoConfig.register(MODEL_TYPE, KVLMConfig, exist_ok=True)
    AutoModelForCausalLM.register(KVLMConfig, KVLMForCausalLM, exist_ok=True)


register_auto_classes()


def to_hf(model) -> KVLMForCausalLM:
    """A kvlm ``KVLM`` -> ``KVLMForCausalLM`` sharing nothing with it (weights copied)."""
    hf = KVLMForCausalLM(KVLMConfig(kvlm_config=model.cfg.to_dict()))
    hf.model.load_state_dict(model.state_dict())
    p = next(model.parameters())
    return hf.to(device=p.device, dtype=p.dtype).eval()


def hf_tokenizer(tokenizer) -> PreTrainedTokenizerFast:
    """kvlm Tokenizer (or tokenizers.Tokenizer) -> transformers fast tokenizer with eos = pad = <|endoftext|>."""
    backend = getattr(tokenizer, "backend", tokenizer)
    eos = getattr(tokenizer, "eos_token", "<|endoftext|>")
    if backend.token_to_id(eos) is None:
        raise ExportError(f"tokenizer has no end-of-text token {eos!r}")
    # left padding: kvlm's cache takes left-padded batches
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token=eos, pad_token=eos, bos_token=eos, padding_side="left"
    )


def export_hf(checkpoint, out: str | Path, *, remote_code: bool = True, dtype=None) -> Path:
    """Write a transformers folder for ``checkpoint`` (a kvlm checkpoint folder, or a ``(model, tokenizer)``
    pair) at ``out`` (replaced atomically if it exists). Returns the folder."""
    if isinstance(checkpoint, tuple):
        model, tokenizer = checkpoint
    else:
        model, tokenizer, _ = load_checkpoint(checkpoint)
    if dtype is not None:
        model = model.to(dtype)
    hf = to_hf(model)
    if remote_code:
        hf.config.auto_map = dict(AUTO_MAP)
    if tokenizer is not None:
        eos = getattr(tokenizer, "eos_id", None) or getattr(tokenizer, "backend", tokenizer).token_to_id(
            "<|endoftext|>"
        )
        for name in ("eos_token_id", "pad_token_id", "bos_token_id"):
            setattr(hf.config, name, eos)
            setattr(hf.generation_config, name, eos)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        hf.save_pretrained(tmp, safe_serialization=True)
        if tokenizer is not None:
            hf_tokenizer(tokenizer).save_pretrained(tmp)
        if remote_code:
            write_remote_code(tmp, model.cfg.attention)
        replace_folder(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.debug("exported %s (%s) to %s", checkpoint if not isinstance(checkpoint, tuple) else "model",
                 model.cfg.attention, out)  # fmt: skip
    return out


__all__ = ["ExportError", "MODEL_TYPE", "export_hf", "hf_tokenizer", "register_auto_classes", "to_hf"]
