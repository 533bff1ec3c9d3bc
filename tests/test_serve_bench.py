"""The serving load generator (kvlm.bench.serve, `kvlm bench-serve`) against a real in-process server.

The numbers it reports are checked for what they must be whatever the machine's speed: every request answered
in full (tokens = requests x output length), latencies present and ordered (p50 <= p99), the capacity equal to
the engine's own page accounting, and a demonstration that admits that many sequences at once without
preemption. Speeds themselves are not asserted (benchmarks/serve.md has them).
"""

from __future__ import annotations

import json
import math

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("httpx")

from conftest import tiny_config  # noqa: E402

from kvlm import build_model  # noqa: E402
from kvlm.bench import serve as sb  # noqa: E402
from kvlm.serve.launch import Served, ServerThread, build_server, byte_tokenizer  # noqa: E402

CTX = 64
PAGE = 4
# the capacity demonstration's context: long enough (128 generated tokens each) that the first sequences are still
# running when the last of the 10 requests arrives, even with the machine busy (at 64 one run saw 8 together)
LONG = 256


@pytest.fixture(scope="module")
def server():
    torch.manual_seed(0)
    model = build_model(tiny_config("gqa", n_kv_head=2, vocab_size=257, max_seq_len=LONG)).eval()
    served = Served(model, byte_tokenizer(), "tiny-gqa")
    # 10 sequences of 256 tokens: 64 pages each (the 256th token is never cached: ceil(255 / 4) = 64)
    app, engine = build_server(served, max_batch=32, max_waiting=64, page_size=PAGE, cache_tokens=10 * LONG)
    with ServerThread(app) as srv:
        srv.engine, srv.model = engine, model
        yield srv


def test_run_load_counts_every_token(server):
    r = sb.run_load(server.url, 4, prompt_len=10, output_len=6, rounds=2, seed=0)
    assert r["requests"] == 8 and r["generated_tokens"] == 8 * 6
    assert r["tokens_per_s"] == pytest.approx(r["generated_tokens"] / r["wall_s"])
    assert 0 < r["ttft_p50_ms"] <= r["ttft_p99_ms"]
    assert 0 < r["itl_p50_ms"] <= r["itl_p99_ms"]
    assert r["preemptions"] == 0 and r["concurrency"] == 4


def test_capacity_is_the_engines_accounting_and_is_admitted(server):
    stats = server.engine.stats()
    r = sb.capacity(server.url, LONG, demonstrate=True, poll_s=0.02)
    per_seq = math.ceil((LONG - 1) / PAGE)
    assert r["sequences"] == stats["pages_total"] // per_seq == 10
    assert r["bytes_per_token"] == stats["bytes_per_token"]
    # bytes per token from the mechanism's cache_spec: GQA caches k and v of n_kv_head heads in every layer
    cfg = server.model.cfg
    assert stats["bytes_per_token"] == cfg.n_layer * 2 * cfg.n_kv_head * cfg.head_dim * 4
    assert r["admitted_together"] == 10 and r["preemptions"] == 0
    assert r["peak_pages_used"] <= r["pages_needed"] == 10 * per_seq


def test_markdown_has_every_row():
    result = {
        "load": [
            {"variant": "mla", "engine": "kvlm (auto)", "concurrency": 8, "tokens_per_s": 123.4, "requests_per_s": 1.5,
             "ttft_p50_ms": 10.0, "ttft_p99_ms": 20.0, "itl_p50_ms": 1.0, "itl_p99_ms": 2.0, "preemptions": 0},
            {"variant": "mla", "engine": "transformers", "concurrency": 8, "error": "RuntimeError: no"},
        ],
        "capacity": [{"variant": "mla", "kv_dtype": "int8", "context": 4096, "bytes_per_token": 100.0,
                      "pool_tokens": 8192, "sequences": 2}],
    }  # fmt: skip
    text = sb.markdown(result)
    assert "| mla | kvlm (auto) | 8 | 123.4 | 1.50 | 10.0 / 20.0 | 1.0 / 2.0 | 0 |" in text
    assert "RuntimeError: no" in text
    assert "| mla | int8 | 100 | 8192 | 2 | - | - | - |" in text


