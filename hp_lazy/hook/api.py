"""``install(plan, ...)`` / ``deactivate()``: put the finder on ``sys.meta_path`` and take it off
(``hp_lazy.activate`` in :mod:`hp_lazy.api` is the user's call; it wires the lowerer and runtime in).

``HP_LAZY_STRICT=1`` turns the already-imported warning into a ``PlanError``;
``HP_LAZY_DEBUG=1`` logs one line per lowered module (hit/miss, ms, key) to stderr.

Modules imported before ``activate`` stay as they are; deactivating leaves lowered modules lowered
and only restores how *later* imports behave. Activations nest: a handle's exit (``with
activate(...)``) puts back the plan that was active when it was made, if that one is still open.

One mesh per process: a module is lowered once, under one plan's degrees, and models built from
it bind on that mesh, so activating a plan with other degrees than a module already lowered is a
``PlanError``, and :func:`check_mesh` lets ``hp_lazy.mesh()`` refuse to report a mesh the lowered
modules do not use.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import warnings
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import ModuleType, TracebackType
from typing import Any, Union

from hp_lazy.errors import PlanError
from hp_lazy.hook.cache import Cache
from hp_lazy.hook.finder import (
    DYNAMIC_MODULE_UTILS,
    HpLazyFinder,
    NameMatcher,
    install_remote_code_view,
    missing_modules,
    remove_remote_code_view,
)
from hp_lazy.hook.loader import BindFn, HookState, LoweredInfo, LowerFn, plan_mesh
from hp_lazy.names import INFO, LOG_HANDLER
from hp_lazy.plan import Plan
from hp_lazy.plan.fqn import shown
from hp_lazy.plan.parse import check_degree
from hp_lazy.plan.plan import read_json

logger = logging.getLogger("hp_lazy.hook")

PlanSpec = Union[Plan, Mapping[str, Any], str, "os.PathLike[str]"]
_FIX = (
    "call hp_lazy.activate(...) before importing transformers models (first thing in the script, "
    "in every rank), or start a fresh process"
)


class AlreadyImportedWarning(UserWarning):
    """A module the plan targets was imported before ``activate`` and will not be lowered."""


@dataclass
class Handle:
    """The result of :func:`activate`; a context manager whose exit deactivates it and puts back
    the activation it replaced (if that one is still open)."""

    plan: Plan | None
    finder: HpLazyFinder | None = field(default=None, repr=False)
    previous: HpLazyFinder | None = field(default=None, repr=False)
    on_exit: list[Callable[[], None]] = field(default_factory=list, repr=False)

    @property
    def active(self) -> bool:
        return self.finder is not None and self.finder in sys.meta_path

    def deactivate(self) -> None:
        if self.finder is None or self.finder in _CLOSED:
            return
        _remove(self.finder, restore=self.previous)
        for callback in reversed(self.on_exit):
            callback()

    def __enter__(self) -> Handle:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.deactivate()


_LOCK = threading.Lock()
_ACTIVE: HpLazyFinder | None = None
_CLOSED: weakref.WeakSet[HpLazyFinder] = weakref.WeakSet()
"""Finders whose activation was ended: never put back."""


def deactivate() -> None:
    """End every activation (nested ones included); later imports are plain again."""
    global _ACTIVE
    with _LOCK:
        for finder in [f for f in sys.meta_path if isinstance(f, HpLazyFinder)]:
            _detach(finder)
            _CLOSED.add(finder)
        if _ACTIVE is not None:
            _detach(_ACTIVE)
            _CLOSED.add(_ACTIVE)
        _ACTIVE = None


def active_plan() -> Plan | None:
    finder = _ACTIVE
    return finder.state.plan if finder is not None else None  # type: ignore[return-value]


def install(
    plan: Any,
    *,
    cache: Cache,
    lower: LowerFn,
    bind: BindFn,
    runtime: Callable[[], Any],
) -> Handle:
    """Put a finder for ``plan`` (already resolved) at ``sys.meta_path[0]``.

    ``lower(source, module_plan, filename)`` rewrites a module, ``bind(module, module_plan,
    source_sha256)`` records it for the runtime and ``runtime()`` returns the module lowered code
    sees as ``__hp_rt__``: the facade (:mod:`hp_lazy.api`) passes hp_lazy's own; tests pass
    stand-ins to exercise the hook and cache on their own.
    """
    global _ACTIVE
    _maybe_debug_logging()
    state = HookState(
        plan=plan,
        cache=cache,
        lower=lower,
        bind=bind,
        runtime=runtime,
    )
    matcher = NameMatcher(plan.modules)
    _check_modules_exist(plan)
    _check_lowered_mesh(plan)
    _check_already_imported(plan, matcher)
    finder = HpLazyFinder(state, matcher)
    with _LOCK:
        previous = _ACTIVE
        if previous is not None:
            _detach(previous)
        _attach(finder)
        _ACTIVE = finder
    return Handle(plan=plan, finder=finder, previous=previous)


def _attach(finder: HpLazyFinder) -> None:
    sys.meta_path.insert(0, finder)
    dmu = sys.modules.get(DYNAMIC_MODULE_UTILS)
    if dmu is not None:
        install_remote_code_view(dmu, finder)


def _remove(finder: HpLazyFinder, *, restore: HpLazyFinder | None = None) -> None:
    """End ``finder``'s activation; if it is the active one, put ``restore`` back (when still open)."""
    global _ACTIVE
    with _LOCK:
        _detach(finder)
        _CLOSED.add(finder)
        if _ACTIVE is finder:
            _ACTIVE = None
            if restore is not None and restore not in _CLOSED:
                _attach(restore)
                _ACTIVE = restore


