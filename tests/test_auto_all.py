"""``Plan.auto(tp=2)`` over every transformers modeling module whose config declares a
``base_model_tp_plan``: each slice lowers, compiles and passes ``check``, or fails with a
``PlanError`` that names the module and what hp_lazy cannot honour. No module is executed."""

from __future__ import annotations

import glob
import os
from collections import Counter

import pytest

transformers = pytest.importorskip("transformers")

from hp_lazy import Plan, PlanError  # noqa: E402
from hp_lazy.lower import boundary_decisions, lower  # noqa: E402

MODELS = os.path.join(os.path.dirname(transformers.__file__), "models")


def _modules() -> list[tuple[str, str]]:
    found = []
    for config in sorted(glob.glob(os.path.join(MODELS, "*", "configuration_*.py"))):
        with open(config, encoding="utf-8") as fh:
            if "base_model_tp_plan" not in fh.read():
                continue
        family = os.path.basename(os.path.dirname(config))
        for path in sorted(glob.glob(os.path.join(MODELS, family, "modeling_*.py"))):
            found.append((f"transformers.models.{family}.{os.path.basename(path)[:-3]}", path))
    return found


def test_every_auto_module_lowers_or_says_why() -> None:
    plan = Plan.auto(tp=2)
    lowered, unsupported, untouched = [], Counter(), []
    for name, path in _modules():
        with open(path, encoding="utf-8") as fh:
            source = fh.read()
        try:
            module_plan = plan.slice(name, source)
        except PlanError as exc:
            assert str(exc).startswith(name), str(exc)
            unsupported[str(exc).split("'")[-2] if "'" in str(exc) else str(exc)[:60]] += 1
            continue
        if module_plan is None:
            untouched.append(name)
            continue
        code = compile(lower(source, module_plan, path), path, "exec", dont_inherit=True)
        assert code.co_filename == path
        decisions = boundary_decisions(source, module_plan)
        assert module_plan.contracts, name  # leaf-only slices (per-Linear rules) lower no class
        assert all(d.form in ("tp_collective", "generic") for _, d in decisions.values()), (name, decisions)
        lowered.append(name)
    print(f"\nPlan.auto(tp=2): {len(lowered)} modules lowered and compiled, "
          f"{sum(unsupported.values())} refused with a PlanError ({dict(unsupported.most_common(6))}), "
          f"{len(untouched)} without a tp plan of their own")
    assert len(lowered) >= 124
    assert "transformers.models.llama.modeling_llama" in lowered
