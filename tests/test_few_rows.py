"""Decode's weight products at a few rows (issue 15, "weight GEMMs at batch 1-8 read weights near bandwidth"): the
few-row kernel (kvlm.kernels.few_rows, csrc/few_rows.h) against float64 products, where it declines, and its
place in the step: ``Linear`` and grouped projections take it up to 8 rows, eager and compiled, with the same
logits as the library products and the same FLOP count."""

import time

import pytest
import torch
import torch.nn.functional as F
from conftest import require_kernels, tiny_config

from kvlm import build_model
from kvlm.attention.linear import (
    ANY_ROWS,
    PANELS,
    PAST_KERNEL,
    GroupPacking,
    Linear,
    kernel_leads,
    library_packed,
    packing_available,
)
from kvlm.bench.flops import CountFlops
from kvlm.kernels import few_rows
from kvlm.kernels.shared import LINEAR_CALLS
from kvlm.model import Block


@pytest.fixture(autouse=True)
def _kernel():
    require_kernels()
    if not few_rows.few_rows_available():
        pytest.skip("neither AVX-512 nor AVX2 on this CPU: the few-row kernel is not built (the library products run)")


def _require_panels():
    if not few_rows.panels_available():
        pytest.skip("no AVX-512 on this CPU: the kernel on panels is not built (the AVX2 kernel has no panels)")


def _require_head_products():
    if not few_rows.head_products_available():
        pytest.skip("neither AVX-512 nor AVX2 on this CPU: the per-head products are not built (torch.bmm runs them)")


def _reference(x, weights, biases):
    return torch.cat(
        [F.linear(x.double(), w.double(), None if b is None else b.double()) for w, b in zip(weights, biases)], -1
    )


@pytest.mark.parametrize("rows", range(1, few_rows.MAX_ROWS + 1))
@pytest.mark.parametrize("k", [1, 37, 64, 200])
def test_the_kernel_computes_the_products(rows, k):
    """Every row count up to MAX_ROWS (row blocks of 8, 4, 2, 1; on AVX2 from 4 rows blocks of 4 rows x 3 weight
    rows, from 8 rows their loop in assembly with each pass's share of the prefetch: 2 + 1, 1 + 1 + 1, and from 16
    rows (4 passes and more, to 64 on AVX2) some passes none; and the rest), feature counts off and
    on the vector width and its double, weights of any number of rows (not whole work units, nor groups of 3), with
    and without biases, concatenated in one output."""
    torch.manual_seed(rows * 1000 + k)
    x = torch.randn(2, rows, k)[1]  # a view: the kernel reads it as given
    weights = [torch.randn(n, k) for n in (53, 16, 5)]
    biases = [torch.randn(53), None, torch.randn(5)]
    with torch.no_grad():
        got = few_rows.few_rows_linear(x, weights, biases, first=rows <= few_rows.FEW_ROWS)
    assert got is not None and got.shape == (rows, 74)
    torch.testing.assert_close(got.double(), _reference(x, weights, biases), rtol=1e-5, atol=1e-5 * k**0.5)


@pytest.mark.parametrize("offset", [0, 1, 4, 15])
@pytest.mark.parametrize("rows", [1, 2, 8])
def test_weights_at_any_alignment(offset, rows):
    """The kernel loads 64-byte-aligned weight vectors non-temporally and the rest as usual: a contiguous weight
    starting 4, 16 or 60 bytes past a 64-byte boundary (a view into a larger buffer) gives the same products (an
    aligned-only load there would fault)."""
    torch.manual_seed(offset)
    k = 64
    weight = torch.randn(40 * k + 16)[offset : offset + 40 * k].view(40, k)
    assert weight.is_contiguous() and (weight.data_ptr() % 64 == 0) == (offset == 0)
    x = torch.randn(rows, k)
    with torch.no_grad():
        got = few_rows.few_rows_linear(x, [weight], [None])
    torch.testing.assert_close(got.double(), _reference(x, [weight], [None]), rtol=1e-5, atol=1e-4)


