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

import json
import re
import shutil
from pathlib import Path

from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

from kvlm import __version__
from kvlm.checkpoint import load_checkpoint
from kvlm.files import check_replaceable, clean_leftovers, replace_folder, temp_folder
from kvlm.interop import deepseek_v3, llama
from kvlm.interop.deepseek_v3 import FormatError
from kvlm.interop.hf_modeling import KVLMConfig, KVLMForCausalLM
from kvlm.interop.tokenizer_meta import META_KEY
from kvlm.logs import get_logger

MODEL_TYPE = KVLMConfig.model_type
# stock formats: {name: (kvlm.interop module with hf_config / to_hf_state, transformers config, model class)}
STOCK_FORMATS = {
    "deepseek-v3": (deepseek_v3, "DeepseekV3Config", "DeepseekV3ForCausalLM"),
    "llama": (llama, "LlamaConfig", "LlamaForCausalLM"),
}
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


def hf_tokenizer(tokenizer, settings: dict | None = None, model_max_length: int | None = None):
    """kvlm Tokenizer (or tokenizers.Tokenizer) -> transformers fast tokenizer (a stock class: loading it never
    needs remote code). Special-token roles and the chat template come from ``settings``
    (kvlm.interop.tokenizer_meta, kept by ``kvlm import-hf``); by default eos = bos = pad = <|endoftext|>.
    ``model_max_length``: the model's context."""
    backend = getattr(tokenizer, "backend", tokenizer)
    settings = dict(settings or {})
    eos = settings.get("eos_token") or getattr(tokenizer, "eos_token", "<|endoftext|>")
    roles = {"eos_token": eos, "bos_token": settings.get("bos_token", eos)}
    roles["pad_token"] = settings.get("pad_token", eos)
    if "unk_token" in settings:
        roles["unk_token"] = settings["unk_token"]
    for role, token in roles.items():
        if backend.token_to_id(token) is None:
            raise ExportError(f"tokenizer has no {role} {token!r}")
    kw = {"model_max_length": model_max_length} if model_max_length else {}
    if settings.get("extra_special_tokens"):
        kw["extra_special_tokens"] = list(settings["extra_special_tokens"])
    # left padding: kvlm's cache takes left-padded batches
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, padding_side="left", **roles, **kw)
    if settings.get("chat_template"):
        tok.chat_template = settings["chat_template"]
    return tok


# what an export writes (save_pretrained, the tokenizer, the remote code): a folder holding only these, with a
# config.json of model_type "kvlm", is a previous export that force=True may replace
_EXPORT_FILES = re.compile(
    r"config\.json|generation_config\.json|model(-\d+-of-\d+)?\.safetensors|model\.safetensors\.index\.json"
    r"|tokenizer\.json|tokenizer_config\.json|special_tokens_map\.json|chat_template\.jinja"
    r"|configuration_kvlm\.py|modeling_kvlm\.py|kvlm_\w+\.py|__pycache__"
)


def export_foreign_files(folder: Path) -> list[str]:
    """What in ``folder`` is not part of a kvlm export; empty: a previous export that may be replaced (a
    config.json of model_type "kvlm", or a stock-format one marked ``exported_by`` kvlm)."""
    folder = Path(folder)
    out = [p.name for p in sorted(folder.iterdir()) if not _EXPORT_FILES.fullmatch(p.name)]
    if not out:
        try:
            config = json.loads((folder / "config.json").read_text())
            model_type, marked = config.get("model_type"), str(config.get("exported_by", ""))
        except (OSError, ValueError, AttributeError):
            model_type, marked = None, ""
        if model_type != MODEL_TYPE and not marked.startswith("kvlm"):
            out.append(f"config.json (model_type {model_type!r}, not a kvlm export)")
    return out


