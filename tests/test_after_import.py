"""``hp_lazy.hook.after.when_imported``: the callback runs at once for an imported module, right
after execution for a later import (with the module's own loader behind it), and once."""

from __future__ import annotations

import importlib
import sys

from hp_lazy.hook.after import when_imported


def test_already_imported_runs_at_once() -> None:
    seen = []
    when_imported("json", seen.append)
    assert seen == [sys.modules["json"]]


def test_a_later_import_runs_after_execution(tmp_path, monkeypatch) -> None:
    package = tmp_path / "hp_after_demo"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "sub.py").write_text("VALUE = 41\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []
    when_imported("hp_after_demo.sub", lambda m: seen.append(m.VALUE + 1))
    assert seen == []
    module = importlib.import_module("hp_after_demo.sub")
    assert seen == [42]
    assert module.__loader__.get_source("hp_after_demo.sub") == "VALUE = 41\n"  # the stock loader behind it
    importlib.reload(module)
    assert seen == [42]
    for name in ("hp_after_demo.sub", "hp_after_demo"):
        sys.modules.pop(name, None)
