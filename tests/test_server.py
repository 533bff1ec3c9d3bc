"""`kvlm serve`: the OpenAI-compatible HTTP server, tested over real HTTP on 127.0.0.1.

Each server runs in-process (uvicorn on a thread, port 0) around the real engine and a tiny random float64 model
with kvlm's byte-level tokenizer (no download). Answers are checked against ``kvlm.generate`` on the same model:
greedy token ids must be equal, with ``ignore_eos`` so both run to max_tokens. Texts are checked against the
reference ids decoded by kvlm's incremental detokeniser (``TextStream``, tested in test_generate.py), because
random byte ids are mostly not valid UTF-8 and only incremental decoding defines how such text is streamed.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from conftest import tiny_config  # noqa: E402

from kvlm import build_model, generate  # noqa: E402
from kvlm.inference.generation import TextStream  # noqa: E402
from kvlm.serve.chat import render_plain  # noqa: E402
from kvlm.serve.launch import Served, ServerThread, build_server, byte_tokenizer  # noqa: E402

CTX = 1024  # long enough that a 900-token generation is still running when its client disconnects
NAME = "tiny-mla"


@pytest.fixture(scope="module")
def served():
    torch.manual_seed(0)
    cfg = tiny_config("mla", vocab_size=257, max_seq_len=CTX)
    model = build_model(cfg).double().eval()
    return Served(model, byte_tokenizer(), NAME)


@pytest.fixture(scope="module")
def server(served):
    app, engine = build_server(served, max_batch=8, max_waiting=64, page_size=4, cache_tokens=40 * 128)
    with ServerThread(app) as srv:
        srv.engine = engine
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)


def reference(served, ids, n):
    """Greedy ids and their streamed text from kvlm.generate (EOS ignored, as the requests ask)."""
    out = generate(served.model, ids, n, temperature=0.0)
    stream = TextStream(served.tokenizer)
    text = "".join(stream.push(t) for t in out) + stream.flush()
    return out, text


def extra(choice, key):
    return (choice.model_extra or {})[key]


def sse_events(lines):
    """The data payloads of a server-sent event stream."""
    return [line[len("data: ") :] for line in lines if line.startswith("data: ")]


def wait_for(cond, timeout=15.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


# --- the basics ------------------------------------------------------------------------------------------
def test_health_models_and_unknown_path(server, client):
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    models = client.models.list()
    assert [m.id for m in models.data] == [NAME]
    r = httpx.get(server.url + "/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


def test_completion_greedy_equals_generate(served, client):
    prompt = "Once upon a time"
    ids = served.tokenizer.encode(prompt)
    ref, ref_text = reference(served, ids, 12)
    r = client.completions.create(
        model=NAME, prompt=prompt, max_tokens=12, temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )  # fmt: skip
    choice = r.choices[0]
    assert extra(choice, "token_ids") == ref
    assert choice.text == ref_text
    assert choice.finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (
        len(ids),
        12,
        len(ids) + 12,
    )
    # a token-id prompt gives the same answer as its text
    r2 = client.completions.create(model=NAME, prompt=ids, max_tokens=12, temperature=0,
                                   extra_body={"ignore_eos": True, "return_token_ids": True})  # fmt: skip
    assert extra(r2.choices[0], "token_ids") == ref


def test_completion_stream(served, server, client):
    prompt = "The cat sat"
    ref, ref_text = reference(served, served.tokenizer.encode(prompt), 10)
    chunks = list(client.completions.create(
        model=NAME, prompt=prompt, max_tokens=10, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True, "return_token_ids": True},
    ))  # fmt: skip
    with_choice = [c for c in chunks if c.choices]
    assert [t for c in with_choice for t in extra(c.choices[0], "token_ids")] == ref
    assert "".join(c.choices[0].text for c in with_choice) == ref_text
    assert with_choice[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in with_choice[:-1])
    assert chunks[-1].usage.completion_tokens == 10 and not chunks[-1].choices
    # on the wire: server-sent events, the last one [DONE]
    body = {"model": NAME, "prompt": prompt, "max_tokens": 3, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        events = sse_events(resp.iter_lines())
    assert events[-1] == "[DONE]" and all(json.loads(e)["object"] == "text_completion" for e in events[:-1])


def test_chat_greedy_equals_generate_plain_template(served, client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    ids = served.tokenizer.encode(render_plain([(m["role"], m["content"]) for m in messages]))
    assert served.tokenizer.decode(ids).endswith("User: Hello there\n\nAssistant:")
    ref, ref_text = reference(served, ids, 8)
    kw = dict(model=NAME, messages=messages, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    r = client.chat.completions.create(**kw)
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == ref_text
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 8
    chunks = list(client.chat.completions.create(stream=True, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ref_text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_logprobs_are_the_models(served, client):
    """The returned log-probabilities equal log_softmax of the model's own logits (float64)."""
    prompt = "Logs"
    ids = served.tokenizer.encode(prompt)
    r = client.completions.create(model=NAME, prompt=prompt, max_tokens=5, temperature=0, logprobs=3,
                                  extra_body={"ignore_eos": True, "return_token_ids": True})  # fmt: skip
    got = extra(r.choices[0], "token_ids")
    lp = r.choices[0].logprobs
    with torch.no_grad():
        logits = served.model(torch.tensor([ids + got]))[0, len(ids) - 1 : -1]
    want = torch.log_softmax(logits, -1)
    for i, t in enumerate(got):
        assert lp.token_logprobs[i] == pytest.approx(want[i, t].item(), abs=1e-6)
        # keyed by token text: byte ids >= 128 all decode to U+FFFD, so two of the top 3 may share a key
        top = torch.topk(want[i], 3)
        names = {served.tokenizer.decode([j]) for j in top.indices.tolist()}
        assert set(lp.top_logprobs[i]) == names
        for value in lp.top_logprobs[i].values():
            assert min(abs(value - v) for v in top.values.tolist()) < 1e-6
    assert lp.tokens == [served.tokenizer.decode([t]) for t in got]
    chat = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "x"}], max_tokens=3,
                                          temperature=0, logprobs=True, top_logprobs=2)  # fmt: skip
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(c.top_logprobs) == 2 for c in content)


