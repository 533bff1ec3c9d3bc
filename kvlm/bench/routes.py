"""Which decode modes a benchmark runs for a mechanism, and the route each takes: the one place in
kvlm/bench that asks a mechanism about its routes (``Attention.decode_routes``)."""

from __future__ import annotations

from kvlm.attention import get_attention_class
from kvlm.attention.eg_mla import precompute_gate_tables
from kvlm.config import ModelConfig
from kvlm.model import KVLM

# the attention modes the model's forward accepts for every mechanism (one it has no route for runs "auto");
# other modes (eg-mla's "table") are run only where the mechanism lists them
MODEL_MODES = ("naive", "absorbed", "expand")


def decode_routes(cfg: ModelConfig) -> dict[str, str]:
    """The decode modes this mechanism distinguishes -> the route each takes (its label in the tables)."""
    return get_attention_class(cfg.attention).decode_routes(cfg)


def decode_modes(cfg: ModelConfig, requested: list[str]) -> list[str]:
    """The requested modes this mechanism distinguishes, in order and once each: a model mode it has no
    route for runs as "auto"; a mode beyond the model's (e.g. "table") only where the mechanism has it."""
    routes = decode_routes(cfg)
    out = []
    for mode in requested:
        if mode not in routes:
            if mode not in MODEL_MODES:
                continue
            mode = "auto"
        if mode not in out:
            out.append(mode)
    return out or ["auto"]


def route_name(cfg: ModelConfig, mode: str) -> str:
    """The label of the route ``mode`` takes for this mechanism."""
    return decode_routes(cfg).get(mode, mode)


def set_gate_tables(model: KVLM, enable: bool) -> int:
    """EG-MLA-A (the "table" mode) on or off for every layer that has a gate table; returns their bytes."""
    return precompute_gate_tables(model, enable)
