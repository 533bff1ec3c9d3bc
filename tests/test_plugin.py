"""A mechanism defined here, outside the kvlm package, works with every verb without touching any kvlm file.

``ToyLatentAttention`` subclasses the public base ``kvlm.attention.Attention`` and registers under a new name:
each token is compressed into one latent c = x W^D of d_c = kv_lora_rank elements, the only thing cached;
per-head keys and values are c W^UK, c W^UV (MLA without decoupled RoPE, no absorption). Everything kvlm
needs to know about it (cache, defaults, validation, routes, FLOPs, tensor-parallel split) it declares itself.
"""

import json
import math

import pytest
import torch

import kvlm.reference
from kvlm import ConfigError, ModelConfig, build_model
from kvlm.accounting import kv_table
from kvlm.attention import Attention, Step, attend, get_attention_class, register, registry
from kvlm.attention.base import Linear, require
from kvlm.cli import main as kvlm_main
from kvlm.reference import reference_attention
from kvlm.reference.common import causal_attention, linear, output

NAME = "toy-latent"


class ToyLatentAttention(Attention):
    name = NAME

    def __init__(self, cfg, layer_idx):
        super().__init__(cfg, layer_idx)
        h, dh, dc = cfg.n_head, cfg.head_dim, cfg.kv_lora_rank
        self.wq = Linear(cfg.d_model, h * dh, bias=cfg.bias)
        self.w_down = Linear(cfg.d_model, dc, bias=cfg.bias)  # W^D: the cached latent
        self.w_up = Linear(dc, 2 * h * dh, bias=cfg.bias)  # [W^UK; W^UV]
        self.make_output(h * dh)

    @classmethod
    def config_defaults(cls, cfg):
        if cfg.kv_lora_rank is None:
            cfg.kv_lora_rank = cfg.d_model // 4

    @classmethod
    def check_config(cls, cfg):
        require(not cfg.rope, f"{NAME} rebuilds keys from the latent and has no positions: set rope=False")

    @classmethod
    def spec_for(cls, cfg, layer_idx=0, naive=False):
        return {"c": (cfg.kv_lora_rank,)}

    @classmethod
    def tp_shards(cls, cfg):
        return {"c": "replicated"}

    @classmethod
    def tp_max_degree(cls, cfg):
        return 1

    @classmethod
    def decode_routes(cls, cfg):
        return {"auto": "expand"}

    @classmethod
    def decode_flops(cls, cfg, layer_idx=0):
        h, dh, dc = cfg.n_head, cfg.head_dim, cfg.kv_lora_rank
        return 2.0 * dc * 2 * h * dh + 4.0 * h * dh  # up-project the cached latent, then attend

    def forward(self, x, step, cache=None):
        B, T, _ = x.shape
        h, dh = self.cfg.n_head, self.cfg.head_dim
        q = self.wq(x).view(B, T, h, dh).transpose(1, 2)
        c = self.w_down(x)  # (B, T, d_c)
        if cache is not None:
            c = self.write(cache, "c", c, step)  # (B, S, d_c): every cached latent
        S = c.shape[1]
        k, v = self.w_up(c).view(B, S, h, 2 * dh).transpose(1, 2).split(dh, dim=-1)
        self.record_route(step, "expand")
        return self.output(attend(q, k, v, step, 1.0 / math.sqrt(dh)), x)

    def tp_plan(self, rank, world):
        """By query head, on torch's styles: W_Q and [W^UK; W^UV] column-parallel (head i's rows are contiguous),
        the output gate column-, W_O row-parallel; the latent (W^D) on every rank."""
        from torch.distributed.tensor.parallel import ColwiseParallel

        q = self.tp_heads(self.cfg.n_head, rank, world)
        return {
            "config": {"n_head": len(q)},
            "parallelize": {"wq": ColwiseParallel(), "w_up": ColwiseParallel(), **self.tp_output_styles()},
            "holds": {"query_heads": q, "latent": "replicated"},
        }


def toy_latent_reference(m, x, positions):
    cfg = m.cfg
    B, T, _ = x.shape
    h, dh = cfg.n_head, cfg.head_dim
    q = linear(m.wq, x, bias=cfg.bias).view(B, T, h, dh)
    kv = linear(m.w_up, linear(m.w_down, x, bias=cfg.bias), bias=cfg.bias).view(B, T, h, 2 * dh)
    return output(m, causal_attention(q, kv[..., :dh], kv[..., dh:], 1 / math.sqrt(dh)), x)


@pytest.fixture(autouse=True, scope="module")
def _registered():
    """Registered as a plugin would be (``register(name)(cls)``, usually as a decorator), for this module only:
    other test modules iterate the registry and should not meet the toy."""
    register(NAME)(ToyLatentAttention)
    kvlm.reference.register(NAME)(toy_latent_reference)
    yield
    del registry()[NAME]
    del kvlm.reference.references()[NAME]


def _config(**overrides):
    base = dict(attention=NAME, n_layer=2, d_model=64, n_head=4, vocab_size=97, max_seq_len=64, rope=False)
    return ModelConfig(**{**base, **overrides})


