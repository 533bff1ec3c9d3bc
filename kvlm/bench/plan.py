"""What one `kvlm bench` run measures: ``Plan`` (variants with their decode modes, sizes, device, dtype),
built by ``make_plan`` from a named suite and explicit options, with one clear ``BenchError`` for bad ones."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from kvlm.attention import registry
from kvlm.bench.routes import decode_modes
from kvlm.bench.suites import DEFAULTS, DTYPES, MODES, OPTIONS, SHAPE_FIELDS, SUITES
from kvlm.config import ConfigError, ModelConfig, load_yaml_or_json
from kvlm.preset_table import get_preset


class BenchError(ConfigError):
    """Bad benchmark options (unknown variant, suite or mode, empty lists, ...)."""


@dataclass
class Variant:
    label: str
    cfg: ModelConfig
    modes: list[str] = field(default_factory=lambda: ["auto"])


@dataclass
class Plan:
    variants: list[Variant]
    batch: list[int]
    context: list[int]
    prompt: list[int]
    steps: int
    warmup: int
    repeats: int
    dtype: torch.dtype
    device: torch.device
    peers: bool
    bandwidth_mib: int
    seed: int = 0
    suite: str | None = None
    budget_s: float | None = 30.0  # per measurement: slow ones time fewer steps (timing.fit_to_budget)
    baseline: str | None = None  # the variant the route table compares every decode row with


def parse_variant(
    spec: str, shape: dict[str, Any], explicit: dict[str, Any] | None = None
) -> tuple[str, ModelConfig]:
    """``name`` or ``name:key=value:key=value``; name is an attention (built at ``shape``) or a preset
    (its own shape; the ``explicit`` shape fields given on the command line still override)."""
    name, *pairs = spec.strip().split(":")
    overrides: dict[str, Any] = {}
    for pair in pairs:
        if "=" not in pair:
            raise BenchError(f"variant {spec!r}: expected key=value after ':', got {pair!r}")
        key, value = pair.split("=", 1)
        overrides[key.strip()] = load_yaml_or_json(f"v: {value}")["v"]
    if name in registry():
        cfg = ModelConfig(attention=name, **{**shape, **overrides})
    else:
        try:
            cfg = get_preset(name)
        except (ImportError, ModuleNotFoundError, KeyError, ConfigError) as e:
            known = ", ".join(sorted(registry()))
            raise BenchError(
                f"unknown variant {name!r}: not an attention ({known}) nor a preset ({e})"
            ) from e
        changes = {**(explicit or {}), **overrides}
        cfg = cfg.replace(**changes) if changes else cfg
    return spec.strip(), cfg


def _positive(values: list[int], what: str) -> list[int]:
    if not values or any(int(v) <= 0 for v in values):
        raise BenchError(f"--{what} needs positive integers, got {values!r}")
    return [int(v) for v in values]


def _listed(value: str | list[str]) -> list[str]:
    """A list of names, or a comma-separated string of them."""
    return value.split(",") if isinstance(value, str) else list(value)


def resolve_device(name: str) -> torch.device:
    """``auto`` -> cuda if available, else cpu; a CUDA device must exist."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise BenchError("--device cuda but CUDA is not available")
    return device


def make_plan(
    suite: str | None = None,
    options: dict[str, Any] | None = None,
    *,
    dtype: str = "float32",
    device: str = "auto",
    peers: bool = True,
    seed: int = 0,
    budget_s: float | None = 30.0,
) -> Plan:
    """The plan of ``suite`` (or the defaults) with ``options`` on top: keys of ``suites.OPTIONS`` (None =
    not given) and the shape fields of ``suites.SHAPE_FIELDS``, which override the suite's shape and a
    preset variant's own. Lists are lists here (``batch=[1, 8]``, ``variants=["mha", "mla:kv_lora_rank=64"]``)."""
    if suite is not None and suite not in SUITES:
        raise BenchError(f"unknown suite {suite!r}; known: {', '.join(sorted(SUITES))}")
    options = options or {}
    unknown = set(options) - set(OPTIONS) - set(SHAPE_FIELDS)
    if unknown:
        raise BenchError(f"unknown bench options: {', '.join(sorted(unknown))}")
    base = SUITES[suite] if suite else {}

    def get(key):  # explicit, else the suite, else the defaults
        value = options.get(key)
        return value if value is not None else base.get(key, DEFAULTS.get(key))

    shape = dict(base["shape"]) if suite else dict(DEFAULTS["shape"])
    explicit = {name: options[name] for name in SHAPE_FIELDS if options.get(name) is not None}
    shape.update(explicit)
    modes = [m.strip() for m in _listed(get("modes")) if m.strip()]
    for m in modes:
        if m not in MODES:
            raise BenchError(f"unknown mode {m!r}; known: {', '.join(MODES)}")
    variants = []
    for spec in _listed(get("variants")):
        if not spec.strip():
            continue
        label, cfg = parse_variant(spec, shape, explicit)
        variants.append(Variant(label, cfg, decode_modes(cfg, modes)))
    if not variants:
        raise BenchError("no variants to benchmark")
    for what in ("steps", "repeats"):
        if get(what) <= 0:
            raise BenchError(f"--{what} must be positive, got {get(what)}")
    if get("warmup") < 0:
        raise BenchError(f"--warmup must be >= 0, got {get('warmup')}")
    labels = [v.label for v in variants]
    baseline = options.get("baseline")
    if baseline is not None and baseline not in labels:
        raise BenchError(f"--baseline {baseline!r} is not one of the variants ({', '.join(labels)})")
    if baseline is None:  # the suite's, when it is run; else the first variant
        baseline = base.get("baseline") if base.get("baseline") in labels else labels[0]
    if dtype not in DTYPES:
        raise BenchError(f"unknown dtype {dtype!r}; known: {', '.join(sorted(DTYPES))}")
    return Plan(
        variants=variants,
        batch=_positive(get("batch"), "batch"),
        context=_positive(get("context"), "context"),
        prompt=_positive(get("prompt"), "prompt"),
        steps=get("steps"),
        warmup=get("warmup"),
        repeats=get("repeats"),
        dtype=DTYPES[dtype],
        device=resolve_device(device),
        peers=peers,
        bandwidth_mib=get("bandwidth_mib"),
        seed=seed,
        suite=suite,
        budget_s=budget_s or None,
        baseline=baseline,
    )