def test_leading_axes_are_kept():
    x = torch.randn(2, 3, 48)
    w = torch.randn(40, 48)
    with torch.no_grad():
        got = few_rows.few_rows_linear(x, [w], [None])
    torch.testing.assert_close(got.double(), _reference(x, [w], [None]), rtol=1e-5, atol=1e-4)
    assert got.shape == (2, 3, 40)


def test_it_declines_what_it_does_not_take(monkeypatch):
    w, b = torch.randn(40, 48), torch.randn(40)
    x = torch.randn(4, 48)
    with torch.no_grad():
        assert few_rows.few_rows_linear(x, [w], [b]) is not None
        assert few_rows.few_rows_linear(torch.randn(9, 48), [w], [b]) is None  # more than 8 rows
        assert few_rows.few_rows_linear(x.double(), [w.double()], [b.double()]) is None  # the reference dtype
        assert few_rows.few_rows_linear(x, [torch.randn(48, 40).t()], [b]) is None  # not contiguous
        assert few_rows.few_rows_linear(x, [w], [torch.randn(80)[::2]]) is None
        assert few_rows.few_rows_linear(torch.randn(0, 48), [w], [b]) is None  # no rows
    w.requires_grad_(True)
    assert few_rows.few_rows_linear(x, [w], [b]) is None  # autograd records: no backward here
    monkeypatch.setenv("KVLM_KERNELS", "0")
    with torch.no_grad():
        assert few_rows.few_rows_linear(x, [w], [b]) is None


def _off(monkeypatch):
    monkeypatch.setattr(few_rows, "FEW_ROWS", 0)
    monkeypatch.setattr(few_rows, "MAX_ROWS", 0)


def test_its_rows_follow_the_micro_kernel_built():
    """MAX_ROWS is 64 where the kernel built its AVX2 micro-kernel (ahead of oneDNN's layout there to 64 rows: 1.35x
    at 32, 1.12-1.23x at 64 on the Zen 3 EPYC), 16 on AVX-512 (oneDNN ahead from 12-16 rows); the guess from the CPU's
    flags made at import (kvlm.kernels.cpu.avx2_only) agrees with what the compiler built."""
    from kvlm.kernels import cpu

    built_avx2 = bool(cpu.extension().avx2)
    assert cpu.avx2_only() == built_avx2
    assert few_rows.MAX_ROWS == (64 if built_avx2 else 16)


@pytest.mark.parametrize("bias", [False, True])
def test_linear_takes_it_up_to_max_rows_and_a_packed_copy_from_9(bias):
    """Up to 8 rows the kernel takes the product before any packed copy; 9 to MAX_ROWS rows (16; 64 on AVX2) it
    takes those that no packed copy serves; beyond, the library."""
    torch.manual_seed(0)
    lin = Linear(48, 40, bias=bias).eval()

    def through_kernel(rows) -> bool:
        x = torch.randn(rows, 1, 48)
        before = LINEAR_CALLS["few_rows"]
        got = lin(x)
        torch.testing.assert_close(got.double(), _reference(x, [lin.weight], [lin.bias]), rtol=1e-5, atol=1e-5)
        return LINEAR_CALLS["few_rows"] - before == 1

    with torch.no_grad():
        most = few_rows.MAX_ROWS
        assert [through_kernel(rows) for rows in (1, 3, 8, 9, 16, most, most + 1)] == [True] * 6 + [False]
        if packing_available(12):
            assert lin.pack_for_decode(12)
            assert not through_kernel(12)  # the packed copy
            assert lin.pack_for_decode(4) and through_kernel(4)  # the kernel first
    x = torch.randn(2, 48)
    before = LINEAR_CALLS["few_rows"]
    lin(x).sum().backward()  # training: the plain product, which has a backward
    assert LINEAR_CALLS["few_rows"] == before and lin.weight.grad is not None


