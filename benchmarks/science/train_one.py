"""One run of the science grid: train <label> with <seed> (resuming its checkpoint if one is there), then
measure its out-of-domain validation loss and write RUN/summary.json (the runner's "done" marker).

    python benchmarks/science/train_one.py --label sl-mha --seed 0 --runs RUNS --data DATA --ood OOD

Written for the runner (run_grid.py) but usable alone; --steps overrides the recipe for smoke tests only.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import grid  # noqa: E402

from kvlm.data import load_prepared  # noqa: E402
from kvlm.logs import setup_logging  # noqa: E402
from kvlm.training import TrainConfig, train  # noqa: E402
from kvlm.training.data_order import eval_starts  # noqa: E402
from kvlm.training.device import autocast_for  # noqa: E402
from kvlm.training.validation import validation_loss  # noqa: E402


def run_dir(runs: Path, label: str, seed: int) -> Path:
    return runs / label / f"seed{seed}"


def converged_drop(val_losses: list[tuple[int, float]]) -> float | None:
    """How converged: the relative fall of the validation loss over the last fifth of the steps
    (0.01 = still falling 1 % over the last 20 % of training)."""
    if len(val_losses) < 2:
        return None
    last_step, last = val_losses[-1]
    target = 0.8 * last_step
    earlier = min(val_losses[:-1], key=lambda sv: abs(sv[0] - target))
    return (earlier[1] - last) / earlier[1]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--label", required=True)
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--runs", required=True, type=Path)
    p.add_argument("--data", required=True, help="prepared data (kvlm prepare)")
    p.add_argument("--ood", required=True, help="prepared data whose val split is the held-out source")
    p.add_argument("--device", default="auto")
    p.add_argument("--steps", type=int, help="override the recipe's max_steps (smoke tests only)")
    p.add_argument("--eval-interval", type=int, help="override the recipe's eval_interval (smoke tests only)")
    p.add_argument("--eval-iters", type=int, help="override the recipe's eval_iters (smoke tests only)")
    p.add_argument("--keep-weights", type=Path, help="also write the final weights (float16) here")
    args = p.parse_args(argv)
    torch.set_num_threads(1)  # many runs share the machine's cores
    setup_logging()

    v = grid.by_label()[args.label]
    recipe = dict(grid.TRAIN, seed=args.seed, device=args.device)
    if args.steps:
        recipe["max_steps"] = args.steps
    if args.eval_interval:
        recipe["eval_interval"] = args.eval_interval
    if args.eval_iters:
        recipe["eval_iters"] = args.eval_iters
    tcfg = TrainConfig(**recipe)
    out = run_dir(args.runs, args.label, args.seed)
    resume = (out / "checkpoint").is_dir()
    data = load_prepared(args.data)
    t0 = time.time()
    res = train(None if resume else v.cfg, tcfg, data, out, resume=resume, progress=False)

    # out-of-domain: the same windows for every run (eval_starts is deterministic), same dtype as training
    ood = load_prepared(args.ood)
    device = next(res.model.parameters()).device
    autocast, precision = autocast_for(tcfg, device)
    starts = eval_starts(ood.val, tcfg.seq_len, tcfg.eval_iters * tcfg.batch_size)
    ood_loss = validation_loss(res.model, ood.val, starts, tcfg.seq_len, tcfg.batch_size, device, autocast)
    train_tail = res.losses[-50:]
    summary = {
        "label": v.label,
        "group": v.group,
        "seed": args.seed,
        "attention": v.cfg.attention,
        "steps": res.steps,
        "tokens": res.tokens,
        "final_val_loss": res.final_val_loss,
        "best_val_loss": res.best_val_loss,
        "ood_val_loss": ood_loss,
        "ood_windows": len(starts),
        "final_train_loss_mean50": sum(train_tail) / len(train_tail) if train_tail else None,
        "val_curve": res.val_losses,
        "train_curve": [[i + 1, loss] for i, loss in enumerate(res.losses) if (i + 1) % 25 == 0],
        "converged_drop_last20pct": converged_drop(res.val_losses),
        "n_params": res.n_params,
        "kv_elements_per_token": v.cfg.kv_cache_elements_per_token(),
        "kv_bytes_per_token_bf16": v.cfg.kv_cache_bytes_per_token(2),
        "model_config": res.model_config,
        "train_config": res.train_config,
        "data": data.summary(),
        "ood_data": ood.summary(),
        "device": str(device) + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""),
        "precision": precision,
        "step_time_ms": res.step_time_ms,
        "wall_s": time.time() - t0,
        "resumed": resume,
        "torch": torch.__version__,
    }
    if args.keep_weights:
        from safetensors.torch import save_file

        args.keep_weights.mkdir(parents=True, exist_ok=True)
        sd = {k: t.detach().to("cpu", torch.float16).contiguous() for k, t in res.model.state_dict().items()}
        save_file(sd, str(args.keep_weights / "model.fp16.safetensors"))
        (args.keep_weights / "config.json").write_text(json.dumps(res.model_config, indent=2))
    tmp = out / "summary.json.tmp"
    tmp.write_text(json.dumps(summary, indent=1))
    tmp.replace(out / "summary.json")
    print(
        f"done {v.label} seed {args.seed}: val {res.final_val_loss:.4f} ood {ood_loss:.4f} "
        f"({res.steps} steps, {summary['wall_s']:.0f} s)",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