def _detach(finder: HpLazyFinder) -> None:
    while finder in sys.meta_path:
        sys.meta_path.remove(finder)
    remove_remote_code_view(finder)


# -- plans ---------------------------------------------------------------------------------------
def load_plan(
    plan: PlanSpec, *, tp: int | None = None, sequence_parallel: bool = False, cp: int | None = None,
    cp_mode: str | None = None, ep: int | None = None,
) -> Plan:
    """A Plan from any accepted form (shared by ``activate`` and the CLI): a Plan, a dict, JSON text or
    the path of a JSON file (:func:`hp_lazy.plan.plan.read_json`), or ``"auto"``. Bad input of any
    kind is a ``PlanError``."""
    if tp is not None:
        check_degree(f"activate(tp={shown(tp)})", tp, "tp=2")
    if isinstance(plan, str) and plan == "auto":
        if tp is None and (cp is not None or ep is not None):
            tp = 1
        if tp is None:
            raise PlanError(
                "activate('auto'): tp is not given; the auto plan needs the tensor-parallel "
                "degree; pass tp=N, e.g. hp_lazy.activate('auto', tp=2)"
            )
        return Plan.auto(tp=tp, sequence_parallel=sequence_parallel, cp=1 if cp is None else cp,
                         cp_mode=cp_mode or "allgather", ep=1 if ep is None else ep)
    if cp is not None or cp_mode is not None or ep is not None:
        raise PlanError(
            f"activate({shown(plan, limit=60)}): cp=, cp_mode= and ep= apply to the 'auto' plan only; an explicit "
            "plan states cp and ep in its mesh, the inner op on its attention boundaries and the ep_dispatch region "
            "on its experts; drop the arguments"
        )
    if sequence_parallel:
        raise PlanError(
            f"activate({shown(plan, limit=60)}): sequence_parallel=True applies to the 'auto' plan only; "
            "an explicit plan states its sequence-parallel placements itself; drop the argument"
        )
    if isinstance(plan, Plan):
        return plan if tp is None else _with_tp(plan, tp)
    if isinstance(plan, (str, os.PathLike)):
        plan = read_json(plan)
    if isinstance(plan, Mapping):
        return Plan.from_dict(plan if tp is None else _with_mesh_tp(plan, tp))
    raise PlanError(
        f"activate({shown(plan, limit=60)}): a plan of type {type(plan).__name__} is not accepted; "
        "pass a Plan, a dict, JSON text, a path to a .json plan, or 'auto'"
    )


def _with_mesh_tp(data: Mapping[str, Any], tp: int) -> dict[str, Any]:
    """``data`` with ``mesh.tp`` set to ``tp``; a mesh that is not an object is left for validation to name."""
    mesh = data.get("mesh")
    if mesh is None or isinstance(mesh, Mapping):
        return {**data, "mesh": {**(mesh or {}), "tp": tp}}
    return dict(data)


def _with_tp(plan: Plan, tp: int) -> Plan:
    """``plan`` with mesh tp (and, for an auto plan, its tp flag) set to ``tp``."""
    if dict(plan.mesh).get("tp") == tp:
        return plan
    data = plan.to_dict()
    data["mesh"] = {**data.get("mesh", {}), "tp": tp}
    if data.get("auto") is not None:
        data["auto"] = {**data["auto"], "tp": tp}
    return Plan.from_dict(data)


