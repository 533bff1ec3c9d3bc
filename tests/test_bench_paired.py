"""The floors of kvlm bench: the matmul peak from every route torch has (kvlm.bench.hardware), and the decode
step against a floor probed beside each timed round (kvlm.bench.paired)."""

import statistics
import time

import pytest
import torch
from conftest import tiny_config

from kvlm import build_model
from kvlm.bench.hardware import Probe, matmul_calls, measure_hardware
from kvlm.bench.paired import paired_ratios, paired_step, timed_rounds


def test_every_matmul_route_computes_the_product_it_is_timed_for():
    a, b = torch.randn(64, 48), torch.randn(64, 48)
    calls = matmul_calls(a, b)
    want = a.double() @ b.double().t()
    if torch.backends.mkldnn.is_available():
        assert "oneDNN" in calls  # the route that reaches AVX-512 on AMD CPUs
    for name, call in calls.items():
        out = call()
        out = out.to_dense() if out.is_mkldnn else out
        torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-4, msg=name)


def test_measure_hardware_peak_is_the_best_route(monkeypatch):
    hw = measure_hardware(torch.device("cpu"), mib=4, repeats=1)
    routes = hw["matmul_routes_gflops"]
    assert set(routes) == set(matmul_calls(torch.randn(8, 8), torch.randn(8, 8)))
    assert all(v > 0 for v in routes.values())
    assert hw["matmul_fp32_gflops"] == max(routes.values())
    # a slow route listed first (as torch.mm is on AMD CPUs) does not set the peak, here or in a Probe
    import kvlm.bench.hardware as hardware

    real = hardware.matmul_calls

    def with_slow_route(a, b):
        return {"slow": lambda: time.sleep(0.02), **real(a, b)}

    monkeypatch.setattr(hardware, "matmul_calls", with_slow_route)
    hw = measure_hardware(torch.device("cpu"), mib=4, repeats=1)
    routes = hw["matmul_routes_gflops"]
    assert routes["slow"] < min(v for k, v in routes.items() if k != "slow")
    assert hw["matmul_fp32_gflops"] == max(routes.values()) > routes["slow"]
    probe = Probe(torch.device("cpu"), mib=4, matmul=256, repeats=1)
    assert probe()["matmul_fp32_gflops"] > 2 * 256**3 / 0.02 / 1e9  # faster than the slow route can be


class FakeTime:
    """A clock that moves only when a fake call says it took time."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now

    def takes(self, ms):
        def call():
            self.now += ms / 1e3

        return call


def test_timed_rounds_bracket_each_round_with_two_probes():
    clock = FakeTime()
    bandwidths = iter([10.0, 30.0, 50.0, 70.0, 90.0, 110.0])
    probes = []

    def probe():
        probes.append(next(bandwidths))
        return {"bandwidth_gbs": probes[-1], "matmul_fp32_gflops": 2 * probes[-1]}

    durations = iter([3.0, 1.0, 2.0] * 3)  # "a" takes 3, 1, 2 ms in turn: median 2
    calls = {"a": lambda: clock.takes(next(durations))(), "b": clock.takes(5.0)}
    rounds = timed_rounds(calls, probe, rounds=3, steps=3, clock=clock)
    assert len(probes) == 6
    assert [r["hardware"]["bandwidth_gbs"] for r in rounds] == [20.0, 60.0, 100.0]  # mean of each round's two
    assert [r["hardware"]["matmul_fp32_gflops"] for r in rounds] == [40.0, 120.0, 200.0]
    for r in rounds:
        assert r["ms"]["a"] == pytest.approx(2.0) and r["ms"]["b"] == pytest.approx(5.0)


def _floor_by_hand(classes, bw_gbs, peak_gflops):
    return {k: max(c["bytes"] / (bw_gbs * 1e6), c["flops"] / (peak_gflops * 1e6)) for k, c in classes.items()}


def test_paired_ratios_set_each_round_against_its_own_floor():
    classes = {
        "weight GEMMs": {"bytes": 4e6, "flops": 1e6},  # bandwidth-bound at every round below
        "attention": {"bytes": 1e6, "flops": 4e8},  # compute-bound
        "LM head": {"bytes": 2e6, "flops": 1e6},
    }
    hws = [(10.0, 100.0), (20.0, 400.0), (40.0, 200.0)]  # the machine moves between rounds
    ms = {"step": 12.0, "short": 7.0, "head": 1.5}  # the same times in every round
    rounds = [{"ms": dict(ms), "hardware": {"bandwidth_gbs": b, "matmul_fp32_gflops": p}} for b, p in hws]
    out = paired_ratios(rounds, classes)
    xs = []
    for r, (b, p) in zip(out["rounds"], hws):
        f = _floor_by_hand(classes, b, p)
        xs.append(12.0 / sum(f.values()))
        assert r["x_floor"] == pytest.approx(xs[-1])
        assert r["classes"]["weight GEMMs"] == pytest.approx((7.0 - 1.5) / f["weight GEMMs"])
        assert r["classes"]["attention"] == pytest.approx((12.0 - 7.0) / f["attention"])
        assert r["classes"]["LM head"] == pytest.approx(1.5 / f["LM head"])
    assert out["x_floor"] == pytest.approx(statistics.median(xs))
    assert (out["x_floor_min"], out["x_floor_max"]) == (pytest.approx(min(xs)), pytest.approx(max(xs)))
    assert out["bandwidth_gbs"] == [10.0, 40.0] and out["ms"] == 12.0


def test_paired_step_times_the_step_at_its_context_and_at_one_token(monkeypatch):
    cfg = tiny_config("gqa", n_kv_head=2).replace(max_seq_len=128)
    model = build_model(cfg).eval()
    context, rounds, steps = 40, 3, 2
    seen = {}  # cache id -> lengths the forward saw
    forward = type(model).forward

    def spy(self, tokens, cache=None, **kw):
        seen.setdefault(id(cache), []).append(cache.length)
        return forward(self, tokens, cache=cache, **kw)

    monkeypatch.setattr(type(model), "forward", spy)
    hw = {"bandwidth_gbs": 50.0, "matmul_fp32_gflops": 300.0}
    out = paired_step(model, 2, context, "auto", lambda: dict(hw), rounds=rounds, steps=steps)
    lengths = sorted(seen.values())
    # one warm-up step then rounds x steps timed steps per cache, each a token on
    n = 1 + rounds * steps
    assert lengths == [list(range(1, 1 + n)), list(range(context, context + n))]
    assert len(out["rounds"]) == rounds and out["bandwidth_gbs"] == [50.0, 50.0]
    # the floor counts the step's classes at ``context`` cached tokens
    from kvlm.bench.roofline import attention_cost, operation_classes, operation_roofline, weight_classes

    classes = operation_classes(weight_classes(model), attention_cost(cfg, 2, context, "auto", 4), 2)
    floor = sum(o["floor_ms"] for o in operation_roofline(classes, hw).values())
    assert out["floor_ms"] == pytest.approx(floor)
    assert out["x_floor"] == pytest.approx(statistics.median(r["ms"]["step"] for r in out["rounds"]) / floor)


def test_probe_measures_positive_bandwidth_and_peak():
    hw = Probe(torch.device("cpu"), mib=4, matmul=64, repeats=1)()
    assert hw["bandwidth_gbs"] > 0 and hw["matmul_fp32_gflops"] > 0