def test_the_packed_products_or_the_kernel_by_measurement(monkeypatch):
    """From 9 rows on ``generate`` packs in whichever layout measured fastest on this machine, or not at all
    where the kernel did: each available candidate timed, once per rows and shape (a second call times nothing),
    the one with the lowest median named; where the kernel does not take the weight, a packed layout wins."""
    from kvlm.attention import linear

    if not (packing_available(12) and packing_available(ANY_ROWS)):
        pytest.skip("this torch build has no MKL / oneDNN packed GEMM")
    w = torch.randn(200, 64)
    reorders = []
    real_reorder, real_product, real_few = linear._reorder, linear._packed_product, linear.few_rows_linear
    monkeypatch.setattr(linear, "_reorder", lambda w, rows: reorders.append(rows) or real_reorder(w, rows))
    monkeypatch.setattr(linear, "_FASTEST", {})
    answer = linear.fastest_packing(w, 12)
    panels = [PANELS] if few_rows.panels_available() else []  # the AVX2 kernel has no panels
    assert answer in (None, 12, ANY_ROWS, PANELS) and reorders == [12, ANY_ROWS, *panels]
    assert linear.fastest_packing(w, 12) == answer and reorders == [12, ANY_ROWS, *panels]
    reorders.clear()  # up to 8 rows the AVX-512 kernel's own panels are the one candidate (the libraries are
    # behind there); the AVX2 kernel, which has no panels, races MKL's layout for the rows (oneDNN's from 4 rows)
    if panels:
        assert linear.fastest_packing(w, 3) in (None, PANELS) and reorders == [PANELS]
    else:
        assert linear.fastest_packing(w, 3) in (None, 3) and reorders == [3]
    reorders.clear()  # at 1 row none with the panels (they were no faster there); MKL's layout for 1 row without
    if panels:
        assert linear.fastest_packing(w, 1) is None and reorders == []
    else:
        assert linear.fastest_packing(w, 1) in (None, 1) and reorders == [1]
    # the slowest arm is never the answer: each candidate made slow in turn
    for slow in (None, 12, ANY_ROWS, PANELS):
        monkeypatch.setattr(linear, "_FASTEST", {})

        def product(x, packed, weight, bias, rows, count=True, slow=slow):
            time.sleep(0.02 if rows == slow else 0.0)
            return real_product(x, packed, weight, bias, rows, count)

        def few(*a, slow=slow, **k):
            time.sleep(0.02 if slow is None and k.get("count") is False else 0.0)
            return real_few(*a, **k)

        monkeypatch.setattr(linear, "_packed_product", product)
        monkeypatch.setattr(linear, "few_rows_linear", few)
        got = linear.fastest_packing(w, 12)
        assert got != slow
        if slow is None and few_rows.few_rows_available():
            assert got in (12, ANY_ROWS, PANELS)
    # without the kernel, and beyond its rows with it, the unpacked arm is torch's own product: timed as well
    monkeypatch.setattr(linear, "_packed_product", real_product)
    monkeypatch.setattr(linear, "few_rows_linear", real_few)
    real_unpacked = linear._unpacked_product
    for rows, kernel in ((40, True), (13, False)):
        if not kernel:
            _off(monkeypatch)
        for fast in (None, rows, ANY_ROWS):  # each arm made the fastest in turn: it is the answer
            monkeypatch.setattr(linear, "_FASTEST", {})

            def unpacked(*a, fast=fast, **k):
                time.sleep(0.0 if fast is None else 0.02)
                return real_unpacked(*a, **k)

            def product(x, packed, weight, bias, r, count=True, fast=fast):
                time.sleep(0.0 if r == fast else 0.02)
                return real_product(x, packed, weight, bias, r, count)

            monkeypatch.setattr(linear, "_unpacked_product", unpacked)
            monkeypatch.setattr(linear, "_packed_product", product)
            assert linear.fastest_packing(w, rows) == fast


