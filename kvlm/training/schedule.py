"""The learning-rate schedule and the optimizer.

- ``lr_at(cfg, step, elapsed)``: linear warm-up, then cosine decay to ``min_lr_ratio * lr`` over the budget.
- ``make_optimizer(model, cfg, device)``: AdamW (beta 0.9 / 0.95), weight decay on the >= 2-D weights (matrices
  and embeddings, as nanoGPT); norms and biases are not decayed.
"""

from __future__ import annotations

import math

import torch

from kvlm.training.config import TrainConfig


def lr_at(cfg: TrainConfig, step: int, elapsed: float = 0.0) -> float:
    """Learning rate for update `step` (0-based): linear warm-up, then cosine from lr down to
    min_lr_ratio * lr over the rest of the budget. A step or token budget counts in steps; a time budget
    alone counts in seconds of training (`elapsed`), and by default warms up over its first 5 %."""
    total = cfg.total_steps()
    if total is None and cfg.warmup_steps is None:
        frac, warm = elapsed / (cfg.max_minutes * 60.0), 0.05
        if frac < warm:
            return cfg.lr * frac / warm
        p = (frac - warm) / (1 - warm)
    else:
        warmup = cfg.warmup()
        if step < warmup:
            return cfg.lr * (step + 1) / warmup
        p = (
            (step - warmup) / max(1, total - warmup)
            if total is not None
            else elapsed / (cfg.max_minutes * 60.0)
        )
    p = min(max(p, 0.0), 1.0)
    min_lr = cfg.min_lr_ratio * cfg.lr
    return min_lr + 0.5 * (cfg.lr - min_lr) * (1.0 + math.cos(math.pi * p))


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    decay, no_decay = [], []
    for _, p in model.named_parameters():  # named_parameters yields tied weights once
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    extra = {"fused": True} if device.type == "cuda" else {}
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, **extra)
