"""`kvlm train`: train a model from a preset or YAML config (kvlm.training).

The run folder is kvlm.training.guard's to protect: an OUT holding a previous run needs ``--resume`` (continue it)
or ``--force`` (start over, replacing its checkpoint and metrics); a second trainer on the same OUT fails at once
(a lock); a NaN / infinite loss stops the run with an error naming the step, the last finite checkpoint kept; the
first Ctrl-C saves the current step and exits with status 130 and the command that resumes, a second aborts."""

from __future__ import annotations

import contextlib
import os
import shlex
import sys
from dataclasses import fields
from pathlib import Path
from typing import Any

from kvlm.cli.common import parse_overrides
from kvlm.config import ConfigError, ModelConfig, check_mapping, load_yaml_or_json
from kvlm.data import load_or_prepare
from kvlm.errors import TrainingInterrupted
from kvlm.files import json_text, prepare_output_folder
from kvlm.logs import get_logger
from kvlm.preset_table import get_preset
from kvlm.training import TrainConfig, train
from kvlm.training.guard import check_new_run, run_lock

logger = get_logger(__name__)

# model flags: (flag, field, type)
MODEL_FLAGS = [
    ("--attention", "attention", str),
    ("--arch", "arch", str),
    ("--n-layer", "n_layer", int),
    ("--d-model", "d_model", int),
    ("--n-head", "n_head", int),
    ("--head-dim", "head_dim", int),
    ("--n-kv-head", "n_kv_head", int),
    ("--ffn-dim", "ffn_dim", int),
    ("--kv-lora-rank", "kv_lora_rank", int),
    ("--q-lora-rank", "q_lora_rank", int),
    ("--rope-head-dim", "rope_head_dim", int),
    ("--max-seq-len", "max_seq_len", int),
    ("--vocab-size", "vocab_size", int),
    ("--dropout", "dropout", float),
]
TRAIN_FLAGS = [
    ("--batch-size", "batch_size", int),
    ("--grad-accum", "grad_accum", int),
    ("--seq-len", "seq_len", int),
    ("--lr", "lr", float),
    ("--min-lr-ratio", "min_lr_ratio", float),
    ("--warmup", "warmup_steps", int),
    ("--weight-decay", "weight_decay", float),
    ("--grad-clip", "grad_clip", float),
    ("--eval-interval", "eval_interval", int),
    ("--eval-iters", "eval_iters", int),
    ("--log-interval", "log_interval", int),
    ("--checkpoint-interval", "checkpoint_interval", int),
    ("--seed", "seed", int),
    ("--device", "device", str),
    ("--dtype", "dtype", str),
]


# what each TrainConfig override does, for --help (its default comes from TrainConfig itself)
TRAIN_HELP = {
    "batch_size": "sequences per optimizer step, over all ranks and accumulation steps",
    "grad_accum": "micro-steps per optimizer step (each rank)",
    "seq_len": "training window length in tokens",
    "lr": "peak learning rate",
    "min_lr_ratio": "the cosine decay ends at this fraction of --lr",
    "warmup_steps": "linear warm-up steps",
    "weight_decay": "AdamW weight decay of the matrices and embeddings",
    "grad_clip": "max global gradient norm (0: off)",
    "eval_interval": "steps between validation losses",
    "eval_iters": "validation batches per evaluation",
    "log_interval": "steps between metrics records",
    "checkpoint_interval": "steps between checkpoints",
    "seed": "seed of the weights, data order and dropout",
    "device": "auto (cuda if available), cpu, cuda, cuda:N or mps",
    "dtype": "auto (bf16 autocast on CUDA, float32 on CPU), float32 or bfloat16",
}
TRAIN_DEFAULT_NOTE = {
    "warmup_steps": "None: 5 %% of the steps, at most 100",
    "checkpoint_interval": "None: every --eval-interval",
}


def _default(cls, name: str):
    return next(f.default for f in fields(cls) if f.name == name)


def _model_default(name: str):
    value = _default(ModelConfig, name)
    return "derived from the shape" if value is None else value


def _train_help(name: str) -> str:
    default = TRAIN_DEFAULT_NOTE.get(name, _default(TrainConfig, name))
    cpu = {"batch_size": CPU_BATCH_SIZE, "seq_len": CPU_SEQ_LEN}.get(name)
    where = f"; {cpu} on CPU when not given" if cpu is not None else ""
    return f"{TRAIN_HELP[name]} (TrainConfig.{name}, default {default}{where})"