def test_fastest_packing_names_a_layout_only_for_a_clear_gain(monkeypatch):
    """A packed copy of the weights is named only when it beats the unpacked product by ``PACK_GAIN`` (near-ties
    would flip with the machine's noise): on a clock the arms advance by set amounts."""
    from types import SimpleNamespace

    from kvlm.attention import linear

    if not packing_available(ANY_ROWS):
        pytest.skip("this torch build has no oneDNN packed GEMM")
    clock = [0.0]
    cost: dict = {}

    def advance(arm):
        clock[0] += cost.get(arm, 1.0)

    monkeypatch.setattr(linear, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    monkeypatch.setattr(linear, "_unpacked_product", lambda *a, **k: advance(None))
    monkeypatch.setattr(linear, "_packed_product", lambda x, p, w, b, rows, count=True: advance(rows))
    w = torch.randn(40, 16)
    for gain, want in ((1.05, None), (linear.PACK_GAIN * 1.02, ANY_ROWS)):
        monkeypatch.setattr(linear, "_FASTEST", {})
        cost.clear()
        cost.update({None: 1.0, ANY_ROWS: 1.0 / gain, 24: 2.0})
        assert linear.fastest_packing(w, 24) == want


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("k", [1, 37, 64, 200])
def test_panels_take_1_to_max_rows_before_the_kernel(bias, k):
    """A Linear packed in the kernel's panels (32 weight rows column by column) takes products of 1 to MAX_ROWS (16)
    rows through them, before the kernel on the plain weight, with float64's values: 33 weight rows (a partial
    panel), feature counts off and on the vector width, row blocks of 8, 4, 2, 1 and their sums, leading axes kept;
    beyond MAX_ROWS rows the unpacked product."""
    _require_panels()
    torch.manual_seed(k)
    lin = Linear(k, 33, bias=bias).eval()
    with torch.no_grad():
        assert lin.pack_for_decode(PANELS) and lin.packed_first()
        for rows in (1, 2, 3, 4, 5, 7, 8, 9, 12, 15, 16, 17):
            x = torch.randn(rows, 1, k)
            panels, plain = LINEAR_CALLS["panels"], LINEAR_CALLS["few_rows"]
            got = lin(x)
            assert got.shape == (rows, 1, 33)
            want = _reference(x, [lin.weight], [lin.bias])
            torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * k**0.5)
            calls = (LINEAR_CALLS["panels"] - panels, LINEAR_CALLS["few_rows"] - plain)
            assert calls == ((1, 0) if rows <= few_rows.MAX_ROWS else (0, 0)), rows


def test_panels_step_aside_for_a_written_weight_and_for_autograd():
    """A weight written since packing makes the copy stale: the kernel on the plain weight takes the product (the
    new weight's values) until it is packed again; with autograd recording, the plain product (it has a backward)."""
    _require_panels()
    torch.manual_seed(0)
    lin = Linear(48, 40).eval()
    x = torch.randn(3, 48)
    with torch.no_grad():
        assert lin.pack_for_decode(PANELS)
        lin.weight.mul_(2)
        panels, plain = LINEAR_CALLS["panels"], LINEAR_CALLS["few_rows"]
        got = lin(x)
        assert (LINEAR_CALLS["panels"] - panels, LINEAR_CALLS["few_rows"] - plain) == (0, 1)
        torch.testing.assert_close(got.double(), _reference(x, [lin.weight], [lin.bias]), rtol=1e-5, atol=1e-5)
        assert lin.pack_for_decode(PANELS)
        lin(x)
        assert LINEAR_CALLS["panels"] - panels == 1
    panels = LINEAR_CALLS["panels"]
    lin(x.requires_grad_(True)).sum().backward()
    assert LINEAR_CALLS["panels"] == panels and x.grad is not None and lin.weight.grad is not None


