"""The serving engine (kvlm.serve.Engine): greedy output equal to kvlm.generate whatever the page size, chunking,
batching, mixing of decodes and prompt chunks in one forward, and preemption; the packed one-token-row batch
against each sequence alone (float64, every mechanism); abort frees pages; prefix sharing; batched sampling
(top-k / top-p against a plain reference, draws that follow the distribution, seeded requests independent
of the batch); stop rules; logprobs; clear errors for bad requests."""

import math

import pytest
import torch
from conftest import all_variants, tiny_config, twin_paged_caches

from kvlm import build_model, generate
from kvlm.cache import CacheError, PagedKVCache
from kvlm.cache.paged_batch import PackedBatch
from kvlm.serve import Engine, SamplingParams
from kvlm.serve.engine import MIX_KEYS, plan_step
from kvlm.serve.sampling import distributions, logprobs_batch, sample_batch

GREEDY = dict(temperature=0.0)


class CharTokenizer:
    """Two letters per id (so a stop string can span tokens); ``eos_id`` like kvlm's Tokenizer."""

    eos_id = 96

    def decode(self, ids):
        return "".join(chr(97 + i % 26) + chr(65 + i // 26) for i in ids)


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    out = {}
    for name in ("mla", "mha", "eg-mla"):
        out[name] = build_model(tiny_config(name, max_seq_len=96)).double().requires_grad_(False)
    return out


def _prompts(n=5, lengths=(5, 11, 2, 30, 17), seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 97, (k,), generator=g).tolist() for k in lengths[:n]]


def _run(engine, prompts, params):
    """Submit all prompts at once, step to the end; per request the ids, the text, the final output."""
    ids = [engine.add_request(p, params) for p in prompts]
    toks = {i: [] for i in ids}
    text = {i: "" for i in ids}
    final = {}
    while engine.has_unfinished():
        for o in engine.step():
            toks[o.request_id] += o.new_token_ids
            text[o.request_id] += o.new_text
            assert o.completion_tokens == len(toks[o.request_id])
            if o.finished:
                final[o.request_id] = o
    return [toks[i] for i in ids], [text[i] for i in ids], [final[i] for i in ids]


@pytest.mark.parametrize("name", ["mla", "mha", "eg-mla"])
@pytest.mark.parametrize("page_size,chunk", [(1, 256), (16, 7)])
def test_greedy_equals_generate(models, name, page_size, chunk):
    model = models[name]
    prompts = _prompts()
    want = [generate(model, p, 10, **GREEDY) for p in prompts]
    engine = Engine(model, cache_tokens=512, page_size=page_size, prefill_chunk=chunk)
    got, _, finals = _run(engine, prompts, SamplingParams(max_tokens=10, **GREEDY))
    assert got == want
    assert all(f.finish_reason == "length" and f.prompt_tokens == len(p) for f, p in zip(finals, prompts))
    s = engine.stats()
    assert s["pages_used"] == 0 and s["running"] == s["waiting"] == 0
    assert s["generation_tokens_total"] == 50 and s["prompt_tokens_total"] == sum(map(len, prompts))


def test_preemption_under_a_tiny_pool_gives_the_same_outputs(models):
    model = models["mla"]
    prompts = _prompts()
    want = [generate(model, p, 12, **GREEDY) for p in prompts]
    engine = Engine(model, cache_tokens=48, page_size=4, prefill_chunk=8)  # 12 pages for 5 requests
    got, _, _ = _run(engine, prompts, SamplingParams(max_tokens=12, **GREEDY))
    assert got == want
    assert engine.stats()["preemptions"] > 0 and engine.stats()["pages_used"] == 0


def test_max_batch_limits_the_running_requests(models):
    engine = Engine(models["mla"], cache_tokens=512, page_size=4, max_batch=2)
    for p in _prompts():
        engine.add_request(p, SamplingParams(max_tokens=3, **GREEDY))
    engine.step()
    assert engine.stats()["running"] == 2 and engine.stats()["waiting"] == 3


def test_abort_frees_pages(models):
    engine = Engine(models["mla"], cache_tokens=256, page_size=4)
    a = engine.add_request(_prompts()[3], SamplingParams(max_tokens=20, **GREEDY))
    b = engine.add_request(_prompts()[1], SamplingParams(max_tokens=20, **GREEDY))
    engine.step()
    engine.step()
    assert engine.stats()["pages_used"] > 0
    engine.abort(a)
    used_b = len(engine.cache.seq_pages(b))
    assert engine.stats()["pages_used"] == used_b
    engine.abort(b)
    assert engine.stats()["pages_used"] == 0
    outs = engine.step()
    assert {o.request_id: o.finish_reason for o in outs} == {a: "abort", b: "abort"}
    assert all(o.finished for o in outs) and not engine.has_unfinished()
    engine.abort("unknown")  # already gone: nothing to do


def test_prefix_sharing_uses_fewer_pages_and_same_outputs(models):
    model = models["mha"]
    common = _prompts(1, (24,), seed=5)[0]
    prompts = [common + [1, 2, 3], common + [7]]
    want = [generate(model, p, 6, **GREEDY) for p in prompts]
    peak = {}
    for enable in (True, False):
        engine = Engine(model, cache_tokens=256, page_size=8, enable_prefix_cache=enable)
        params = SamplingParams(max_tokens=6, **GREEDY)
        first = engine.add_request(prompts[0], params)
        got = [
            engine.step()[0].new_token_ids,
            [],
        ]  # its full pages are keyed before the second prompt arrives
        rids = [first, engine.add_request(prompts[1], params)]
        peak[enable] = 0
        while engine.has_unfinished():
            for o in engine.step():
                got[rids.index(o.request_id)] += o.new_token_ids
            peak[enable] = max(peak[enable], engine.stats()["pages_used"])
        assert got == want
        assert engine.stats()["prefix_cache_hit_tokens"] == (24 if enable else 0)
    assert peak[True] == peak[False] - 3  # the 3 full pages of the common prefix are held once


def test_seeded_sampling_is_reproducible_whatever_the_batch(models):
    model = models["mla"]
    p = _prompts()[1]
    params = SamplingParams(max_tokens=12, temperature=1.0, top_k=20, top_p=0.9, seed=123)
    alone = Engine(model, cache_tokens=512).generate([p], params)[0]
    engine = Engine(model, cache_tokens=512, page_size=4)
    others = [SamplingParams(max_tokens=8, temperature=0.7, seed=s) for s in (1, 2)]
    ids = [engine.add_request(q, o) for q, o in zip(_prompts()[2:4], others)]
    mine = engine.add_request(p, params)
    got = {i: [] for i in [*ids, mine]}
    while engine.has_unfinished():
        for o in engine.step():
            got[o.request_id] += o.new_token_ids
    assert got[mine] == alone
    other_seed = Engine(model, cache_tokens=512).generate(
        [p], SamplingParams(**{**vars(params), "seed": 124})
    )[0]
    assert other_seed != alone  # the seed matters (12 draws over a 20-token nucleus)


def test_stop_strings_stop_ids_eos_and_max_tokens(models):
    model, tok = models["mla"], CharTokenizer()
    p = _prompts()[3]
    engine = Engine(model, tok, cache_tokens=512, page_size=4)
    full_ids, full_text, finals = _run(engine, [p], SamplingParams(max_tokens=12, ignore_eos=True, **GREEDY))
    full_ids, full_text = full_ids[0], full_text[0]
    assert full_text == tok.decode(full_ids) and finals[0].finish_reason == "length" and len(full_ids) == 12
    # a stop string spanning two tokens: the text stops before it
    stop = full_text[9:12]
    cut = full_text.find(stop)
    ids, text, finals = _run(
        engine, [p], SamplingParams(max_tokens=12, stop=[stop], ignore_eos=True, **GREEDY)
    )
    assert text[0] == full_text[:cut] and finals[0].finish_reason == "stop"
    assert ids[0] == full_ids[: len(ids[0])] and len(ids[0]) < 12
    # a stop token id: not emitted
    stop_id = full_ids[5]
    first = full_ids.index(stop_id)
    ids, text, finals = _run(engine, [p], SamplingParams(max_tokens=12, stop_token_ids=[stop_id], **GREEDY))
    assert ids[0] == full_ids[:first] and finals[0].finish_reason == "stop" and text[0] == tok.decode(ids[0])
    # EOS ends a request unless ignore_eos
    tok.eos_id = full_ids[7]
    try:
        eos_engine = Engine(model, tok, cache_tokens=512)
        ids, _, finals = _run(eos_engine, [p], SamplingParams(max_tokens=12, **GREEDY))
        assert ids[0] == full_ids[: full_ids.index(tok.eos_id)] and finals[0].finish_reason == "stop"
        ids, _, _ = _run(eos_engine, [p], SamplingParams(max_tokens=12, ignore_eos=True, **GREEDY))
        assert ids[0] == full_ids
    finally:
        tok.eos_id = CharTokenizer.eos_id
    # the model's context ends a request ("length")
    long = _prompts(1, (94,))[0]
    ids, _, finals = _run(engine, [long], SamplingParams(max_tokens=10, ignore_eos=True, **GREEDY))
    assert len(ids[0]) == 3 and finals[0].finish_reason == "length"  # positions 94, 95 fed back; 96 > context


def test_logprobs(models):
    model = models["mla"]
    p = _prompts()[0]
    engine = Engine(model, CharTokenizer(), cache_tokens=256)
    rid = engine.add_request(p, SamplingParams(max_tokens=3, logprobs=2, ignore_eos=True, **GREEDY))
    lps, tops, ids = [], [], []
    while engine.has_unfinished():
        for o in engine.step():
            assert o.request_id == rid
            ids += o.new_token_ids
            lps += o.token_logprobs
            tops += o.top_logprobs
    cache = model.new_cache(1, 16)
    logits = model(torch.tensor([p]), cache=cache)[0, -1]
    want = torch.log_softmax(logits, -1)
    assert lps[0] == pytest.approx(float(want[ids[0]]), abs=1e-9)
    assert len(tops) == 3 and all(len(t) == 2 for t in tops)
    assert max(tops[0].values()) == pytest.approx(
        lps[0], abs=1e-12
    )  # greedy: the chosen token is the top one
    engine.add_request(p, SamplingParams(max_tokens=1, logprobs=0, **GREEDY))
    out = engine.step()[0]
    assert len(out.token_logprobs) == 1 and out.top_logprobs is None


@pytest.mark.parametrize(
    "field,value",
    [
        ("max_tokens", 0),
        ("max_tokens", 2.5),
        ("temperature", -1.0),
        ("temperature", "hot"),
        ("top_k", -1),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("seed", 1.5),
        ("stop", [""]),
        ("stop", [3]),
        ("stop_token_ids", [-1]),
        ("logprobs", -1),
        ("logprobs", 21),
        ("ignore_eos", "yes"),
    ],
)
def test_bad_sampling_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_bad_requests_get_clear_errors(models):
    model = models["mla"]
    engine = Engine(model, cache_tokens=64, page_size=4)
    ok = SamplingParams(max_tokens=4)
    with pytest.raises(ValueError, match="prompt is empty"):
        engine.add_request([], ok)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request([1, 97], ok)
    with pytest.raises(ValueError, match="longer than the model's context of 96"):
        engine.add_request([1] * 97, ok)
    with pytest.raises(ValueError, match="more than the whole cache pool"):
        engine.add_request([1] * 60, SamplingParams(max_tokens=20))
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        engine.add_request([1], SamplingParams(stop=["x"]))
    engine.add_request([1], ok, request_id="r")
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request([1], ok, request_id="r")
    with pytest.raises(ValueError, match="max_batch"):
        Engine(model, max_batch=0)
    assert engine.max_model_len == 96


def test_a_long_prompt_is_prefilled_in_chunks_beside_running_decodes(models):
    model = models["mla"]
    engine = Engine(model, cache_tokens=512, page_size=4, prefill_chunk=8)
    params = SamplingParams(max_tokens=20, **GREEDY)
    a = engine.add_request(_prompts()[0], params)
    engine.step()  # a's prompt (5 tokens) is in, its first token out
    long_prompt = _prompts(1, (40,), seed=9)[0]
    b = engine.add_request(long_prompt, params)
    for _ in range(4):  # 40 prompt tokens at 8 a step: a decodes every step meanwhile
        outs = {o.request_id: o for o in engine.step()}
        assert len(outs[a].new_token_ids) == 1 and b not in outs
        assert engine.requests[b].computed < 40
    outs = {o.request_id: o for o in engine.step()}  # the last chunk, then b's first token
    assert len(outs[a].new_token_ids) == 1 and len(outs[b].new_token_ids) == 1
    while engine.has_unfinished():
        engine.step()
    assert engine.stats()["pages_used"] == 0


def test_prefill_chunks_of_several_requests_run_as_one_forward(models):
    """Prompts of different lengths admitted together are prefilled in one padded forward (not one each), and
    the greedy output still equals generate in float64."""
    from kvlm.serve.engine import group_chunks

    model = models["mha"]
    prompts = _prompts(4, lengths=(30, 17, 20, 25))
    want = [generate(model, p, 4, **GREEDY) for p in prompts]
    engine = Engine(model, cache_tokens=512, page_size=4, prefill_chunk=256)
    calls, hook = _forwards(model)
    try:
        ids = [engine.add_request(p, SamplingParams(max_tokens=4, **GREEDY)) for p in prompts]
        got = {i: [] for i in ids}
        for o in engine.step():  # all four prompts in, and their first tokens
            got[o.request_id] += o.new_token_ids
        assert calls == [[((4, 30), "PagedBatch")]]
        while engine.has_unfinished():
            for o in engine.step():
                got[o.request_id] += o.new_token_ids
    finally:
        hook.remove()
    assert [got[i] for i in ids] == want
    assert engine.cache.num_used_pages == 0

    class R:  # group_chunks only reads the counts
        pass

    chunks = [(R(), n) for n in (100, 90, 3, 3, 3, 8, 8)]
    groups = [[n for _, n in g] for g in group_chunks(chunks)]
    assert sorted(n for g in groups for n in g) == sorted(n for _, n in chunks)
    # the 3-token chunks would take the padded size over twice the real tokens: a group of their own
    assert groups == [[100, 90, 8, 8], [3, 3, 3]]
    groups = [[n for _, n in g] for g in group_chunks([(R(), n) for n in (16, 16, 9, 9, 4)])]
    assert groups == [[16, 16], [9, 9], [4]]  # at most 16 columns (the kernels' calls): equal lengths only


# --- one forward per step: decodes and prompt chunks as one-token rows (PackedBatch) ------------------------


def _forwards(model):
    """Record every forward of the model, each as the list of its cache calls' (tokens shape, view type): one
    for ``model(tokens, cache=view)``, one per call for ``forward_parts``. Returns (forwards, undo)."""
    forwards = []

    def hook(module, args, kwargs):
        forwards.append([(tuple(args[0].shape), type(kwargs.get("cache")).__name__)])

    handle = model.register_forward_pre_hook(hook, with_kwargs=True)
    plain = model.forward_parts

    def forward_parts(calls, logits_rows):
        forwards.append([(tuple(t.shape), type(view).__name__) for t, view in calls])
        return plain(calls, logits_rows)

    model.forward_parts = forward_parts

    class Undo:
        @staticmethod
        def remove():
            handle.remove()
            del model.forward_parts

    return forwards, Undo


def _calls(forwards):
    return [call for forward in forwards for call in forward]


def _one_per_mechanism():
    seen, out = set(), []
    for param in all_variants():
        if param.values[0] not in seen:
            seen.add(param.values[0])
            out.append(param)
    return out


PACK_CACHED = (6, 0, 17, 9)  # tokens each sequence holds before the packed call
PACK_NEW = (1, 7, 1, 3)  # its new tokens in the call: decodes and prompt chunks


@pytest.mark.parametrize("attention,overrides", _one_per_mechanism())
def test_packed_batch_equals_each_sequence_alone(attention, overrides):
    """Decodes and chunks of different sequences as one call of one-token rows give, in float64, every new
    token's logits of each sequence run alone, and leave caches from which the next decodes agree."""
    _check_packed(attention, overrides, None)


@pytest.mark.parametrize("attention", ["mha", "mla"])
def test_packed_batch_quantized(attention):
    _check_packed(attention, {}, "int8")


def _check_packed(attention, overrides, kv_dtype):
    torch.manual_seed(0)
    model = build_model(tiny_config(attention, **overrides)).double().eval().prepare_for_inference()
    g = torch.Generator().manual_seed(3)
    V = model.cfg.vocab_size
    cached = [torch.randint(0, V, (n,), generator=g) for n in PACK_CACHED]
    new = [torch.randint(0, V, (n,), generator=g) for n in PACK_NEW]
    with torch.inference_mode():
        alone, packed = twin_paged_caches(model, cached, kv_dtype)
        want = torch.cat([model(x[None], cache=alone.batch([i]))[0] for i, x in enumerate(new)])
        view = PackedBatch(packed, [0, 1, 2, 3], list(PACK_NEW))
        got = model(torch.cat(new)[:, None], cache=view)[:, 0]
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
        assert view.last_rows == [0, 7, 8, 11]
        for i in range(4):
            assert packed.seq_len(i) == alone.seq_len(i) == PACK_CACHED[i] + PACK_NEW[i]
            assert packed.seqs[i].tokens == alone.seqs[i].tokens  # the prefix keys hash the same tokens
        step = torch.randint(0, V, (4, 1), generator=g)
        torch.testing.assert_close(
            model(step, cache=packed.batch([0, 1, 2, 3])),
            model(step, cache=alone.batch([0, 1, 2, 3])),
            rtol=1e-10,
            atol=1e-10,
        )


PARTS_CACHED = (6, 0, 17, 9, 5)  # tokens each sequence holds before the forward_parts call
PARTS_NEW = (1, 7, 1, 3, 4)  # its new tokens: decodes of 0 and 2, a padded group of 1 and 3, a packed call of 4


@pytest.mark.parametrize(
    "attention,overrides", [*_one_per_mechanism(), pytest.param("mha", {"arch": "gpt2"}, id="mha[arch=gpt2]")]
)
def test_forward_parts_equals_each_call_alone(attention, overrides):
    """Three calls in one forward (a decode batch, a left-padded prefill group, a packed call: each attends
    through its own view, the MLP and LM head run once on all rows) give, in float64, the logits of each
    sequence run alone, and leave caches from which the next decodes agree."""
    torch.manual_seed(0)
    model = build_model(tiny_config(attention, **overrides)).double().eval().prepare_for_inference()
    g = torch.Generator().manual_seed(5)
    V = model.cfg.vocab_size
    cached = [torch.randint(0, V, (n,), generator=g) for n in PARTS_CACHED]
    new = [torch.randint(0, V, (n,), generator=g) for n in PARTS_NEW]
    with torch.inference_mode():
        alone, parts = twin_paged_caches(model, cached)
        want = torch.stack([model(x[None], cache=alone.batch([i]))[0, -1] for i, x in enumerate(new)])
        padded = torch.stack([torch.cat([torch.zeros(7 - len(x), dtype=x.dtype), x]) for x in (new[1], new[3])])
        calls = [
            (torch.cat([new[0], new[2]])[:, None], parts.batch([0, 2])),
            (padded, parts.batch([1, 3], [7, 3])),
            (new[4][:, None], PackedBatch(parts, [4], [4])),
        ]
        got = model.forward_parts(calls, [0, 1, 2 + 6, 2 + 13, 16 + 3])
        torch.testing.assert_close(got, want[[0, 2, 1, 3, 4]], rtol=1e-10, atol=1e-10)
        for i in range(5):
            assert parts.seq_len(i) == alone.seq_len(i) == PARTS_CACHED[i] + PARTS_NEW[i]
            assert parts.seqs[i].tokens == alone.seqs[i].tokens
        step = torch.randint(0, V, (5, 1), generator=g)
        torch.testing.assert_close(
            model(step, cache=parts.batch(list(range(5)))),
            model(step, cache=alone.batch(list(range(5)))),
            rtol=1e-10,
            atol=1e-10,
        )


def test_forward_parts_refuses_bad_calls(models):
    model = models["mha"]
    cache = PagedKVCache.for_model(model, cache_tokens=64, page_size=4)
    for i in range(2):
        cache.add_sequence(i)
    one = torch.tensor([[3]])
    with torch.inference_mode():
        with pytest.raises(ValueError, match="at least one"):
            model.forward_parts([], [])
        with pytest.raises(CacheError, match="appear in two calls"):
            model.forward_parts([(one, cache.batch([0])), (one, cache.batch([0]))], [0])
        with pytest.raises(CacheError, match="paged views"):
            model.forward_parts([(one, model.new_cache(1))], [0])
        with pytest.raises(ValueError, match="outside the vocabulary"):
            model.forward_parts([(torch.tensor([[500]]), cache.batch([1]))], [0])
    assert cache.seq_len(0) == cache.seq_len(1) == 0 and cache.num_used_pages == 0


@pytest.mark.parametrize("name", ["mla", "mha", "eg-mla"])
def test_mixed_steps_run_one_forward_and_equal_generate(models, name):
    """A step with decodes and prompt chunks is ONE forward: with mixing, one call of one-token rows (a packed
    batch); without (mix_tokens=0), one call per padded chunk group beside the decodes' (``forward_parts``).
    The greedy output equals generate both ways."""
    model = models[name]
    prompts = _prompts(3, lengths=(5, 11, 2))
    want = [generate(model, p, 8, **GREEDY) for p in prompts]
    params = SamplingParams(max_tokens=8, **GREEDY)
    results = {}
    for mix in (64, 0):
        engine = Engine(model, cache_tokens=512, page_size=4, prefill_chunk=8, mix_tokens=mix)
        calls, hook = _forwards(model)
        try:
            ids = [engine.add_request(prompts[0], params)]
            got = {ids[0]: engine.step()[0].new_token_ids}  # a's prompt alone
            assert calls == [[((1, 5), "PagedBatch")]]
            ids += [engine.add_request(p, params) for p in prompts[1:]]
            got.update({i: [] for i in ids[1:]})
            per_step = []
            while engine.has_unfinished():
                del calls[:]
                for o in engine.step():
                    got[o.request_id] += o.new_token_ids
                per_step.append(list(calls))
        finally:
            hook.remove()
        assert [got[i] for i in ids] == want
        results[mix] = per_step
    # a decodes while b's prompt (11 tokens) goes in as 8 + 3 and c's (2) beside the 3
    assert results[64][:2] == [[[((9, 1), "PackedBatch")]], [[((6, 1), "PackedBatch")]]]
    assert results[0][:2] == [  # chunks of <= 16 tokens and different lengths are never padded together
        [[((1, 1), "PagedBatch"), ((1, 8), "PagedBatch")]],
        [[((1, 1), "PagedBatch"), ((1, 3), "PagedBatch"), ((1, 2), "PagedBatch")]],
    ]
    assert all(len(step) == 1 for mix in (64, 0) for step in results[mix])


def test_packed_step_runs_the_lm_head_on_each_sequences_last_row_only(models):
    """In a packed step the LM head (the largest GEMM of a decode step) sees one row per sequence, its last, not
    every prompt token; the logits of that row are the ones a model call without the cut gives."""
    model = models["mla"]
    params = SamplingParams(max_tokens=4, **GREEDY)
    engine = Engine(model, cache_tokens=512, page_size=4, prefill_chunk=8)
    head_rows = []
    hook = model.lm_head.register_forward_pre_hook(lambda m, args: head_rows.append(args[0].shape[0]))
    try:
        engine.add_request(_prompts(1, lengths=(5,))[0], params)
        engine.step()
        engine.add_request(_prompts(1, lengths=(11,))[0], params)
        del head_rows[:]
        engine.step()  # one packed forward: 1 decode row + 8 prompt rows of two sequences
    finally:
        hook.remove()
    assert head_rows == [2]
    torch.manual_seed(0)
    tokens = torch.randint(0, model.cfg.vocab_size, (5, 3))
    with torch.inference_mode():
        full = model(tokens)
        cut = model(tokens, logits_rows=[4, 1])
    torch.testing.assert_close(cut, full[[4, 1]])


def test_greedy_equals_generate_through_mixed_steps_and_preemption(models):
    """Requests arriving while others decode, chunked prompts and preemption in a tiny pool: every schedule
    runs mixed forwards and the outputs still equal generate (float64)."""
    model = models["mla"]
    prompts = _prompts()
    want = [generate(model, p, 12, **GREEDY) for p in prompts]
    engine = Engine(model, cache_tokens=48, page_size=4, prefill_chunk=8)  # 12 pages for 5 requests
    calls, hook = _forwards(model)
    params = SamplingParams(max_tokens=12, **GREEDY)
    try:
        ids, got = [], {}
        for p in prompts:  # one new request every other step
            ids.append(engine.add_request(p, params))
            got[ids[-1]] = []
            for _ in range(2):
                for o in engine.step():
                    got[o.request_id] += o.new_token_ids
        while engine.has_unfinished():
            for o in engine.step():
                got[o.request_id] += o.new_token_ids
    finally:
        hook.remove()
    assert [got[i] for i in ids] == want
    assert engine.stats()["preemptions"] > 0 and engine.stats()["pages_used"] == 0
    assert sum(kind == "PackedBatch" for _, kind in _calls(calls)) >= 3


def test_plan_step_mixes_when_it_saves_a_forward():
    class R:
        def __init__(self, computed=0):
            self.computed = computed

    def plan(counts, mix=64, computed=0):
        packed, groups = plan_step([(R(computed), n) for n in counts], mix)
        return sorted(n for _, n in packed), [sorted(n for _, n in g) for g in groups]

    # decodes take the shortest chunks while their tokens fit mix_tokens; the rest keep padded forwards
    assert plan([1, 1, 60, 3, 100, 5]) == ([1, 1, 3, 5], [[60, 100]])
    assert plan([1, 1, 32]) == ([1, 1, 32], [])
    assert plan([1, 1, 32], mix=0) == ([1, 1], [[32]])
    assert plan([1, 1, 65]) == ([1, 1], [[65]])
    # a chunk deep in a long prompt reads many keys per row: its own (prefill) forward
    assert plan([1, 8], computed=MIX_KEYS // 8) == ([1], [[8]])
    # no decodes: packed only when that saves a forward
    assert plan([3, 5, 7]) == ([3, 5, 7], [])  # three unpadded calls otherwise
    assert plan([32] * 8) == ([], [[32] * 8])  # one padded prefill forward already
    assert plan([20]) == ([], [[20]])


# --- batched sampling -----------------------------------------------------------------------------------


def _reference_distribution(row, p):
    """Temperature, then top-k (ties with the k-th kept), then top-p on what top-k kept (the token that
    crosses top_p kept), written out plainly in Python."""
    z = [v / p.temperature for v in row]
    keep = list(range(len(z)))
    if 0 < p.top_k < len(z):
        kth = sorted(z, reverse=True)[p.top_k - 1]
        keep = [i for i in keep if z[i] >= kth]
    m = max(z[i] for i in keep)
    w = {i: math.exp(z[i] - m) for i in keep}
    total = sum(w.values())
    prob = {i: w[i] / total for i in keep}
    if p.top_p < 1:
        mass, kept = 0.0, []
        for i in sorted(keep, key=lambda i: -prob[i]):
            if mass >= p.top_p:
                break
            kept.append(i)
            mass += prob[i]
        keep = kept
    total = sum(w[i] for i in keep)
    return [w[i] / total if i in keep else 0.0 for i in range(len(z))]


SAMPLING_CASES = [
    dict(temperature=1.0),
    dict(temperature=0.5, top_k=3),
    dict(temperature=2.0, top_k=1),
    dict(temperature=1.0, top_p=0.5),
    dict(temperature=0.7, top_k=5, top_p=0.8),
    dict(temperature=1.3, top_k=4),  # the 4th value is tied with the 5th: both stay
    dict(temperature=1.0, top_k=12, top_p=0.999),
    dict(temperature=1.0, top_p=0.05),  # only the most likely token
]


def _fixed_logits():
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(len(SAMPLING_CASES), 12, generator=g, dtype=torch.float64) * 2
    row = logits[5].sort(descending=True).values
    logits[5, logits[5] == row[4]] = float(row[3])  # a tie at the top-k boundary
    return logits


def test_top_k_top_p_match_a_plain_reference():
    logits = _fixed_logits()
    params = [SamplingParams(**c) for c in SAMPLING_CASES]
    got = distributions(logits, params)
    for b, p in enumerate(params):
        want = _reference_distribution(logits[b].tolist(), p)
        assert got[b].tolist() == pytest.approx(want, abs=1e-12), SAMPLING_CASES[b]
    assert (got[5] > 0).sum() == 5 and (got[2] > 0).sum() == 1 and (got[7] > 0).sum() == 1


def test_sampled_tokens_follow_the_distribution():
    """5000 draws per setting (in batches of 500 rows, each with its own generator) match the filtered
    probabilities (a frequency's standard error is at most 0.007) and never pick a token the filters removed."""
    logits = _fixed_logits()
    params = [SamplingParams(**c) for c in SAMPLING_CASES]
    want = distributions(logits, params)
    counts = torch.zeros_like(want)
    for b, p in enumerate(params):
        gens = [torch.Generator().manual_seed(1000 * b + i) for i in range(500)]
        for _ in range(10):
            for t in sample_batch(logits[b].expand(500, -1), [p] * 500, gens):
                counts[b, t] += 1
    freq = counts / counts.sum(-1, keepdim=True)
    assert (counts[want == 0] == 0).all()
    assert (freq - want).abs().max() < 0.03


def test_sampling_rows_are_independent_of_the_batch():
    """A seeded row draws the same tokens alone and among other rows (greedy and sampled, other settings)."""
    logits = _fixed_logits()
    params = [SamplingParams(**c) for c in SAMPLING_CASES]
    alone = []
    for b, p in enumerate(params):
        g = torch.Generator().manual_seed(b)
        alone.append([sample_batch(logits[b : b + 1], [p], [g])[0] for _ in range(30)])
    greedy = SamplingParams(temperature=0.0)
    mixed_params = [greedy, *params, greedy]
    mixed_logits = torch.cat([logits[:1], logits, logits[-1:]])
    gens = [torch.Generator().manual_seed(s) for s in [99, *range(len(params)), 98]]
    together = [sample_batch(mixed_logits, mixed_params, gens) for _ in range(30)]
    for b in range(len(params)):
        assert [step[b + 1] for step in together] == alone[b]
    assert all(
        step[0] == int(logits[0].argmax()) and step[-1] == int(logits[-1].argmax()) for step in together
    )
    assert len(set(alone[0])) > 3  # the draws do vary (temperature 1 over 12 tokens)


def test_logprobs_batch_against_log_softmax():
    logits = _fixed_logits()
    chosen, tops = logprobs_batch(logits[:3], [4, 0, 11], [0, 2, 5])
    lp = torch.log_softmax(logits[:3], -1)
    assert chosen == pytest.approx([float(lp[0, 4]), float(lp[1, 0]), float(lp[2, 11])], abs=1e-12)
    assert tops[0] == []
    for b, n in ((1, 2), (2, 5)):
        order = lp[b].argsort(descending=True)[:n].tolist()
        assert [i for i, _ in tops[b]] == order
        assert [v for _, v in tops[b]] == pytest.approx(lp[b, order].tolist(), abs=1e-12)


def test_seeded_request_in_mixed_steps_samples_as_alone(models):
    """A seeded request keeps its tokens when other requests' prompts are packed into its decode forwards
    and when it is itself prefilled beside their decodes."""
    model = models["mla"]
    p = _prompts()[1]
    params = SamplingParams(max_tokens=10, temperature=0.9, top_k=30, top_p=0.95, seed=7)
    alone = Engine(model, cache_tokens=512).generate([p], params)[0]
    engine = Engine(model, cache_tokens=512, page_size=4, prefill_chunk=16)
    calls, hook = _forwards(model)
    try:
        got = {}
        others = [
            SamplingParams(max_tokens=6, temperature=1.0, seed=1),
            SamplingParams(max_tokens=6, **GREEDY),
        ]
        first = engine.add_request(_prompts()[0], others[0])
        engine.step()
        mine = engine.add_request(p, params)  # prefilled beside first's decode
        got[mine] = []
        for k in range(12):
            if k == 2:
                engine.add_request(_prompts()[3], others[1])  # a 30-token prompt: 16 + 14 beside mine
            for o in engine.step():
                if o.request_id == mine:
                    got[mine] += o.new_token_ids
        while engine.has_unfinished():
            for o in engine.step():
                if o.request_id == mine:
                    got[mine] += o.new_token_ids
    finally:
        hook.remove()
    assert first != mine and got[mine] == alone
    assert sum(kind == "PackedBatch" for _, kind in _calls(calls)) >= 2


@pytest.mark.parametrize("leads", [True, False])
def test_weights_packed_past_the_kernel_where_it_leads(leads, monkeypatch):
    """float32 on CPU the engine packs oneDNN's layout for the rows past the few-row kernel's where the kernel
    measured faster at its most rows (``kernel_leads``), else for any rows; greedy output equals the unpacked
    engine's either way (12 requests: decode steps of 12 rows)."""
    import kvlm.serve.engine as engine_module
    from kvlm.attention.linear import ANY_ROWS, PAST_KERNEL, packing_available

    if not packing_available(ANY_ROWS):
        pytest.skip("no oneDNN in this torch build: nothing to pack")
    monkeypatch.setattr(engine_module, "kernel_leads", lambda weight: leads)
    torch.manual_seed(0)
    model = build_model(tiny_config("mha", max_seq_len=96)).eval()
    prompts = _prompts(12, lengths=(5, 11, 2, 30, 17, 3, 8, 9, 4, 6, 12, 7))
    params = SamplingParams(max_tokens=6, **GREEDY)
    plain = Engine(model, cache_tokens=2048, pack_weights=False)
    want, _, _ = _run(plain, prompts, params)
    engine = Engine(model, cache_tokens=2048)
    assert engine.weight_layout == (PAST_KERNEL if leads else ANY_ROWS) and engine.packed_weights > 0
    assert model.lm_head._packed[0][2] == engine.weight_layout
    got, _, _ = _run(engine, prompts, params)
    assert got == want
