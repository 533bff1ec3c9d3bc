"""Training: the loop, its configuration, schedule, data order, checkpoints with exact resume, and metrics.

    from kvlm.training import TrainConfig, train
    result = train(model_cfg, TrainConfig(max_steps=300), data="data/stories", out_dir="runs/mla")

- ``TrainConfig`` (config.py): budget (the first of max_steps / max_tokens / max_minutes), batch and sequence
  length, gradient accumulation, AdamW and schedule settings, device and precision (float32 on CPU, bf16
  autocast on CUDA), torch.compile, embedding_parallel.
- ``train`` / ``Trainer`` (loop.py): AdamW (weight decay on >= 2-D weights), linear warm-up then cosine decay
  to min_lr_ratio of the peak (schedule.py), gradient clipping and accumulation, data parallel under torchrun,
  EG-MLA embedding parallelism (each rank a column slice of the gate tables; eg-mla.md Eqs. 9-11).
- Data order (data_order.py) is a pure function of (seed, step); checkpoints (state.py) hold weights, AdamW
  state, every rank's RNG states and the counters, so a resumed run reproduces the uninterrupted run's losses
  exactly on CPU.
- Fine-tuning (start.py): ``TrainConfig.init`` starts from a kvlm checkpoint or a Hugging Face folder with a
  fresh optimizer at step 0; ``train_only`` / ``freeze`` (globs on parameter names) train only some parameters;
  config.yaml's ``init`` section records where the weights came from.
- Run folder: config.yaml, metrics.jsonl (metrics.py: one record per logged step with loss, val_loss, lr,
  tokens/s, per-rank memory and step time), checkpoint/ (kvlm.checkpoint format + trainer_state.pt),
  result.json, loss.png (plot.py: log-log loss curve), tensorboard/ (optional). Log lines go through kvlm.logs (rank 0).
"""

from kvlm.training.config import TrainConfig
from kvlm.training.data_order import BatchOrder, eval_starts
from kvlm.training.loop import Trainer, train
from kvlm.training.metrics import TrainResult
from kvlm.training.schedule import lr_at, make_optimizer
from kvlm.training.state import CHECKPOINT_DIR
from kvlm.training.validation import validation_loss

__all__ = [
    "CHECKPOINT_DIR",
    "BatchOrder",
    "TrainConfig",
    "TrainResult",
    "Trainer",
    "eval_starts",
    "lr_at",
    "make_optimizer",
    "train",
    "validation_loss",
]