def test_registered_with_declared_defaults_and_validation():
    assert get_attention_class(NAME) is ToyLatentAttention
    cfg = _config()
    assert cfg.kv_lora_rank == 16 and cfg.cache_spec() == {"c": (16,)}
    assert cfg.kv_cache_elements_per_token() == 2 * 16
    with pytest.raises(ConfigError, match="set rope=False"):
        _config(rope=True)
    with pytest.raises(ConfigError, match="rope_kv_heads"):
        _config(rope_kv_heads=2)  # not declared supports_rope_kv_heads


def test_kv_table(tmp_path, capsys):
    cfg = _config(kv_lora_rank=24)
    row = kv_table([cfg], tp=(1, 2))[0]
    assert row["attention"] == NAME and row["kv_elements_per_token"] == 2 * 24
    assert row["kv_reduction_vs_mha"] == pytest.approx(1 - 24 / (2 * 4 * 16))  # vs a same-shape MHA
    flops = 2 * 24 * 2 * 4 * 16 + 4 * 4 * 16
    assert row["decode_flops_per_cached_token"] == flops
    assert row["arithmetic_intensity"][1] == pytest.approx(flops / (24 * 2))
    assert row["per_device"][2]["elements_per_token"] == 2 * 24  # replicated: every device reads the latent
    assert row["params"]["total"] == sum(p.numel() for p in build_model(cfg).parameters())
    path = tmp_path / "toy.json"
    cfg.save(path)
    assert kvlm_main(["kv-table", "--config", str(path), "--tp", "1", "--json"]) == 0
    out = capsys.readouterr().out
    assert NAME in out
    assert json.loads(out.strip().splitlines()[-1])["rows"][0]["kv_elements_per_token"] == 48


def test_model_reference_and_cached_decode_float64():
    torch.manual_seed(0)
    model = build_model(_config(gated=True, bias=True)).double().eval()
    attn = model.layers[1].attn
    x = torch.randn(2, 9, 64, dtype=torch.float64)
    positions = torch.arange(9).expand(2, 9)
    step = Step.build(torch.zeros(2, 9, dtype=torch.long))
    assert (attn(x, step) - reference_attention(attn, x, positions)).abs().max().item() < 1e-12
    tokens = torch.randint(0, 97, (2, 12))
    full = model(tokens)
    cache = model.new_cache(2, 12)
    assert cache.nbytes == 2 * 12 * 2 * 16 * 8
    trace = []
    parts = [model(tokens[:, :5], cache=cache, trace=trace)]
    parts += [model(tokens[:, t : t + 1], cache=cache, trace=trace) for t in range(5, 12)]
    assert (torch.cat(parts, 1) - full).abs().max().item() < 1e-12
    assert set(trace) == {(0, "expand"), (1, "expand")} and len(trace) == 2 * 8
    assert model.prepare_for_inference() is model  # the base class's no-op hook


def test_bench_toy_shape():
    from kvlm.bench import make_plan, run

    plan = make_plan(
        "toy",
        {"variants": [f"{NAME}:rope=false"], "batch": [1], "context": [16], "prompt": [8], "steps": 2},
        device="cpu",
        peers=False,
        budget_s=5.0,
    )
    result = run(plan)
    decode = [r for r in result["decode"] if r["variant"].startswith(NAME)]
    assert decode and all(r["median_ms"] > 0 for r in decode)
    cost = ToyLatentAttention.decode_cost(plan.variants[0].cfg, 1, 16)
    assert cost["cache_elements"] == 16 * plan.variants[0].cfg.kv_lora_rank


def _tp_decode(rank, world):
    """One rank of the toy under tensor parallelism: cached decode against the single-process forward."""
    from dist_scripts import workers

    from kvlm.parallel import shard_model, tp_plan

    model = workers._model(_config(gated=True, bias=True))  # float64, random biases and norms
    tp = shard_model(model, rank, world)
    tokens = torch.randint(0, 97, (2, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(tokens)
        cache = tp.new_cache(2, 10)
        parts = [tp(tokens[:, :4], cache=cache)]
        parts += [tp(tokens[:, t : t + 1], cache=cache) for t in range(4, 10)]
    return {
        "err": (torch.cat(parts, 1) - full).abs().max().item(),
        "cache_elements": cache.elements_per_token,
        "holds": tp_plan(tp)[0],
    }


@pytest.mark.distributed
def test_tensor_parallel_decode(tmp_path):
    """The toy's own tp_plan (torch's ColwiseParallel / RowwiseParallel) drives two ranks: equal to one process,
    each rank caching the whole latent and computing half of the heads."""
    from dist_scripts import workers

    results = workers.run(_tp_decode, 2, str(tmp_path))
    assert all(r["err"] < 1e-12 for r in results), [r["err"] for r in results]
    assert all(r["cache_elements"] == 2 * 16 for r in results)  # replicated latent, 2 layers
    assert [r["holds"]["query_heads"] for r in results] == [[0, 1], [2, 3]]
