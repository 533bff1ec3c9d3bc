"""EG-MLA beyond the generic contract: EG-MLA-A (precomputed gate table) equals the rebuild route, layer-group
sharing shares parameters and activations, the paper's embedding-parameter count, no absorbed route."""

import math

import pytest
import torch
from conftest import tiny_config

from kvlm import ConfigError, build_model, count_parameters
from kvlm.attention import Step
from kvlm.attention.eg_mla import EGMLA, precompute_gate_tables
from kvlm.cache import CacheError, ContiguousLayer


def _model(dtype=torch.float64, **overrides):
    torch.manual_seed(0)
    model = build_model(tiny_config("eg-mla", **overrides)).to(dtype).eval()
    with torch.no_grad():  # non-trivial norms (ln_emb included) and biases
        for name, p in model.named_parameters():
            if "norm" in name or "ln_emb" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    return model


def _decode(model, tokens, mode, prefill=5):
    cache = model.new_cache(tokens.shape[0], tokens.shape[1], naive=(mode == "naive"))
    out = [model(tokens[:, :prefill], cache=cache, mode=mode)]
    out += [model(tokens[:, t : t + 1], cache=cache, mode=mode) for t in range(prefill, tokens.shape[1])]
    return torch.cat(out, 1)


@pytest.mark.parametrize(
    "overrides", [{}, {"eg_group_size": 2, "n_layer": 4}, {"eg_op": "add", "eg_norm": False}]
)
def test_gate_table_route_equals_rebuild_and_full(overrides):
    model = _model(**overrides)
    tokens = torch.randint(0, model.cfg.vocab_size, (2, 10))
    with torch.no_grad():
        full = model(tokens)
        rebuild = _decode(model, tokens, "auto")
        nbytes = precompute_gate_tables(model)
        table = _decode(model, tokens, "auto")
        naive = _decode(model, tokens, "naive")
    cfg = model.cfg
    groups = math.ceil(cfg.n_layer / cfg.eg_group_size)
    assert nbytes == groups * cfg.vocab_size * cfg.n_head * 2 * cfg.head_dim * 8  # float64 tables
    assert model.layers[0].attn.gate_table_nbytes == nbytes // groups
    for out in (rebuild, table, naive):
        assert (out - full).abs().max() < 1e-10


def test_gate_table_is_used_and_refreshed():
    """The table is built once and looked up; prepare_for_inference rebuilds it from changed weights; the trace
    names the route ("gate table" against "rebuild")."""
    model = _model()
    attn = model.layers[0].attn
    calls = []
    attn.emb_gate.w_ue.register_forward_hook(lambda m, i, o: calls.append(i[0].shape[0]))
    tokens = torch.randint(0, model.cfg.vocab_size, (1, 8))
    with torch.no_grad():
        attn.precompute_gate_table()
        assert calls == [model.cfg.vocab_size]  # one pass over the whole vocabulary
        trace = []
        cache = model.new_cache(1, 8)
        model(tokens, cache=cache, trace=trace)
        assert calls == [model.cfg.vocab_size]  # decode only looks up
        assert trace[0] == (0, "gate table") and trace[1] == (1, "rebuild")  # layer 1's table is off
        attn.emb_gate.kv_emb.weight.mul_(2.0)  # the weights change: the table is rebuilt on request
        model.prepare_for_inference()
        assert len(calls) == 2
        out = _decode(model, tokens, "auto")
        assert len(calls) == 2
        assert (out - model(tokens)).abs().max() < 1e-10
        assert attn.precompute_gate_table(False) == 0 and attn.gate_table_nbytes == 0
        model.prepare_for_inference()  # a disabled table stays off
        assert len(calls) == 2 and attn.gate_table_nbytes == 0


def test_table_not_used_while_training():
    model = _model(torch.float32).train()
    precompute_gate_tables(model)
    tokens = torch.randint(0, model.cfg.vocab_size, (2, 6))
    torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
    assert model.layers[0].attn.emb_gate.kv_emb.weight.grad.abs().sum() > 0


def test_layer_groups_share_gate_parameters_and_activations():
    model = _model(n_layer=4, eg_group_size=2)
    attns = [b.attn for b in model.layers]
    assert attns[0].emb_gate is attns[1].emb_gate and attns[2].emb_gate is attns[3].emb_gate
    assert attns[1].emb_gate is not attns[2].emb_gate
    assert attns[0].wkv_b is not attns[1].wkv_b  # only the gate branch is shared
    calls = []
    for a in (attns[0], attns[2]):
        a.emb_gate.w_ue.register_forward_hook(lambda m, i, o: calls.append(1))
    tokens = torch.randint(0, model.cfg.vocab_size, (2, 7))
    with torch.no_grad():
        model(tokens)
    assert len(calls) == 2  # once per group, not once per layer
    assert model.layers[1].attn.emb_gate.w_ue.weight is model.layers[0].attn.emb_gate.w_ue.weight


