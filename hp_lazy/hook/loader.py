"""The loader: read source -> plan slice -> cache or lower -> compile -> exec with the runtime.

``get_code`` is overridden (not only ``source_to_code``): a valid ``__pycache__`` pyc would
otherwise bypass the rewrite, and lowered bytecode must never land in ``__pycache__`` where an
un-hooked process would load it. A module whose slice is empty is compiled the stock way (pyc
included). ``__file__``, ``co_filename`` and ``get_source`` stay the real ``.py`` file, so
tracebacks, ``inspect.getsource`` and transformers' source heuristics see the original text.
"""

from __future__ import annotations

import ast
import hashlib
import importlib
import importlib.util
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib.machinery import SourceFileLoader
from types import CodeType, ModuleType
from typing import Any, Protocol

from hp_lazy.errors import LoweringError
from hp_lazy.hook.cache import Cache, cache_key
from hp_lazy.names import INFO, RT

logger = logging.getLogger("hp_lazy.hook")

LowerFn = Callable[[str, Any, str], ast.Module]
"""``lower(source, module_plan, filename) -> ast.Module`` (hp_lazy.lower.lower)."""
BindFn = Callable[[str, Any, str], None]
"""``register(module_name, module_plan, source_sha256)`` (hp_lazy.runtime.registry.register)."""


class PlanLike(Protocol):
    hash: str

    def slice(self, module_name: str, source: str) -> Any: ...


@dataclass(frozen=True)
class LoweredInfo:
    """What ``module.__hp_lazy__`` holds for a lowered module."""

    module: str
    plan_hash: str
    slice_hash: str
    source_sha256: str
    cache_key: str
    cache_path: str | None
    hit: bool
    ms: float
    """Wall time of the whole load (read, slice, cache lookup or lower + compile + store)."""
    slice_ms: float
    """Of which ``plan.slice``; for ``auto`` it includes importing the model's config module,
    which the module's own imports would otherwise pay."""
    mesh: tuple[tuple[str, int], ...] = ()
    """The degrees of the plan it was lowered under (its models bind on that mesh)."""


def plan_mesh(plan: Any) -> tuple[tuple[str, int], ...]:
    """A plan's degrees as sorted pairs (``()`` for a plan without a mesh)."""
    return tuple(sorted(dict(getattr(plan, "mesh", None) or {}).items()))


@dataclass(frozen=True)
class HookState:
    """Everything a loader needs; one per activation."""

    plan: PlanLike
    cache: Cache
    lower: LowerFn
    bind: BindFn
    runtime: Callable[[], Any]
    """Returns the module lowered code sees as ``__hp_rt__`` (hp_lazy.runtime.rt)."""


@dataclass(frozen=True)
class _Loaded:
    code: CodeType
    module_plan: Any
    info: LoweredInfo | None


class HpLazyLoader(SourceFileLoader):
    """A SourceFileLoader whose code for a planned module is the lowered tree."""

    def __init__(self, fullname: str, path: str, state: HookState) -> None:
        super().__init__(fullname, path)
        self._state = state

    def get_code(self, fullname: str) -> CodeType:
        return self._load(fullname).code

    def exec_module(self, module: ModuleType) -> None:
        loaded = self._load(module.__name__)
        if loaded.info is not None:
            namespace = module.__dict__
            namespace[RT] = self._state.runtime()
            namespace[INFO] = loaded.info
            self._state.bind(module.__name__, loaded.module_plan, loaded.info.source_sha256)
        exec(loaded.code, module.__dict__)

    def _load(self, fullname: str) -> _Loaded:
        start = time.perf_counter()
        data = self.get_data(self.path)
        source = importlib.util.decode_source(data)
        module_plan = self._state.plan.slice(fullname, source)
        slice_ms = (time.perf_counter() - start) * 1000.0
        if module_plan is None:
            code = super().get_code(fullname)
            if code is None:
                raise ImportError(f"{fullname}: no code for {self.path}", name=fullname)
            return _Loaded(code, None, None)
        return self._lowered(fullname, data, source, module_plan, start, slice_ms)

    def _lowered(
        self, fullname: str, data: bytes, source: str, module_plan: Any, start: float, slice_ms: float
    ) -> _Loaded:
        """Cache hit, or lower + compile + store; ``start`` is when the load began."""
        source_sha256 = hashlib.sha256(data).hexdigest()
        key = cache_key(
            slice_hash=module_plan.hash, source_sha256=source_sha256, module=fullname, origin=self.path
        )
        cache = self._state.cache
        code, path = cache.lookup(key, fullname, source_sha256)
        hit = code is not None
        if code is None:
            code = self._compile(fullname, self._state.lower(source, module_plan, self.path))
            path = cache.store(key, fullname, source_sha256, code, self.path)
        info = LoweredInfo(
            module=fullname,
            plan_hash=self._state.plan.hash,
            slice_hash=module_plan.hash,
            source_sha256=source_sha256,
            cache_key=key,
            cache_path=str(path) if path is not None else None,
            hit=hit,
            ms=round((time.perf_counter() - start) * 1000.0, 3),
            slice_ms=round(slice_ms, 3),
            mesh=plan_mesh(self._state.plan),
        )
        logger.debug(
            "hp_lazy: %s %s %.2fms key=%s %s",
            fullname, "hit" if hit else "miss", info.ms, key[:12], info.cache_path or "(memory)",
        )
        return _Loaded(code, module_plan, info)

    def _compile(self, fullname: str, tree: ast.Module) -> CodeType:
        try:
            return compile(tree, self.path, "exec", dont_inherit=True)
        except (SyntaxError, ValueError, TypeError) as exc:
            raise LoweringError(
                f"{fullname}: the lowered module does not compile ({exc}); this is an hp_lazy bug: "
                f"report it with the output of `python -m hp_lazy show {fullname} --plan ...`"
            ) from exc
