"""Where a run's model comes from, and which of its parameters train.

- A fresh run builds the model from its config, seeded with ``TrainConfig.seed`` (the same weights on every rank).
- A fine-tune (``TrainConfig.init``) starts from existing weights: a kvlm checkpoint folder, a Hugging Face
  folder kvlm can import (a Llama-family or dense DeepseekV3 model, or a folder ``kvlm export-hf`` wrote), or a
  Llama ``.gguf`` file. The optimizer is fresh and the step is 0; the model config is the init's (model overrides are refused
  rather than silently ignored), and the data must be tokenized with the init's tokenizer.
- ``TrainConfig.train_only`` / ``freeze``: comma-separated ``fnmatch`` globs on parameter names
  (``layers.0.attn.wkv_a.weight``); train_only selects the trainable ones (default: all), freeze removes from
  them. The rest get ``requires_grad=False``, so AdamW holds no state for them and they never change (weight
  decay included). A pattern that matches nothing is an error: a typo must not train the whole model.
"""

from __future__ import annotations

from collections.abc import Callable
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

import torch

from kvlm.config import ConfigError, ModelConfig
from kvlm.data import PreparedData
from kvlm.logs import get_logger
from kvlm.model import build_model
from kvlm.training.config import TrainConfig

logger = get_logger(__name__)


def patterns(text: str | None) -> list[str]:
    """'a*, b*' -> ['a*', 'b*'] (None or blank: [])."""
    return [p.strip() for p in (text or "").split(",") if p.strip()]


def trainable_names(model: torch.nn.Module, tcfg: TrainConfig) -> set[str]:
    """The names of the parameters that train under tcfg.train_only / tcfg.freeze (ConfigError for a pattern
    that matches no parameter, or for a selection that leaves nothing to train)."""
    names = [n for n, _ in model.named_parameters()]
    only, frozen = patterns(tcfg.train_only), patterns(tcfg.freeze)
    for option, pats in (("train_only", only), ("freeze", frozen)):
        for pat in pats:
            if not any(fnmatchcase(n, pat) for n in names):
                raise ConfigError(
                    f"{option} pattern {pat!r} matches no parameter (names look like {names[min(2, len(names) - 1)]!r})"
                )
    chosen = {n for n in names if not only or any(fnmatchcase(n, p) for p in only)}
    chosen -= {n for n in chosen if any(fnmatchcase(n, p) for p in frozen)}
    if not chosen:
        raise ConfigError("train_only / freeze leave no parameter to train")
    return chosen


def apply_freeze(model: torch.nn.Module, tcfg: TrainConfig) -> tuple[int, int]:
    """Set requires_grad from tcfg.train_only / freeze; -> (trainable, frozen) parameter counts. Tied weights
    are one parameter: named_parameters yields them once, under their first name."""
    if not (tcfg.train_only or tcfg.freeze):
        return sum(p.numel() for p in model.parameters()), 0
    chosen = trainable_names(model, tcfg)
    counts = [0, 0]
    for n, p in model.named_parameters():
        p.requires_grad_(n in chosen)
        counts[n not in chosen] += p.numel()
    return counts[0], counts[1]


def load_init(source: str | Path) -> tuple[torch.nn.Module, Any, dict[str, Any]]:
    """-> (model (float32, cpu), kvlm Tokenizer or None, what the run records about its start). Folders are
    read by kvlm.interop.hf_folder (as ``kvlm eval`` / ``generate`` read them); a .gguf file as a Llama."""
    path = Path(source)
    if not path.exists():
        raise ConfigError(f"init: nothing at {path} (give a kvlm checkpoint folder or a Hugging Face folder)")
    origin: dict[str, Any] = {"path": str(path.resolve())}
    if path.is_file() and path.suffix == ".gguf":
        from kvlm.interop.convert import import_llama, kvlm_tokenizer, load_hf_llama

        hf_model, hf_tok = load_hf_llama(path)
        origin["kind"] = "gguf-llama"
        return import_llama(hf_model).float(), kvlm_tokenizer(hf_tok) if hf_tok is not None else None, origin
    if not (path.is_dir() and ((path / "meta.json").is_file() or (path / "config.json").is_file())):
        raise ConfigError(
            f"init: {path} is neither a kvlm checkpoint (meta.json) nor a Hugging Face folder (config.json)"
        )
    from kvlm.interop.hf_folder import hf_model_type, load_model_folder

    model_type = hf_model_type(path)
    try:
        model, tokenizer, meta = load_model_folder(path)
    except ValueError as e:  # a Hugging Face model type kvlm does not read: one error naming the option
        raise ConfigError(f"init: {e}") from None
    origin["kind"] = "kvlm-checkpoint" if model_type is None else f"hf-{model_type}"
    if model_type is None:
        origin.update(step=meta.get("step"), tokens=meta.get("tokens"))
    if meta.get("hf_tokenizer"):  # stop tokens, chat template (kvlm.interop.tokenizer_meta): the fine-tune keeps them
        origin["hf_tokenizer"] = meta["hf_tokenizer"]
    return model.float(), tokenizer, origin


