"""kvlm compare's statistics, verdicts, Pareto marking, parameter matching, costs and report sentences, on
hand-made numbers (no training). Expected values are computed by hand in the comments or taken from published
t tables; none is read back from the code under test."""

import math

import pytest

from kvlm.compare import aggregate
from kvlm.compare.stats import summarize, t_quantile, t_two_sided_p, welch
from kvlm.config import ConfigError, ModelConfig


# --- Student's t and Welch's test ------------------------------------------------------------------------
@pytest.mark.parametrize(
    "df, t975",  # two-sided 95 % critical values of any printed t table
    [(1, 12.706), (2, 4.303), (4, 2.776), (10, 2.228), (30, 2.042)],
)
def test_t_quantile_matches_the_published_table(df, t975):
    assert t_quantile(0.975, df) == pytest.approx(t975, abs=5e-4)
    assert t_two_sided_p(t975, df) == pytest.approx(0.05, abs=2e-4)


def test_t_tails_by_hand():
    # df = 1 is the Cauchy distribution: P(|T| >= 1) = 1 - 2 atan(1) / pi = 0.5 exactly
    assert t_two_sided_p(1.0, 1) == pytest.approx(0.5, abs=1e-12)
    # df = 2 has a closed form: P(|T| >= t) = 1 - t / sqrt(2 + t^2); at t = 2: 1 - 2 / sqrt(6)
    assert t_two_sided_p(2.0, 2) == pytest.approx(1 - 2 / math.sqrt(6), abs=1e-12)
    assert t_two_sided_p(0.0, 5) == pytest.approx(1.0)
    assert t_quantile(0.975, 1e6) == pytest.approx(1.95996, abs=1e-4)  # the normal limit


def test_summarize_by_hand():
    s = summarize([1.0, 2.0, 3.0])  # mean 2, sample std 1, sem 1 / sqrt(3), half-width t(0.975, 2) sem
    assert (s["n"], s["mean"], s["std"]) == (3, pytest.approx(2.0), pytest.approx(1.0))
    assert s["sem"] == pytest.approx(1 / math.sqrt(3))
    assert s["ci_low"] == pytest.approx(2.0 - 4.3027 / math.sqrt(3), abs=1e-4)
    assert s["ci_high"] == pytest.approx(2.0 + 4.3027 / math.sqrt(3), abs=1e-4)
    one = summarize([2.5])
    assert one["mean"] == 2.5 and one["std"] is None and one["ci_low"] is None


def test_welch_by_hand():
    """a = 1, 2, 3 (mean 2, variance 1), b = 4..7 (mean 5.5, variance 5/3): se^2 = 1/3 + 5/12 = 3/4,
    t = -3.5 / sqrt(3/4) = -4.0415, Welch-Satterthwaite df = (3/4)^2 / ((1/3)^2 / 2 + (5/12)^2 / 3) = 4.9592,
    p = 0.01008 (scipy.stats.ttest_ind(a, b, equal_var=False) gives the same)."""
    w = welch([1, 2, 3], [4, 5, 6, 7])
    assert w["diff"] == pytest.approx(-3.5)
    assert w["t"] == pytest.approx(-3.5 / math.sqrt(0.75))
    assert w["df"] == pytest.approx(0.5625 / ((1 / 9) / 2 + (25 / 144) / 3))
    assert w["p"] == pytest.approx(0.010077, abs=2e-6) and w["significant"]
    assert welch([1.0], [2.0, 3.0]) is None  # one value: nothing to test
    assert not welch([1, 2, 3], [1.5, 2.5, 2.0])["significant"]
    # no spread on either side: the means differ or they do not
    assert welch([1, 1], [2, 2])["significant"] and not welch([1, 1], [1, 1])["significant"]


# --- rows from runs ---------------------------------------------------------------------------------------
def _runs(label, losses, kv_bytes, attention="mla", total=1000, gate=0, tokens=4096):
    return [
        {
            "label": label,
            "attention": attention,
            "seed": s,
            "params": {"total": total, "activated": total - gate, "embedding": 100, "gate_embedding": gate},
            "kv_elements_per_token": kv_bytes // 2,
            "kv_bytes_per_token": kv_bytes,
            "val_loss": loss,
            "val_loss_stderr": 0.001,
            "val_perplexity": math.exp(loss),
            "train_tokens": tokens,
            "repetition": {},
            "history": [],
        }
        for s, loss in enumerate(losses)
    ]


