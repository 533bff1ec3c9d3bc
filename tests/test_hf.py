"""kvlm <-> Hugging Face transformers: export, Auto-class loading (with kvlm or with the folder's own code),
generate() on kvlm's compact cache."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="needs transformers (pip install 'kvlm[hf]')")

from kvlm import ModelConfig, build_model  # noqa: E402
from kvlm.checkpoint import load_checkpoint, save_checkpoint  # noqa: E402
from kvlm.inference.generation import generate  # noqa: E402
from kvlm.interop.hf import export_hf  # noqa: E402
from kvlm.interop.hf_modeling import CACHE_NAME, KVLMCache  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TEXTS = ["the cat sat on the mat and the dog sat on the log", "a small model with a small cache"] * 10

VARIANTS = {
    "gqa": dict(attention="gqa", n_kv_head=2),
    "mla": dict(attention="mla", kv_lora_rank=24, rope_head_dim=8),
}


@pytest.fixture(scope="module")
def tokenizer():
    from kvlm.data.tokenizer import train_bpe

    return train_bpe(TEXTS, vocab_size=300)


def make_checkpoint(path, tokenizer, name):
    torch.manual_seed(0)
    cfg = ModelConfig(n_layer=2, d_model=64, n_head=4, vocab_size=tokenizer.vocab_size, max_seq_len=64,
                      init_std=0.3, **VARIANTS[name])  # fmt: skip
    model = build_model(cfg).eval()
    save_checkpoint(path, model, tokenizer)
    return model


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_export_round_trip_keeps_logits(tmp_path, tokenizer, name):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = make_checkpoint(tmp_path / "ck", tokenizer, name)
    out = export_hf(tmp_path / "ck", tmp_path / "hf")
    for f in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "modeling_kvlm.py",
        "configuration_kvlm.py",
    ):
        assert (out / f).is_file(), f
    assert json.loads((out / "config.json").read_text())["model_type"] == "kvlm"
    hf = AutoModelForCausalLM.from_pretrained(out)  # registered by `import kvlm.interop.hf`
    assert type(hf).__name__ == "KVLMForCausalLM" and type(hf).__module__ == "kvlm.interop.hf_modeling"
    tok = AutoTokenizer.from_pretrained(out)
    ids = tok(TEXTS[0]).input_ids
    assert ids == tokenizer.encode(TEXTS[0]) and tok.padding_side == "left"
    ids = tokenizer.encode(" ".join(TEXTS[:6]))
    x = torch.tensor([ids[:20], ids[5:25]])
    with torch.no_grad():
        ref = model(x)
        assert torch.equal(hf(x).logits, ref)
    # and back: the HF model's kvlm module saved as a kvlm checkpoint
    save_checkpoint(tmp_path / "back", hf.model)
    back, _, _ = load_checkpoint(tmp_path / "back")
    with torch.no_grad():
        assert torch.equal(back(x), ref)


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_hf_generate_equals_kvlm_generate_on_the_compact_cache(tmp_path, tokenizer, name):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = make_checkpoint(tmp_path / "ck", tokenizer, name)
    export_hf(tmp_path / "ck", tmp_path / "hf")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    tok = AutoTokenizer.from_pretrained(tmp_path / "hf")
    prompts = ["the cat sat on", "a small model with a small cache and the dog"]
    batch = tok(prompts, return_tensors="pt", padding=True)
    assert batch.attention_mask[0, 0] == 0  # left-padded
    out = hf.generate(**batch, max_new_tokens=12, do_sample=False, return_dict_in_generate=True)
    new = out.sequences[:, batch.input_ids.shape[1] :].tolist()
    # both stop a sequence at end-of-text: transformers pads after it, kvlm leaves it out
    eos = tokenizer.eos_id
    new = [seq[: seq.index(eos)] if eos in seq else seq for seq in new]
    ref = generate(model, [tokenizer.encode(p) for p in prompts], 12, stop_tokens=[eos])
    assert new == ref
    assert len({t for seq in ref for t in seq}) > 3  # not a degenerate repeat of one token
    cache = getattr(out, CACHE_NAME)  # `cache` since transformers 5.24, `past_key_values` before
    assert isinstance(cache, KVLMCache) and cache.kv.mode == "compact"
    spec = model.cfg.cache_spec(0)
    assert set(cache.kv.layers[0]) == set(spec)  # e.g. c_kv + k_rope for MLA, never per-head K/V
    assert cache.kv.nbytes == 2 * cache.kv.max_seq_len * model.cfg.kv_cache_elements_per_token() * 4
    # beam search reorders the compact cache: same beams as recomputing everything without a cache
    kw = dict(max_new_tokens=6, do_sample=False, num_beams=3, eos_token_id=None)
    beams = hf.generate(**batch, **kw)
    assert torch.equal(beams, hf.generate(**batch, use_cache=False, **kw))


def test_forward_rejects_foreign_caches_and_bad_padding(tmp_path, tokenizer):
    from transformers import DynamicCache

    from kvlm.interop.hf import to_hf

    hf = to_hf(make_checkpoint(tmp_path / "ck", tokenizer, "mla"))
    x = torch.randint(0, 100, (2, 6))
    with pytest.raises(ValueError, match="compact cache"):
        hf(x, past_key_values=DynamicCache())
    holes = torch.tensor([[1, 0, 1, 1, 1, 1], [1] * 6])
    with pytest.raises(ValueError, match="left-padded"):
        hf(x, attention_mask=holes)
    right = torch.tensor([[1, 1, 1, 1, 0, 0], [1] * 6])
    with pytest.raises(ValueError, match="left-padded"):
        hf(x, attention_mask=right, past_key_values=KVLMCache())
    with torch.no_grad():  # right padding without a cache: the real tokens' logits are unaffected
        # (allclose, not equal: a batch of 12 rows and one of 4 may take different matmul blockings)
        assert torch.allclose(hf(x, attention_mask=right).logits[0, :4], hf(x[:1, :4]).logits[0], atol=1e-5)
    # labels give the shifted next-token loss
    with torch.no_grad():
        out = hf(x, labels=x)
        ref = torch.nn.functional.cross_entropy(out.logits[:, :-1].flatten(0, 1), x[:, 1:].flatten())
    assert torch.allclose(out.loss, ref)


def test_import_kvlm_installs_no_hook_and_interop_hf_registers():
    """`import kvlm` changes nothing outside kvlm (no import hook, no transformers); `import kvlm.interop.hf`
    registers "kvlm" with the Auto classes; the modeling module alone (also the exported remote code) does
    not register anything."""
    code = """
