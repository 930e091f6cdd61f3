"""Hub kernels never bypass a planned module.

transformers (``from_pretrained(use_kernels=...)``, on by default since 5.25) and the ``kernels``
library's ``kernelize`` replace the forward of every module whose class carries
``kernel_layer_name`` (``@use_kernel_forward_from_hub("RMSNorm")``) with a hub kernel's. A planned
module, one that holds planned modules, or one whose parameters hp_lazy cut must run its own
forward: a kernel there skips the boundary's entry and exit ops and computes on this rank's shards
as if they were whole (a fused kernel reads ``self.<proj>.weight`` itself). At bind each such
module keeps its forward: kernels' per-instance switch, the class's ``kernel_condition``, answers
False for it; a forward a kernel already set on the instance is removed; one
:class:`HubKernelWarning` per class names the module and the kernel. Kernels elsewhere (norms
between boundaries, rotary embeddings) stay: they see whole values or per-token rows.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from types import MethodType
from typing import Any

from torch import nn

from hp_lazy.names import HUB_CONDITION, NO_HUB_KERNEL

LAYER_NAME = "kernel_layer_name"
"""The class attribute ``kernels.use_kernel_forward_from_hub`` sets (what ``kernelize`` looks for)."""
CONDITION = "kernel_condition"

_warned: set[type] = set()


class HubKernelWarning(UserWarning):
    """A hub kernel is turned off for a planned module (which then runs hp_lazy's forward)."""


def keep_planned_forwards(model: nn.Module, planned: Iterable[str], sharded: Iterable[str]) -> None:
    """Turn hub kernels off for the modules of ``model`` at the FQNs in ``planned`` (bound
    boundaries), their ancestors, and the modules owning a parameter in ``sharded``."""
    keep = set(planned)
    keep |= {fqn.rpartition(".")[0] for fqn in sharded}
    keep |= {fqn[:i] for fqn in list(keep) for i, c in enumerate(fqn) if c == "."} | {""}
    for fqn, module in model.named_modules():
        if fqn in keep and getattr(type(module), LAYER_NAME, None) is not None:
            _turn_off(fqn or type(module).__qualname__, module)


def _turn_off(fqn: str, module: nn.Module) -> None:
    cls = type(module)
    module.__dict__[NO_HUB_KERNEL] = True
    current = getattr(cls, CONDITION, None)
    if not getattr(current, HUB_CONDITION, False):  # not wrapped yet, or registered again since
        _wrap_condition(cls, current)
    replaced = module.__dict__.get("forward")  # what kernelize set (a bound method), if it ran before the bind;
    if isinstance(replaced, MethodType) and replaced.__self__ is module:  # other wrappers (accelerate's hooks) stay
        del module.__dict__["forward"]
    else:
        replaced = None
    if cls not in _warned:
        _warned.add(cls)
        warnings.warn(
            f"hp_lazy: {fqn} ({cls.__qualname__}) is planned or holds planned modules, so its hub kernel "
            f"{getattr(cls, LAYER_NAME)!r} is turned off for it{' (it was already in place)' if replaced else ''}: "
            "the boundary's own forward runs on every instance of this class that the plan splits",
            HubKernelWarning, stacklevel=3,
        )


def _wrap_condition(cls: type, original: Callable[[Any], bool] | None) -> None:
    def condition(module: Any) -> bool:
        if module.__dict__.get(NO_HUB_KERNEL):
            return False
        return True if original is None else bool(original(module))

    setattr(condition, HUB_CONDITION, True)
    setattr(cls, CONDITION, staticmethod(condition))
