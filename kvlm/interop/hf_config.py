"""``KVLMConfig``: the transformers configuration class of kvlm models (see kvlm.interop.hf_modeling).

Kept apart from the model class so that registering it with ``AutoConfig`` imports only transformers'
configuration code, not its modeling code. Copied into ``kvlm export-hf`` folders (kvlm.interop.remote_code).
"""

from __future__ import annotations

from kvlm.config import ModelConfig

try:  # transformers >= 5 renamed the config base class
    from transformers import PreTrainedConfig
except ImportError:  # pragma: no cover - transformers 4.x
    from transformers import PretrainedConfig as PreTrainedConfig


class KVLMConfig(PreTrainedConfig):
    """The kvlm ``ModelConfig`` (``kvlm_config``, all fields) plus transformers' generic settings. The usual
    transformers names (hidden_size, num_hidden_layers, ...) mirror it for tools that read them."""

    model_type = "kvlm"
    keys_to_ignore_at_inference = ["past_key_values", "cache"]  # the name before and since transformers 5.24

    def __init__(self, kvlm_config: dict | None = None, **kwargs):
        cfg = ModelConfig.from_dict(dict(kvlm_config)) if kvlm_config else ModelConfig()
        self.kvlm_config = cfg.to_dict()
        kwargs.setdefault("tie_word_embeddings", cfg.tie_embeddings)
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "max_position_embeddings", "intermediate_size"):  # fmt: skip
            kwargs.pop(name, None)  # derived below, never read back from a saved config.json
        super().__init__(**kwargs)
        self.vocab_size = cfg.vocab_size
        self.hidden_size = cfg.d_model
        self.num_hidden_layers = cfg.n_layer
        self.num_attention_heads = cfg.n_head
        self.num_key_value_heads = cfg.n_kv_head
        self.head_dim = cfg.head_dim
        self.max_position_embeddings = cfg.max_seq_len
        self.intermediate_size = cfg.ffn_dim

    def model_config(self) -> ModelConfig:
        return ModelConfig.from_dict(dict(self.kvlm_config))


__all__ = ["KVLMConfig"]
