"""Validation loss of checkpoints on the exact windows `kvlm train` evaluates (the conversion page's anchors).

    python benchmarks/heal_anchor.py DATA CKPT [CKPT ...] --seq-len 128 --windows 32

DATA: a `kvlm prepare` folder; the windows are `kvlm.training.data_order.eval_starts(val, seq_len, windows)`,
the ones a `kvlm train --seq-len S --batch-size B --eval-iters I` run scores (windows = B * I), so a checkpoint
before conversion, after it and after healing are compared on the same tokens. Prints one JSON line per
checkpoint: {"checkpoint", "val_loss", "perplexity", "tokens"}.
"""

from __future__ import annotations

import argparse
import json
import math

import torch

from kvlm.data.prepared import load_prepared
from kvlm.interop.hf_folder import load_model_folder
from kvlm.training.data_order import eval_starts
from kvlm.training.validation import validation_loss


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("data", help="a kvlm prepare folder (its val split)")
    p.add_argument("checkpoints", nargs="+", help="kvlm checkpoints or Hugging Face folders kvlm reads")
    p.add_argument("--seq-len", type=int, default=128, help="window length (the run's --seq-len)")
    p.add_argument("--windows", type=int, default=32, help="windows: the run's batch size x eval iters")
    p.add_argument("--batch", type=int, default=8, help="windows per forward call")
    args = p.parse_args()
    data = load_prepared(args.data)
    starts = eval_starts(data.val, args.seq_len, args.windows)
    for ckpt in args.checkpoints:
        model, _tok, _meta = load_model_folder(ckpt)
        loss = validation_loss(model.float(), data.val, starts, args.seq_len, args.batch, torch.device("cpu"))
        out = {"checkpoint": ckpt, "val_loss": loss, "perplexity": math.exp(loss)}
        print(json.dumps({**out, "tokens": len(starts) * args.seq_len}), flush=True)


if __name__ == "__main__":
    main()
