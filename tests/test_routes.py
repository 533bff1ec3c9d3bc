"""Which decode route runs, and what it builds.

Outputs cannot tell the routes apart: absorbed, expand and naive give the same numbers (that is their contract),
so a mechanism whose absorbed route silently fell through to expand would pass every output test. Two proofs:

- ``Step.trace``: every attention layer appends ``(layer_idx, route)`` for the route it ran; a decode step in
  each mode of ``decode_routes(cfg)`` must report exactly that route in every layer.
- Allocations: a dispatch mode records every tensor the ops of one decode step allocate. The absorbed (MLA, GLA,
  MLRA, GTA) and factorised (TPA) routes must allocate nothing as large as the per-head keys or values of the
  cached tokens, (B, H, S, d_h) with H the key/value heads; the expand route must (or the check could not fail).
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import all_variants, decode_route, tiny_config
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten

from kvlm import build_model
from kvlm.attention import Step, get_attention_class

# Configurations with a real compression, so that per-head K/V are larger than anything the absorbed route needs:
# d_c = 32 < h d_h = 64 (the variants' default d_c = 4 d_h = h d_h would make the latent as large as K),
# GTA g < h value heads, TPA beta_kv = 2 < h.
COMPRESSED = [
    ("mla", {"kv_lora_rank": 32}),
    ("mla", {"kv_lora_rank": 32, "q_lora_rank": 16, "bias": True}),
    ("mla", {"kv_lora_rank": 8}),  # d_c < d_h: the folded weights
    ("mla", {"kv_lora_rank": 32, "rope": False}),
    ("mla", {"kv_latent": "separate", "kv_lora_rank": 16}),
    ("mla", {"kv_lora_rank": 32, "rope_kv_heads": 2}),
    ("mla", {"kv_lora_rank": 32, "gated": True, "q_lora_rank": 16}),
    ("gla-2", {"kv_lora_rank": 32}),
    ("gla-4", {"kv_lora_rank": 32, "q_lora_rank": 16}),
    ("mlra-2", {"kv_lora_rank": 32}),
    ("mlra-4", {"kv_lora_rank": 32}),
    ("mlra-4", {"kv_lora_rank": 32, "rope": False}),
    ("gta", {}),  # g = 1
    ("gta", {"n_kv_head": 2, "gated": True}),
    ("tpa", {}),
    ("tpa", {"tpa_q_rank": 3, "tpa_kv_rank": 1, "rope": False}),
]
COMPRESSED_IDS = [f"{a}[{','.join(f'{k}={v}' for k, v in o.items())}]" for a, o in COMPRESSED]

# Routes that build per-head keys and values from the cache (or read materialised ones)
MATERIALISING = {"expand", "naive", "materialised", "plain", "rebuild"}

BATCH = 2
# S, the cached length a decode step attends over, is a prime that divides no other size in these models (d = 64,
# d_h = 16, ffn 192, vocab 97, max_seq_len 64, ...), so a tensor whose size S divides scales with the cache
CACHED = 19


def _model(attention, overrides, dtype=torch.float32):
    torch.manual_seed(0)
    model = build_model(tiny_config(attention, **overrides)).to(dtype).eval()
    model.prepare_for_inference()
    return model


class AllocationRecorder(TorchDispatchMode):
    """Records (op, shape) of every tensor an op allocates: outputs that share no storage with the op's inputs
    (views, in-place updates and cache writes allocate nothing). A tensor subclass such as a tensor-parallel
    DTensor counts by the plain tensors it wraps (a rank's local shard)."""

    def __init__(self):
        super().__init__()
        self.allocated: list[tuple[str, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = {id_ for t in tree_flatten((args, kwargs))[0] for _, id_ in _plain(t)}
        for t in tree_flatten(out)[0]:
            for plain, id_ in _plain(t):
                if id_ not in inputs:
                    self.allocated.append((str(func), tuple(plain.shape)))
        return out


def _plain(t) -> list[tuple[torch.Tensor, int]]:
    """(plain tensor, its storage's address) for a tensor, or for each tensor a wrapper subclass holds."""
    if not isinstance(t, torch.Tensor):
        return []
    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        return [p for name in names for p in _plain(getattr(t, name))]
    return [(t, t.untyped_storage().data_ptr())]


def kv_heads(cfg) -> int:
    """H of the per-head keys/values a materialising route would build: the value heads for GTA (its expand
    route builds keys per value head), the query heads for the others."""
    return cfg.n_kv_head if cfg.attention == "gta" else cfg.n_head


def per_head_kv(allocated, cfg, batch: int, cached: int) -> list[tuple[str, tuple[int, ...]]]:
    """The allocations at least as large as per-head keys or values of the cache, (B, H, S, d_h), and scaling
    with S (their size is a multiple of the prime S: shapes such as (B S, H d_h) before a view count too)."""
    floor = batch * kv_heads(cfg) * cached * cfg.head_dim
    return [(op, s) for op, s in allocated if math.prod(s) >= floor and math.prod(s) % cached == 0]


def _prefill(model, mode, n_new):
    """A cache holding CACHED - n_new tokens, filled in `mode`; returns (cache, the next n_new tokens)."""
    cfg = model.cfg
    tokens = torch.randint(0, cfg.vocab_size, (BATCH, CACHED))
    cache = model.new_cache(BATCH, CACHED + 4, naive=(mode == "naive"))
    with torch.no_grad():
        model(tokens[:, : CACHED - n_new], cache=cache, mode=mode)
    return cache, tokens[:, CACHED - n_new :]


def _decode_allocations(model, mode, n_new, trace=None):
    """What one decode step of n_new tokens over CACHED cached ones allocates (and, into trace, its routes)."""
    cache, new = _prefill(model, mode, n_new)
    with torch.no_grad(), AllocationRecorder() as rec:
        model(new, cache=cache, mode=mode, trace=trace)
    assert cache.length == CACHED
    return rec.allocated


def _decode_routes(model, mode, n_new) -> list[tuple[int, str]]:
    """The (layer, route) pairs one decode step reports in ``Step.trace``."""
    cache, new = _prefill(model, mode, n_new)
    trace = []
    with torch.no_grad():
        model(new, cache=cache, mode=mode, trace=trace)
    return trace


# --- the route taken ---------------------------------------------------------------------------------


def _route_cases():
    return all_variants() + [pytest.param(a, o, id=i) for (a, o), i in zip(COMPRESSED, COMPRESSED_IDS)]


@pytest.mark.parametrize("attention,overrides", _route_cases())
def test_decode_step_runs_the_declared_route(attention, overrides):
    model = _model(attention, overrides, torch.float64)
    routes = type(model.layers[0].attn).decode_routes(model.cfg)
    assert "auto" in routes, routes
    for key, route in routes.items():
        with decode_route(model, key) as mode:
            for n_new in (1, 2):  # a decode step, a short speculative chunk
                want = [(i, route) for i in range(model.cfg.n_layer)]
                assert _decode_routes(model, mode, n_new) == want, (key, n_new)


def test_trace_is_off_by_default_and_covers_prefill():
    assert Step.build(torch.zeros(1, 3, dtype=torch.long)).trace is None
    model = _model("mla", {"kv_lora_rank": 32})
    cache = model.new_cache(1, 8)
    tokens = torch.zeros(1, 3, dtype=torch.long)
    with torch.no_grad():
        model(tokens, cache=cache)  # no trace: records nothing, raises nothing
        trace = []
        model(tokens, trace=trace)  # the training forward (no cache) reports its route too
    assert [i for i, _ in trace] == [0, 1] and all(isinstance(r, str) and r for _, r in trace)


def test_declared_routes_of_the_field():
    """The route tables of the mechanisms whose routes the brief names; the latent family, GTA and TPA decode
    (auto) on their absorbed / factorised route, which is not the expand route."""
    cfg = tiny_config("mla")
    assert get_attention_class("mla").decode_routes(cfg) == {
        "auto": "absorbed",
        "absorbed": "absorbed",
        "expand": "expand",
        "naive": "materialised",
    }
    for name in ("mha", "mqa", "gqa"):
        assert get_attention_class(name).decode_routes(tiny_config(name)) == {"auto": "plain"}
    assert get_attention_class("eg-mla").decode_routes(tiny_config("eg-mla")) == {
        "auto": "rebuild",
        "expand": "rebuild",
        "naive": "materialised",
        "table": "gate table",
    }
    for name, overrides in COMPRESSED:
        cfg = tiny_config(name, **overrides)
        routes = get_attention_class(name).decode_routes(cfg)
        assert routes["auto"] == routes["absorbed"], (name, routes)
        assert routes["auto"] not in MATERIALISING and routes["expand"] in MATERIALISING, (name, routes)


# --- what the route builds ---------------------------------------------------------------------------


@pytest.mark.parametrize("n_new", [1, 2], ids=["decode", "chunk2"])
@pytest.mark.parametrize("mode", ["auto", "absorbed"])
@pytest.mark.parametrize("attention,overrides", COMPRESSED, ids=COMPRESSED_IDS)
def test_absorbed_routes_never_materialise_per_head_kv(attention, overrides, mode, n_new):
    model = _model(attention, overrides)
    allocated = _decode_allocations(model, mode, n_new)
    assert allocated, "the recorder saw no allocation at all"
    big = per_head_kv(allocated, model.cfg, BATCH, CACHED)
    assert not big, f"{mode} decode built tensors as large as per-head K/V: {big[:4]}"


@pytest.mark.parametrize("attention,overrides", COMPRESSED, ids=COMPRESSED_IDS)
def test_expand_route_does_materialise_per_head_kv(attention, overrides):
    """The control: the same check finds the per-head K/V that the expand route builds."""
    model = _model(attention, overrides)
    allocated = _decode_allocations(model, "expand", 1)
    assert per_head_kv(allocated, model.cfg, BATCH, CACHED), "expand decode built no per-head K/V?"


@pytest.mark.parametrize("n_new", [1, 2], ids=["decode", "chunk2"])
@pytest.mark.parametrize(
    "attention,overrides", [("mqa", {}), ("gqa", {"n_kv_head": 2}), ("mfa", {"q_lora_rank": 32})]
)
def test_grouped_heads_read_shared_kv_in_place(attention, overrides, n_new):
    """MQA-style decoding: query heads that share a key/value head are folded into its query axis, so no
    per-query-head copy of the cached K/V, (B, h, S, d_h), is made (repeat_interleave would make one)."""
    model = _model(attention, overrides)
    allocated = _decode_allocations(model, "auto", n_new)
    floor = BATCH * model.cfg.n_head * CACHED * model.cfg.head_dim
    big = [(op, s) for op, s in allocated if math.prod(s) >= floor and math.prod(s) % CACHED == 0]
    assert not big, f"decode built per-query-head K/V: {big[:4]}"


def test_recorder_sees_views_as_free():
    rec = AllocationRecorder()
    x = torch.randn(4, 6)
    with rec:
        x.view(2, 12)
        x[:, :3]
        x.mul_(2)
        y = x @ x.T
    assert rec.allocated == [("aten.mm.default", (4, 4))]
    assert y.shape == (4, 4)


# --- the same under tensor parallelism ---------------------------------------------------------------

TP_WORLD = 2
TP_CASES = [(a, o) for a, o in COMPRESSED if a != "mla" or o == {"kv_lora_rank": 32}]


def _tp_routes_and_allocations(rank, world, cases):
    """One rank of a tensor-parallel model: the routes its layers report and the per-head K/V of its own
    heads (or latent blocks) that a decode step allocates, for each case and mode."""
    from kvlm.parallel.tensor_parallel import shard_model

    out = {}
    for attention, overrides in cases:
        model = shard_model(_model(attention, overrides), rank, world).prepare_for_inference()
        cfg = model.cfg
        routes = get_attention_class(attention).decode_routes(cfg)
        heads = max(1, kv_heads(cfg) // world)  # the K/V heads of one rank's shard
        for mode in ("auto", "absorbed", "expand"):
            trace = []
            allocated = _decode_allocations(model, mode, 1, trace)
            floor = BATCH * heads * CACHED * cfg.head_dim
            big = [s for _, s in allocated if math.prod(s) >= floor and math.prod(s) % CACHED == 0]
            out[(attention, str(overrides), mode)] = {
                "want": [(i, routes[mode]) for i in range(cfg.n_layer)],
                "got": trace,
                "big": big,
            }
    return out


@pytest.mark.distributed
def test_tensor_parallel_decode_keeps_the_absorbed_routes(tmp_path):
    from dist_scripts import workers

    results = workers.run(_tp_routes_and_allocations, TP_WORLD, str(tmp_path), TP_CASES)
    bad = []
    for rank, per_case in enumerate(results):
        for (attention, overrides, mode), r in per_case.items():
            where = f"rank {rank} {attention}{overrides} {mode}"
            if r["got"] != r["want"]:
                bad.append(f"{where}: ran {r['got']}, declared {r['want']}")
            if (mode == "expand") != bool(r["big"]):
                bad.append(f"{where}: per-head K/V allocations {r['big'][:3]}")
    assert len(results[0]) == 3 * len(TP_CASES)
    assert not bad, "\n".join(bad)
