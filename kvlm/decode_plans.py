"""The decode step's kernel plans, kept from step to step: each decoder block's one-call plan
(``Attention.decode_block_plan``, through ``Block.kept_plan``) and each model's stack of them in one kernel call
(``KVLM.decode_stack``, ``kvlm.kernels.block_stack``). Both are kept off the modules, in weak dictionaries keyed by
them, so that copies and state dicts never carry them; what they hold must not hold their key (``Bound`` keeps
the modules' dictionaries, not the modules), or a model once decoded would never be freed."""

from __future__ import annotations

import weakref

import torch
from torch import nn

from kvlm.attention.watch import Bound
from kvlm.kernels import block_stack
from kvlm.kernels.few_rows import few_rows_fit

# each Block's plan and the state it was built from: (Bound, plan or None)
_PLANS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# each model's stack of its blocks' plans: (the plans, the stack or None)
_STACKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def decoding(module: nn.Module) -> bool:
    """Whether a decode step of ``module`` may run as kernel calls: inference, no autograd, not traced."""
    return not (module.training or torch.is_grad_enabled() or torch.compiler.is_compiling())


def block_rows(module: nn.Module, x: torch.Tensor) -> bool:
    """Whether a call on x (B, T, d) may run its blocks as kernel calls: ``decoding`` and rows the block kernels'
    products may take (``few_rows_fit``: float32 on CPU, B T up to ``MAX_ROWS``; past ``FEW_ROWS`` only blocks
    whose weights no library layout holds, ``BlockCall.wide``), T > 1 new tokens a sequence included
    (speculative verification, a short prompt)."""
    return x.dim() == 3 and few_rows_fit(x, first=False) and decoding(module)


def kept_plan(block: nn.Module):
    """``block.one_call_plan()``, built once and kept while nothing it was built from changes (``Bound``):
    gathering and checking the block's weights every step cost ~50 us a layer warm and 2-4x that after each
    weight stream (benchmarks/decode-limit.md)."""
    kept = _PLANS.get(block)
    if kept is None or not kept[0].holds():
        plan = block.one_call_plan()
        kept = _PLANS[block] = (Bound(list(block.modules())), plan)
    return kept[1]


def decode_stack(model: nn.Module, x: torch.Tensor, step, cache) -> torch.Tensor | None:
    """Every block of ``model`` at a decode step (x (B, T, d), T new tokens a sequence: ``block_rows``) in one
    kernel call (kvlm.kernels.block_stack, csrc/decode_stack.h) over the blocks' kept plans, or None where a
    block has none or the step does not apply (each block then runs on its own: ``Block.one_call``, else module
    by module). The stack is built again when any block's plan is (a weight, hook or flag changed). The Python
    around each block's own call cost a step ~60-105 us a layer, cold after each weight stream
    (benchmarks/decode-limit.md)."""
    if not block_rows(model, x):
        return None
    plans = []
    for block in model.layers:
        plan = block.kept_plan()
        if plan is None:
            return None
        plans.append(plan)
    kept = _STACKS.get(model)
    if kept is None or kept[0] != tuple(plans):  # plans compare by identity
        kept = _STACKS[model] = (tuple(plans), block_stack([p.call for p in plans]))
    if kept[1] is None:
        return None
    inputs = []
    for plan, layer in zip(plans, cache.layers):
        step_inputs = plan.inputs(x, step, layer)
        if step_inputs is None:
            return None
        inputs.append(step_inputs)
    y = kept[1](x, inputs)
    if y is not None:
        for plan in plans:
            plan.ran(step)
    return y
