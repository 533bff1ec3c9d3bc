"""A decode step under torch.compile (issue 15, "a static decode step, optionally torch.compile'd"): the CPU kernels
enter the graph as the custom operator ``kvlm::decode_attention`` (kvlm.kernels.library) instead of breaking it,
the products on packed weights as ``kvlm::packed_linear`` (which finds the packed copies when it runs), and the
compiled step equals the eager one over growing cache lengths."""

import pytest
import torch
from conftest import require_kernels, tiny_config

from kvlm import build_model, generate, kernels
from kvlm.attention.linear import packing_available

CASES = [
    ("mha", {}, "gqa_cpu"),
    ("gqa", dict(n_kv_head=2), "gqa_cpu"),
    ("mla", dict(kv_lora_rank=48, rope_head_dim=8), "latent_cpu"),
    ("mlra-2", dict(kv_lora_rank=48, rope_head_dim=8), "latent_block_cpu"),
]


def _model_and_cache(attention, extra, batch=2, cached=5, pad=None):
    torch.manual_seed(0)
    cfg = tiny_config(attention, max_seq_len=32, **extra)
    model = build_model(cfg).eval()
    cache = model.new_cache(batch, 24)
    if pad is not None:
        cache.set_left_padding(pad)
    cache.fill_random_(cached, cfg.vocab_size)
    tok = torch.randint(0, cfg.vocab_size, (batch, 1))
    return model, cache, tok


def _ops_in_graphs(fn, *args) -> set:
    """The call targets of every graph torch.compile captures running fn(*args) (no code generation)."""
    targets = set()

    def backend(gm, example_inputs):
        targets.update(n.target for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=backend)(*args)
    return targets


@pytest.mark.parametrize("attention,extra,counter", CASES)
def test_the_kernel_is_one_operator_of_the_graph(attention, extra, counter):
    require_kernels()
    model, cache, tok = _model_and_cache(attention, extra)
    mode = "absorbed" if attention in ("mla", "mlra-2") else "auto"
    with torch.inference_mode():
        before = kernels.CALLS[counter]
        targets = _ops_in_graphs(lambda t: model(t, cache=cache, mode=mode), tok)
    assert torch.ops.kvlm.decode_attention.default in targets
    assert (
        kernels.CALLS[counter] - before == model.cfg.n_layer
    )  # counted by the operator itself, once per layer


def test_the_eager_step_does_not_go_through_the_dispatcher(monkeypatch):
    """Eagerly the extension is called directly (the operator is for the compiler only)."""
    require_kernels()
    from kvlm.kernels import library

    model, cache, tok = _model_and_cache("mha", {})
    calls = []
    monkeypatch.setattr(library, "decode_attention", lambda *a, **k: calls.append(1))
    with torch.inference_mode():
        model(tok, cache=cache)
    assert not calls


@pytest.mark.parametrize("pad", [None, [3, 0]], ids=["unpadded", "left-padded"])
@pytest.mark.parametrize("attention,extra,counter", [CASES[0], CASES[2]])
def test_compiled_decode_equals_eager_as_the_cache_grows(attention, extra, counter, pad):
    require_kernels()
    model, cache, tok = _model_and_cache(attention, extra, pad=pad)
    model.pack_for_decode(2)  # packed weights: the compiled step runs them through kvlm::packed_linear
    mode = "absorbed" if attention == "mla" else "auto"
    torch._dynamo.reset()
    step = torch.compile(lambda t: model(t, cache=cache, mode=mode))
    with torch.inference_mode():
        for length in (5, 6, 9, 12):  # new lengths: the first compiles, the next with a dynamic length
            cache.length = length
            flops = kernels.FLOPS["attention"]
            eager = model(tok, cache=cache, mode=mode)
            eager_flops = kernels.FLOPS["attention"] - flops
            cache.length = length
            before, flops = kernels.CALLS[counter], kernels.FLOPS["attention"]
            compiled = step(tok)
            assert kernels.CALLS[counter] - before == model.cfg.n_layer
            assert kernels.FLOPS["attention"] - flops == eager_flops > 0  # counted in the operator, traced
            torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("attention,extra,counter", [CASES[0], CASES[2]])
def test_the_growing_cache_compiles_twice_not_every_step(attention, extra, counter):
    """The first step compiles for its cache length, the second for any length; later steps, each a token
    longer, reuse that graph. (A cache length specialised on would recompile every step, until torch's
    recompile limit sent the step back to eager.)"""
    require_kernels()
    from torch._dynamo.utils import counters

    model, cache, tok = _model_and_cache(attention, extra)
    mode = "absorbed" if attention == "mla" else "auto"
    torch._dynamo.reset()
    counters.clear()
    step = torch.compile(lambda t: model(t, cache=cache, mode=mode))
    graphs = []
    with torch.inference_mode():
        for _ in range(8):
            step(tok)
            graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[2:] == [graphs[1]] * 6, graphs


@pytest.mark.parametrize("attention,extra,counter", [CASES[0], CASES[2]])
def test_the_step_is_one_graph(attention, extra, counter):
    """The whole step traces into one graph, unbroken: traced, the cache reads nothing back to the host (once the
    extension is loaded: a first eager call here)."""
    require_kernels()
    model, cache, tok = _model_and_cache(attention, extra)
    mode = "absorbed" if attention == "mla" else "auto"
    torch._dynamo.reset()
    with torch.inference_mode():
        model(tok, cache=cache, mode=mode)
        cache.length = 5
        explained = torch._dynamo.explain(lambda t: model(t, cache=cache, mode=mode))(tok)
    assert explained.graph_break_count == 0, [str(b.reason)[:200] for b in explained.break_reasons]
    assert explained.graph_count == 1


