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


_ONE_MESH = '''
import warnings, hp_lazy
from hp_lazy.errors import PlanError
outer = hp_lazy.activate("auto", tp=2)
with hp_lazy.activate("auto", tp=4) as inner:
    assert hp_lazy.mesh is not None and dict(hp_lazy.api.active_plan().mesh) == {"tp": 4}
assert hp_lazy.api.active_plan() is outer.plan, "the nested activate's exit restores the outer plan"
import transformers.models.llama.modeling_llama as m
assert m.__hp_lazy__.mesh == (("tp", 2),)
try:
    hp_lazy.activate("auto", tp=4)
except PlanError as exc:
    print("MESH:", exc)
assert hp_lazy.api.active_plan() is outer.plan, "a refused activate changes nothing"
with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    again = hp_lazy.activate("auto", tp=2, sequence_parallel=True)
print("WARN:", " | ".join(str(w.message) for w in seen))
again.deactivate()
assert hp_lazy.api.active_plan() is outer.plan
with hp_lazy.activate("auto", tp=2):
    hp_lazy.deactivate()
assert hp_lazy.api.active_plan() is None, "deactivate() ends every activation; no exit brings one back"
'''


def test_one_mesh_per_process_and_nested_activations_restore() -> None:
    out = subprocess.run([sys.executable, "-c", _ONE_MESH], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = dict(line.split(": ", 1) for line in out.stdout.splitlines())
    assert lines["MESH"] == (
        "activate(mesh={tp: 4}): the plan's mesh is {tp: 4} but transformers.models.llama.modeling_llama was "
        "already lowered in this process under {tp: 2}, and the models built from it bind on that mesh; a module "
        "is lowered once per process, so keep one mesh per process (activate the same degrees again, or start a "
        "fresh process for another mesh)"
    )
    assert "will not be lowered" not in lines["WARN"]
    assert ("transformers.models.llama.modeling_llama was lowered under an earlier hp_lazy.activate() plan and "
            "stays lowered under it") in lines["WARN"]


def test_the_process_group_timeout_is_validated(monkeypatch) -> None:
    from datetime import timedelta

    from hp_lazy.errors import ShardingError
    from hp_lazy.runtime.mesh import pg_timeout

    monkeypatch.delenv("HP_LAZY_PG_TIMEOUT_S", raising=False)
    assert pg_timeout() == timedelta(seconds=600)
    monkeypatch.setenv("HP_LAZY_PG_TIMEOUT_S", "90")
    assert pg_timeout() == timedelta(seconds=90)
    for bad in ("ten", "0", "-3", "1e9"):
        monkeypatch.setenv("HP_LAZY_PG_TIMEOUT_S", bad)
        with pytest.raises(ShardingError, match=rf"HP_LAZY_PG_TIMEOUT_S='{bad}' is not a positive number of seconds"):
            pg_timeout()