def test_cli_against_a_running_server(server, tmp_path, capsys):
    from kvlm.cli import main

    out = tmp_path / "serve.json"
    rc = main(["bench-serve", "--url", server.url, "--concurrency", "1,3", "--prompt-len", "8", "--output-len", "4",
               "--rounds", "1", "--capacity-context", "32", "--out", str(out), "--markdown", str(tmp_path / "t.md")])  # fmt: skip
    assert rc == 0
    result = json.loads(out.read_text())
    assert [r["concurrency"] for r in result["load"]] == [1, 3]
    assert [r["generated_tokens"] for r in result["load"]] == [4, 12]
    assert result["capacity"][0]["sequences"] == server.engine.stats()["pages_total"] // math.ceil(31 / PAGE)
    assert "tiny-gqa" in (tmp_path / "t.md").read_text()


def test_cli_in_process_rows(tmp_path):
    """`--in-process --no-http --no-peers`: kvlm's engine in-process only, one row per C, every request whole."""
    from kvlm.cli import main

    out = tmp_path / "serve.json"
    rc = main(["bench-serve", "--variants", "mla", "--set", "n_layer=1", "--set", "d_model=64", "--set", "n_head=4",
               "--set", "vocab_size=257", "--concurrency", "1,3", "--prompt-len", "6", "--output-len", "3",
               "--rounds", "2", "--cache-bytes", "4MiB", "--no-capacity", "--device", "cpu", "--threads", "1",
               "--in-process", "--no-http", "--no-peers", "--out", str(out)])  # fmt: skip
    assert rc == 0
    rows = json.loads(out.read_text())["load"]
    assert [(r["engine"], r["concurrency"]) for r in rows] == [
        ("kvlm (auto), in-process", 1),
        ("kvlm (auto), in-process", 3),
    ]
    assert [r["per_request_tokens"] for r in rows] == [[3] * 2, [3] * 6]


def test_spec_of_an_attention_is_the_bench_shape():
    from kvlm.cli.bench_serve import _spec

    assert _spec("mla", {"n_layer": 2}, 4096) == "bench/mla:max_seq_len=4096:n_layer=2"
    assert _spec("mla:kv_lora_rank=64", {}, 512) == "bench/mla:kv_lora_rank=64:max_seq_len=512"
    assert _spec("tiny/mla", {}, 4096) == "tiny/mla"


def _bench_model(attention: str, **overrides):
    torch.manual_seed(0)  # init_std 0.1: logits large enough that greedy tokens depend on the whole context
    cfg = tiny_config(attention, vocab_size=257, max_seq_len=CTX, init_std=0.1, **overrides)
    return build_model(cfg).eval()


def test_engine_load_in_process_completes_every_request():
    """kvlm's engine driven in-process as the peer is: C requests in flight, each with its output length."""
    from kvlm.bench.serve_inprocess import engine_load

    model = _bench_model("mla")
    r = engine_load(model, 3, prompt_len=9, output_len=5, rounds=2, cache_bytes=1 << 20, page_size=PAGE)
    assert r["requests"] == 6 and r["per_request_tokens"] == [5] * 6 and r["generated_tokens"] == 30
    assert r["tokens_per_s"] == pytest.approx(30 / r["wall_s"])
    assert 0 < r["ttft_p50_ms"] <= r["ttft_p99_ms"] and 0 < r["itl_p50_ms"] <= r["itl_p99_ms"]
    assert r["concurrency"] == 3 and r["preemptions"] == 0


def test_engine_load_queues_past_a_small_pool():
    """A pool too small for C requests at once still completes all of them (queued or preempted, not lost)."""
    from kvlm.bench.serve_inprocess import engine_load

    model = _bench_model("gqa", n_kv_head=2)
    per_token = model.cfg.n_layer * 2 * model.cfg.n_kv_head * model.cfg.head_dim * 4
    r = engine_load(
        model, 8, prompt_len=12, output_len=6, rounds=1, cache_bytes=3 * 20 * per_token, page_size=PAGE
    )
    assert r["per_request_tokens"] == [6] * 8