def _count_packed_products(monkeypatch) -> list:
    from kvlm.attention import linear

    calls, real = [], linear._packed_product
    monkeypatch.setattr(linear, "_packed_product", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


@pytest.mark.parametrize("attention,extra", [("mha", {}), ("mla", dict(kv_lora_rank=48, rope_head_dim=8))])
@pytest.mark.usefixtures("no_few_rows")
def test_the_compiled_step_keeps_the_packed_products(attention, extra, monkeypatch):
    """Every product the eager step runs on packed weights, the compiled one runs there too (through the operator
    in its graph), with the same logits."""
    if not packing_available(4):
        pytest.skip("this torch build has no MKL packed GEMM")
    model, cache, tok = _model_and_cache(attention, extra, batch=4)
    assert model.pack_for_decode(4) > 0
    calls = _count_packed_products(monkeypatch)
    torch._dynamo.reset()
    step = torch.compile(lambda t: model(t, cache=cache))
    with torch.inference_mode():
        for length in (5, 6, 9):
            cache.length = length
            del calls[:]
            eager = model(tok, cache=cache)
            n_eager = len(calls)
            cache.length = length
            del calls[:]
            compiled = step(tok)
            assert n_eager > 0 and len(calls) == n_eager
            torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)
        targets = _ops_in_graphs(lambda t: model(t, cache=cache), tok)
    assert torch.ops.kvlm.packed_linear.default in targets


@pytest.mark.usefixtures("no_few_rows")
def test_a_weight_written_after_packing_is_read_by_the_compiled_step_too():
    """The packed copy goes stale when its weight is written: the operator then takes the plain product (else the
    compiled step would decode with the old weights)."""
    if not packing_available(4):
        pytest.skip("this torch build has no MKL packed GEMM")
    model, cache, tok = _model_and_cache("gqa", dict(n_kv_head=2), batch=4)
    model.pack_for_decode(4)
    torch._dynamo.reset()
    step = torch.compile(lambda t: model(t, cache=cache))
    with torch.no_grad():
        cache.length = 5
        step(tok)  # compiled against the packed weights
        model.lm_head.weight.mul_(-2)
        model.layers[0].mlp.w1.weight.add_(0.5)
        cache.length = 5
        eager = model(tok, cache=cache)
        cache.length = 5
        torch.testing.assert_close(step(tok), eager, rtol=1e-5, atol=1e-5)


def test_generate_compiled_gives_the_eager_tokens_and_times_compiling_apart():
    """generate(compile=True): the same greedy tokens as eager decoding (left padding, packed weights at batch 4);
    the steps that compiled are timed as compile_s, not as decode."""
    require_kernels()
    torch.manual_seed(0)
    cfg = tiny_config("mla", kv_lora_rank=48, rope_head_dim=8, max_seq_len=64)
    model = build_model(cfg).eval()
    prompts = [torch.randint(0, cfg.vocab_size, (n,)).tolist() for n in (5, 3, 7, 4)]
    torch._dynamo.reset()
    eager, eager_stats = generate(model, prompts, 20, return_stats=True, pack_weights=True)
    compiled, stats = generate(model, prompts, 20, return_stats=True, pack_weights=True, compile=True)
    assert compiled == eager
    assert eager_stats["compile_s"] == 0 and stats["compile_s"] > 0
    assert stats["decode_tokens"] == 4 * (19 - 2) and eager_stats["decode_tokens"] == 4 * 19  # two steps compiled
    again, stats = generate(model, prompts, 20, return_stats=True, pack_weights=True, compile=True)
    assert again == eager and stats["compile_s"] == 0  # compiled once for this model class and batch


def test_generate_compiled_names_a_compiler_failure(monkeypatch):
    from kvlm.inference import generation

    def no_compiler(gm, example_inputs):
        raise RuntimeError("no C++ compiler")

    model = build_model(tiny_config("mha"))
    torch._dynamo.reset()
    monkeypatch.setitem(generation._COMPILED, type(model), torch.compile(type(model).forward, backend=no_compiler))
    with pytest.raises(RuntimeError, match="compile=True.*Generate without compile"):
        generate(model, [1, 2, 3], 4, compile=True)


@pytest.mark.parametrize(
    "attention,extra,mode",
    [("gqa", dict(n_kv_head=2), "auto"), ("mla", dict(kv_lora_rank=48, rope_head_dim=8), "absorbed")],
)
def test_compiled_plain_path_equals_eager_with_left_padding(attention, extra, mode, monkeypatch):
    """Without the kernels (the plain PyTorch path, as on a GPU without Triton), the traced step masks the left
    padding it can no longer read back, and equals the eager step."""
    monkeypatch.setenv("KVLM_KERNELS", "0")
    model, cache, tok = _model_and_cache(attention, extra, pad=[3, 0])
    torch._dynamo.reset()
    step = torch.compile(lambda t: model(t, cache=cache, mode=mode))
    with torch.inference_mode():
        for length in (5, 6, 9):
            cache.length = length
            eager = model(tok, cache=cache, mode=mode)
            cache.length = length
            torch.testing.assert_close(step(tok), eager, rtol=1e-5, atol=1e-5)