import sys
finders = list(sys.meta_path)
import kvlm
assert sys.meta_path == finders, "import kvlm changed sys.meta_path"
assert "transformers" not in sys.modules, "import kvlm imported transformers"
from transformers import AutoConfig, AutoModelForCausalLM
from kvlm.interop.hf_modeling import KVLMConfig, KVLMForCausalLM
assert KVLMConfig not in AutoModelForCausalLM._model_mapping, "hf_modeling registered on import"
import kvlm.interop.hf
assert AutoModelForCausalLM._model_mapping[KVLMConfig] is KVLMForCausalLM
assert type(AutoConfig.for_model("kvlm")) is KVLMConfig
assert not [f for f in sys.meta_path if type(f).__module__.startswith("kvlm")], sys.meta_path
"""
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_remote_code_rewrites_only_kvlm_import_statements():
    from kvlm.interop.remote_code import RemoteCodeError, rewrite_imports

    source = '''"""from kvlm.config import ModelConfig (in a docstring: unchanged)"""

from __future__ import annotations

import torch
from kvlm.config import (
    ModelConfig,
    ConfigError as CE,
)
from ..cache import KVCache


def f():
    from kvlm.model import KVLM  # a comment after the import stays

    return "kvlm.config", KVLM
'''
    out, deps = rewrite_imports("kvlm.interop.example", source)
    assert sorted(deps) == ["kvlm.cache", "kvlm.config", "kvlm.model"]
    assert out == source.replace(
        "from kvlm.config import (\n    ModelConfig,\n    ConfigError as CE,\n)",
        "from .kvlm_config import ModelConfig, ConfigError as CE",
    ).replace("from ..cache import KVCache", "from .kvlm_cache import KVCache").replace(
        "    from kvlm.model import KVLM  #", "    from .kvlm_model import KVLM  #"
    )
    for bad in (
        "import kvlm.config\n",  # a dotted module name the flat folder does not have
        "from kvlm import ModelConfig\n",  # the package's __init__ (all of kvlm)
        "from kvlm.attention import mla\n",  # a module object
        "x = 1; from kvlm.config import ModelConfig\n",  # transformers would not copy the file
    ):
        with pytest.raises(RemoteCodeError):
            rewrite_imports("kvlm.interop.example", bad)


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_trust_remote_code_loads_without_kvlm(tmp_path, tokenizer, name):
    """The exported folder carries kvlm's source: a process where `import kvlm` fails loads it (the config
    alone first: it must register the mechanism it names)."""
    model = make_checkpoint(tmp_path / "ck", tokenizer, name)
    export_hf(tmp_path / "ck", tmp_path / "hf")
    ids = tokenizer.encode(TEXTS[1])[:12]
    with torch.no_grad():
        torch.save(
            {"logits": model(torch.tensor([ids])), "gen": generate(model, ids, 8)}, tmp_path / "ref.pt"
        )
    code = f"""
