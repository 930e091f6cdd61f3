"""``when_imported(name, callback)``: run ``callback(module)`` once the module ``name`` has executed.

At once if it is already in ``sys.modules``; otherwise a ``sys.meta_path`` finder that only
watches the registered names (one dict lookup per import) lets the other finders produce the spec
and wraps its loader so that ``callback`` runs right after ``exec_module``. The facade uses it to
connect hp_lazy to training stacks imported after ``activate`` (accelerate, which the transformers
Trainer drives) without importing them itself. Import-time half: no torch, no runtime.
"""

from __future__ import annotations

import importlib.machinery
import sys
import threading
from collections.abc import Callable, Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Any

Callback = Callable[[ModuleType], None]


class _Watcher:
    """A meta_path finder for the watched names only."""

    def __init__(self) -> None:
        self.pending: dict[str, list[Callback]] = {}
        self._busy = threading.local()

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if fullname not in self.pending or getattr(self._busy, "on", False):
            return None
        self._busy.on = True
        try:
            spec = _delegate(self, fullname, path, target)
        finally:
            self._busy.on = False
        if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _ThenCall(spec.loader, self.pending.pop(fullname))
        return spec


def _delegate(watcher: _Watcher, fullname: str, path: Sequence[str] | None, target: ModuleType | None) -> Any:
    for finder in [f for f in sys.meta_path if f is not watcher] or [importlib.machinery.PathFinder]:
        find_spec = getattr(finder, "find_spec", None)
        spec = find_spec(fullname, path, target) if find_spec is not None else None
        if spec is not None:
            return spec
    return None


class _ThenCall:
    """The module's own loader, then the callbacks (every other attribute is the loader's)."""

    def __init__(self, loader: Any, callbacks: list[Callback]) -> None:
        self._loader, self._callbacks = loader, callbacks

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        for callback in self._callbacks:
            callback(module)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


_WATCHER = _Watcher()
_LOCK = threading.Lock()


def when_imported(name: str, callback: Callback) -> None:
    """``callback(module)`` now if ``name`` is imported, else right after its import executes."""
    module = sys.modules.get(name)
    if module is not None:
        callback(module)
        return
    with _LOCK:
        _WATCHER.pending.setdefault(name, []).append(callback)
        if _WATCHER not in sys.meta_path:
            sys.meta_path.insert(0, _WATCHER)  # before PathFinder, which would answer first
