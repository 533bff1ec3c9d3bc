"""What a plan built once and reused every decode step relies on (``kvlm.decode_plans``: the decoder
block's weights, panels and flags gathered for one kernel call), and a check of it that costs a few
microseconds a step instead of the ~50 (warm; 2-4x that cold, after each weight stream) of gathering it again.

A plan goes stale when a module it was built from changes. Those changes reach the modules in three ways, and
``Bound.holds`` sees each:
- attributes set, deleted or registered (a weight or submodule replaced, ``eps`` or a flag changed, weights
  packed or dropped, ``train()``, ``.to()``): kvlm's modules are ``Watched``, whose ``__setattr__``,
  ``__delattr__`` and ``_apply`` advance a global count (``touch``); code that writes a module's ``__dict__``
  directly calls ``touch``;
- tensors written in place or swapped under the module (``load_state_dict`` copies, an optimizer step,
  ``torch.func.functional_call``, which writes ``_parameters`` directly): every parameter of the modules is
  checked by identity in its module, version counter and data pointer (derived copies, e.g. panels or MLA's
  absorbed weights, were built from the old values);
- forward hooks, which a plan would skip (it declines under them): checked on every module, and torch's global
  ones, added or removed.
"""

from __future__ import annotations

from torch import nn
from torch.nn.modules import module as _nn_module

_epoch = 0


def touch() -> None:
    """Mark every plan built before now stale (for code that writes a module's ``__dict__`` directly)."""
    global _epoch
    _epoch += 1


class Watched:
    """Mixin (before ``nn.Module`` or its subclass among the bases): any attribute set, deleted or registered and
    any ``_apply`` (``.to()``, ``.float()``, ...) marks plans stale (``touch``)."""

    def __setattr__(self, name, value):
        touch()
        super().__setattr__(name, value)

    def __delattr__(self, name):
        touch()
        super().__delattr__(name)

    def register_parameter(self, name, param):
        touch()
        super().register_parameter(name, param)

    def register_buffer(self, name, tensor, persistent=True):
        touch()
        super().register_buffer(name, tensor, persistent)

    def register_module(self, name, module):
        touch()
        super().register_module(name, module)

    add_module = register_module

    def _apply(self, fn, recurse=True):
        touch()
        return super()._apply(fn, recurse)


def hooked(*modules: nn.Module) -> bool:
    """Whether a forward call of any of ``modules`` would run hooks (their own or torch's global ones): a
    decode path that computes them in one kernel call would skip those, so it declines."""
    return _any_hooks([(m._forward_hooks, m._forward_pre_hooks) for m in modules])


def _any_hooks(hooks) -> bool:
    """Whether torch has global forward hooks or any of the (forward hooks, forward pre-hooks) dictionaries
    ``hooks`` holds one."""
    if _nn_module._global_forward_hooks or _nn_module._global_forward_pre_hooks:
        return True
    return any(post or pre for post, pre in hooks)


class Bound:
    """The state of ``modules`` when a plan was built from them; ``holds()`` while nothing it relies on has
    changed (see the module docstring). Holds their parameters (so that their identities stay unique) and their
    parameter and hook dictionaries, not the modules: a plan kept beside a module in a weak dictionary
    (``kvlm.decode_plans``) must not keep that module alive."""

    def __init__(self, modules: list[nn.Module]):
        self.epoch = _epoch
        self.hooks = tuple((m._forward_hooks, m._forward_pre_hooks) for m in modules)
        self.hooked = _any_hooks(self.hooks)  # a plan built under hooks (none) is stale once they are gone
        self.params = tuple(
            (m._parameters, name, p, -1 if p is None else version(p), None if p is None else p.data_ptr())
            for m in modules
            for name, p in m._parameters.items()
        )
        self.counts = tuple((m._parameters, len(m._parameters)) for m in modules)  # one added directly

    def holds(self) -> bool:
        if _epoch != self.epoch or _any_hooks(self.hooks) != self.hooked:
            return False
        for params, n in self.counts:
            if len(params) != n:
                return False
        for params, name, p, version, ptr in self.params:
            if params.get(name) is not p:
                return False
            if p is not None and ((version != -1 and p._version != version) or p.data_ptr() != ptr):
                return False
        return True


def version(w) -> int:
    """The tensor's in-place write counter; -1 for an inference tensor (a model built under
    torch.inference_mode), which has none: such weights, and copies derived from them, are trusted."""
    return -1 if w.is_inference() else w._version
