"""activate() checks the plan's module names against what is installed, without importing them:
a typo would otherwise parallelize nothing and train unparallelized, silently."""

from __future__ import annotations

import subprocess
import sys

import pytest

import hp_lazy
from hp_lazy.errors import PlanError
from hp_lazy.hook.api import MissingModuleWarning


def plan(module: str) -> dict:
    return {"version": 1, "mesh": {"tp": 2}, "modules": [module],
            "boundaries": {"lm_head": {"in_src": {"input": {"tp": "R"}}, "out_src": {"output": {"tp": "S(-1)"}},
                                       "params": {"weight": {"tp": "S(0)"}}}}}


def test_a_misspelt_module_warns(tmp_path) -> None:
    with pytest.warns(MissingModuleWarning, match=r"plan.modules names \['transformers.models.lama.modeling_llama'\], "
                                                  r"which no installed package provides"):
        handle = hp_lazy.activate(plan("transformers.models.lama.modeling_llama"), cache_dir=tmp_path)
    handle.deactivate()


def test_strict_makes_it_an_error(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("HP_LAZY_STRICT", "1")
    with pytest.raises(PlanError, match=r"fix the module name\(s\)"):
        hp_lazy.activate(plan("transformers.models.llama.modeling_lama"), cache_dir=tmp_path)


def test_an_installed_module_and_globs_pass_and_nothing_is_imported() -> None:
    code = (
        "import sys, warnings; warnings.simplefilter('error'); import hp_lazy; "
        f"h = hp_lazy.activate({plan('transformers.models.llama.modeling_llama')!r}); "
        "hp_lazy.activate('auto', tp=2).deactivate(); "
        "print(sorted(m for m in ('transformers', 'torch') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stderr
