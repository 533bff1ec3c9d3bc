"""Fine-tuning: `kvlm train --init` starts from existing weights at step 0 with a fresh optimizer, --freeze /
--train-only train only named parameters, the run records where it started, and its resume is exact."""

import json

import pytest
import torch
import yaml

from kvlm import ModelConfig
from kvlm.checkpoint import load_checkpoint, save_checkpoint
from kvlm.cli import main as cli
from kvlm.config import ConfigError
from kvlm.data import prepare
from kvlm.training import TrainConfig, train


@pytest.fixture(scope="module")
def stories(tmp_path_factory):
    return prepare("synthetic", tmp_path_factory.mktemp("data") / "d", max_tokens=20_000, vocab_size=300)


@pytest.fixture(scope="module")
def base(stories, tmp_path_factory):
    """A pretrained kvlm checkpoint (4 steps of MLA) to fine-tune from."""
    cfg = ModelConfig(attention="mla", n_layer=2, d_model=32, n_head=2, kv_lora_rank=16, q_lora_rank=16,
                      rope_head_dim=8, vocab_size=stories.vocab_size, max_seq_len=32)  # fmt: skip
    res = train(cfg, quick(max_steps=4), stories, tmp_path_factory.mktemp("base") / "run", progress=False)
    return res.checkpoint


def quick(**kw):
    base = dict(batch_size=4, seq_len=16, max_steps=6, lr=3e-3, warmup_steps=1, eval_interval=3, eval_iters=1,
                log_interval=1)  # fmt: skip
    return TrainConfig(**{**base, **kw})


def state_of(path):
    model, _, _ = load_checkpoint(path)
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_init_starts_from_the_weights_at_step_zero(stories, base, tmp_path):
    init = state_of(base)
    seen = {}

    def at_first_record(rec):  # eval_at_start evaluates the init before any step
        seen.setdefault("first", rec)

    res = train(None, quick(init=str(base), eval_at_start=True, max_steps=1), stories, tmp_path / "ft",
                progress=False, callback=at_first_record)  # fmt: skip
    assert seen["first"]["step"] == 0 and res.steps == 1 and res.tokens == 4 * 16  # step 0, not the base's 4
    # the step-0 validation loss is the base run's last one (same windows, same weights); a fresh model's differs
    base_val = json.loads((base / "meta.json").read_text())["val_loss"]
    assert res.val_losses[0] == (0, pytest.approx(base_val, abs=1e-6))
    # and the weights themselves, as the Trainer holds them before its first step
    from kvlm.parallel import data_parallel as dt
    from kvlm.training import Trainer

    trainer = Trainer(None, quick(init=str(base)), stories, None, info=dt.setup("cpu"))
    assert trainer.progress.step == 0 and not trainer.optimizer.state  # fresh AdamW: no moments yet
    for k, v in trainer.model.state_dict().items():
        assert torch.equal(v, init[k]), k
    doc = yaml.safe_load((tmp_path / "ft" / "config.yaml").read_text())
    assert doc["init"]["path"] == str(base.resolve()) and doc["init"]["kind"] == "kvlm-checkpoint"
    assert doc["init"]["step"] == 4 and doc["train"]["init"] == str(base)
    meta = json.loads((tmp_path / "ft" / "checkpoint" / "meta.json").read_text())
    assert meta["init"]["path"] == str(base.resolve())


def test_freeze_keeps_parameters_and_trains_the_rest(stories, base, tmp_path):
    init = state_of(base)
    tcfg = quick(init=str(base), train_only="*.attn.wkv_*,*.attn.kv_norm*", freeze="layers.0.*")
    res = train(None, tcfg, stories, tmp_path / "ft", progress=False)
    after = {k: v.cpu() for k, v in res.model.state_dict().items()}
    trained = {k for k in after if not torch.equal(after[k], init[k])}
    assert trained == {
        "layers.1.attn.wkv_a.weight",
        "layers.1.attn.wkv_b.weight",
        "layers.1.attn.kv_norm.weight",
    }
    # and a run without patterns changes (nearly) everything: the selection is what kept the rest still
    full = train(None, quick(init=str(base)), stories, None, progress=False)
    changed = {k for k, v in full.model.state_dict().items() if not torch.equal(v.cpu(), init[k])}
    assert len(changed) == len(init)


def test_bad_patterns_and_inits_are_named(stories, base, tmp_path):
    with pytest.raises(ConfigError, match="'\\*\\.atn\\.\\*' matches no parameter"):
        train(None, quick(init=str(base), train_only="*.atn.*"), stories, None, progress=False)
    with pytest.raises(ConfigError, match="no parameter to train"):
        train(None, quick(init=str(base), freeze="*"), stories, None, progress=False)
    with pytest.raises(ConfigError, match="nothing at"):
        train(None, quick(init=str(tmp_path / "missing")), stories, None, progress=False)
    (tmp_path / "junk").mkdir()
    with pytest.raises(ConfigError, match="neither a kvlm checkpoint"):
        train(None, quick(init=str(tmp_path / "junk")), stories, None, progress=False)
    other = prepare("synthetic", tmp_path / "other", max_tokens=5_000, vocab_size=280)
    with pytest.raises(ConfigError, match="different tokenizer"):
        train(None, quick(init=str(base)), other, None, progress=False)