def _rows(*groups, baseline=None):
    return {r["label"]: r for r in aggregate([run for g in groups for run in g], baseline)}


def test_aggregation_over_seeds_by_hand():
    rows = _rows(
        _runs("mha", [2.0, 2.2], 1024, "mha", total=3000),
        _runs("eg", [1.9, 2.0], 256, "eg-mla", total=3600, gate=600),
    )
    mha, eg = rows["mha"], rows["eg"]
    assert mha["val_loss"] == pytest.approx(2.1) and mha["val_loss_std"] == pytest.approx(0.2 / math.sqrt(2))
    # 95 % interval with 2 seeds: mean +- 12.706 * std / sqrt(2) = 2.1 +- 12.706 * 0.1
    assert mha["val_loss_ci95"] == pytest.approx([2.1 - 1.2706, 2.1 + 1.2706], abs=1e-4)
    assert eg["kv_reduction_vs_baseline"] == pytest.approx(0.75)  # 1 - 256 / 1024
    assert eg["val_loss_delta_pct"] == pytest.approx(100 * (1.95 / 2.1 - 1))
    assert eg["val_perplexity"] == pytest.approx((math.exp(1.9) + math.exp(2.0)) / 2)
    # parameters: total 3600 = 100 token embedding + 600 gate tables + 2900 non-embedding
    assert (eg["params_gate_embedding"], eg["params_non_embedding"]) == (600, 2900)
    assert eg["params_ratio_vs_baseline"] == pytest.approx(1.2)
    assert eg["train_tokens"] == [4096]


def test_verdicts_against_the_baseline():
    rows = _rows(
        _runs("mha", [2.00, 2.01, 2.02], 1024, "mha"),
        _runs("good", [1.90, 1.91, 1.92], 256),  # 0.1 lower, spread 0.01: p far below 0.05
        _runs("bad", [2.10, 2.11, 2.12], 256),
        _runs("same", [1.99, 2.03, 2.00], 256),  # mean 2.0067 against 2.01: within noise
    )
    assert rows["mha"]["vs_baseline"]["verdict"] == "baseline"
    assert rows["good"]["vs_baseline"]["verdict"] == "better" and rows["good"]["vs_baseline"]["p"] < 0.001
    assert rows["bad"]["vs_baseline"]["verdict"] == "worse"
    assert rows["same"]["vs_baseline"]["verdict"] == "within seed noise"
    assert rows["same"]["vs_baseline"]["p"] > 0.05
    one = _rows(_runs("mha", [2.0], 1024, "mha"), _runs("x", [1.0], 256))
    assert one["x"]["vs_baseline"]["verdict"] == "not tested" and one["x"]["val_loss_ci95"] is None


def test_baseline_is_explicit():
    groups = (
        _runs("small", [1.0, 1.1], 100),
        _runs("ref", [2.0, 2.2], 400, "mha"),
        _runs("mid", [1.5, 1.6], 200),
    )
    rows = _rows(*groups)  # default: the first MHA, though it is not the first variant
    assert all(r["baseline"] == "ref" for r in rows.values()) and rows["ref"]["is_baseline"]
    rows = _rows(*groups, baseline="mid")
    assert rows["small"]["kv_reduction_vs_baseline"] == pytest.approx(0.5)  # 1 - 100 / 200
    assert rows["ref"]["val_loss_delta_pct"] == pytest.approx(100 * (2.1 / 1.55 - 1))
    assert rows["mid"]["vs_baseline"]["verdict"] == "baseline"
    no_mha = _rows(groups[0], groups[2])
    assert no_mha["small"]["is_baseline"]  # no MHA: the first variant
    with pytest.raises(ConfigError, match="--baseline 'nope' is not a variant"):
        _rows(*groups, baseline="nope")


