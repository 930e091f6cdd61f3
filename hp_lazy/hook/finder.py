"""The finder: decides by module *name* alone whether an import is hp_lazy's business.

Every import in the process passes through ``find_spec``; a non-target costs one frozenset lookup
and (for glob plans) one compiled-regex match: no I/O, no imports. For a target, the remaining
finders on ``sys.meta_path`` produce the spec (so editable installs and other finders keep
working); only a plain ``SourceFileLoader`` spec over a real ``.py`` file is adopted, by swapping
its loader for :class:`~hp_lazy.hook.loader.HpLazyLoader` (origin, cached, search locations kept).

``trust_remote_code`` modules are not imported through ``sys.meta_path``: transformers'
``dynamic_module_utils.get_class_in_module`` builds a spec with
``importlib.util.spec_from_file_location`` and calls ``spec.loader.exec_module`` itself. While
active, that module's global ``importlib`` name is replaced by a view whose
``util.spec_from_file_location`` hands the spec to :meth:`HpLazyFinder.adopt` (the real
``importlib`` is untouched, so no other import is affected). The view is installed at activation
if transformers.dynamic_module_utils is imported, else right after it is.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import threading
import warnings
from collections.abc import Iterable, Sequence
from importlib.machinery import ModuleSpec, SourceFileLoader
from types import ModuleType
from typing import Any

from hp_lazy.hook.loader import HookState, HpLazyLoader
from hp_lazy.plan.fqn import compile_globs, is_glob

DYNAMIC_MODULE_UTILS = "transformers.dynamic_module_utils"


class ForeignLoaderWarning(UserWarning):
    """A planned module is loaded by another tool's loader, so hp_lazy cannot lower it."""


class UnmatchedModelingWarning(UserWarning):
    """A transformers modeling module is imported while the plan has matched no module yet: its
    models would run unparallelized."""


def _is_modeling(name: str) -> bool:
    """``transformers.models.<family>.modeling_<...>`` (not ``auto``, which only maps names)."""
    parts = name.split(".")
    return len(parts) == 4 and parts[:2] == ["transformers", "models"] and parts[2] != "auto" and \
        parts[3].startswith("modeling_")


class NameMatcher:
    """Exact names in a frozenset, globs (:mod:`hp_lazy.plan.fqn`: ``*`` stays inside one dotted
    segment, ``**`` spans segments) in one regex."""

    def __init__(self, patterns: Iterable[str]) -> None:
        patterns = tuple(patterns)
        self.exact = frozenset(p for p in patterns if not is_glob(p))
        self.globs = tuple(p for p in patterns if is_glob(p))
        self._regex = compile_globs(self.globs)

    def __call__(self, name: str) -> bool:
        if name in self.exact:
            return True
        return self._regex is not None and self._regex.match(name) is not None


class HpLazyFinder:
    """A ``sys.meta_path`` finder for the modules of one activated plan."""

    def __init__(self, state: HookState, matcher: NameMatcher) -> None:
        self.state = state
        self.matches = matcher
        self._busy = threading.local()
        self._matched_any = False

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if fullname == DYNAMIC_MODULE_UTILS:
            return self._watch_dynamic_module_utils(fullname, path, target)
        if not self.matches(fullname):
            if not self._matched_any and fullname.startswith("transformers.models.") and _is_modeling(fullname):
                self._warn_unmatched(fullname)
            return None
        if getattr(self._busy, "on", False):
            return None
        self._matched_any = True
        return self.adopt(self._delegate(fullname, path, target))

    def _warn_unmatched(self, fullname: str) -> None:
        """Once per activation: the first modeling module imported while the plan's modules
        matched nothing (a typo in a glob or a name, or a plan for another family)."""
        self._matched_any = True  # said once
        warnings.warn(
            f"hp_lazy: {fullname} is imported, but plan.modules {sorted(self.matches.exact | set(self.matches.globs))} "
            "has matched no module so far, so its models run unparallelized; fix plan.modules (e.g. "
            "'transformers.models.llama.modeling_llama' or 'transformers.models.*.modeling_*'), or ignore this if "
            "that model is meant to run whole",
            UnmatchedModelingWarning,
            stacklevel=2,
        )

    def adopt(self, spec: ModuleSpec | None) -> ModuleSpec | None:
        """Swap the loader of a planned source module's spec for hp_lazy's; else leave it."""
        if spec is None or not self.matches(spec.name):
            return spec
        loader = spec.loader
        if type(loader) is SourceFileLoader and not loader.path.endswith(".py"):
            return spec
        if type(loader) is not SourceFileLoader:
            if isinstance(loader, SourceFileLoader) and not isinstance(loader, HpLazyLoader):
                warnings.warn(
                    f"hp_lazy: {spec.name} is loaded by {type(loader).__qualname__}, another "
                    "tool's loader, so hp_lazy does not lower it; activate that tool for other "
                    "packages only, or deactivate it",
                    ForeignLoaderWarning,
                    stacklevel=2,
                )
            return spec
        spec.loader = HpLazyLoader(spec.name, loader.path, self.state)
        return spec

    def _delegate(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None
    ) -> ModuleSpec | None:
        self._busy.on = True
        try:
            for finder in _after(self):
                find_spec = getattr(finder, "find_spec", None)
                if find_spec is None:
                    continue
                spec = find_spec(fullname, path, target)
                if spec is not None:
                    return spec
            return None
        finally:
            self._busy.on = False

    def _watch_dynamic_module_utils(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None
    ) -> ModuleSpec | None:
        if getattr(self._busy, "on", False):
            return None
        spec = self._delegate(fullname, path, target)
        if spec is not None and type(spec.loader) is SourceFileLoader:
            spec.loader = _PatchAfterExec(spec.name, spec.loader.path, self)
        return spec


