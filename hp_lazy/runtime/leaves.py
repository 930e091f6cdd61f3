"""Run-time implementations for modules hp_lazy does not rewrite from source.

torch leaves (``nn.Embedding``, ``nn.Linear``), classes imported from elsewhere and contracts
marked ``skip_source_lowering`` get a subclass (``module.__class__`` is swapped, so ``isinstance``,
``state_dict`` names and optimizer references are unchanged) whose forward applies the same
entry/exit ops a lowered forward would:

- ``nn.Embedding`` with its weight ``S(0)`` on tp is vocab-parallel (:mod:`hp_lazy.runtime.tp.embedding`);
- ``nn.ModuleList`` (the decoder-layer stack under sequence parallel: :mod:`hp_lazy.runtime.sp.stack`)
  applies its entry op to the first layer's hidden states and its exit op to the last layer's output;
- anything else wraps its own forward: entry ops on the declared inputs, exit ops on the output.

Deferred biases (rowwise Linears whose bias is added once after the reduction) are hidden from
their module's forward here too.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from hp_lazy.names import BINDING, IMPL, LEAF, LEAF_INPUTS
from hp_lazy.runtime.adapters import base_of, is_tuner
from hp_lazy.runtime.binding import Binding, CallContext

if TYPE_CHECKING:  # the mixins only ever sit in front of these classes
    _Module = nn.Module
    _Linear = nn.Linear
else:
    _Module = _Linear = object


def wrap_forward(module: nn.Module, binding: Binding) -> None:
    """Entry ops on the declared inputs -> the class's own forward -> exit ops. The binding is
    also kept (``LEAF``) on the module PEFT would wrap, so it can move to a tuner layer and back."""
    setattr(module, BINDING, binding)
    # a PEFT layer passes its inputs through to the module it wraps (``forward(x, *args, **kwargs)``):
    # the declared inputs sit where that module's forward has them
    setattr(module, LEAF_INPUTS, _input_positions(type(base_of(module)), binding))
    module.__class__ = subclass(type(module), _LeafForward)
    base_of(module).__dict__[LEAF] = binding


def unwrap_forward(module: nn.Module) -> None:
    """Undo :func:`wrap_forward` (the leaf's ops move to the PEFT layer that now wraps it, or back)."""
    cls = type(module)
    if issubclass(cls, _LeafForward):
        module.__class__ = cls.__mro__[2]  # (made subclass, mixin, original)
        module.__dict__.pop(BINDING, None)


def move_leaves(model: nn.Module) -> None:
    """After PEFT wrapped (or unwrapped) a bound torch leaf: its entry/exit ops run around the
    outermost module that now stands for it (a LoRA layer adds its adapter inside the boundary)."""
    holder: dict[int, nn.Module] = {}
    for m in model.modules():  # outer before inner: nested wrappers (PEFT's target_parameters) keep the outermost
        if is_tuner(m):
            holder.setdefault(id(base_of(m)), m)
    for module in list(model.modules()):
        binding = module.__dict__.get(LEAF)
        if binding is None:
            continue
        outer = holder.get(id(module), module)
        if outer is not module:
            unwrap_forward(module)
        if not isinstance(outer, _LeafForward):
            wrap_forward(outer, binding)


class _LeafForward(_Module):
    """Mixin: ``forward`` = entry ops on declared inputs -> the class's own forward -> exit ops."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        binding: Binding = getattr(self, BINDING)
        call = CallContext()
        values = list(args)
        for name, position in getattr(self, LEAF_INPUTS):
            if position is not None and position < len(values):
                values[position] = binding.enter(name, values[position], call)
            elif name in kwargs:
                kwargs[name] = binding.enter(name, kwargs[name], call)
        return binding.exit(super().forward(*values, **kwargs), call)


def _input_positions(cls: type[nn.Module], binding: Binding) -> tuple[tuple[str, int | None], ...]:
    params = list(inspect.signature(own_forward(cls)).parameters.values())[1:]
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    names = sorted(set(binding.contract.in_src) | set(binding.contract.in_dst))
    if len(names) == 1 and names[0] not in positional and names[0] == "input" and positional:
        return ((names[0], 0),)  # "input" names the first input of any leaf
    return tuple((name, positional.index(name) if name in positional else None) for name in names)


class _NoBiasLinear(_Linear):
    """Mixin for ``nn.Linear`` whose bias is added by its boundary after the reduction."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return F.linear(input, self.weight)


class _NoBiasModule(_Module):
    """Mixin for any other module owning a deferred bias: the bias is hidden during forward."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        bias = self._parameters["bias"]
        self._parameters["bias"] = None
        try:
            return super().forward(*args, **kwargs)
        finally:
            self._parameters["bias"] = bias


def suppress_bias(owner: nn.Module) -> None:
    """Keep ``owner.bias`` registered (state_dict, optimizer) but out of ``owner``'s forward."""
    if issubclass(type(owner), (_NoBiasLinear, _NoBiasModule)):
        return
    mixin = _NoBiasLinear if type(owner).forward is nn.Linear.forward else _NoBiasModule
    owner.__class__ = subclass(type(owner), mixin)


_SUBCLASSES: dict[tuple[type, type], type] = {}
_MIXINS: set[type] = set()


def subclass(cls: type, mixin: type) -> type:
    """``cls`` with ``mixin``'s forward in front (same name, module and qualname), made once."""
    made = _SUBCLASSES.get((cls, mixin))
    if made is None:
        made = type(cls.__name__, (mixin, cls), {"__module__": cls.__module__, "__qualname__": cls.__qualname__})
        _SUBCLASSES[(cls, mixin)] = made
        _MIXINS.add(mixin)
    return made


def own_forward(cls: type[nn.Module]) -> Any:
    """The forward the model's code defines for ``cls``: the first in its MRO that is not one of
    the mixins :func:`subclass` put in front (whose ``*args, **kwargs`` hide the real parameters)."""
    for klass in cls.__mro__:
        if klass not in _MIXINS and "forward" in vars(klass):
            return vars(klass)["forward"]
    return cls.forward


def calls_attention(module: nn.Module) -> bool:
    """A module whose forward dispatches through transformers' attention interface (read under
    the decorators transformers puts on forwards, and under hp_lazy's lowered one)."""
    code = inspect.unwrap(getattr(type(module), IMPL, type(module).forward))
    return "ALL_ATTENTION_FUNCTIONS" in getattr(getattr(code, "__code__", None), "co_names", ())
