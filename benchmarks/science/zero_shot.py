"""Zero-shot WinoGrande-format accuracy (lm-eval, task winogrande_local) of the kept seed-0 models.

    python benchmarks/science/zero_shot.py --weights .science_data/weights --data .science_data/mix \
        --out benchmarks/science/zero_shot.json [--limit 2000]

The GPU sitting keeps float16 weights of a few seed-0 runs (gpu_sitting.sh KEEP); each is rebuilt here into a
kvlm checkpoint folder (float32 weights, the grid's tokenizer) and scored on CPU.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from kvlm.checkpoint import save_checkpoint
from kvlm.config import ModelConfig
from kvlm.data import load_prepared
from kvlm.interop.lm_eval import run_lm_eval
from kvlm.model import build_model


def rebuild(folder: Path, data) -> Path:
    ckpt = folder / "checkpoint"
    if (ckpt / "model.safetensors").exists():
        return ckpt
    cfg = ModelConfig.from_dict(json.loads((folder / "config.json").read_text()))
    model = build_model(cfg)
    sd = {k: v.float() for k, v in load_file(str(folder / "model.fp16.safetensors")).items()}
    model.load_state_dict(sd)
    save_checkpoint(ckpt, model, tokenizer=data.tokenizer, meta={"note": "rebuilt from float16 weights"})
    return ckpt


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--weights", type=Path, required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--limit", type=int, default=2000)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    data = load_prepared(args.data)
    out = json.loads(args.out.read_text()) if args.out.exists() else {}
    for folder in sorted(d for d in args.weights.iterdir() if d.is_dir()):
        if folder.name in out:
            continue
        ckpt = rebuild(folder, data)
        res = run_lm_eval(str(ckpt), ["winogrande_local"], limit=args.limit)["winogrande_local"]
        n = args.limit
        acc = res["acc"]
        res["n"] = n
        res["binomial_se"] = math.sqrt(0.25 / n)  # under chance (0.5): what "near chance" means here
        out[folder.name] = res
        args.out.write_text(json.dumps(out, indent=1))
        print(
            f"{folder.name}: acc {acc:.4f} (n={n}; chance 0.5 +- {1.96 * res['binomial_se']:.3f})", flush=True
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
