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


@pytest.fixture(scope="module")
def server():
    torch.manual_seed(0)
    model = build_model(tiny_config("gqa", n_kv_head=2, vocab_size=257, max_seq_len=CTX)).eval()
    served = Served(model, byte_tokenizer(), "tiny-gqa")
    # 10 sequences of 64 tokens: 16 pages each (the 64th token is never cached: ceil(63 / 4) = 16)
    app, engine = build_server(served, max_batch=32, max_waiting=64, page_size=PAGE, cache_tokens=10 * CTX)
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
    r = sb.capacity(server.url, CTX, demonstrate=True, poll_s=0.02)
    per_seq = math.ceil((CTX - 1) / PAGE)
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


def test_spec_of_an_attention_is_the_bench_shape():
    from kvlm.cli.bench_serve import _spec

    assert _spec("mla", {"n_layer": 2}, 4096) == "bench/mla:max_seq_len=4096:n_layer=2"
    assert _spec("mla:kv_lora_rank=64", {}, 512) == "bench/mla:kv_lora_rank=64:max_seq_len=512"
    assert _spec("tiny/mla", {}, 4096) == "tiny/mla"


@pytest.mark.slow  # imports transformers and starts its continuous-batching thread: ~10 s
def test_peer_is_transformers_continuous_batching(server):
    """The peer generates the same greedy tokens count through transformers' paged continuous batching."""
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = build_model(tiny_config("gqa", n_kv_head=2, vocab_size=257, max_seq_len=CTX)).eval()
    r = sb.peer_load(model, 2, prompt_len=8, output_len=4, rounds=2, cache_bytes=1 << 20, page_size=PAGE)
    assert r["requests"] == 4 and r["generated_tokens"] == 16
    assert r["peer"].startswith("transformers CB (LlamaForCausalLM)")
    assert 0 < r["ttft_p50_ms"] <= r["ttft_p99_ms"]
