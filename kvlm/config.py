"""Model configuration: one dataclass for every attention mechanism, with validation and YAML I/O.

Symbols follow the papers (see ../shared/papers): d = d_model, h = n_head, d_h = head_dim,
g = n_kv_head, d_c = kv_lora_rank, d'_c = q_lora_rank, d_h^R = rope_head_dim.

Every field is coerced to its declared type on construction (``coerce_fields``, also used by TrainConfig):
YAML's ``lr: 1e-3`` (a string to PyYAML), ``--set n_layer=4`` or a config.json's ``"n_layer": "4"`` become
numbers, ``rope: "no"`` becomes False; ``four``, a list, a bool for a number, nan or inf is one ConfigError
naming the field, the value and the expected type.
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvlm.errors import ConfigError

if TYPE_CHECKING:
    from kvlm.attention.base import Attention

ARCHS = ("llama", "gpt2")


@dataclass
class ModelConfig:
    """The architecture of a kvlm model: the attention mechanism (``attention``, a kvlm.attention registry name),
    the shape, positions and each mechanism's own sizes (symbols as the papers write them: d_c = kv_lora_rank,
    d_h^R = rope_head_dim). Unset sizes (None) are derived from the shape; ``validate()`` runs on construction
    and names the first field that does not fit. ``to_dict`` / ``from_dict`` and ``save`` / ``load`` (YAML or JSON) round-trip it;
    ``replace(**changes)`` makes a changed copy; kvlm.preset_table holds the papers' configurations."""

    # --- the mechanism -----------------------------------------------------------------
    attention: str = "mha"  # registry name: mha mqa gqa mla eg-mla mlra-2 mlra-4 gla-2 gla-4 gta mfa tpa
    # --- shape ---------------------------------------------------------------------------
    n_layer: int = 4
    d_model: int = 256
    n_head: int = 8
    head_dim: int | None = None  # d_h; default d_model // n_head
    n_kv_head: int | None = (
        None  # g; default n_head, or the mechanism's (config_defaults: gqa / gta h/4, mqa 1)
    )
    vocab_size: int = 4096
    max_seq_len: int = 1024
    # --- block ---------------------------------------------------------------------------
    arch: str = "llama"  # "llama": RMSNorm + SwiGLU + RoPE; "gpt2": LayerNorm + GELU MLP + learned positions
    ffn_dim: int | None = None  # d_f; default 8/3 d rounded up to 64 (llama) or 4 d (gpt2)
    tie_embeddings: bool = True
    norm_eps: float = 1e-5
    bias: bool = False
    dropout: float = 0.0
    # --- positions -------------------------------------------------------------------------
    rope: bool = True  # RoPE on q/k (mha/mqa/gqa/mfa/tpa: whole head; latent mechanisms: see rope_head_dim)
    rope_theta: float = 10000.0
    rope_head_dim: int | None = None  # d_h^R, decoupled RoPE key for mla/eg-mla/gla/mlra/gta; 0 = no RoPE
    # n_R: decoupled RoPE key heads (mla only); query head i reads k_rope head i // (n_head / n_R). 1 = DeepSeek's
    # one shared k_rope; n_R = g lets a GQA model with g kv heads convert to MLA exactly (MHA2MLA)
    rope_kv_heads: int = 1
    # --- latent attention (mla, eg-mla, gla, mlra, mfa) ------------------------------------
    q_lora_rank: int = 0  # d'_c; 0 = plain W_Q (no query compression)
    kv_lora_rank: int | None = None  # d_c
    kv_latent: str = (
        "joint"  # "joint": one c_kv for K and V (DeepSeek); "separate": c_k and c_v (small-LM grid)
    )
    latent_norm: bool = True  # RMSNorm on the latents (DeepSeek-V2)
    latent_scaling: bool = False  # alpha_q = sqrt(d/d'_c), alpha_kv = sqrt(d/d_c) (mlra.md Sec. 3.3)
    attn_out_scaling: bool = False  # alpha_attn = 1/sqrt(branches) for mlra (mlra.md Eq. 10)
    # --- eg-mla ---------------------------------------------------------------------------
    kv_emb_dim: int = 64  # per-layer gating embedding width
    eg_norm: bool = True  # LayerNorm after the gate (eg-mla.md Eq. 5); False = Table 3 ablation
    eg_op: str = "mul"  # "mul" (Hadamard gate) or "add" (Table 3 ablation)
    eg_group_size: int = 1  # lgz: layers per group sharing KV projections (eg-mla.md Appendix H)
    # --- tpa ------------------------------------------------------------------------------
    tpa_q_rank: int = 6  # beta_q
    tpa_kv_rank: int = 2  # beta_kv
    # --- options for any mechanism ---------------------------------------------------------
    gated: bool = False  # sigmoid output gate (mlra.md Appendix E)
    zero_init_out: bool = False  # zero-initialised attention / FFN output projections (mlra.md Sec. 4.2.1)
    init_std: float = 0.02
    # free-form note carried into reports (e.g. what a scaled preset changed)
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    # ------------------------------------------------------------------------------------
    def __post_init__(self) -> None:
        coerce_fields(
            self
        )  # YAML's "1e-3", a config.json's "4": one type error naming the field, not a crash later
        self.attention = self.attention.lower()
        if self.head_dim is None:
            if self.n_head <= 0 or self.d_model % self.n_head:
                raise ConfigError(
                    f"d_model={self.d_model} is not divisible by n_head={self.n_head}; set head_dim explicitly"
                )
            self.head_dim = self.d_model // self.n_head
        if self.ffn_dim is None:
            self.ffn_dim = 4 * self.d_model if self.arch == "gpt2" else _round_up(8 * self.d_model // 3, 64)
        self.mechanism().config_defaults(self)  # e.g. n_kv_head of mqa / gqa / gta
        if self.n_kv_head is None:
            self.n_kv_head = self.n_head
        if self.rope_head_dim is None:
            self.rope_head_dim = self.head_dim // 2 if self.rope else 0
        if not self.rope:
            self.rope_head_dim = 0
        if self.kv_lora_rank is None:
            self.kv_lora_rank = 4 * self.head_dim
        self.validate()

    def mechanism(self) -> type[Attention]:
        """The registered attention class of ``self.attention`` (ConfigError if none)."""
        # imported on use: the registry's package imports kvlm.attention.base, which imports this module
        from kvlm.attention.registry import get_attention_class

        return get_attention_class(self.attention)

    def validate(self) -> None:
        mechanism = self.mechanism()
        if self.arch not in ARCHS:
            raise ConfigError(f"unknown arch {self.arch!r}; known: {', '.join(ARCHS)}")
        for name in ("n_layer", "d_model", "n_head", "head_dim", "vocab_size", "max_seq_len", "ffn_dim"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.n_kv_head <= 0 or self.n_head % self.n_kv_head:
            raise ConfigError(f"n_head={self.n_head} is not divisible by n_kv_head={self.n_kv_head}")
        if self.rope and self.head_dim % 2:
            raise ConfigError(f"RoPE needs an even head_dim, got {self.head_dim}")
        if self.rope_head_dim < 0 or self.rope_head_dim % 2:
            raise ConfigError(f"rope_head_dim must be even and >= 0, got {self.rope_head_dim}")
        if self.kv_latent not in ("joint", "separate"):
            raise ConfigError(f"kv_latent must be 'joint' or 'separate', got {self.kv_latent!r}")
        if self.eg_op not in ("mul", "add"):
            raise ConfigError(f"eg_op must be 'mul' or 'add', got {self.eg_op!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"dropout must be in [0, 1), got {self.dropout}")
        if self.q_lora_rank < 0:
            raise ConfigError(f"q_lora_rank must be >= 0, got {self.q_lora_rank}")
        if self.rope_kv_heads < 1:
            raise ConfigError(f"rope_kv_heads must be >= 1, got {self.rope_kv_heads}")
        if self.rope_kv_heads != 1 and not mechanism.supports_rope_kv_heads:
            supported = sorted(n for n, c in _registry().items() if c.supports_rope_kv_heads)
            raise ConfigError(
                f"rope_kv_heads={self.rope_kv_heads}: attention {self.attention!r} has one shared RoPE key; "
                f"several decoupled RoPE key heads are implemented for {', '.join(map(repr, supported))} only"
            )
        # mechanism-specific checks live with the mechanism
        mechanism.check_config(self)

    # ------------------------------------------------------------------------------------
    def replace(self, **changes: Any) -> ModelConfig:
        """A copy with some fields changed; derived defaults (head_dim, ffn_dim, ...) are kept
        unless the field they derive from changed, in which case pass them as None to re-derive."""
        data = self.to_dict()
        unknown = set(changes) - set(data)
        if unknown:
            raise ConfigError(f"unknown ModelConfig field(s): {', '.join(sorted(unknown))}")
        data.update(changes)
        return ModelConfig(**data)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        check_mapping(data, "ModelConfig")
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ConfigError(f"unknown ModelConfig field(s): {', '.join(sorted(unknown))}")
        return cls(**data)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2))

    @classmethod
    def load(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        text = path.read_text()
        data = load_yaml_or_json(text, path)
        return cls.from_dict(data)

    # --- accounting (derived from the mechanism's cache_spec, never a second table) -----
    def cache_spec(self, layer_idx: int = 0, naive: bool = False) -> dict[str, tuple[int, ...]]:
        return self.mechanism().spec_for(self, layer_idx, naive)

    def kv_cache_elements_per_layer(self) -> list[int]:
        return [spec_numel(self.cache_spec(i)) for i in range(self.n_layer)]

    def kv_cache_elements_per_token(self) -> int:
        return sum(self.kv_cache_elements_per_layer())

    def kv_cache_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        return self.kv_cache_elements_per_token() * dtype_bytes


def spec_numel(spec: dict[str, tuple[int, ...]] | tuple[int, ...]) -> int:
    """Elements per token of a cache spec {name: per-token shape} (summed over its tensors), or of one shape."""
    if isinstance(spec, dict):
        return sum(math.prod(shape) for shape in spec.values())
    return math.prod(spec)


def _registry() -> dict[str, type[Attention]]:
    from kvlm.attention.registry import registry  # on use, as in ModelConfig.mechanism

    return registry()


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def load_yaml_or_json(text: str, where: str | Path = "<config>") -> dict[str, Any]:
    import yaml

    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"{where}: not valid YAML/JSON: {e}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping of config fields, got {type(data).__name__}")
    return data


# --- type checking of config fields -----------------------------------------------------------------------
# Values arrive from YAML (PyYAML reads `1e-3` as a string), `--set KEY=VALUE`, JSON files written by hand and
# Python callers. Each field is coerced to its declared type the way a reader would (the string "1e-3" to a
# float, "4" to an int, "no" to False) by pydantic's TypeAdapter; what cannot be read as that type (`four`, a
# list, a float for an int, a bool for a number, nan/inf) is one ConfigError naming the field and the value.
# Values that already have exactly the declared type skip pydantic, so building a config stays cheap and
# `import kvlm` does not import pydantic.
_HINTS: dict[type, dict[str, Any]] = {}
_ADAPTERS: dict[Any, Any] = {}
_TYPE_WORDS = {int: "an integer", float: "a finite number", bool: "true or false", str: "a string"}


def coerce_fields(obj: Any) -> None:
    """Coerce every field of the dataclass instance ``obj`` to its declared type, in place (ConfigError naming
    the field, the value and the expected type when it cannot be)."""
    cls = type(obj)
    hints = _HINTS.get(cls)
    if hints is None:
        hints = _HINTS[cls] = typing.get_type_hints(cls)
    for f in fields(obj):
        value = getattr(obj, f.name)
        hint = hints[f.name]
        if not _has_exact_type(value, hint):
            setattr(obj, f.name, _coerce(cls.__name__, f.name, value, hint))


def _members(hint: Any) -> tuple[Any, ...]:
    """int | None -> (int, NoneType); int -> (int,)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return typing.get_args(hint)
    return (hint,)


def _has_exact_type(value: Any, hint: Any) -> bool:
    for t in _members(hint):
        if t is type(None) and value is None:
            return True
        if t in (int, bool, str) and type(value) is t:
            return True
        if t is float and type(value) is float and math.isfinite(value):
            return True
        if typing.get_origin(t) is dict and type(value) is dict:
            return all(type(k) is str for k in value)
    return False


def _expected(hint: Any) -> str:
    words = []
    for t in _members(hint):
        if t is type(None):
            words.append("null")
        elif typing.get_origin(t) is dict:
            words.append("a mapping")
        else:
            words.append(_TYPE_WORDS.get(t, getattr(t, "__name__", str(t))))
    return " or ".join(words)


def _coerce(owner: str, name: str, value: Any, hint: Any) -> Any:
    members = _members(hint)
    problem = None
    if isinstance(value, bool) and bool not in members and (int in members or float in members):
        problem = "a boolean is not a number"  # `n_layer: true` must not mean one layer
    elif type(value) is int and float in members:
        return float(value)  # the common case (JSON's 10000 for rope_theta), also where pydantic is absent
    else:
        # on use: only values of another type than the declared one get here (an exported model's remote code
        # runs this file where pydantic may be missing, with values of the declared types)
        import pydantic

        adapter = _ADAPTERS.get(hint)
        if adapter is None:
            adapter = _ADAPTERS[hint] = pydantic.TypeAdapter(
                hint, config=pydantic.ConfigDict(allow_inf_nan=False)
            )
        try:
            return adapter.validate_python(value)
        except pydantic.ValidationError as e:
            problem = e.errors()[0]["msg"]
    raise ConfigError(f"{owner}.{name}: expected {_expected(hint)}, got {value!r} ({problem})")


def check_mapping(data: Any, what: str) -> None:
    """ConfigError unless ``data`` is a mapping of field names (a config file holding a list or a number)."""
    if not isinstance(data, dict):
        raise ConfigError(
            f"{what}: expected a mapping of field names to values, got {type(data).__name__} {data!r:.80}"
        )


def config_fields() -> list[str]:
    return [f.name for f in dataclasses.fields(ModelConfig)]