import sys
sys.modules["kvlm"] = None  # kvlm is not installed here
import torch
from transformers import AutoConfig, AutoModelForCausalLM
config = AutoConfig.from_pretrained({str(tmp_path / "hf")!r}, trust_remote_code=True)
assert config.model_config().attention == {name!r}, config
hf = AutoModelForCausalLM.from_pretrained({str(tmp_path / "hf")!r}, trust_remote_code=True)
assert type(hf).__module__.startswith("transformers_modules."), type(hf).__module__
ref = torch.load({str(tmp_path / "ref.pt")!r})
x = torch.tensor([{ids!r}])
with torch.no_grad():
    err = (hf(x).logits - ref["logits"]).abs().max().item()
assert err < 1e-4, err
out = hf.generate(x, max_new_tokens=8, do_sample=False)
assert out[0, x.shape[1]:].tolist() == ref["gen"], (out, ref["gen"])
assert not any(k == "kvlm" or k.startswith("kvlm.") for k, v in sys.modules.items() if v is not None)
print("ok")
"""
    env = {**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules"), "HF_HUB_OFFLINE": "1"}
    res = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr[-3000:]


def test_export_hf_cli(tmp_path, tokenizer, capsys):
    from kvlm.cli import main

    make_checkpoint(tmp_path / "ck", tokenizer, "gqa")
    assert main(["export-hf", str(tmp_path / "ck"), str(tmp_path / "hf"), "--no-remote-code", "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert "model.safetensors" in result["files"] and "modeling_kvlm.py" not in result["files"]
    assert "auto_map" not in json.loads((tmp_path / "hf" / "config.json").read_text())
    assert main(["export-hf", str(tmp_path / "missing"), str(tmp_path / "hf2")]) == 1
    assert not (tmp_path / "hf2").exists()


def test_remote_code_replaces_kvlm_kernels_by_the_plain_path_stand_in():
    """kvlm.kernels (a C++ source built on first use, a Triton module) cannot be a flat file: its imports become
    imports of a stand-in whose ``ready`` is False, so the folder's attention takes the plain path."""
    from kvlm.interop.remote_code import FALLBACKS, RemoteCodeError, bundle, rewrite_imports

    source = "from kvlm import kernels\n\n\ndef f(q):\n    return kernels.ready(q, 1) or kernels.latent_decode(q)\n"
    out, deps = rewrite_imports("kvlm.attention.example", source)
    assert out == source.replace("from kvlm import kernels", "from .kvlm_kernels_fallback import kernels")
    assert deps == ["kvlm_kernels_fallback"]
    out, _ = rewrite_imports("kvlm.attention.example", "from kvlm.kernels import ready as r, gqa_decode\n")
    assert out == "from .kvlm_kernels_fallback import ready as r, gqa_decode\n"
    for bad in (
        "from kvlm import kernels\nkernels.new_kernel(1)\n",  # a name the stand-in lacks: refused at export
        "from kvlm.kernels import new_kernel\n",
    ):
        with pytest.raises(RemoteCodeError, match="stand-in"):
            rewrite_imports("kvlm.attention.example", bad)
    files = bundle(["kvlm.attention.mla", "kvlm.attention.mha"])
    assert "kvlm_kernels_fallback.py" in files and not any(
        f.startswith("kvlm_kernels_") and f != "kvlm_kernels_fallback.py" for f in files
    )
    stand_in: dict = {}
    exec(FALLBACKS["kvlm.kernels"][1], stand_in)
    assert stand_in["kernels"].ready(torch.zeros(1), 1) is False
    assert stand_in["latent_decode"](None) is None and stand_in["gqa_decode"](None) is None