def test_stop_string_ends_the_answer(served, client):
    prompt = "abc"
    _, ref_text = reference(served, served.tokenizer.encode(prompt), 20)
    stop = ref_text[5:7]
    if not stop or "\ufffd" in stop:
        pytest.skip("the reference text has no usable stop string")
    r = client.completions.create(model=NAME, prompt=prompt, max_tokens=20, temperature=0, stop=[stop],
                                  extra_body={"ignore_eos": True})  # fmt: skip
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == ref_text[: ref_text.index(stop)]


# --- many clients ----------------------------------------------------------------------------------------
def test_32_concurrent_clients_mixed_lengths(served, server):
    """32 clients at once (max_batch 8: the rest queue), prompt lengths 1..94, half streaming: each answer is
    its own greedy reference."""
    g = torch.Generator().manual_seed(1)
    cases = []
    for i in range(32):
        n = 1 + (i * 37) % 94
        ids = torch.randint(1, 257, (n,), generator=g).tolist()
        cases.append((ids, 3 + i % 9, i % 2 == 0))
    refs = [reference(served, ids, m)[0] for ids, m, _ in cases]

    async def one(http, ids, max_tokens, stream):
        body = {"model": NAME, "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True, "stream": stream}  # fmt: skip
        if not stream:
            r = await http.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["token_ids"]
        out = []
        async with http.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    out += json.loads(line[6:])["choices"][0]["token_ids"]
        return out

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
            return await asyncio.gather(*(one(http, *c) for c in cases))

    got = asyncio.run(main())
    for i, (g_ids, r_ids) in enumerate(zip(got, refs)):
        assert g_ids == r_ids, f"client {i} (prompt {len(cases[i][0])} tokens)"
    wait_for(lambda: server.engine.stats()["running"] == 0, what="all requests retired")


def test_disconnect_mid_stream_frees_pages(server):
    engine = server.engine
    wait_for(lambda: engine.stats()["running"] == 0 and engine.inflight == 0, what="an idle server")
    before = engine.stats()
    body = {"model": NAME, "prompt": "Tell me a long story", "max_tokens": 900, "stream": True,
            "ignore_eos": True}  # fmt: skip
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as resp:
        seen = 0
        for line in resp.iter_lines():
            seen += line.startswith("data: {")
            if seen == 3:
                break
        assert engine.stats()["running"] == 1
    # the connection is closed: the server aborts the request and its pages go back to the pool
    wait_for(lambda: engine.inflight == 0 and engine.stats()["running"] == 0, what="the request's abort")
    after = engine.stats()
    assert after["pages_used"] == before["pages_used"]
    generated = after["generation_tokens_total"] - before["generation_tokens_total"]
    assert generated < 900, "the request ran to the end instead of being aborted"


def test_overload_answers_429(served):
    app, engine = build_server(served, max_batch=1, max_waiting=1, page_size=4, cache_tokens=4 * CTX)
    body = {"model": NAME, "prompt": "busy", "max_tokens": 800, "stream": True, "ignore_eos": True}
    with ServerThread(app) as srv, httpx.Client(base_url=srv.url, timeout=30) as http:
        with (
            http.stream("POST", "/v1/completions", json=body) as a,
            http.stream("POST", "/v1/completions", json=body) as b,
        ):
            assert a.status_code == 200 and b.status_code == 200
            assert engine.inflight == 2
            r = http.post("/v1/completions", json={**body, "stream": False})
            assert r.status_code == 429
            assert r.json()["error"]["type"] == "rate_limit_error"
            c = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
            with pytest.raises(openai.RateLimitError):
                c.completions.create(model=NAME, prompt="x", max_tokens=1)
        # both streams closed: their requests are aborted and the server takes requests again
        wait_for(lambda: engine.inflight == 0, what="the aborts")
        assert http.post("/v1/completions", json={"prompt": "ok", "max_tokens": 2}).status_code == 200


# --- n completions of one prompt ----------------------------------------------------------------------------
def test_n_greedy_gives_n_equal_choices(served, client):
    """n=3 greedy completions: three choices indexed 0..2, each the greedy reference; usage counts the prompt once
    and every choice's tokens."""
    prompt = "Twice"
    ids = served.tokenizer.encode(prompt)
    ref, ref_text = reference(served, ids, 6)
    r = client.completions.create(model=NAME, prompt=prompt, max_tokens=6, temperature=0, n=3,
                                  extra_body={"ignore_eos": True, "return_token_ids": True})  # fmt: skip
    assert [c.index for c in r.choices] == [0, 1, 2]
    for c in r.choices:
        assert extra(c, "token_ids") == ref and c.text == ref_text and c.finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), 3 * 6)
    chat = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}], n=2,
                                          max_tokens=4, temperature=0, extra_body={"ignore_eos": True})  # fmt: skip
    assert [c.index for c in chat.choices] == [0, 1]
    assert chat.choices[0].message.content == chat.choices[1].message.content
    assert chat.usage.completion_tokens == 8


