"""kvlm: language models with small KV caches.

    from kvlm import ModelConfig, build_model, generate
    model = build_model(ModelConfig(attention="mla", n_layer=4, d_model=256, n_head=8))
    logits = model(tokens)                                  # (B, T, vocab), full causal forward
    ids = generate(model, prompt_ids, 20)                   # prefill + decode on the compact cache

The public surface (kept stable): ``ModelConfig``, ``build_model``, ``KVLM``, ``KVCache``, ``generate``,
``load_checkpoint`` / ``save_checkpoint``, ``count_parameters``, ``presets()``, and the errors ``ConfigError``
and ``CacheError`` (ValueErrors). The subpackages hold the rest (see the README's layout section):
``kvlm.attention`` (one file per mechanism, the registry), ``kvlm.cache``, ``kvlm.inference``,
``kvlm.training``, ``kvlm.data``, ``kvlm.parallel``, ``kvlm.bench``, ``kvlm.compare``, ``kvlm.interop``
(Hugging Face, lm-eval, conversion) and ``kvlm.cli`` (the ``kvlm`` command).

Importing kvlm changes nothing outside it: no import hooks, and transformers is not imported. To load exported
folders with transformers' Auto classes, ``import kvlm.interop.hf`` (it registers model_type "kvlm").
"""

from __future__ import annotations

from kvlm.cache import CacheError, KVCache
from kvlm.checkpoint import load_checkpoint, save_checkpoint
from kvlm.config import ConfigError, ModelConfig
from kvlm.inference.generation import generate
from kvlm.model import KVLM, build_model, count_parameters
from kvlm.preset_table import presets as _preset_names

__version__ = "0.1.0"


def presets() -> list[str]:
    """Names accepted by kvlm.preset_table.get_preset."""
    return _preset_names()


__all__ = [
    "CacheError",
    "ConfigError",
    "KVCache",
    "KVLM",
    "ModelConfig",
    "build_model",
    "count_parameters",
    "generate",
    "load_checkpoint",
    "presets",
    "save_checkpoint",
]