@pytest.mark.parametrize("attention,extra", [("mha", {}), ("mla", dict(kv_lora_rank=32, rope_head_dim=8))])
def test_a_step_on_panels_gives_the_logits_and_flops_of_the_plain_kernel(attention, extra):
    """With the weights packed in panels a decode step of 3 rows runs every product through them, one call per
    group of projections (as many calls as the kernel on the plain weights made), with its logits and its FLOPs."""
    _require_panels()
    model = build_model(tiny_config(attention, **extra)).eval().prepare_for_inference()
    want, calls, _ = _decode(model, 3)
    tok = torch.randint(0, model.cfg.vocab_size, (3, 1))
    flops = []
    for packed in (False, True):
        if packed:
            assert model.pack_for_decode(PANELS) > 0
        with torch.inference_mode(), CountFlops() as c:
            model(tok, cache=model.new_cache(3, 8))
        flops.append(c.total)
    panels = LINEAR_CALLS["panels"]
    got, plain, _ = _decode(model, 3)
    assert calls > 0 and plain == 0 and LINEAR_CALLS["panels"] - panels == calls
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert flops[0] > 0 and flops[0] == flops[1]
    model.pack_for_decode(None)
    panels = LINEAR_CALLS["panels"]
    _decode(model, 3)
    assert LINEAR_CALLS["panels"] == panels  # unpacked: the copies dropped


def _decode(model, B, n_new=1):
    """Logits of one decode step of B x n_new rows, the kernel's calls in it and the Linears' own calls, the
    blocks module by module (the block in one call runs its products inside it). The calls are counted on the
    class, not by hooks: a hook on a Linear takes it out of its group's one product, so that the hook fires."""
    torch.manual_seed(1)
    cache = model.new_cache(B, 32)
    prompt = torch.randint(0, model.cfg.vocab_size, (B, 9))
    step = torch.randint(0, model.cfg.vocab_size, (B, n_new))
    linear_calls = []
    forward = Linear.forward
    with pytest.MonkeyPatch.context() as mp, torch.inference_mode():
        mp.setattr(Block, "kept_plan", lambda self: None)
        mp.setattr(Linear, "forward", lambda self, x: linear_calls.append(1) or forward(self, x))
        model(prompt, cache=cache)
        before, linear_calls[:] = LINEAR_CALLS["few_rows"], []
        logits = model(step, cache=cache)
        return logits, LINEAR_CALLS["few_rows"] - before, len(linear_calls)


@pytest.mark.parametrize("attention,extra", [("mha", {}), ("gqa", dict(n_kv_head=2)),
                                             ("mla", dict(kv_lora_rank=32, rope_head_dim=8))])  # fmt: skip
def test_the_step_runs_its_products_through_it_with_the_same_logits(attention, extra, monkeypatch):
    """A decode step of 3 rows (batch 3, or batch 1 with 3 new tokens) runs every weight product through the
    kernel, one call per group of projections reading one input (MHA's q/k/v, SwiGLU's gate/up), and gives the
    logits of the library products (the kernel off: every Linear called on its own)."""
    model = build_model(tiny_config(attention, **extra)).eval().prepare_for_inference()
    groups = [names for m in model.modules() if isinstance(m, GroupPacking) for names in m.packed_groups]
    assert len(groups) == model.cfg.n_layer * (2 if attention in ("mha", "gqa") else 1)
    grouped = sum(len(names) for names in groups)
    for B, n_new in ((3, 1), (1, 3)):
        _off(monkeypatch)
        want, calls, products = _decode(model, B, n_new)
        monkeypatch.undo()
        assert calls == 0
        got, calls, linear_calls = _decode(model, B, n_new)
        assert linear_calls == products - grouped  # a group's Linears run inside its one call
        assert calls == products - grouped + len(groups)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_past_kernel_leaves_the_kernels_rows_to_it():
    """pack_for_decode(PAST_KERNEL) (the serving engine's where the kernel measured faster): oneDNN's copy serves
    only the products past MAX_ROWS rows, the few-row kernel those up to them on the plain weight, so a block
    kernel need not decline them (library_packed); ANY_ROWS's copy takes them from 9 rows."""
    if not packing_available(ANY_ROWS):
        pytest.skip("no oneDNN in this torch build: nothing to pack")
    torch.manual_seed(0)
    lin = Linear(48, 40, bias=True).eval()
    most = few_rows.MAX_ROWS
    for layout, kernel_rows in ((PAST_KERNEL, (4, 8, 12, 16, most)), (ANY_ROWS, (4, 8))):
        assert lin.pack_for_decode(layout)
        assert library_packed([lin]) == (layout == ANY_ROWS)
        with torch.no_grad():
            for rows in (4, 8, 12, 16, most, most + 1):
                x = torch.randn(rows, 1, 48)
                before = LINEAR_CALLS["few_rows"]
                got = lin(x)
                assert (LINEAR_CALLS["few_rows"] - before == 1) == (rows in kernel_rows), (layout, rows)
                torch.testing.assert_close(got.double(), _reference(x, [lin.weight], [lin.bias]), rtol=1e-5, atol=1e-5)


