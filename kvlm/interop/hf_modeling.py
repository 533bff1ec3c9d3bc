"""Hugging Face transformers classes for kvlm models: ``KVLMConfig``, ``KVLMForCausalLM``, ``KVLMCache``.

``KVLMForCausalLM`` wraps a ``kvlm.model.KVLM`` (as ``.model``), so every attention mechanism works in
transformers unchanged. ``generate()`` keeps kvlm's compact KV cache (the latent ``c_kv`` for MLA, not
materialised per-head K/V): ``_prepare_cache_for_generation`` hands generate a ``KVLMCache`` and ``forward``
refuses any other cache class, so there is no silent fallback to a transformers ``DynamicCache``.

Batches are left-padded (``tokenizer.padding_side = "left"``): the attention mask's leading zeros become the
cache's left padding (``KVCache.set_left_padding``) and kvlm derives positions from it. Right padding is
accepted only without a cache (causal attention never looks right, so real tokens are unaffected).

This file is also copied, with its kvlm imports made relative, into every ``kvlm export-hf`` folder (see
``kvlm.interop.remote_code``), so it may import only torch, transformers and kvlm's core modules, and it has no
import-time side effects: registration with the Auto classes is ``kvlm.interop.hf``'s.
Written for transformers 5 (causal LMs inherit ``GenerationMixin`` explicitly; the config, in kvlm.interop.hf_config,
subclasses ``PreTrainedConfig``, ``PretrainedConfig`` on 4.x).
"""

from __future__ import annotations

import importlib
import json
import shutil
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from kvlm.attention.rope import RotaryEmbedding
from kvlm.cache import CacheError, KVCache
from kvlm.interop.hf_config import KVLMConfig
from kvlm.model import KVLM

# transformers 5.24 renamed generate's cache argument and the output field ``past_key_values`` to ``cache``
# (the old name deprecated): kvlm hands generate its cache, and returns it, under the name this version reads
CACHE_NAME = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


class KVLMCache:
    """kvlm's compact ``KVCache`` behind the few calls transformers' ``generate`` makes on a cache.

    Allocated on the model's first call with it (then the batch size and left padding are known), for
    ``max_length`` tokens (default: the model's max_seq_len). ``.kv`` is the ``kvlm.cache.KVCache``."""

    is_compileable = False
    is_croppable = False
    # no recurrent (linear-attention) layers: generate may slice a prompt by the cached length
    is_linear = (False,)

    def __init__(self, max_length: int | None = None):
        self.max_length = max_length
        self.kv: KVCache | None = None

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0 if self.kv is None else self.kv.length

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return -1 if self.kv is None else self.kv.max_seq_len

    @property
    def nbytes(self) -> int:
        return 0 if self.kv is None else self.kv.nbytes

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: sequence b continues beam ``beam_idx[b]``."""
        if self.kv is None:
            return
        self.kv.reorder_(beam_idx)

    def __repr__(self) -> str:
        return f"KVLMCache({self.kv!r})"


def left_padding(attention_mask: torch.Tensor | None, allow_right: bool) -> torch.Tensor | None:
    """(B, L) 0/1 mask -> left padding per row (B,), or None when nothing is padded on the left.

    Each row must be zeros then ones (left padding) or, with allow_right, ones then zeros (right padding,
    harmless without a cache). Anything else (holes inside a sequence) cannot be expressed by kvlm's cache."""
    if attention_mask is None:
        return None
    m = attention_mask.to(torch.bool)
    if bool(m.all()):
        return None
    pad = (~m).long().cumprod(dim=1).sum(dim=1)  # leading zeros
    n_ones = m.long().sum(dim=1)
    L = m.shape[1]
    left_ok = bool((pad + n_ones == L).all())
    if left_ok:
        return pad if bool(pad.any()) else None
    trailing = m.flip(1).logical_not().long().cumprod(dim=1).sum(dim=1)
    if allow_right and bool((trailing + n_ones == L).all()):
        return None
    raise ValueError(
        "kvlm models need left-padded batches (attention_mask = zeros then ones per row; set "
        "tokenizer.padding_side = 'left'); this mask has padding inside or after the sequence"
    )


