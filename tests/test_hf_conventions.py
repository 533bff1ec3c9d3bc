"""What a transformers / lm-eval user expects of kvlm's folders: ``save_pretrained`` writes a folder that loads
elsewhere, tokenizers load with ``AutoTokenizer`` (stock class, model_max_length = the context), chat templates
and special tokens survive import and export, and the plain ``lm_eval`` CLI evaluates an export."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="needs transformers (pip install 'kvlm[hf]')")

from kvlm import ModelConfig, build_model  # noqa: E402
from kvlm.cli import main  # noqa: E402
from kvlm.interop.hf import to_hf  # noqa: E402

TEXTS = ["the cat sat on the mat and the dog sat on the log", "a small model with a small cache"] * 10
CHAT = [{"role": "user", "content": "the cat"}, {"role": "assistant", "content": "sat on the mat"}]
TEMPLATE = (  # SmolLM2-Instruct's template, shortened
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def run_isolated(code: str, cwd: Path, block_kvlm: bool = True) -> str:
    """Run ``code`` in a fresh interpreter (kvlm unimportable if ``block_kvlm``), stdin closed so that a
    trust_remote_code prompt cannot wait for an answer; returns stdout+stderr, asserting success."""
    head = 'import sys\nsys.modules["kvlm"] = None\n' if block_kvlm else ""
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_MODULES_CACHE": str(cwd / "modules"),
        "OMP_NUM_THREADS": "1",
    }
    res = subprocess.run([sys.executable, "-c", head + code], cwd=cwd, env=env, capture_output=True, text=True,
                         stdin=subprocess.DEVNULL)  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stdout + res.stderr


def test_save_pretrained_writes_a_folder_that_loads_without_kvlm(tmp_path):
    """``to_hf(model).save_pretrained(d)`` carries the remote code (an MLA model: its decode imports kvlm's
    kernels, which the folder replaces by a stand-in that sends attention down the plain path)."""
    torch.manual_seed(0)
    cfg = ModelConfig(attention="mla", n_layer=2, d_model=64, n_head=4, vocab_size=97, max_seq_len=32,
                      kv_lora_rank=24, rope_head_dim=8)  # fmt: skip
    model = build_model(cfg).eval()
    hf = to_hf(model)
    hf.save_pretrained(tmp_path / "d")
    assert (tmp_path / "d" / "kvlm_kernels_fallback.py").is_file()
    assert json.loads((tmp_path / "d" / "config.json").read_text())["auto_map"]
    x = torch.arange(10)[None] % 97
    with torch.no_grad():
        torch.save({"logits": hf(x).logits, "gen": hf.generate(x, max_new_tokens=6, do_sample=False)},
                   tmp_path / "ref.pt")  # fmt: skip
    out = run_isolated(f"""
import torch
from transformers import AutoModelForCausalLM
hf = AutoModelForCausalLM.from_pretrained({str(tmp_path / "d")!r}, trust_remote_code=True)
ref = torch.load({str(tmp_path / "ref.pt")!r})
x = torch.arange(10)[None] % 97
with torch.no_grad():
    assert (hf(x).logits - ref["logits"]).abs().max() < 1e-5
assert torch.equal(hf.generate(x, max_new_tokens=6, do_sample=False), ref["gen"])
hf.save_pretrained({str(tmp_path / "again")!r})  # a model loaded from remote code saves its code again
again = AutoModelForCausalLM.from_pretrained({str(tmp_path / "again")!r}, trust_remote_code=True)
with torch.no_grad():
    assert (again(x).logits - ref["logits"]).abs().max() < 1e-5
print("ok")
""", tmp_path)  # fmt: skip
    assert "ok" in out
    assert (tmp_path / "again" / "kvlm_kernels_fallback.py").is_file()
    # remote_code=False: no auto_map pointing at files that are not there
    hf.save_pretrained(tmp_path / "bare", remote_code=False)
    assert "auto_map" not in json.loads((tmp_path / "bare" / "config.json").read_text())
    assert not list((tmp_path / "bare").glob("*.py"))


@pytest.fixture(scope="module")
def instruct_llama(tmp_path_factory):
    """A tiny SmolLM2-Instruct-like source: Llama weights, a BPE tokenizer with <|endoftext|>, <|im_start|>,
    <|im_end|> (eos), and a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    path = tmp_path_factory.mktemp("instruct") / "src"
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(TEXTS, trainers.BpeTrainer(vocab_size=300, special_tokens=specials))
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|im_start|>",
                                     pad_token="<|im_end|>", unk_token="<|endoftext|>")  # fmt: skip
    hf_tok.chat_template = TEMPLATE
    hf_tok.save_pretrained(path)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=True)  # fmt: skip
    LlamaForCausalLM(cfg).save_pretrained(path)
    return path