# -- modules that do not exist ------------------------------------------------------------------
class MissingModuleWarning(UserWarning):
    """A module the plan names exactly is not installed: the plan would parallelize nothing there."""


def _check_modules_exist(plan: Any) -> None:
    missing = missing_modules(getattr(plan, "modules", ()))
    if not missing:
        return
    message = (
        f"hp_lazy: plan.modules names {missing}, which no installed package provides, so nothing there "
        "would be lowered and the model would run unparallelized; fix the module name(s) (e.g. "
        "'transformers.models.llama.modeling_llama')"
    )
    if os.environ.get("HP_LAZY_STRICT", "0").strip() not in ("", "0"):
        raise PlanError(message)
    warnings.warn(message, MissingModuleWarning, stacklevel=3)


# -- one mesh per process ----------------------------------------------------------------------
def lowered_modules() -> dict[str, LoweredInfo]:
    """Every module hp_lazy lowered in this process that is still imported."""
    found = {}
    for name, module in list(sys.modules.items()):
        info = getattr(module, INFO, None) if module is not None else None
        if isinstance(info, LoweredInfo):
            found[name] = info
    return found


def _mesh_text(mesh: tuple[tuple[str, int], ...]) -> str:
    return "{" + ", ".join(f"{axis}: {n}" for axis, n in mesh) + "}"


def check_mesh(plan: Any, what: str) -> None:
    """Refuse ``plan`` when a module already lowered in this process was lowered with other degrees."""
    wanted = plan_mesh(plan)
    other = {n: info.mesh for n, info in lowered_modules().items() if info.mesh and info.mesh != wanted}
    if not other:
        return
    name, mesh = sorted(other.items())[0]
    more = f" (and {len(other) - 1} more)" if len(other) > 1 else ""
    raise PlanError(
        f"{what}: the plan's mesh is {_mesh_text(wanted)} but {name}{more} was already lowered in this process "
        f"under {_mesh_text(mesh)}, and the models built from it bind on that mesh; a module is lowered once per "
        "process, so keep one mesh per process (activate the same degrees again, or start a fresh process "
        "for another mesh)"
    )


def _check_lowered_mesh(plan: Any) -> None:
    check_mesh(plan, f"activate(mesh={_mesh_text(plan_mesh(plan))})")


# -- already-imported targets ------------------------------------------------------------------
def _check_already_imported(plan: Any, matcher: NameMatcher) -> None:
    hits = {n: sys.modules[n] for n in list(sys.modules) if matcher(n) and _declares_plan(plan, sys.modules[n])}
    plain = sorted(n for n, m in hits.items() if not isinstance(getattr(m, INFO, None), LoweredInfo))
    earlier = sorted(n for n in hits if n not in plain)
    messages = []
    if plain:
        messages.append(
            f"hp_lazy: {', '.join(plain)} imported before hp_lazy.activate(); "
            f"{'it' if len(plain) == 1 else 'they'} will not be lowered; {_FIX}"
        )
    if earlier:
        messages.append(
            f"hp_lazy: {', '.join(earlier)} {'was' if len(earlier) == 1 else 'were'} lowered under an earlier "
            f"hp_lazy.activate() plan and {'stays' if len(earlier) == 1 else 'stay'} lowered under it (models "
            "built from it bind with that plan's contracts); this plan applies to modules imported from now on; "
            "activate one plan per process, or start a fresh process"
        )
    if not messages:
        return
    message = " / ".join(messages)
    if os.environ.get("HP_LAZY_STRICT", "0").strip() not in ("", "0"):
        raise PlanError(message)
    warnings.warn(message, AlreadyImportedWarning, stacklevel=3)


def _declares_plan(plan: Any, module: ModuleType | None) -> bool:
    """Exact targets always count; a glob match of an auto plan only if its config has a TP plan."""
    if module is None:
        return False
    info = getattr(module, INFO, None)
    if info is not None and getattr(info, "plan_hash", None) == plan.hash:
        return False
    if getattr(plan, "auto_flags", None) is None or module.__name__ in plan.modules:
        return True
    for value in list(vars(module).values()):
        if isinstance(value, type) and getattr(value, "base_model_tp_plan", None):
            return True
    return False


def _maybe_debug_logging() -> None:
    if os.environ.get("HP_LAZY_DEBUG", "0").strip() in ("", "0"):
        return
    if not any(getattr(h, LOG_HANDLER, False) for h in logger.handlers):
        handler = logging.StreamHandler(sys.stderr)
        setattr(handler, LOG_HANDLER, True)
        logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
