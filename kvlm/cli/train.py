"""`kvlm train`: train a model from a preset or YAML config (kvlm.training)."""

from __future__ import annotations

import json
import os
from dataclasses import fields
from pathlib import Path
from typing import Any

from kvlm.cli.common import parse_overrides
from kvlm.config import ConfigError, ModelConfig, load_yaml_or_json
from kvlm.data import load_or_prepare
from kvlm.logs import get_logger
from kvlm.preset_table import get_preset
from kvlm.training import TrainConfig, train

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
        g.add_argument(flag, dest=f"m_{name}", type=typ, metavar=name.upper(), help=f"ModelConfig.{name}")
    g = p.add_argument_group("budget (the first reached ends training)")
    g.add_argument("--steps", type=int, help="optimizer steps (default 1000 when no other budget is given)")
    g.add_argument("--tokens", type=int, help="training tokens")
    g.add_argument("--minutes", type=float, help="training time")
    g = p.add_argument_group("training")
    for flag, name, typ in TRAIN_FLAGS:
        g.add_argument(flag, dest=f"t_{name}", type=typ, metavar=name.upper(), help=f"TrainConfig.{name}")
    g.add_argument("--compile", action="store_true", help="torch.compile the model")
    g.add_argument("--embedding-parallel", action="store_true",
                   help="EG-MLA under torchrun: shard each gating embedding table by columns over the ranks "
                   "(eg-mla.md Eqs. 9-11); a no-op with one process")  # fmt: skip
    g.add_argument("--fsdp", action="store_true",
                   help="under torchrun: FSDP2 (fully_shard) instead of DDP, each rank holding 1/N of the weights, "
                   "gradients and AdamW state; checkpoints stay whole; a no-op with one process")  # fmt: skip
    g.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="any ModelConfig or TrainConfig field (repeatable)")  # fmt: skip
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint")
    p.add_argument("--tensorboard", action="store_true", help="also log to OUT/tensorboard")
    p.add_argument("--no-progress", action="store_true")
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
    return ModelConfig.from_dict(model), TrainConfig.from_dict(trn), "vocab_size" in explicit


def main(args) -> int:
    out = Path(args.out)
    model_cfg, tcfg, explicit_vocab = configs_from_args(args)
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not (Path(args.data) / "meta.json").is_file():
        raise ConfigError(
            f"under torchrun, --data must be a prepared folder (run `kvlm prepare` first): {args.data}"
        )
    data = load_or_prepare(args.data, out / "data")
    if not explicit_vocab and model_cfg.vocab_size != data.vocab_size:
        logger.info(f"vocab_size {model_cfg.vocab_size} -> {data.vocab_size} (the data's tokenizer)")
        model_cfg = model_cfg.replace(vocab_size=data.vocab_size)
    result = train(
        model_cfg,
        tcfg,
        data,
        out,
        resume=args.resume,
        progress=not args.no_progress,
        tensorboard=args.tensorboard,
    )
    if args.json and rank == 0:
        summary = {k: v for k, v in result.to_dict().items() if k not in ("losses", "history")}
        print(json.dumps(summary))
    return 0