def test_past_kernel_in_a_model_runs_its_groups_on_the_kernel():
    """A model packed PAST_KERNEL runs a 12-row step's products (grouped W1 / W2, W^Q / W^K / W^V, the rest) on the
    kernel, an ANY_ROWS one on oneDNN's copy, both with the unpacked model's logits."""
    if not packing_available(ANY_ROWS):
        pytest.skip("no oneDNN in this torch build: nothing to pack")
    torch.manual_seed(0)
    model = build_model(tiny_config("mha")).eval()
    tok = torch.randint(0, 97, (12, 1))
    with torch.inference_mode():
        want = model(tok)
        for layout in (PAST_KERNEL, ANY_ROWS):
            assert model.pack_for_decode(layout) > 0
            assert library_packed(model.modules()) == (layout == ANY_ROWS)
            before = LINEAR_CALLS["few_rows"]
            got = model(tok)
            assert (LINEAR_CALLS["few_rows"] > before) == (layout == PAST_KERNEL)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        model.pack_for_decode(None)


def test_kernel_leads_times_the_two():
    """kernel_leads races the kernel against oneDNN's layout at up to MAX_ROWS rows (a weight it cannot take, or
    more rows, is False), and is what the serving engine's layout follows."""
    w = torch.randn(256, 64)
    assert kernel_leads(w, rows=few_rows.MAX_ROWS + 1) is False  # past the kernel's rows
    assert kernel_leads(w.double()) is False  # not float32
    assert isinstance(kernel_leads(w), bool)


def test_a_step_through_it_counts_the_same_flops(monkeypatch):
    """kvlm bench counts a step's FLOPs with torch's counter, which does not see the extension: the kernel adds
    its own to the running total it reads."""
    model = build_model(tiny_config("gqa", n_kv_head=2)).eval()
    tok = torch.randint(0, 97, (4, 1))
    totals = []
    for on in (True, False):
        if not on:
            _off(monkeypatch)
        cache = model.new_cache(4, 16)
        before = LINEAR_CALLS["few_rows"]
        with torch.inference_mode(), CountFlops() as c:
            model(tok, cache=cache)
        assert (LINEAR_CALLS["few_rows"] > before) == on
        totals.append(c.total)
    assert totals[0] > 0 and totals[0] == totals[1]


@pytest.mark.parametrize("batch,layout", [(2, None), (12, None), (2, PANELS)])
def test_the_compiled_step_runs_the_same_products_through_it(batch, layout, monkeypatch):
    """Under torch.compile the products go through the operator kvlm::packed_linear, which runs the kernel (at 12
    rows: as no packed copy serves them), or the panels first where the weights are packed in them: as many calls
    as the eager step module by module (the compiled step runs the modules; eagerly a block may be one call,
    tests/test_decode_block.py), the same logits."""
    if layout == PANELS:
        _require_panels()
    monkeypatch.setattr(Block, "kept_plan", lambda self: None)
    torch.manual_seed(0)
    model = build_model(tiny_config("mla", kv_lora_rank=48, rope_head_dim=8, max_seq_len=32)).eval()
    counter = "few_rows" if layout is None else "panels"
    if layout is not None:
        assert model.pack_for_decode(layout) > 0
    cache = model.new_cache(batch, 24)
    cache.fill_random_(5, model.cfg.vocab_size)
    tok = torch.randint(0, model.cfg.vocab_size, (batch, 1))
    torch._dynamo.reset()
    step = torch.compile(lambda t: model(t, cache=cache))
    with torch.inference_mode():
        for length in (5, 7):
            cache.length = length
            before = LINEAR_CALLS[counter]
            eager = model(tok, cache=cache)
            n_eager = LINEAR_CALLS[counter] - before
            cache.length = length
            before = LINEAR_CALLS[counter]
            compiled = step(tok)
            assert n_eager > 0 and LINEAR_CALLS[counter] - before == n_eager
            torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)


