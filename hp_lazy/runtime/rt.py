"""The names lowered code calls, as ``__hp_rt__.<name>`` (docs/contract.md).

This module is the whole contract between the two halves: the lowerer emits calls to these
names only, and the loader puts this module into each lowered module as ``__hp_rt__``.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Mapping
from typing import Any, NoReturn

import torch
from torch import nn
from torch.nn.modules.module import register_module_module_registration_hook

from hp_lazy.errors import ShardingError
from hp_lazy.names import BOUND, CP_ENTRY, INPUT_CHECK, LAID_OUT, LAZY_HOOK, LAZY_INIT, WATCH, WRAPPED
from hp_lazy.runtime import guard, outputs, record
from hp_lazy.runtime.binding import Binding, CallContext, add_deferred_bias
from hp_lazy.runtime.comm import (
    all_to_all,
    copy_to,
    gather_from,
    gather_to,
    reduce_from,
    reduce_scatter_to,
    scatter_to,
)
from hp_lazy.runtime.grads import owner_of

__all__ = [
    "add_deferred_bias",
    "all_to_all",
    "begin",
    "copy_to",
    "ensure_parallel",
    "enter",
    "enter_call",
    "exit",
    "gather_from",
    "gather_to",
    "install_root",
    "lazy_root",
    "reduce_from",
    "reduce_scatter_to",
    "scatter_to",
    "unbound",
]


class Unbound:
    """Class-level default of ``_hp_b``: any use means the model was never bound."""

    __slots__ = ("qualname",)

    def __init__(self, qualname: str) -> None:
        self.qualname = qualname

    def __getattr__(self, name: str) -> NoReturn:
        if name.startswith("__") and name.endswith("__"):  # introspection (copy, pickle, hasattr of a protocol)
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        raise ShardingError(
            f"{self.qualname}: this forward was lowered by hp_lazy but runs on an instance that was never "
            "bound (its parameters are not sharded, it has no process group); call "
            "hp_lazy.parallelize(model) on the top-level model before the first forward, or run the "
            "top-level model's forward, which binds it"
        )

    def __repr__(self) -> str:
        return f"<hp_lazy unbound {self.qualname}>"


def unbound(qualname: str) -> Unbound:
    return Unbound(qualname)


def ensure_parallel(module: nn.Module, inputs: Mapping[str, Any] | None = None) -> None:
    """Root prologue: bind the model on its first forward; a few dict lookups afterwards.

    ``inputs`` (the forward's arguments; the caller's frame locals when omitted, which at the top
    of a forward are exactly its arguments) go to the tp group's input check.
    """
    if BOUND not in module.__dict__:
        from hp_lazy.runtime.owner import parallelize

        top = record.top_of(module) if LAID_OUT in module.__dict__ else record.built_in(module)
        parallelize(top if top is not None else module)  # a backbone run first binds the model it was built in
    watch = module.__dict__.get(WATCH)
    if watch is not None and watch.dirty:  # PEFT wrapped (or unwrapped) a planned Linear since binding
        from hp_lazy.runtime.owner import refresh

        refresh(watch.top())
    top = watch.top() if watch is not None else None
    if top is not None and "forward" in top.__dict__:  # someone replaced the model's forward
        guard.check(top)
    owner = owner_of(module)
    if owner is not None:
        owner.check(module)
    check = module.__dict__.get(INPUT_CHECK)
    split_later = inputs is None and CP_ENTRY in module.__dict__  # cp: the wrapper checked the full inputs
    if check is not None and not split_later and not torch.compiler.is_compiling():
        check(sys._getframe(1).f_locals if inputs is None else inputs)


def install_root(cls: type[nn.Module]) -> None:
    """Wrap a root class's ``forward`` (inherited, or under context parallel its own, whose
    prologue then finds the model bound): bind, check inputs, and let the bound root's context
    parallel entry split the batch. The signature is kept (``functools.wraps``). Also
    :func:`lazy_root`."""
    lazy_root(cls)
    inner = cls.forward

    @functools.wraps(inner)
    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        ensure_parallel(self, {"args": args, "kwargs": kwargs})
        entry = self.__dict__.get(CP_ENTRY)
        if entry is None:
            return inner(self, *args, **kwargs)
        return entry(inner, self, args, kwargs, whole=outputs.wanted())

    cls.forward = forward


class _LazyHook:
    """``_initialize_hook`` of a lowered root: present (truthy) while the instance is unbound or
    changed since binding (PEFT wrapped a planned Linear), absent otherwise."""

    def __get__(self, module: nn.Module | None, owner: type) -> Any:
        if module is not None:
            watch = module.__dict__.get(WATCH)
            if BOUND not in module.__dict__ or (watch is not None and watch.dirty):
                return True
        raise AttributeError(LAZY_HOOK)


def _bind_now(module: nn.Module, *args: Any) -> None:
    """Bind ``module`` outside any traced region (no-op when bound)."""
    ensure_parallel(module)


def _is_root(module: nn.Module) -> bool:
    return getattr(type(module), LAZY_INIT, None) is _bind_now


def _bind_wrapped(wrapper: nn.Module, *args: Any) -> None:
    """``_infer_parameters`` of a module that wraps lowered roots: bind them (no-op when bound)."""
    for root in wrapper.__dict__.get(WRAPPED, ()):
        ensure_parallel(root)


def _on_registration(parent: nn.Module, name: str, module: nn.Module | None) -> None:
    """A module that takes a lowered root (or such a wrapper) as a child (``PeftModel``, PEFT's
    ``LoraModel``, DDP, a user's own ``nn.Module``) gets the lazy-module attributes on the instance:
    ``torch.compile(wrapper)`` then binds the model (or the adapters PEFT added since binding)
    before tracing, as it does for the root itself; without them dynamo would trace the binding."""
    if module is None or _is_root(parent):
        return
    roots = [module] if _is_root(module) else list(module.__dict__.get(WRAPPED, ()))
    if not roots:
        return
    held = parent.__dict__.setdefault(WRAPPED, [])
    held.extend(r for r in roots if all(r is not h for h in held))
    parent.__dict__[LAZY_HOOK] = True
    parent.__dict__[LAZY_INIT] = _bind_wrapped


_WRAP_HOOK: list[Any] = []


def lazy_root(cls: type[nn.Module]) -> None:
    """Bind a root before ``torch.compile`` traces it: torch's lazy-module protocol
    (``_initialize_hook`` / ``_infer_parameters``, which ``torch.compile(model)`` and dynamo call
    outside the graph), and ``model.compile()`` binds first. The traced forward then only reads
    two dicts (``ensure_parallel``'s fast path): one graph, no break. ``resize_token_embeddings``
    on a bound model re-cuts a vocab-sharded embedding and head at the new size
    (:mod:`hp_lazy.runtime.tp.resize`)."""
    if LAZY_INIT in cls.__dict__:
        return
    if not _WRAP_HOOK:
        _WRAP_HOOK.append(register_module_module_registration_hook(_on_registration))
    setattr(cls, LAZY_HOOK, _LazyHook())
    setattr(cls, LAZY_INIT, _bind_now)
    compile_module = cls.compile

    def compile(self: nn.Module, *args: Any, **kwargs: Any) -> None:  # noqa: A001 - nn.Module's name
        ensure_parallel(self)
        compile_module(self, *args, **kwargs)

    cls.compile = compile  # type: ignore[method-assign]
    resize = getattr(cls, "resize_token_embeddings", None)
    if resize is not None:

        def resize_token_embeddings(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
            from hp_lazy.runtime.tp.resize import resize_sharded

            return resize_sharded(self, resize, args, kwargs)

        cls.resize_token_embeddings = functools.wraps(resize)(resize_token_embeddings)  # type: ignore[attr-defined]


def begin(binding: Binding) -> CallContext:
    """Generic form: the context of one call, carried from its entry ops to its exit ops."""
    return CallContext()


def enter(binding: Binding, name: str, value: Any, call: CallContext) -> Any:
    """Generic form: the entry ops of input ``name``."""
    return binding.enter(name, value, call)


def enter_call(binding: Binding, fn: Any, args: tuple, kwargs: dict, call: CallContext) -> tuple[tuple, dict]:
    """Generic form of a forward inherited from another module: the entry ops of the declared
    inputs, found by name in ``fn``'s signature."""
    import inspect

    bound = inspect.signature(fn).bind_partial(*args, **kwargs)
    for name in binding.in_ops:
        if name in bound.arguments:
            bound.arguments[name] = binding.enter(name, bound.arguments[name], call)
    return bound.args, bound.kwargs


def exit(binding: Binding, outputs: Any, call: CallContext) -> Any:  # noqa: A001 - the contract's name
    """Generic form: every exit op, by output position, plus deferred biases."""
    return binding.exit(outputs, call)