def _after(finder: HpLazyFinder) -> list[Any]:
    """The meta_path finders after ``finder`` (PathFinder if it is not on the path any more)."""
    meta_path = list(sys.meta_path)
    rest = meta_path[meta_path.index(finder) + 1 :] if finder in meta_path else []
    rest = [f for f in rest if not isinstance(f, HpLazyFinder)]
    return rest or [importlib.machinery.PathFinder]


class _PatchAfterExec(SourceFileLoader):
    """Stock loader for transformers.dynamic_module_utils that installs the view once executed."""

    def __init__(self, fullname: str, path: str, finder: HpLazyFinder) -> None:
        super().__init__(fullname, path)
        self._finder = finder

    def exec_module(self, module: ModuleType) -> None:
        super().exec_module(module)
        if self._finder in sys.meta_path:
            install_remote_code_view(module, self._finder)


class _UtilView:
    def __init__(self, finder: HpLazyFinder) -> None:
        self._finder = finder

    def __getattr__(self, name: str) -> Any:
        return getattr(importlib.util, name)

    def spec_from_file_location(self, *args: Any, **kwargs: Any) -> ModuleSpec | None:
        return self._finder.adopt(importlib.util.spec_from_file_location(*args, **kwargs))


class ImportlibView:
    """Stands in for ``importlib`` inside transformers.dynamic_module_utils only."""

    def __init__(self, finder: HpLazyFinder) -> None:
        self.util = _UtilView(finder)
        self.finder = finder

    def __getattr__(self, name: str) -> Any:
        return getattr(importlib, name)


def install_remote_code_view(dmu: ModuleType, finder: HpLazyFinder) -> None:
    if getattr(dmu, "importlib", None) is importlib or isinstance(dmu.__dict__.get("importlib"), ImportlibView):
        dmu.importlib = ImportlibView(finder)  # type: ignore[attr-defined]


def remove_remote_code_view(finder: HpLazyFinder) -> None:
    dmu = sys.modules.get(DYNAMIC_MODULE_UTILS)
    view = getattr(dmu, "importlib", None) if dmu is not None else None
    if isinstance(view, ImportlibView) and view.finder is finder:
        dmu.importlib = importlib  # type: ignore[union-attr]


DYNAMIC_ROOT = "transformers_modules"
"""Where transformers puts trust_remote_code modules (they exist only once downloaded)."""


def missing_modules(patterns: Iterable[str]) -> list[str]:
    """The exact module names in ``patterns`` that no installed package provides (a typo there plans
    nothing, silently). Looked up on the file system from the top-level package's locations, so
    nothing is imported; globs and trust_remote_code modules (created at download) are not checked."""
    return [name for name in patterns if not is_glob(name) and not name.startswith(DYNAMIC_ROOT) and not _exists(name)]



def _exists(name: str) -> bool:
    top, *rest = name.split(".")
    if top in sys.modules:
        return _exists_below(list(getattr(sys.modules[top], "__path__", []) or []), rest) if rest else True
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return False
    if spec is None:
        return False
    return _exists_below(list(spec.submodule_search_locations or []), rest) if rest else True


def _exists_below(locations: list[str], parts: list[str]) -> bool:
    head, *rest = parts
    for location in locations:
        package = os.path.join(location, head)
        if os.path.isdir(package):
            if not rest:
                return True
            if _exists_below([package], rest):
                return True
        elif not rest and any(
            entry.split(".")[0] == head and entry.endswith((".py", ".pyc", ".so", ".pyd"))
            for entry in _listdir(location)
        ):
            return True
    return False


def _listdir(location: str) -> list[str]:
    try:
        return os.listdir(location)
    except OSError:
        return []