def test_n_streaming_interleaves_indexed_choices(served, client):
    """A streamed n=2 request: every chunk's choice carries its index; each index's tokens, joined, are the
    reference and end with its own finish_reason; the usage chunk sums both."""
    prompt = "Streams"
    ref, ref_text = reference(served, served.tokenizer.encode(prompt), 7)
    chunks = list(client.completions.create(
        model=NAME, prompt=prompt, max_tokens=7, temperature=0, n=2, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True, "return_token_ids": True},
    ))  # fmt: skip
    tokens, texts, finish = {0: [], 1: []}, {0: "", 1: ""}, {}
    for chunk in chunks:
        for c in chunk.choices:
            assert c.index not in finish, "a chunk after the choice's finish_reason"
            tokens[c.index] += extra(c, "token_ids")
            texts[c.index] += c.text
            if c.finish_reason is not None:
                finish[c.index] = c.finish_reason
    assert tokens == {0: ref, 1: ref} and texts == {0: ref_text, 1: ref_text}
    assert finish == {0: "length", 1: "length"}
    assert chunks[-1].usage.completion_tokens == 14 and not chunks[-1].choices
    chat = list(client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}], n=2,
                                               max_tokens=3, temperature=0, stream=True,
                                               extra_body={"ignore_eos": True}))  # fmt: skip
    content = {0: "", 1: ""}
    roles = set()
    for chunk in chat:
        for c in chunk.choices:
            content[c.index] += c.delta.content or ""
            if c.delta.role:
                roles.add(c.index)
    assert roles == {0, 1} and content[0] == content[1]


