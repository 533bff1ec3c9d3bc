"""FLOP counting of the ops a block runs: torch's ``FlopCounterMode`` (matmuls and attention; elementwise
work is not counted), extended with the fused CPU attention kernel, which torch's table lacks, and with the
FLOPs of kvlm's own decode kernels (``kvlm.kernels.FLOPS``), which run outside torch's dispatcher."""

from __future__ import annotations

import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

from kvlm import kernels


def sdpa_flops(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    """FLOPs of one scaled-dot-product attention call (q.k and p.v), from the operand shapes."""
    return sdpa_flop_count(query_shape, key_shape, value_shape)


class CountFlops:
    """FLOPs of the ops run inside the block (``total`` after it ends), with the fused CPU attention kernel
    counted as SDPA."""

    def __enter__(self) -> CountFlops:
        extra = {}
        cpu_flash = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
        if cpu_flash is not None:  # absent from some torch builds
            extra[cpu_flash] = sdpa_flops  # keyed by overload packet, as torch's own table
        self._mode = FlopCounterMode(display=False, custom_mapping=extra)
        self._kernel_flops = kernels.FLOPS["total"]
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)
        self.total = self._mode.get_total_flops() + kernels.FLOPS["total"] - self._kernel_flops