@pytest.mark.parametrize("lgz,n_layer", [(1, 4), (2, 4), (3, 4), (4, 4)])
def test_gate_embedding_parameters_as_the_paper_counts(lgz, n_layer):
    """Table 10: embed params = n_layer x vocab x kv_emb_dim (12 x 50257 x 256 = 154M); lgz layers share."""
    cfg = tiny_config("eg-mla", n_layer=n_layer, eg_group_size=lgz, kv_emb_dim=24)
    counts = count_parameters(cfg)
    groups = math.ceil(n_layer / lgz)
    assert counts["gate_embedding"] == groups * cfg.vocab_size * 24
    assert counts["activated"] == counts["total"] - counts["gate_embedding"]
    mla = count_parameters(cfg.replace(attention="mla"))
    width = cfg.n_head * 2 * cfg.head_dim
    # vs MLA: + tables and W^UE per group, + LayerNorm (weight, bias) per layer; W^UKV has W^UK + W^UV's size
    assert counts["total"] - mla["total"] == groups * (cfg.vocab_size * 24 + 24 * width) + n_layer * 2 * width


def test_paper_base_model_embedding_size():
    """eg-mla.md Table 10's EG-MLA-Base: 12 layers, GPT-2 vocabulary, kv_emb_dim 256 -> 154M embed params."""
    cfg = tiny_config(
        "eg-mla",
        n_layer=12,
        d_model=768,
        n_head=12,
        vocab_size=50257,
        kv_emb_dim=256,
        arch="gpt2",
        kv_lora_rank=64,
        rope_head_dim=64,
        max_seq_len=1024,
    )
    assert round(count_parameters(cfg)["gate_embedding"] / 1e6) == 154
    assert cfg.kv_cache_elements_per_token() == 12 * (64 + 64)  # Table 10's 1.54K elements per token


def test_cache_is_mla_latent_and_token_ids():
    model = _model(torch.float32)
    cfg = model.cfg
    assert (
        cfg.cache_spec() == tiny_config("mla").cache_spec() == {"c_kv": (cfg.kv_lora_rank,), "k_rope": (8,)}
    )
    cache = model.new_cache(2, 8)
    tokens = torch.randint(0, cfg.vocab_size, (2, 5))
    model(tokens, cache=cache)
    assert torch.equal(cache.token_ids[:, :5], tokens)
    assert cache.nbytes == 2 * 8 * cfg.n_layer * (cfg.kv_lora_rank + cfg.rope_head_dim) * 4


def test_absorbed_mode_runs_rebuild_with_a_warning():
    model = _model()
    assert not EGMLA.supports_absorption
    with pytest.raises(NotImplementedError, match="LayerNorm"):
        model.layers[0].attn.forward_absorbed(None, None, None, None)
    tokens = torch.randint(0, model.cfg.vocab_size, (1, 8))
    EGMLA._warned_absorbed = False
    trace = []
    with pytest.warns(UserWarning, match="no absorbed route"):
        cache = model.new_cache(1, 8)
        absorbed = torch.cat(
            [model(tokens[:, :5], cache=cache, mode="absorbed", trace=trace)]
            + [model(tokens[:, t : t + 1], cache=cache, mode="absorbed", trace=trace) for t in range(5, 8)],
            1,
        )
    assert {r for _, r in trace} == {"rebuild"}
    assert (absorbed - model(tokens)).abs().max() < 1e-10


def test_missing_token_ids_are_a_clear_error():
    model = _model()
    attn = model.layers[0].attn
    x = torch.randn(1, 3, model.cfg.d_model, dtype=torch.float64)
    step = Step.build(torch.zeros(1, 3, dtype=torch.long))
    step.token_ids = None
    with pytest.raises(ValueError, match="token_ids"):
        attn(x, step)
    cache = ContiguousLayer(attn.cache_spec(), 1, 4, torch.float64, naive=False)  # without token ids
    with pytest.raises(CacheError, match="token ids"):
        attn(x, Step.build(torch.zeros(1, 3, dtype=torch.long)), cache)


@pytest.mark.parametrize(
    "overrides,match",
    [
        ({"kv_latent": "separate"}, "joint"),
        ({"eg_group_size": 0}, "eg_group_size"),
        ({"eg_group_size": 3}, "eg_group_size"),  # n_layer = 2
        ({"kv_emb_dim": 0}, "kv_emb_dim"),
        ({"kv_lora_rank": 100}, "larger than its input"),
    ],
)
def test_config_errors(overrides, match):
    with pytest.raises(ConfigError, match=match):
        tiny_config("eg-mla", **overrides)