@pytest.mark.parametrize("fmt", ["kvlm", "llama", "deepseek-v3"])
def test_chat_template_and_special_tokens_survive_import_and_export(tmp_path, instruct_llama, fmt):
    from transformers import AutoTokenizer

    src = AutoTokenizer.from_pretrained(instruct_llama)
    expected = src.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    import_args = ["import-hf", str(instruct_llama), str(tmp_path / "ck")]
    assert main(import_args + (["--mla"] if fmt == "deepseek-v3" else [])) == 0
    assert main(["export-hf", str(tmp_path / "ck"), str(tmp_path / "hf"), "--format", fmt]) == 0
    # kvlm's own format: the model's config needs remote code, and transformers' AutoTokenizer reads the model
    # config first, so a process without kvlm's registration (import kvlm.interop.hf) is asked to trust it
    out = run_isolated(f"""
{"import kvlm.interop.hf" if fmt == "kvlm" else ""}
from transformers import AutoTokenizer, PreTrainedTokenizerBase
tok = AutoTokenizer.from_pretrained({str(tmp_path / "hf")!r})
print("CHAT=" + repr(tok.apply_chat_template({CHAT!r}, tokenize=False, add_generation_prompt=True)))
print("EOS=" + tok.eos_token, "BOS=" + tok.bos_token, "PAD=" + tok.pad_token, "MAX=" + str(tok.model_max_length))
print("CLASS=" + type(tok).__module__)
""", tmp_path, block_kvlm=fmt != "kvlm")  # fmt: skip
    assert "[y/N]" not in out, out
    assert f"CHAT={expected!r}" in out, out
    assert "EOS=<|im_end|> BOS=<|im_start|> PAD=<|im_end|> MAX=64" in out, out
    assert "CLASS=transformers." in out, out
    config = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    # the eos first, then the other stop tokens the model declares (test_hf_stop_tokens.py)
    assert config["eos_token_id"] == src.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])


def _local_task(folder: Path) -> None:
    """A 6-question multiple-choice task over a local JSONL file (no download)."""
    rows = [{"q": f"the cat sat on the {w}", "choices": ["mat", "log"], "label": i % 2} for i, w in
            enumerate(["mat", "log", "dog", "cat", "cache", "model"])]  # fmt: skip
    (folder / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "kvlm_local_mc.yaml").write_text(f"""task: kvlm_local_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {folder / "data.jsonl"}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{q}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
metric_list:
  - metric: acc
""")


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["llama", "kvlm"])
def test_plain_lm_eval_cli_evaluates_an_export(tmp_path, instruct_llama, fmt):
    """The `lm_eval` console script, no kvlm import: lm-eval 0.4.13 has no model-plugin entry point, so the
    supported route is its own "hf" model on an export: a stock format as is, kvlm's own format (any mechanism)
    with trust_remote_code=True (the folder's code)."""
    lm_eval = shutil.which("lm_eval", path=str(Path(sys.executable).parent))
    if lm_eval is None:
        pytest.skip("lm_eval console script not installed")
    assert main(["import-hf", str(instruct_llama), str(tmp_path / "ck")]) == 0
    assert main(["export-hf", str(tmp_path / "ck"), str(tmp_path / "hf"), "--format", fmt]) == 0
    (tmp_path / "tasks").mkdir()
    _local_task(tmp_path / "tasks")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "HF_DATASETS_CACHE": str(tmp_path / "ds_cache"), "HF_MODULES_CACHE": str(tmp_path / "modules")}  # fmt: skip
    res = subprocess.run(
        [lm_eval, "--model", "hf", "--model_args", f"pretrained={tmp_path / 'hf'},dtype=float32" + (",trust_remote_code=True" if fmt == "kvlm" else ""),
         "--tasks", "kvlm_local_mc", "--include_path", str(tmp_path / "tasks"), "--device", "cpu",
         "--batch_size", "2", "--output_path", str(tmp_path / "results")],
        env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=300,
    )  # fmt: skip
    assert res.returncode == 0, (res.stdout[-2000:], res.stderr[-3000:])
    results = [json.loads(p.read_text()) for p in (tmp_path / "results").rglob("results*.json")]
    assert results and "acc,none" in results[0]["results"]["kvlm_local_mc"], results


@pytest.mark.parametrize("fmt", ["kvlm", "llama"])
def test_generate_and_eval_accept_an_exported_folder(tmp_path, capsys, fmt):
    from kvlm.checkpoint import save_checkpoint
    from kvlm.data.tokenizer import train_bpe

    tok = train_bpe(TEXTS, vocab_size=300)
    torch.manual_seed(0)
    cfg = ModelConfig(attention="gqa", n_kv_head=2, n_layer=2, d_model=64, n_head=4, vocab_size=tok.vocab_size,
                      max_seq_len=48, init_std=0.1)  # fmt: skip
    save_checkpoint(tmp_path / "ck", build_model(cfg).eval(), tok)
    assert main(["export-hf", str(tmp_path / "ck"), str(tmp_path / "hf"), "--format", fmt]) == 0
    capsys.readouterr()
    outs = []
    for folder in ("ck", "hf"):
        args = ["generate", str(tmp_path / folder), "--prompt", "the cat", "--max-new-tokens", "6", "--json"]
        assert main(args) == 0
        result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        outs.append({k: v for k, v in result.items() if not k.endswith(("_s", "per_s"))})  # not timings
    assert outs[0] == outs[1] and outs[0]["completions"], outs
    (tmp_path / "val.txt").write_text("\n".join(TEXTS))
    ppl = []
    for folder in ("ck", "hf"):
        args = [
            "eval",
            str(tmp_path / folder),
            "--data",
            str(tmp_path / "val.txt"),
            "--samples",
            "0",
            "--json",
        ]
        assert main(args) == 0
        ppl.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1])["perplexity"])
    assert ppl[0]["tokens"] == ppl[1]["tokens"] > 0
    assert ppl[0]["loss"] == pytest.approx(ppl[1]["loss"], rel=1e-5)