def _heads_reference(x, w):
    return torch.einsum("bhtp,hpc->bhtc", x.double(), w.double())


@pytest.mark.parametrize("B,T", [(1, 1), (3, 1), (1, 4), (2, 3), (16, 1), (few_rows.MAX_ROWS // 4, 4)])
@pytest.mark.parametrize("a,b", [(64, 256), (256, 64), (37, 48), (1, 16)])
def test_the_per_head_products_match_float64(B, T, a, b):
    """MLA's absorption products x_h W_h (``few_rows_head_matmul``): every row block (4, 2, 1 rows), column
    counts of one to several 64-column items, inner widths off the vector width, x read in place as a strided
    view (as the query arrives) or copied."""
    _require_head_products()
    torch.manual_seed(B * 100 + T * 10 + a + b)
    h = 3
    w = torch.randn(h, a, b)
    for x in (torch.randn(B, h, T, a), torch.randn(B, T, h, a).transpose(1, 2)):
        with torch.no_grad():
            got = few_rows.few_rows_head_matmul(x, w)
        assert got is not None and got.shape == (B, h, T, b)
        torch.testing.assert_close(got.double(), _heads_reference(x, w), rtol=1e-5, atol=1e-5 * a**0.5)


def test_the_per_head_products_decline_what_they_do_not_take(monkeypatch):
    _require_head_products()
    x, w = torch.randn(2, 3, 1, 32), torch.randn(3, 32, 64)
    with torch.no_grad():
        assert few_rows.few_rows_head_matmul(x, w) is not None
        too_many = torch.randn(few_rows.MAX_ROWS + 1, 3, 1, 32)
        assert few_rows.few_rows_head_matmul(too_many, w) is None  # more than MAX_ROWS rows
        assert few_rows.few_rows_head_matmul(x, torch.randn(3, 32, 40)) is None  # columns not whole vectors
        assert few_rows.few_rows_head_matmul(x.double(), w.double()) is None  # the reference dtype
        assert few_rows.few_rows_head_matmul(x, torch.randn(3, 64, 32).transpose(1, 2)) is None  # not contiguous
        assert few_rows.few_rows_head_matmul(x, torch.randn(2, 32, 64)) is None  # another head count
    w.requires_grad_(True)
    assert few_rows.few_rows_head_matmul(x, w) is None  # autograd records: no backward here
    monkeypatch.setenv("KVLM_KERNELS", "0")
    with torch.no_grad():
        assert few_rows.few_rows_head_matmul(x, w.detach()) is None


@pytest.mark.parametrize("B,n_new", [(3, 1), (1, 3)])
def test_absorbed_mla_runs_its_head_products_through_it(B, n_new, monkeypatch):
    """An absorbed MLA decode step makes its two per-head products a layer through the kernel, with the logits
    and the FLOP count of torch.bmm's products (the kernel declined)."""
    _require_head_products()
    from kvlm.attention import latent_ops

    model = build_model(tiny_config("mla", kv_lora_rank=32, rope_head_dim=8)).eval().prepare_for_inference()
    prompt, tok = torch.randint(0, 97, (B, 5)), torch.randint(0, 97, (B, n_new))
    results = []
    for on in (True, False):
        if not on:
            monkeypatch.setattr(latent_ops, "few_rows_head_matmul", lambda x, w: None)
        cache = model.new_cache(B, 32)
        with torch.inference_mode():
            model(prompt, cache=cache)
            before = LINEAR_CALLS["head_products"]
            with CountFlops() as c:
                logits = model(tok, cache=cache, mode="absorbed")
        results.append((logits, LINEAR_CALLS["head_products"] - before, c.total))
    (got, calls, flops), (want, off_calls, off_flops) = results
    assert calls == 2 * model.cfg.n_layer and off_calls == 0
    assert flops == off_flops
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
