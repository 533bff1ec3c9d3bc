"""AutoTokenizer on a kvlm-format export, in a process without kvlm: what asks "[y/N]" and what does not.

transformers 5 (models/auto/tokenization_auto.py) calls ``AutoConfig.from_pretrained(folder)`` before it reads
tokenizer_config.json, and AutoConfig asks to trust remote code whenever config.json's ``auto_map`` names an
``AutoConfig`` class and its ``model_type`` is not a built-in one; nothing in tokenizer_config.json (its
``tokenizer_class`` is the stock ``TokenizersBackend``) or elsewhere in the folder is read before that question.
A kvlm export needs that ``auto_map`` (``AutoModelForCausalLM.from_pretrained(..., trust_remote_code=True)``
finds its classes there), so the documented routes are ``trust_remote_code=False`` (or True) or the stock class
itself; the stock formats (``--format llama`` / ``deepseek-v3``) never ask."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers", reason="needs transformers (pip install 'kvlm[hf]')")

from test_hf_conventions import run_isolated  # noqa: E402  (fresh interpreter, kvlm blocked, stdin closed)

from kvlm import ModelConfig, build_model  # noqa: E402
from kvlm.data.tokenizer import train_bpe  # noqa: E402
from kvlm.interop.hf import export_hf  # noqa: E402

TEXT = "the cat sat on the mat"


@pytest.fixture(scope="module")
def kvlm_export(tmp_path_factory):
    tok = train_bpe([TEXT] * 20, vocab_size=300)
    cfg = ModelConfig(attention="mla", n_layer=1, d_model=32, n_head=2, vocab_size=tok.vocab_size, max_seq_len=40,
                      kv_lora_rank=8, rope_head_dim=4)  # fmt: skip
    out = tmp_path_factory.mktemp("export") / "hf"
    export_hf((build_model(cfg), tok), out)
    return out, tok.encode(TEXT)


# one interpreter (transformers' import dominates the time), each call's output after its marker on stdout,
# where the question (input()) is printed too
CALLS = {
    "no-flag": "AutoTokenizer.from_pretrained({d!r}, trust_remote_code=False)",
    "stock-class": "PreTrainedTokenizerFast.from_pretrained({d!r})",
    "no-auto-config": "AutoTokenizer.from_pretrained({bare!r})",
    "plain": "AutoTokenizer.from_pretrained({d!r})",  # last: stdin is closed, the question gets EOF
}


def test_which_tokenizer_calls_ask_to_trust_remote_code(tmp_path, kvlm_export):
    """Stock routes load the stock fast tokenizer without asking; plain AutoTokenizer asks because AutoConfig
    reads config.json's auto_map (the same folder without its AutoConfig entry does not ask). If a transformers
    release stops asking, the last assertion fails: then drop the README's advice to pass trust_remote_code."""
    import json
    import shutil

    folder, ids = kvlm_export
    bare = tmp_path / "bare"
    shutil.copytree(folder, bare)
    config = json.loads((bare / "config.json").read_text())
    del config["auto_map"]["AutoConfig"]
    (bare / "config.json").write_text(json.dumps(config))
    code = "import sys\nfrom transformers import AutoTokenizer, PreTrainedTokenizerFast\n"
    for name, call in CALLS.items():
        code += f"print('@@{name}', flush=True)\ntok = {call.format(d=str(folder), bare=str(bare))}\n"
        code += f"print('CLASS=' + type(tok).__module__, 'MAX=' + str(tok.model_max_length), 'IDS=' + str(tok.encode({TEXT!r})), flush=True)\n"
        code += "sys.stderr.flush()\n"
    out = run_isolated(code, tmp_path)
    seen = {}
    for part in out.split("@@")[1:]:
        name, _, rest = part.partition("\n")
        seen[name] = rest
    assert set(seen) == set(CALLS), out
    for name, rest in seen.items():
        assert "CLASS=transformers." in rest and "MAX=40" in rest and f"IDS={ids}" in rest, (name, out)
        assert ("[y/N]" in rest) == (name == "plain"), (name, out)
