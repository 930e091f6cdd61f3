"""Stand-ins for the plan and the lowerer, so the hook and the cache are tested on their own.

``FakePlan.slice`` gives every planned module a slice (None when the source contains
``HP_SKIP``); ``fake_lower`` appends ``__lowered_by__ = 'fake'`` to the module and counts calls.
"""

from __future__ import annotations

import ast
import hashlib
import sys
import textwrap
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TOY_SOURCE = textwrap.dedent(
    '''\
    """A toy modeling module."""


    class Block:
        def forward(self, x):
            return x + 1


    def boom():
        raise RuntimeError("boom")
    '''
)
BOOM_LINE = 10

LOWER_CALLS: list[str] = []
BIND_CALLS: list[tuple[str, Any, str]] = []


@dataclass(frozen=True)
class FakeModulePlan:
    module: str
    hash: str


@dataclass(frozen=True)
class FakePlan:
    modules: tuple[str, ...]
    hash: str = "fakeplan0"
    auto_flags: Any = None
    extra: dict[str, str] = field(default_factory=dict)

    def slice(self, module_name: str, source: str) -> FakeModulePlan | None:
        if "HP_SKIP" in source:
            return None
        digest = hashlib.sha256(f"{self.hash}:{module_name}".encode()).hexdigest()
        return FakeModulePlan(module=module_name, hash=digest)


def fake_lower(source: str, module_plan: Any, filename: str) -> ast.Module:
    LOWER_CALLS.append(module_plan.module)
    tree = ast.parse(source, filename)
    marker = ast.parse("__lowered_by__ = 'fake'").body[0]
    last = tree.body[-1]
    for node in ast.walk(marker):
        if hasattr(node, "lineno"):
            node.lineno = node.end_lineno = last.end_lineno
            node.col_offset, node.end_col_offset = 0, 1
    tree.body.append(marker)
    return tree


def fake_bind(module_name: str, module_plan: Any, source_sha256: str) -> None:
    BIND_CALLS.append((module_name, module_plan, source_sha256))


FAKE_RT = types.ModuleType("fake_rt")


def fake_runtime() -> types.ModuleType:
    return FAKE_RT


def make_pkg(root: Path, pkg: str, source: str = TOY_SOURCE, module: str = "modeling_toy") -> Path:
    """``root/pkg/__init__.py`` + ``root/pkg/<module>.py``; returns the module file."""
    (root / pkg).mkdir(parents=True, exist_ok=True)
    (root / pkg / "__init__.py").write_text("")
    path = root / pkg / f"{module}.py"
    path.write_text(source)
    return path


def install_fake(modules: tuple[str, ...], cache_dir: str | Path, mode: str | None = None):
    from hp_lazy.hook.api import install
    from hp_lazy.hook.cache import Cache

    return install(
        FakePlan(modules), cache=Cache(cache_dir, mode), lower=fake_lower, bind=fake_bind, runtime=fake_runtime
    )


def child_main(argv: list[str]) -> None:
    """``python hookfakes.py PKG_ROOT MODULE CACHE_DIR``: import MODULE hooked, print its info."""
    import importlib
    import json

    root, module, cache_dir = argv
    sys.path.insert(0, root)
    install_fake((module,), cache_dir)
    mod = importlib.import_module(module)
    info = mod.__hp_lazy__
    print(json.dumps({"hit": info.hit, "key": info.cache_key, "sha": info.source_sha256,
                      "lowered": mod.__lowered_by__}))


if __name__ == "__main__":
    child_main(sys.argv[1:])