def test_n_sampled_with_seed_is_reproducible(client):
    """Sampled n=3 with a seed: the same request gives the same three choices; choice i is what a single
    request with seed + i gives, so the three differ."""
    kw = dict(model=NAME, prompt="dice", max_tokens=8, temperature=1.0,
              extra_body={"ignore_eos": True, "return_token_ids": True})  # fmt: skip
    first = client.completions.create(n=3, seed=7, **kw)
    again = client.completions.create(n=3, seed=7, **kw)
    got = [extra(c, "token_ids") for c in first.choices]
    assert got == [extra(c, "token_ids") for c in again.choices]
    singles = [extra(client.completions.create(seed=7 + i, **kw).choices[0], "token_ids") for i in range(3)]
    assert got == singles
    assert len({tuple(t) for t in got}) > 1, "seed + i should give different samples"


def test_n_stream_disconnect_frees_every_choice(server):
    engine = server.engine
    wait_for(lambda: engine.stats()["running"] == 0 and engine.inflight == 0, what="an idle server")
    before = engine.stats()
    body = {"model": NAME, "prompt": "Two long stories", "max_tokens": 900, "stream": True, "n": 2,
            "ignore_eos": True}  # fmt: skip
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as resp:
        seen = 0
        for line in resp.iter_lines():
            seen += line.startswith("data: {")
            if seen == 4:
                break
        # the 4 chunks may all be the first choice's while the second is being admitted (seen once under load)
        wait_for(lambda: engine.stats()["running"] == 2 and engine.inflight == 2, what="both choices running")
    wait_for(lambda: engine.inflight == 0 and engine.stats()["running"] == 0, what="both aborts")
    after = engine.stats()
    assert after["pages_used"] == before["pages_used"]
    assert after["generation_tokens_total"] - before["generation_tokens_total"] < 1800


def test_n_larger_than_the_server_holds_is_400(served):
    app, _ = build_server(served, max_batch=2, max_waiting=1, page_size=4, cache_tokens=4 * CTX)
    with ServerThread(app) as srv:
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2, "n": 4}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "n"
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2, "n": 3}, timeout=30)
        assert r.status_code == 200 and len(r.json()["choices"]) == 3


# --- the hand-off from the engine thread ---------------------------------------------------------------------
class _RecordingLoop:
    """Stands in for an event loop: records the thread-safe calls instead of running them."""

    def __init__(self):
        self.calls = []

    def call_soon_threadsafe(self, fn, *args):
        self.calls.append((fn, args))


def _out(rid, ids, text, finished=False, lps=None):
    from kvlm.serve.request import RequestOutput

    return RequestOutput(rid, list(ids), text, lps, None, finished, "length" if finished else None, 3, 0)


def test_one_handoff_per_step_carries_every_request():
    """All requests' outputs of one step reach the event loop in ONE call_soon_threadsafe, each to its own
    request's stream and index."""
    from kvlm.serve.async_engine import AsyncEngine, _Sink, _Stream

    loop = _RecordingLoop()
    ae = AsyncEngine(engine=None)
    sinks = [_Sink(loop) for _ in range(3)]
    for k, sink in enumerate(sinks):
        ae._streams[f"r{k}"] = _Stream(f"r{k}", k % 2, sink, 3, 0.0)
    ae._dispatch([_out(f"r{k}", [10 + k], f"t{k}") for k in range(3)])
    assert len(loop.calls) == 1
    fn, (batch,) = loop.calls[0]
    fn(batch)  # what the event loop would run
    for k, sink in enumerate(sinks):
        assert list(sink.pending) == [k % 2]
        assert sink.pending[k % 2].new_token_ids == [10 + k] and sink.pending[k % 2].new_text == f"t{k}"