def test_resume_of_a_finetune_is_exact(stories, base, tmp_path):
    tcfg = quick(init=str(base), train_only="*.attn.*", max_steps=8, checkpoint_interval=4)
    full = train(None, tcfg, stories, tmp_path / "full", progress=False)

    class Crash(Exception):
        pass

    def crash_at_6(rec):
        if rec["step"] == 6:
            raise Crash

    with pytest.raises(Crash):
        train(None, tcfg, stories, tmp_path / "cut", progress=False, callback=crash_at_6)
    resumed = train(None, tcfg, stories, tmp_path / "cut", resume=True, progress=False)
    assert resumed.losses == full.losses and resumed.val_losses == full.val_losses
    for a, b in zip(full.model.state_dict().values(), resumed.model.state_dict().values()):
        assert torch.equal(a, b)
    with pytest.raises(ConfigError, match="which parameters train"):
        train(None, tcfg.replace(train_only=None), stories, tmp_path / "cut", resume=True, progress=False)


def test_cli_init_and_freeze(stories, base, tmp_path, capsys):
    run = tmp_path / "run"
    args = ["train", "--data", str(stories.path), "--out", str(run), "--init", str(base), "--freeze", "embed.*",
            "--seq-len", "16", "--batch-size", "4", "--steps", "2", "--eval-iters", "1", "--no-progress", "--json"]  # fmt: skip
    assert cli(args) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["steps"] == 2 and out["train_config"]["freeze"] == "embed.*"
    model, _, _ = load_checkpoint(run / "checkpoint")
    assert torch.equal(model.embed.weight, state_of(base)["embed.weight"])
    assert cli([*args, "--preset", "tiny/mla", "--force"]) == 1
    assert "--init takes the model config" in capsys.readouterr().err


def test_init_from_a_kvlm_export_folder(stories, base, tmp_path):
    """An HF folder kvlm wrote (export-hf) is a valid --init: same weights."""
    pytest.importorskip("transformers")
    from kvlm.interop.hf import export_hf

    model, tok, _ = load_checkpoint(base)
    save_checkpoint(tmp_path / "ck", model, tok, meta={})
    export_hf(tmp_path / "ck", tmp_path / "hf")
    from kvlm.parallel import data_parallel as dt
    from kvlm.training import Trainer

    trainer = Trainer(None, quick(init=str(tmp_path / "hf")), stories, None, info=dt.setup("cpu"))
    for k, v in trainer.model.state_dict().items():
        assert torch.equal(v, model.state_dict()[k]), k


def test_init_from_a_transformers_llama_folder(stories, tmp_path):
    """A stock transformers Llama folder is a valid --init: the Trainer's model gives transformers' logits."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)  # fmt: skip
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    hf.save_pretrained(tmp_path / "llama")
    from kvlm.parallel import data_parallel as dt
    from kvlm.training import Trainer

    trainer = Trainer(None, quick(init=str(tmp_path / "llama")), stories, None, info=dt.setup("cpu"))
    ids = torch.randint(0, 300, (2, 12))
    with torch.no_grad():
        mine = trainer.model.eval()(ids)
        theirs = hf(ids).logits
    assert torch.allclose(mine, theirs, atol=1e-5), (mine - theirs).abs().max()
    assert trainer.origin["kind"] == "hf-llama" and trainer.progress.step == 0


def test_a_finetune_keeps_the_inits_stop_tokens_and_chat_template(stories, base, tmp_path):
    """An imported chat model's tokenizer settings (meta.json ``hf_tokenizer``: stop tokens, chat template) stay
    with the fine-tuned weights, so `kvlm generate` on the healed checkpoint still stops at the end of a turn
    and export-hf still writes the template; config.yaml's init section stays a short record."""
    model, tok, _ = load_checkpoint(base)
    turn_end = tok.backend.id_to_token(5)  # this small BPE has no <|im_end|>: any token stands in for it
    settings = {
        "eos_token": "<|endoftext|>",
        "stop_tokens": ["<|endoftext|>", turn_end],
        "chat_template": "{{ x }}",
    }
    save_checkpoint(tmp_path / "chat", model, tok, meta={"hf_tokenizer": settings})
    assert load_checkpoint(tmp_path / "chat")[1].stop_ids == [tok.eos_id, 5]
    res = train(
        None, quick(init=str(tmp_path / "chat"), max_steps=1), stories, tmp_path / "ft", progress=False
    )
    _, tuned_tok, meta = load_checkpoint(res.checkpoint)
    assert meta["hf_tokenizer"] == settings and "hf_tokenizer" not in meta["init"]
    assert tuned_tok.stop_ids == [tok.eos_id, 5]
    assert "hf_tokenizer" not in yaml.safe_load((tmp_path / "ft" / "config.yaml").read_text())["init"]
