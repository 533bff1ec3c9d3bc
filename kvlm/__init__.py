"""kvlm: language models with small KV caches.

from kvlm import ModelConfig, build_model
model = build_model(ModelConfig(attention="mla", n_layer=4, d_model=256, n_head=8))
"""

from __future__ import annotations

from kvlm.cache import CacheError, KVCache
from kvlm.config import ConfigError, ModelConfig
from kvlm.inference.generation import generate
from kvlm.model import KVLM, build_model, count_parameters

__version__ = "0.1.0"

# transformers' AutoConfig / AutoModelForCausalLM learn model_type "kvlm" when transformers' auto modules load
# (an import hook, stdlib only): importing kvlm never imports transformers (kvlm.interop.hf)
from kvlm.interop.hf import install_auto_registration as _install_auto_registration

_install_auto_registration()


def presets() -> list[str]:
    """Names accepted by ModelConfig.from_preset."""
    from kvlm.presets import presets as _presets

    return _presets()


def __getattr__(name: str):
    # heavier parts load on first use
    if name == "generate":
        from kvlm.inference.generation import generate

        return generate
    if name in ("load_checkpoint", "save_checkpoint"):
        import kvlm.checkpoint as ckpt

        return getattr(ckpt, name)
    raise AttributeError(f"module 'kvlm' has no attribute {name!r}")


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