def test_a_lagging_consumer_gets_the_outputs_merged():
    """Outputs its consumer has not taken yet are merged per index (tokens, text and logprobs joined in order,
    the finish from the last), so a consumer behind by three steps sends one event, not three."""
    from kvlm.serve.async_engine import _Sink

    async def main():
        sink = _Sink(asyncio.get_running_loop())
        sink.put(0, _out("a", [1], "x", lps=[-1.0]))
        sink.put(1, _out("b", [7], "q"))
        sink.put(0, _out("a", [2, 3], "yz", lps=[-2.0, -3.0]))
        sink.put(0, _out("a", [4], "w", finished=True, lps=[-4.0]))
        first = await sink.get()
        waiter = asyncio.ensure_future(sink.get())
        await asyncio.sleep(0)
        assert not waiter.done()  # nothing pending: the consumer waits
        sink.put(1, _out("b", [8], "r", finished=True))
        return first, await waiter

    first, second = asyncio.run(main())
    assert [i for i, _ in first] == [0, 1]
    a = first[0][1]
    assert (a.new_token_ids, a.new_text, a.token_logprobs) == ([1, 2, 3, 4], "xyzw", [-1.0, -2.0, -3.0, -4.0])
    assert a.finished and a.finish_reason == "length"
    assert first[1][1].new_token_ids == [7]
    assert [(i, o.new_token_ids, o.finished) for i, o in second] == [(1, [8], True)]


def test_stream_frames_equal_the_full_bodies():
    """The pre-serialized SSE envelope gives the same JSON as building each chunk's whole body."""
    from kvlm.serve.openai_protocol import StreamFrames, chat_body, completion_body, usage

    choice = {"index": 1, "text": 'a "quoted" \u00e9\n', "logprobs": None, "finish_reason": None,
              "token_ids": [1, 2]}  # fmt: skip
    frames = StreamFrames("cmpl-1", "text_completion", 'm"odel')
    for got, want in [
        (frames.choice(choice), completion_body("cmpl-1", 'm"odel', choice, None, chunk=True)),
        (frames.usage(usage(3, 4)), completion_body("cmpl-1", 'm"odel', None, usage(3, 4), chunk=True)),
    ]:
        assert got.startswith("data: ") and got.endswith("\n\n")
        body = json.loads(got[6:])
        assert abs(body.pop("created") - want.pop("created")) <= 1 and body == want
    chat = StreamFrames("c", "chat.completion.chunk", "m")
    delta_choice = {"index": 0, "delta": {"content": "hi"}, "logprobs": None, "finish_reason": None}
    body, want = (
        json.loads(chat.choice(delta_choice)[6:]),
        chat_body("c", "m", delta_choice, None, chunk=True),
    )
    assert abs(body.pop("created") - want.pop("created")) <= 1 and body == want