def test_padded_mla_peer_computes_kvlm_function():
    """The MLA peer for transformers' paged cache (values padded to d_h + d_h^R) equals kvlm's logits."""
    pytest.importorskip("transformers")
    from kvlm.bench.peers import build_peer, max_logit_diff

    model = _bench_model("mla", rope_head_dim=8)
    stock, padded = build_peer(model), build_peer(model, paged=True)
    c = padded.model.config
    d_h, d_r = model.cfg.head_dim, model.cfg.rope_head_dim
    assert stock.model.config.v_head_dim == d_h  # the stock export: values of d_h
    assert c.v_head_dim == c.qk_head_dim == c.head_dim == d_h + d_r  # padded: one slot shape for K and V
    attn = padded.model.model.layers[0].self_attn
    assert attn.o_proj.weight.shape == (model.cfg.d_model, model.cfg.n_head * (d_h + d_r))
    tokens = torch.randint(0, 257, (2, 11))
    with torch.inference_mode():
        scale = model(tokens).abs().max().item()
    assert scale > 1.0
    assert max_logit_diff(model, padded, tokens, decode_steps=3) < 1e-5 * scale
    # the check sees a wrong pad: a value in the padded rows reaches the output through o_proj's padded columns
    with torch.no_grad():
        attn.kv_b_proj.weight.view(model.cfg.n_head, 2 * d_h + d_r, -1)[:, 2 * d_h :].fill_(0.5)
        attn.o_proj.weight.view(model.cfg.d_model, model.cfg.n_head, d_h + d_r)[..., d_h:].fill_(0.5)
    assert max_logit_diff(model, padded, tokens) > 1e-3


def test_text_prompts_are_one_token_per_letter():
    """transformers serve takes text: the load generator's letters are prompt_len tokens of the bench tokenizer."""
    pytest.importorskip("transformers")
    from kvlm.bench.serve_hf import text_prompts
    from kvlm.interop.hf import hf_tokenizer
    from kvlm.serve.launch import byte_tokenizer

    tok = hf_tokenizer(byte_tokenizer())
    prompts = text_prompts(4, 23, seed=0)
    assert len(set(prompts)) == 4
    assert [len(tok(p)["input_ids"]) for p in prompts] == [23] * 4


@pytest.mark.slow  # imports transformers and starts its continuous-batching thread: ~10 s each
@pytest.mark.parametrize("attention", ["gqa", "mla"])
def test_peer_is_transformers_continuous_batching(attention):
    """The peer runs through transformers' paged continuous batching (MLA with padded values), every request
    to its output length, and its greedy tokens are kvlm's."""
    pytest.importorskip("transformers")
    from transformers import GenerationConfig

    from kvlm.bench.peers import build_peer
    from kvlm.bench.serve_inprocess import peer_load
    from kvlm.serve import Engine, SamplingParams

    model = _bench_model(attention, **({"n_kv_head": 2} if attention == "gqa" else {}))
    peer = build_peer(model, paged=True)
    r = peer_load(
        model, 2, prompt_len=8, output_len=4, rounds=2, cache_bytes=1 << 20, page_size=PAGE, peer=peer
    )
    assert r["requests"] == 4 and r["per_request_tokens"] == [4] * 4 and r["generated_tokens"] == 16
    assert r["peer"].startswith(f"transformers CB ({type(peer.model).__name__}")
    assert 0 < r["ttft_p50_ms"] <= r["ttft_p99_ms"]
    prompts = sb.make_prompts(3, 10, seed=3)
    gen = GenerationConfig(max_new_tokens=6, do_sample=False, eos_token_id=-1, pad_token_id=0)
    theirs = peer.model.generate_batch(prompts, generation_config=gen, progress_bar=False)
    theirs = sorted((out.prompt_ids, out.generated_tokens) for out in theirs.values())
    ours = Engine(model, cache_tokens=256, page_size=PAGE).generate(
        prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    )
    assert theirs == sorted(zip(prompts, ours))
    assert len({tuple(t) for t in ours}) > 1  # the outputs depend on the prompt: a real check