def add_arguments(p) -> None:
    p.add_argument("--data", required=True, help="a prepared data folder (kvlm prepare), or 'synthetic' / text files "
                   "to prepare into OUT/data first")  # fmt: skip
    p.add_argument("--out", "-o", required=True, help="run folder: config.yaml, metrics.jsonl, checkpoint/")
    p.add_argument("--preset", help="a named model configuration (kvlm kv-table --list)")
    p.add_argument(
        "--config", help="YAML/JSON: ModelConfig fields, TrainConfig fields, or model:/train: sections"
    )
    g = p.add_argument_group("model overrides")
    for flag, name, typ in MODEL_FLAGS:
        g.add_argument(flag, dest=f"m_{name}", type=typ, metavar=name.upper(),
                       help=f"ModelConfig.{name} (default: the preset's, else {_model_default(name)})")  # fmt: skip
    g = p.add_argument_group("budget (the first reached ends training)")
    g.add_argument("--steps", type=int, help="optimizer steps (default 1000 when no other budget is given)")
    g.add_argument("--tokens", type=int, help="training tokens")
    g.add_argument("--minutes", type=float, help="training time")
    g = p.add_argument_group("training")
    for flag, name, typ in TRAIN_FLAGS:
        g.add_argument(flag, dest=f"t_{name}", type=typ, metavar=name.upper(), help=_train_help(name))
    g.add_argument("--compile", action="store_true", help="torch.compile the model")
    g.add_argument("--embedding-parallel", action="store_true",
                   help="EG-MLA under torchrun: shard each gating embedding table by columns over the ranks "
                   "(eg-mla.md Eqs. 9-11); a no-op with one process")  # fmt: skip
    g.add_argument("--fsdp", action="store_true",
                   help="under torchrun: FSDP2 (fully_shard) instead of DDP, each rank holding 1/N of the weights, "
                   "gradients and AdamW state; checkpoints stay whole; a no-op with one process")  # fmt: skip
    g.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="any ModelConfig or TrainConfig field (repeatable)")  # fmt: skip
    g = p.add_argument_group("fine-tuning")
    g.add_argument("--init", metavar="CKPT_OR_HF_DIR", default=None,
                   help="start from these weights (a kvlm checkpoint folder; a Hugging Face Llama, Mistral or dense "
                   "DeepseekV3 folder, or a Llama .gguf; a kvlm export-hf folder) with a fresh optimizer at step 0; the model config is "
                   "the init's, and --data must use its tokenizer")  # fmt: skip
    g.add_argument("--train-only", metavar="PATTERNS", default=None,
                   help="comma-separated globs on parameter names: train only these, e.g. '*.attn.wkv_*' (names "
                   "look like layers.0.attn.wkv_a.weight, embed.weight)")  # fmt: skip
    g.add_argument("--freeze", metavar="PATTERNS", default=None,
                   help="comma-separated globs on parameter names kept frozen (after --train-only), e.g. 'embed.*'")  # fmt: skip
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint")
    p.add_argument("--force", action="store_true",
                   help="start a new run in an OUT that holds a previous one (its checkpoint and metrics are replaced)")  # fmt: skip
    p.add_argument("--tensorboard", action="store_true", help="also log to OUT/tensorboard")
    p.add_argument("--no-progress", action="store_true", help="no progress bar or progress lines")
    p.add_argument("--json", action="store_true", help="print the result as one JSON line at the end")


def configs_from_args(args) -> tuple[ModelConfig, TrainConfig, bool]:
    """-> (model config, train config, whether vocab_size was given explicitly)."""
    model_fields = {f.name for f in fields(ModelConfig)}
    train_fields = {f.name for f in fields(TrainConfig)}
    model: dict[str, Any] = {}
    trn: dict[str, Any] = {}
    if args.preset:
        try:
            model.update(get_preset(args.preset).to_dict())
        except ModuleNotFoundError as e:
            raise ConfigError("named presets are not available in this build (kvlm/preset_table.py)") from e
    explicit: dict[str, Any] = {}
    if args.config:
        path = Path(args.config)
        if not path.is_file():
            raise ConfigError(f"no config file at {path}")
        doc = load_yaml_or_json(path.read_text(), path)
        if "model" in doc or "train" in doc:
            for section in ("model", "train"):  # `model: 5` is an error naming the section, not a TypeError
                check_mapping(doc.get(section) or {}, f"{path}: section {section!r}")
            explicit.update(doc.get("model") or {})
            trn.update(doc.get("train") or {})
        else:
            for k, v in doc.items():
                if k in model_fields:
                    explicit[k] = v
                elif k in train_fields:
                    trn[k] = v
                else:
                    raise ConfigError(f"{path}: unknown field {k!r} (neither ModelConfig nor TrainConfig)")
    for _, name, _ in MODEL_FLAGS:
        v = getattr(args, f"m_{name}")
        if v is not None:
            explicit[name] = v
    for _, name, _ in TRAIN_FLAGS:
        v = getattr(args, f"t_{name}")
        if v is not None:
            trn[name] = v
    for key, parsed in parse_overrides(args.set).items():
        if key in model_fields:
            explicit[key] = parsed
        elif key in train_fields:
            trn[key] = parsed
        else:
            raise ConfigError(f"--set {key}: not a ModelConfig or TrainConfig field")
    for name in ("init", "train_only", "freeze"):
        if getattr(args, name, None) is not None:
            trn[name] = getattr(args, name)
    if args.compile:
        trn["compile"] = True
    if getattr(args, "embedding_parallel", False):
        trn["embedding_parallel"] = True
    if getattr(args, "fsdp", False):
        trn["fsdp"] = True
    if args.steps is not None or args.tokens is not None or args.minutes is not None:
        trn["max_steps"], trn["max_tokens"], trn["max_minutes"] = args.steps, args.tokens, args.minutes
    if model and explicit.keys() & {"d_model", "n_head"} and "head_dim" not in explicit:
        model["head_dim"] = None  # re-derive from the changed shape
    if model and explicit.keys() & {"d_model"} and "ffn_dim" not in explicit:
        model["ffn_dim"] = None
    model.update(explicit)
    if trn.get("init") is not None and model:
        raise ConfigError(
            f"--init takes the model config from {trn['init']}: drop --preset and the model overrides "
            f"({', '.join(sorted(explicit)) or 'preset'})"
        )
    _cpu_sized(trn)  # on --resume too: the same command gives the same data order
    model_cfg = ModelConfig.from_dict(model) if trn.get("init") is None else None
    return model_cfg, TrainConfig.from_dict(trn), "vocab_size" in explicit