def initial_model(
    model_cfg: ModelConfig | None,
    tcfg: TrainConfig,
    data: PreparedData,
    adapt_vocab: bool,
    say: Callable[[str], None],
) -> tuple[torch.nn.Module, dict[str, Any] | None]:
    """-> (model, origin): built from model_cfg (origin None), or loaded from tcfg.init (origin: where from).
    Seeds torch with tcfg.seed first, so every rank builds the same weights."""
    torch.manual_seed(tcfg.seed)
    if tcfg.init is None:
        if model_cfg is None:
            raise ConfigError("no model config given")
        if model_cfg.vocab_size != data.vocab_size and adapt_vocab:
            say(f"vocab_size {model_cfg.vocab_size} -> {data.vocab_size} (the data's tokenizer)")
            model_cfg = model_cfg.replace(vocab_size=data.vocab_size)
        return build_model(model_cfg), None
    model, tokenizer, origin = load_init(tcfg.init)
    if model_cfg is not None:
        diff = [
            k for k, v in model_cfg.to_dict().items() if v != model.cfg.to_dict()[k] and k != "vocab_size"
        ]
        if diff:
            raise ConfigError(
                f"init: the model config comes from {tcfg.init}; it differs from the one given in {', '.join(diff)}"
            )
    if tokenizer is not None and not same_tokenizer(tokenizer, data.tokenizer):
        raise ConfigError(
            f"init: {data.path} was tokenized with a different tokenizer than {tcfg.init}'s (prepare the data "
            f"with the model's tokenizer: kvlm prepare ... --tokenizer {tcfg.init}/tokenizer.json)"
        )
    if tokenizer is None:
        say(f"warning: {tcfg.init} has no tokenizer kvlm can read: the data's token ids are not checked")
    origin["tokenizer_sha256"] = tokenizer.sha256() if tokenizer is not None else None
    say(f"fine-tuning from {tcfg.init} ({origin['kind']}): fresh optimizer, step 0")
    return model, origin


# text that exercises bytes, spaces, digits and punctuation: two tokenizers that split it alike and share the
# vocabulary map text to the same ids
PROBE = "The café's 3 cats, 42 dogs\tand naïve émigrés!\n  Indented — ünïcödé 🙂 end."


def same_tokenizer(a, b) -> bool:
    """The same token ids for the same text: the same file, or (a Hugging Face round trip rewrites the JSON)
    the same vocabulary and the same split of PROBE."""
    if a.sha256() == b.sha256():
        return True
    vocab_a, vocab_b = (t.backend.get_vocab(with_added_tokens=True) for t in (a, b))
    return vocab_a == vocab_b and a.encode(PROBE) == b.encode(PROBE)


def check_fit(cfg: ModelConfig, tcfg: TrainConfig, data: PreparedData) -> None:
    """The data's token ids and the window length fit the model."""
    if cfg.vocab_size < data.vocab_size:
        raise ConfigError(
            f"vocabulary mismatch: the model has vocab_size={cfg.vocab_size} but the data's tokenizer has "
            f"{data.vocab_size} tokens (set vocab_size={data.vocab_size}, or adapt_vocab=True)"
        )
    if tcfg.seq_len > cfg.max_seq_len:
        raise ConfigError(f"seq_len={tcfg.seq_len} exceeds the model's max_seq_len={cfg.max_seq_len}")