# --- bad input -------------------------------------------------------------------------------------------
LONG = "x" * (CTX + 5)
BAD = [
    ("completions", {"model": "gpt-4", "prompt": "hi"}, "model"),
    ("completions", {"prompt": LONG}, "prompt"),
    ("completions", {"prompt": "hi", "max_tokens": CTX}, "max_tokens"),
    ("completions", {"prompt": "hi", "temperature": -1}, "temperature"),
    ("completions", {"prompt": "hi", "temperature": "hot"}, "temperature"),
    ("completions", {"prompt": "hi", "top_p": 0}, "top_p"),
    ("completions", {"prompt": "hi", "top_p": 1.5}, "top_p"),
    ("completions", {"prompt": "hi", "top_k": -5}, "top_k"),
    ("completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("completions", {"prompt": "hi", "max_tokens": "5"}, "max_tokens"),
    ("completions", {"prompt": "hi", "max_tokens": 2.5}, "max_tokens"),
    ("completions", {"prompt": "hi", "logprobs": 50}, "logprobs"),
    ("completions", {"prompt": "hi", "n": 0}, "n"),
    ("completions", {"prompt": "hi", "n": 129}, "n"),
    ("completions", {"prompt": "hi", "n": 2, "best_of": 3}, "best_of"),
    ("completions", {"prompt": "hi", "stream": "yes"}, "stream"),
    ("completions", {"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ("completions", {"prompt": "hi", "seed": "1"}, "seed"),
    ("completions", {"prompt": "hi", "presence_penalty": 0.5}, "presence_penalty"),
    ("completions", {"prompt": [1, 2, 999]}, "prompt"),
    ("completions", {"prompt": ""}, "prompt"),
    ("completions", {"max_tokens": 3}, "prompt"),
    ("completions", {"prompt": ["a", "b"]}, "prompt"),
    ("chat/completions", {"model": "nope", "messages": [{"role": "user", "content": "hi"}]}, "model"),
    ("chat/completions", {"prompt": "hi"}, "messages"),
    ("chat/completions", {"messages": []}, "messages"),
    ("chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
    ("chat/completions", {"messages": [{"role": "user", "content": LONG}]}, "prompt"),
    (
        "chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2},
        "top_logprobs",
    ),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "temperature": 3}, "temperature"),
]


@pytest.mark.parametrize(
    ("path", "body", "param"), BAD, ids=[f"{p}-{k}-{i}" for i, (p, _, k) in enumerate(BAD)]
)
def test_bad_request_is_400(server, path, body, param):
    r = httpx.post(f"{server.url}/v1/{path}", json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["message"]
    assert err["param"] == param


@pytest.mark.parametrize("raw", [b"{", b"[1, 2]", b"", b"not json"])
def test_malformed_json_is_400(server, raw):
    r = httpx.post(server.url + "/v1/completions", content=raw, headers={"Content-Type": "application/json"})
    assert r.status_code == 400
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_openai_client_sees_bad_request(client):
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.completions.create(model=NAME, prompt=LONG, max_tokens=1)


# --- metrics and shutdown ----------------------------------------------------------------------------------
def test_metrics(server, client):
    from prometheus_client.parser import text_string_to_metric_families

    client.completions.create(model=NAME, prompt="metrics", max_tokens=4, temperature=0,
                              extra_body={"ignore_eos": True})  # fmt: skip
    text = httpx.get(server.url + "/metrics").text
    samples = {
        s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if not s.labels
    }
    stats = server.engine.stats()
    assert samples["kvlm_time_to_first_token_seconds_count"] >= 1
    assert samples["kvlm_inter_token_latency_seconds_count"] >= 3
    assert samples["kvlm_generation_tokens_total"] >= 4
    assert samples["kvlm_cache_pages_total"] == stats["pages_total"]
    assert samples["kvlm_cache_pages_free"] + samples["kvlm_cache_pages_used"] == stats["pages_total"]
    for name in (
        "kvlm_num_requests_running",
        "kvlm_num_requests_waiting",
        "kvlm_generation_tokens_per_second",
    ):
        assert name in samples


def test_shutdown_finishes_then_cancels_inflight(served):
    """Shutdown lets a short request finish; a long stream ends at the timeout with finish_reason "abort" and
    [DONE], and the engine is left with nothing running and no pages held."""
    app, engine = build_server(served, max_batch=4, page_size=4, cache_tokens=4 * CTX)
    # every engine step takes at least 5 ms, so the long request needs >= 5 s and cannot end inside the 3 s
    # grace, while the short one (20 steps) ends well inside it however loaded the machine is
    step = engine.engine.step

    def slow_step(*a, **k):
        time.sleep(0.005)
        return step(*a, **k)

    engine.engine.step = slow_step
    srv = ServerThread(app, graceful_s=3.0).start()
    results = {}

    def short():
        body = {"prompt": "short", "max_tokens": 20, "temperature": 0, "ignore_eos": True}
        results["short"] = httpx.post(srv.url + "/v1/completions", json=body, timeout=30).json()

    def long():
        body = {"prompt": "long", "max_tokens": 1000, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=30) as r:
            results["long"] = sse_events(r.iter_lines())

    threads = [threading.Thread(target=short), threading.Thread(target=long)]
    for t in threads:
        t.start()
    wait_for(lambda: engine.inflight == 2, what="two requests in flight")
    srv.stop()
    for t in threads:
        t.join(30)
    assert results["short"]["choices"][0]["finish_reason"] == "length"
    assert results["short"]["usage"]["completion_tokens"] == 20
    long_events = results["long"]
    assert (
        long_events[-1] == "[DONE]" and json.loads(long_events[-2])["choices"][0]["finish_reason"] == "abort"
    )
    assert len(long_events) < 1000
    assert not engine.alive and not engine.engine.has_unfinished()
    assert engine.stats()["running"] == 0 and engine.stats()["pages_used"] == 0


@pytest.mark.slow  # a fresh interpreter importing torch: ~20 s on a loaded 2-core machine
def test_cli_serve_preset_and_sigterm():
    """`kvlm serve tiny/mla` in a subprocess answers, and SIGTERM stops it with exit status 0."""
    import signal
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "kvlm.cli", "serve", "tiny/mla", "--port", str(port), "--max-batch", "4",
           "--cache-tokens", "4096", "--threads", "1", "--device", "cpu"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "kvlm serve did not start"
            time.sleep(0.2)
        r = httpx.post(
            url + "/v1/completions", json={"model": "tiny/mla", "prompt": [1, 2, 3], "max_tokens": 4}
        )
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 4
        proc.send_signal(signal.SIGTERM)
        # uvicorn shuts down, then re-raises the signal it caught, as a signal-terminated process should
        assert proc.wait(30) in (0, -signal.SIGTERM)
        assert "Application shutdown complete" in proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_cli_serve_rejects_bad_options():
    from kvlm.cli import main

    assert main(["serve", "tiny/mla", "--page-size", "0"]) == 1
    assert main(["serve", "no/such-preset"]) == 1


def test_checkpoint_with_chat_template(served, tmp_path):
    """A checkpoint folder is served under its folder name with its tokenizer, and its chat template (Jinja, as
    Hugging Face stores it) renders the prompt."""
    from kvlm import save_checkpoint
    from kvlm.serve.launch import load_served_model

    folder = save_checkpoint(tmp_path / "ckpt", served.model, served.tokenizer)
    template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{{ eos_token }}{% endfor %}<assistant>"
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    loaded = load_served_model(str(folder), device="cpu", dtype=torch.float64)
    assert loaded.name == "ckpt" and loaded.chat_template == template
    app, _ = build_server(loaded, max_batch=2, page_size=4, cache_tokens=4 * CTX)
    rendered = "<user>Hi<|endoftext|><assistant>"
    ids = served.tokenizer.encode(rendered)
    ref, ref_text = reference(served, ids, 5)
    with ServerThread(app) as srv:
        body = {"model": "ckpt", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5,
                "temperature": 0, "ignore_eos": True, "return_token_ids": True}  # fmt: skip
        r = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=30).json()
    assert r["usage"]["prompt_tokens"] == len(ids)
    assert r["choices"][0]["token_ids"] == ref and r["choices"][0]["message"]["content"] == ref_text


def test_non_streaming_client_that_gives_up_is_aborted(server):
    """A non-streaming request whose client disconnects (here: a client-side timeout) is aborted within the
    server at once, not run to its 900 tokens."""
    engine = server.engine
    wait_for(lambda: engine.stats()["running"] == 0 and engine.inflight == 0, what="an idle server")
    before = engine.stats()["generation_tokens_total"]
    body = {"model": NAME, "prompt": "patience", "max_tokens": 900, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, timeout=httpx.Timeout(30, read=0.3))
    wait_for(lambda: engine.inflight == 0 and engine.stats()["running"] == 0, what="the abort", timeout=10)
    assert engine.stats()["generation_tokens_total"] - before < 900


def test_engine_failure_ends_requests_and_health_says_so(served):
    """An exception inside the engine ends every open request (no client hangs) and /health answers 503."""
    app, engine = build_server(served, max_batch=2, page_size=4, cache_tokens=4 * CTX)
    with ServerThread(app) as srv:

        def broken_step():
            raise RuntimeError("simulated engine bug")

        engine.engine.step = broken_step
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 5}, timeout=30)
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "abort"
        health = httpx.get(srv.url + "/health")
        assert health.status_code == 503 and "simulated engine bug" in health.json()["error"]
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 5}, timeout=30)
        assert r.status_code == 503 and r.json()["error"]["type"] == "server_error"