def to_stock(model, fmt: str):
    """A kvlm ``KVLM`` -> transformers' own model class of format ``fmt`` ("deepseek-v3": DeepseekV3ForCausalLM
    for MLA, "llama": LlamaForCausalLM for MHA/GQA/MQA), same weights, float32 unless the model is another dtype.
    Raises FormatError naming an option the format cannot hold."""
    if fmt not in STOCK_FORMATS:
        raise ExportError(f"unknown format {fmt!r}; known: kvlm, {', '.join(STOCK_FORMATS)}")
    module, config_cls, model_cls = STOCK_FORMATS[fmt]
    import transformers

    cfg = model.cfg
    hf_cfg = getattr(transformers, config_cls)(**module.hf_config(cfg))
    state = module.to_hf_state(cfg, model.state_dict())
    p = next(model.parameters())
    hf = getattr(transformers, model_cls)(hf_cfg).to(device=p.device, dtype=p.dtype)
    missing, unexpected = hf.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (cfg.tie_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise ExportError(f"{fmt} weights do not fit: missing {missing[:4]}, unexpected {unexpected[:4]}")
    if cfg.tie_embeddings:
        hf.tie_weights()
    hf.config.exported_by = f"kvlm {__version__}"
    return hf.eval()


def export_hf(
    checkpoint,
    out: str | Path,
    *,
    remote_code: bool = True,
    dtype=None,
    force: bool = False,
    format: str = "kvlm",
) -> Path:
    """Write a transformers folder for ``checkpoint`` (a kvlm checkpoint folder, or a ``(model, tokenizer)``
    pair) at ``out``. ``format``: "kvlm" (model_type kvlm, any mechanism, with its remote code unless
    ``remote_code=False``), or a stock format that transformers, vLLM and SGLang load without kvlm's code:
    "deepseek-v3" (MLA) or "llama" (MHA/GQA/MQA) (``to_stock``). A non-empty ``out`` is refused unless
    ``force``, and even then unless it is a previous export (``export_foreign_files``) that does not hold the
    checkpoint; it is then replaced atomically. Returns the folder."""
    if format != "kvlm" and format not in STOCK_FORMATS:
        raise ExportError(f"unknown format {format!r}; known: kvlm, {', '.join(STOCK_FORMATS)}")
    source = [] if isinstance(checkpoint, tuple) else [checkpoint]
    clean_leftovers(Path(out))  # what an export cut by a crash left beside out (recovering out first)
    check_replaceable(
        out, force=force, foreign=export_foreign_files, kind="Hugging Face export", protect=source
    )
    meta = {}
    if isinstance(checkpoint, tuple):
        model, tokenizer = checkpoint[:2]
        meta = checkpoint[2] if len(checkpoint) > 2 else {}
    else:
        model, tokenizer, meta = load_checkpoint(checkpoint)
    if dtype is not None:
        if format == "deepseek-v3":
            deepseek_v3.check_dtype(model.cfg, dtype)
        model = model.to(dtype)
    hf = to_hf(model) if format == "kvlm" else to_stock(model, format)
    hf_tok = None
    if tokenizer is not None:
        settings = (meta or {}).get(META_KEY)
        hf_tok = hf_tokenizer(tokenizer, settings, model_max_length=model.cfg.max_seq_len)
        ids = {"eos_token_id": hf_tok.eos_token_id, "pad_token_id": hf_tok.pad_token_id}
        ids["bos_token_id"] = hf_tok.bos_token_id
        for name, value in ids.items():
            setattr(hf.config, name, value)
            setattr(hf.generation_config, name, value)
        # every stop token the model declares (a chat model's end of turn besides the eos): generation_config's
        # eos_token_id list, which transformers' generate, vLLM and SGLang stop at
        stops = list(dict.fromkeys([hf_tok.eos_token_id, *getattr(tokenizer, "stop_ids", [])]))
        if len(stops) > 1:
            hf.generation_config.eos_token_id = stops
    out = Path(out)
    tmp = temp_folder(out)
    try:
        if format == "kvlm":  # with remote_code: auto_map and the code files
            hf.save_pretrained(tmp, remote_code=remote_code)
        else:
            hf.save_pretrained(tmp)
        if hf_tok is not None:
            hf_tok.save_pretrained(tmp)
        replace_folder(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.debug("exported %s (%s, format %s) to %s", checkpoint if not isinstance(checkpoint, tuple) else
                 "model", model.cfg.attention, format, out)  # fmt: skip
    return out


__all__ = [
    "ExportError",
    "FormatError",
    "STOCK_FORMATS",
    "MODEL_TYPE",
    "export_foreign_files",
    "export_hf",
    "hf_tokenizer",
    "register_auto_classes",
    "to_hf",
    "to_stock",
]