# the auto_map of a folder with kvlm's remote code (entry files written by kvlm.interop.remote_code)
REMOTE_AUTO_MAP = {
    "AutoConfig": "configuration_kvlm.KVLMConfig",
    "AutoModelForCausalLM": "modeling_kvlm.KVLMForCausalLM",
}


class KVLMForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = KVLMConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    _no_split_modules = ["Block"]
    _supports_cache_class = True
    supports_gradient_checkpointing = False

    def __init__(self, config: KVLMConfig):
        super().__init__(config)
        self.model = KVLM(config.model_config())
        self.post_init()

    # the tie is kvlm's own (lm_head.weight is embed.weight); these tell transformers about it
    @property
    def _tied_weights_keys(self):
        if self.config.kvlm_config.get("tie_embeddings", True):
            return {"model.lm_head.weight": "model.embed.weight"}
        return None

    def _init_weights(self, module):
        """KVLM initialises its weights when built (kvlm.model.KVLM.reset_parameters). transformers' loader
        builds on the meta device and leaves non-persistent buffers empty: kvlm's only ones are the RoPE
        tables, recomputed here."""
        if isinstance(module, RotaryEmbedding):
            fresh = RotaryEmbedding(module.dim, module.cos_table.shape[0], module.theta)
            with torch.no_grad():
                module.cos_table = fresh.cos_table.to(module.cos_table.device)
                module.sin_table = fresh.sin_table.to(module.sin_table.device)

    def get_input_embeddings(self):
        return self.model.embed

    def set_input_embeddings(self, value):
        self.model.embed = value

    def get_output_embeddings(self):
        return self.model.lm_head

    def set_output_embeddings(self, value):
        self.model.lm_head = value

    @property
    def kvlm_model(self) -> KVLM:
        return self.model

    def save_pretrained(self, save_directory, *args, remote_code: bool = True, **kwargs):
        """transformers' ``save_pretrained``, plus (``remote_code=True``) the code that lets
        ``from_pretrained(save_directory, trust_remote_code=True)`` load the folder where kvlm is not installed:
        ``auto_map`` in config.json and the files of kvlm.interop.remote_code. A model loaded from such a folder
        (its class in ``transformers_modules``) saves the files it was loaded from."""
        native = type(self).__module__ == "kvlm.interop.hf_modeling"
        if not native:  # loaded from a folder's remote code: save that whole set of files again
            super().save_pretrained(save_directory, *args, **kwargs)
            if kwargs.get("is_main_process", True):
                self._copy_remote_code(save_directory)
            return
        if remote_code:
            # imported by name, not by an import statement: this file is itself bundled as remote code, and the
            # bundler (which follows import statements) must not copy the exporter into the folder
            remote = importlib.import_module("kvlm.interop.remote_code")
            self.config.auto_map = dict(remote.AUTO_MAP)
        elif getattr(self.config, "auto_map", None) is not None:
            del self.config.auto_map  # a folder without the code must not point at it
        super().save_pretrained(save_directory, *args, **kwargs)
        if remote_code and kwargs.get("is_main_process", True):
            remote.write_remote_code(save_directory, self.config.model_config().attention)

    def _copy_remote_code(self, save_directory) -> None:
        """transformers' own save copies only this class's file and what it imports, and points auto_map at
        them; the entry files (the configuration registers the attention mechanism) and the mechanism's
        modules would be lost. Copy every file of the loaded code and point auto_map at the entry files."""
        source = Path(sys.modules[type(self).__module__].__file__).parent
        for f in source.glob("*.py"):
            if f.name != "__init__.py":
                shutil.copyfile(f, Path(save_directory) / f.name)
        path = Path(save_directory) / "config.json"
        config = json.loads(path.read_text())
        config["auto_map"] = dict(REMOTE_AUTO_MAP)
        path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")

    # --- generation -----------------------------------------------------------------------------
    def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
        """Give generate() a KVLMCache (the compact cache), never a transformers DynamicCache."""
        user_cache = model_kwargs.get("cache", model_kwargs.get("past_key_values"))
        if user_cache is not None:
            if not isinstance(user_cache, KVLMCache):
                raise ValueError(
                    f"kvlm models keep their own compact cache: pass a KVLMCache, not {type(user_cache).__name__}"
                )
            user_cache._is_user_defined = True
            return
        if generation_config.use_cache is False:
            return
        impl = getattr(generation_config, "cache_implementation", None)
        if impl not in (None, "dynamic"):
            raise ValueError(
                f"kvlm models use their own compact cache; cache_implementation={impl!r} is not supported"
            )
        model_kwargs[CACHE_NAME] = KVLMCache(max_length=generation_config.max_length)

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:  # generate() asks: no DynamicCache for kvlm
        return False

    # --- forward ---------------------------------------------------------------------------------
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        past_key_values: KVLMCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        return_dict: bool | None = None,
        logits_to_keep: int = 0,
        cache: KVLMCache | None = None,
        **kwargs,
    ):
        if inputs_embeds is not None or input_ids is None:
            raise ValueError("kvlm models take input_ids (inputs_embeds is not supported)")
        for name in ("output_attentions", "output_hidden_states"):
            if kwargs.get(name):
                raise ValueError(f"{name}=True is not supported by kvlm models")
        if cache is None:  # the argument's name before transformers 5.24
            cache = past_key_values
        if cache is None and use_cache is True:
            cache = KVLMCache()
        if cache is not None and not isinstance(cache, KVLMCache):
            raise ValueError(
                f"kvlm models keep their own compact cache (KVLMCache); got {type(cache).__name__}"
            )
        B, T = input_ids.shape
        last_only = logits_to_keep == 1
        if cache is None:
            pad = left_padding(attention_mask, allow_right=True)
            if pad is None:
                logits = self.model(input_ids, last_only=last_only)
            else:  # left padding: a throw-away cache carries the padding (masks and positions)
                kv = self.model.new_cache(B, T)
                kv.set_left_padding(pad)
                logits = self.model(input_ids, cache=kv, last_only=last_only)
        else:
            if cache.kv is None:
                if attention_mask is not None and attention_mask.shape[1] != T:
                    raise CacheError("a new KVLMCache must be filled with the whole prompt first")
                cfg = self.model.cfg
                max_len = min(cache.max_length or cfg.max_seq_len, cfg.max_seq_len)
                cache.kv = self.model.new_cache(B, max(max_len, T))
                if not self.model.training:  # a new generation: derived decode weights once, not per step
                    self.model.prepare_for_inference()
                pad = left_padding(attention_mask, allow_right=False)
                if pad is not None:
                    cache.kv.set_left_padding(pad)
            elif attention_mask is not None:
                new = attention_mask[:, cache.kv.length :]
                if new.shape[1] != T or not bool(new.to(torch.bool).all()):
                    raise ValueError("attention_mask must cover the cached tokens and be 1 on the new ones")
            logits = self.model(input_ids, cache=cache.kv, last_only=last_only)
        if isinstance(logits_to_keep, int) and logits_to_keep > 1:
            logits = logits[:, -logits_to_keep:]
        loss = None
        if labels is not None:
            loss = F.cross_entropy(
                logits[:, :-1].flatten(0, 1).float(),
                labels[:, 1:].flatten().to(logits.device),
                ignore_index=-100,
            )
        if return_dict is False:
            out = (logits, cache)
            return (loss, *out) if loss is not None else out
        return CausalLMOutputWithPast(loss=loss, logits=logits, **{CACHE_NAME: cache})


__all__ = ["KVLMCache", "KVLMConfig", "KVLMForCausalLM"]