# TrainConfig's batch 32 x 256 tokens is sized for a GPU; on CPU it takes half a minute a step even for tiny/*
CPU_BATCH_SIZE, CPU_SEQ_LEN = 8, 128


def _cpu_sized(trn: dict[str, Any]) -> None:
    """On CPU, batch_size / seq_len that were not given become CPU_BATCH_SIZE / CPU_SEQ_LEN (logged)."""
    from kvlm.cli.common import resolve_device

    if "batch_size" in trn and "seq_len" in trn:
        return
    if resolve_device(trn.get("device", "auto")).type != "cpu":
        return
    sized = {k: v for k, v in (("batch_size", CPU_BATCH_SIZE), ("seq_len", CPU_SEQ_LEN)) if k not in trn}
    if "grad_accum" in trn and "batch_size" in sized and CPU_BATCH_SIZE % trn["grad_accum"]:
        return  # the user's accumulation does not split the CPU batch: keep TrainConfig's
    trn.update(sized)
    logger.info(
        "CPU: "
        + ", ".join(f"{k} {v}" for k, v in sized.items())
        + " (TrainConfig's GPU-sized defaults are batch_size 32, seq_len 256; pass --batch-size / --seq-len)"
    )


def main(args) -> int:
    out = Path(args.out)
    model_cfg, tcfg, explicit_vocab = configs_from_args(args)
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not (Path(args.data) / "meta.json").is_file():
        raise ConfigError(
            f"under torchrun, --data must be a prepared folder (run `kvlm prepare` first): {args.data}"
        )
    if rank == 0:
        prepare_output_folder(out, "run folder --out")
    # rank 0 holds the run folder's lock from here to the end: a second trainer fails at once
    with run_lock(out) if rank == 0 else contextlib.nullcontext():
        data = load_or_prepare(args.data, out / "data")
        if rank == 0:
            check_new_run(out, resume=args.resume, force=args.force)
        if model_cfg is not None and not explicit_vocab and model_cfg.vocab_size != data.vocab_size:
            logger.info(f"vocab_size {model_cfg.vocab_size} -> {data.vocab_size} (the data's tokenizer)")
            model_cfg = model_cfg.replace(vocab_size=data.vocab_size)
        try:
            result = train(
                model_cfg,
                tcfg,
                data,
                out,
                resume=args.resume,
                progress=not args.no_progress,
                tensorboard=args.tensorboard,
            )
        except TrainingInterrupted as e:
            if rank == 0:
                saved = f"checkpoint saved to {e.checkpoint}" if e.checkpoint else "no checkpoint saved"
                print(f"kvlm train: interrupted at step {e.step}, {saved}; resume with: {_resume_command()}",
                      file=sys.stderr)  # fmt: skip
            return 130
    if args.json and rank == 0:
        summary = {k: v for k, v in result.to_dict().items() if k not in ("losses", "history")}
        print(json_text(summary))  # a NaN is null: strict JSON
    return 0


def _resume_command() -> str:
    """The command line of this run with --resume (and without --force)."""
    argv = [a for a in sys.argv[1:] if a not in ("--force", "--resume")]
    if "train" not in argv:
        return "the same command with --resume"
    return shlex.join(["kvlm", *argv, "--resume"])