def test_pareto_with_noise_and_ties():
    rows = _rows(
        _runs("a", [2.0, 2.1, 1.9], 10),
        _runs("b", [1.95, 2.05, 2.0], 20),  # more bytes, loss within noise of a: not dominated
        _runs("c", [3.0, 3.01, 3.02], 20),  # more bytes than a and significantly worse: dominated by a
        _runs("d", [1.5, 1.51, 1.52], 40),  # most bytes, significantly best: on the front
        _runs("e", [3.5, 3.51, 3.52], 10),  # same bytes as a, significantly worse: dominated by a
        _runs("f", [2.0, 2.1, 1.9], 10),  # a's exact twin: a tie dominates neither
    )
    assert {k for k, r in rows.items() if r["pareto"]} == {"a", "b", "d", "f"}
    assert rows["c"]["dominated_by"] == "a" and rows["e"]["dominated_by"] in ("a", "f")
    assert all(r["pareto_tested"] for r in rows.values())


def test_pareto_with_one_seed_goes_by_the_means():
    rows = _rows(_runs("mha", [2.0], 512, "mha"), _runs("mla", [2.0], 128), _runs("big", [1.5], 1024))
    # untested: classical dominance; the tie on loss goes to the smaller cache
    assert (rows["mha"]["pareto"], rows["mla"]["pareto"], rows["big"]["pareto"]) == (False, True, True)
    assert not rows["mla"]["pareto_tested"]


# --- report sentences -------------------------------------------------------------------------------------
def _meta(synthetic=True):
    return {
        "data": "synthetic stories (not real text): 1,000 tokens" if synthetic else "wiki.txt: 1,000 tokens",
        "synthetic": synthetic,
        "budget": "2 steps of 2x32 tokens, peak lr 0.002",
        "train_tokens_per_run": [4096],
        "match": "preset: as the preset sizes them",
        "deploy": {"batch": 2, "context": 1024},
        "hardware": [],
    }


def _with_costs(rows):
    for r in rows.values():
        r["deploy_cache_bytes"] = {"bf16": r["kv_bytes_per_token"] * 2 * 1024}
    return list(rows.values())


def test_report_sentences_on_synthetic_numbers():
    from kvlm.compare.findings import answers

    rows = _with_costs(
        _rows(
            _runs("mha", [2.00, 2.01, 2.02], 1024, "mha"),
            _runs("mla", [1.99, 2.03, 2.00], 256),
            _runs("tiny-r", [2.50, 2.51, 2.52], 1024),
        )
    )
    pareto, noise, budget, cost, data = answers(rows, _meta())
    assert "Pareto front" in pareto and "significantly lower loss" in pareto
    front = pareto.split("Dominated:")[0]
    assert "mla (256 B/token" in front and "mha (1,024 B/token" in front and "tiny-r" not in front
    assert "tiny-r (by mla)" in pareto.split("Dominated:")[1]  # the cheapest dominating variant is named
    assert "within seed noise: mla (-0.17 %" in noise  # 100 * (2.00667 / 2.01 - 1) = -0.166 %
    assert "significantly higher: tiny-r (+24.88 %" in noise  # 100 * (2.51 / 2.01 - 1)
    assert "significantly lower loss: none" in noise
    assert "4,096 training tokens" in budget and "3 seeds per variant" in budget
    assert "2.0 MiB for mha and 0.5 MiB for mla" in cost and "4.0x less" in cost  # 1024 * 2 * 1024 bytes
    assert "synthetic stories (not real text)" in data
    assert "not real text" not in answers(rows, _meta(synthetic=False))[-1]


def test_single_seed_report_says_nothing_is_tested():
    from kvlm.compare.findings import answers

    rows = _with_costs(_rows(_runs("mha", [2.0], 1024, "mha"), _runs("mla", [1.9], 256)))
    pareto, noise, *_ = answers(rows, _meta())
    assert "not tested" in noise and "--seeds 0,1,2" in noise
    assert "nothing is tested" in pareto


def test_gate_tables_are_named_in_the_budget_sentence():
    from kvlm.compare.findings import budget_sentence

    rows = _with_costs(
        _rows(
            _runs("mha", [2.0, 2.1], 1024, "mha", total=1000),
            _runs("eg", [2.0, 2.1], 256, total=1250, gate=250),
        )
    )
    text = budget_sentence(rows, _meta())
    assert "1.000-1.250 x the baseline mha's 1,000" in text
    assert "Gate-embedding tables (counted in the total, not in non-embedding): eg 250." in text


