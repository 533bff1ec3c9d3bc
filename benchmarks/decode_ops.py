"""Count the work of one decode step (FLOPs, aten operator calls, bytes of tensors produced) per attention:
deterministic where timings on a shared machine are not (benchmarks/architecture-v2.md).

    python benchmarks/decode_ops.py        # also runs against an older checkout with PYTHONPATH=<checkout>
"""

import collections

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from kvlm import ModelConfig, build_model
from kvlm.attention.eg_mla import precompute_gate_tables


class CountOps(TorchDispatchMode):
    """aten operator calls and bytes of the tensors they return."""

    def __init__(self):
        super().__init__()
        self.calls = collections.Counter()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.calls[str(func.overloadpacket)] += 1
        if isinstance(out, torch.Tensor):
            self.bytes += out.numel() * out.element_size()
        return out


def main() -> None:
    torch.set_num_threads(2)
    for attention in ("eg-mla", "mla", "mha", "gqa"):
        cfg = ModelConfig(
            attention=attention, n_layer=2, d_model=768, n_head=12, vocab_size=32000, max_seq_len=1024
        )
        torch.manual_seed(0)
        model = build_model(cfg).eval()
        if hasattr(model, "prepare_for_inference"):  # absent before architecture v2
            model.prepare_for_inference()
        for table in (False, True) if attention == "eg-mla" else (False,):
            if attention == "eg-mla":
                precompute_gate_tables(model, table)
            with torch.inference_mode():
                cache = model.new_cache(2, 1024)
                model(torch.randint(0, 32000, (2, 512)), cache=cache)
                token = torch.randint(0, 32000, (2, 1))
                model(token, cache=cache)  # warm: derived weights built, first-call work done
                flops, ops = FlopCounterMode(display=False), CountOps()
                with flops, ops:
                    model(token, cache=cache)
            label = f"{attention}{' table' if table else ''}"
            print(
                f"{label:12s} flops={flops.get_total_flops():.4g} ops={sum(ops.calls.values())} "
                f"produced={ops.bytes / 1e6:.2f}MB"
            )


if __name__ == "__main__":
    main()