# --- sizing and costs -------------------------------------------------------------------------------------
def test_match_params_makes_totals_equal_within_one_ffn_step():
    from kvlm.compare import Variant, match_variants
    from kvlm.model import count_parameters

    base = ModelConfig(attention="mha", n_layer=2, d_model=64, n_head=4, vocab_size=500, max_seq_len=64)
    eg = ModelConfig(attention="eg-mla", n_layer=2, d_model=64, n_head=4, vocab_size=500, max_seq_len=64,
                     kv_lora_rank=16, rope_head_dim=8, kv_emb_dim=32)  # fmt: skip
    out = match_variants([Variant("mha", base), Variant("eg", eg)], "mha", "params")
    matched = out[1].cfg
    target = count_parameters(base)["total"]
    gap = abs(count_parameters(matched)["total"] - target)
    # the gate tables (2 layers x 500 x 32 = 32,000) cost FFN width: the FFN shrinks, and no neighbouring width
    # (a multiple of 8) comes closer to the baseline's total
    assert matched.ffn_dim < eg.ffn_dim
    for other in (matched.ffn_dim - 8, matched.ffn_dim + 8):
        assert abs(count_parameters(matched.replace(ffn_dim=other))["total"] - target) >= gap
    assert "ffn_dim" in out[1].note and out[0].cfg is base
    assert match_variants([Variant("mha", base), Variant("eg", eg)], "mha", "preset")[1].cfg is eg
    with pytest.raises(ConfigError, match="unknown --match"):
        match_variants([Variant("mha", base)], "mha", "flops")


def test_kv_bytes_per_dtype_by_hand():
    from kvlm.compare.costs import cache_bytes, kv_bytes_by_dtype

    mha = ModelConfig(attention="mha", n_layer=2, d_model=32, n_head=4, vocab_size=100)  # k, v: (4, 8)
    # 2 layers x 2 tensors x 32 elements = 128 elements; int8 adds a 4-byte scale per head row: 2 x 2 x 4 x 4
    assert kv_bytes_by_dtype(mha) == {"fp32": 512, "bf16": 256, "int8": 128 + 64}
    mla = ModelConfig(attention="mla", n_layer=1, d_model=32, n_head=4, vocab_size=100, kv_lora_rank=16,
                      rope_head_dim=8, q_lora_rank=0)  # fmt: skip
    assert kv_bytes_by_dtype(mla) == {"fp32": 96, "bf16": 48, "int8": 24 + 8}  # c_kv (16,), k_rope (8,)
    assert cache_bytes(256, 8, 4096) == 256 * 8 * 4096


def test_reference_size_keeps_the_mechanism_ratios():
    from kvlm.compare.costs import at_reference_size
    from kvlm.preset_table import get_preset

    tiny = get_preset("tiny/mla")  # d = 192, 8 heads of 24, d_c = 96, d_h^R = 12
    ref = at_reference_size(tiny, context=4096)
    assert (ref.n_layer, ref.d_model, ref.vocab_size, ref.n_head) == (6, 768, 32000, 8)
    assert (ref.head_dim, ref.kv_lora_rank, ref.rope_head_dim) == (96, 384, 48)  # all x 768 / 192 = 4
    assert ref.max_seq_len >= 4097
    gqa = at_reference_size(get_preset("tiny/gqa"))
    assert gqa.n_kv_head == get_preset("tiny/gqa").n_kv_head  # head counts kept


def test_loss_curve_bands_by_hand():
    from kvlm.compare.plots import loss_curves

    runs = _runs("a", [1.0, 1.0], 10)
    runs[0]["history"] = [
        {"tokens": 100, "val_loss": 3.0},
        {"tokens": 200, "val_loss": 2.0},
        {"tokens": 250, "val_loss": None},
    ]
    runs[1]["history"] = [{"tokens": 100, "val_loss": 4.0}, {"tokens": 200, "val_loss": 2.5}]
    c = loss_curves(aggregate(runs), runs)["a"]
    assert c == {"tokens": [100, 200], "mean": [3.5, 2.25], "low": [3.0, 2.0], "high": [4.0, 2.5]}
