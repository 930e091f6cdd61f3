"""Mutants of Plan.auto's own plans, shared by ``test_plan_mutants.py`` and ``benchmarks/mutants.py``.

A mutant is Plan.auto's slice of one modeling module written out as an explicit JSON plan, with one
change. :func:`mutants` makes the changes a careless edit makes (a field dropped, a placement
flipped, a partial sum let out); :func:`exhaustive` makes every single change of every field of every
contract: each placement entry set to every value on every mesh axis or dropped, each list field
dropped, each flag toggled, each inner op and region swapped for every other kind or dropped, each
boundary's class swapped for another boundary's. :func:`run` is the pool worker that activates one
and trains one step; :func:`verdict` compares it with one process: ``refused`` (an hp_lazy error on
every rank), ``match`` (logits, loss and every gradient within 1e-5), ``unclear: ...`` (it failed, but
not with hp_lazy's error on every rank: the user gets torch's message, not the fix) or ``wrong: ...``
(it trained, and the numbers are off).
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable
from typing import Any

import models
import parity

PLACEMENTS = ("R", "S(0)", "S(1)", "S(2)", "S(-1)", "P(sum)")
SIDES = ("in_src", "in_dst", "out_src", "out_dst", "params")
LISTS = ("deferred_bias_params", "grad_sum_params", "optional_params")
INNER_KINDS = ("cp_allgather_kv", "cp_ulysses")
REGION_KINDS = ("ep_dispatch", "tp_experts")

Mutant = tuple[str, dict[str, Any]]


def module_name(family: str) -> str:
    return f"transformers.models.{family}.modeling_{family}"


def explicit_plan(family: str, **axes: Any) -> dict[str, Any]:
    """Plan.auto(**axes)'s slice of ``transformers.models.<family>.modeling_<family>`` as a JSON plan
    (``axes``: tp=2, cp=2, ep=2, and Plan.auto's other arguments)."""
    import importlib

    from hp_lazy import Plan

    name = module_name(family)
    source = inspect.getsource(importlib.import_module(name))
    plan = Plan.auto(**axes)
    sliced = plan.slice(name, source)
    assert sliced is not None
    return {
        "version": 1, "mesh": dict(plan.mesh), "modules": [name],
        "boundaries": {c.pattern: c.to_dict() for c in sliced.contracts},
        "boundary_classes": dict(sliced.classes),
    }


def _flip(placement: str) -> str:
    return {"S(0)": "S(1)", "S(1)": "S(0)", "S(-1)": "S(0)"}.get(placement, "S(0)")


class _Maker:
    """Collects ``(what changed, mutant)`` pairs of one plan."""

    def __init__(self, plan: dict[str, Any]) -> None:
        self.plan = plan
        self.out: list[Mutant] = []

    def add(self, what: str, change: Callable[[dict[str, Any]], Any]) -> None:
        mutant = copy.deepcopy(self.plan)
        change(mutant)
        self.out.append((what, mutant))


def mutants(plan: dict[str, Any]) -> list[Mutant]:
    """(what changed, the mutant) for the likely single changes of every contract."""
    make = _Maker(plan)
    add = make.add
    for pattern, body in plan["boundaries"].items():
        def at(m, pattern=pattern):
            return m["boundaries"][pattern]

        add(f"{pattern}: contract dropped", lambda m, p=pattern: m["boundaries"].pop(p))
        for side in ("in_src", "in_dst", "out_src", "out_dst"):
            if side in body:
                add(f"{pattern}: {side} dropped", lambda m, s=side, at=at: at(m).pop(s))
        if "in_src" in body:
            add(f"{pattern}: in_src and in_dst dropped", lambda m, at=at: (at(m).pop("in_src"), at(m).pop("in_dst", None)))
        if "out_src" in body:
            add(f"{pattern}: out_src R", lambda m, at=at: at(m)["out_src"].update(output={"tp": "R"}))
        if "out_dst" in body:
            add(f"{pattern}: out_dst S(1)", lambda m, at=at: at(m)["out_dst"].update(output={"tp": "S(1)"}))
        # a partial sum leaving the boundary (the exit all-reduce dropped), or one declared on entry
        add(f"{pattern}: out_dst P(sum)", lambda m, at=at: at(m).setdefault("out_dst", {}).update(output={"tp": "P(sum)"}))
        for name in body.get("in_src", {}):
            add(f"{pattern}: in_src {name} P(sum)", lambda m, n=name, at=at: at(m)["in_src"].update({n: {"tp": "P(sum)"}}))
        if body.get("skip_source_lowering"):
            add(f"{pattern}: skip_source_lowering dropped", lambda m, at=at: at(m).pop("skip_source_lowering"))
        if "region" in body:
            add(f"{pattern}: region dropped", lambda m, at=at: at(m).pop("region"))
        for field in LISTS:
            if field in body:
                add(f"{pattern}: {field} dropped", lambda m, f=field, at=at: at(m).pop(f))
        for name, spec in body.get("params", {}).items():
            add(f"{pattern}: param {name} dropped", lambda m, n=name, at=at: at(m)["params"].pop(n))
            add(f"{pattern}: param {name} {spec['tp']} flipped",
                lambda m, n=name, at=at: at(m)["params"][n].update(tp=_flip(at(m)["params"][n]["tp"])))
            if name.endswith("weight"):
                renamed = name[: -len("weight")] + "bias"
                add(f"{pattern}: param {name} renamed {renamed}",
                    lambda m, n=name, r=renamed, at=at: at(m)["params"].update({r: at(m)["params"].pop(n)}))
        add(f"{pattern}: unknown param", lambda m, at=at: at(m).setdefault("params", {}).update(nope={"tp": "S(0)"}))
    return make.out


def exhaustive(plan: dict[str, Any]) -> list[Mutant]:
    """(what changed, the mutant) for every single change of every field of every contract, placements
    on every mesh axis of more than one rank."""
    make = _Maker(plan)
    add = make.add
    axes = [axis for axis, n in plan["mesh"].items() if n > 1]
    patterns = list(plan["boundaries"])
    for pattern, body in plan["boundaries"].items():
        def at(m, pattern=pattern):
            return m["boundaries"][pattern]

        add(f"{pattern}: contract dropped", lambda m, p=pattern: m["boundaries"].pop(p))
        for side in SIDES:
            names = list(body.get(side, {}))
            if side in ("out_src", "out_dst") and "output" not in names:
                names.append("output")  # an exit placement the contract leaves at R
            for name in names:
                current = body.get(side, {}).get(name)
                if current is not None:
                    add(f"{pattern}: {side} {name} dropped", lambda m, s=side, n=name, at=at: at(m)[s].pop(n))
                for axis in axes:
                    now = (current or {}).get(axis, "R")
                    for value in PLACEMENTS:
                        if value != now:
                            add(f"{pattern}: {side} {name} {axis} {now} -> {value}",
                                lambda m, s=side, n=name, a=axis, v=value, at=at:
                                at(m).setdefault(s, {}).setdefault(n, {}).update({a: v}))
            if side in body:
                add(f"{pattern}: {side} dropped", lambda m, s=side, at=at: at(m).pop(s))
        for field in LISTS:
            for name in body.get(field, []):
                add(f"{pattern}: {field} {name} dropped",
                    lambda m, f=field, n=name, at=at: at(m).update({f: [x for x in at(m)[f] if x != n]}))
            if field in body:
                add(f"{pattern}: {field} dropped", lambda m, f=field, at=at: at(m).pop(f))
        for flag in ("skip_source_lowering", "optional"):
            add(f"{pattern}: {flag} {'dropped' if body.get(flag) else 'set'}",
                lambda m, f=flag, at=at: at(m).pop(f) if at(m).get(f) else at(m).update({f: True}))
        inner = body.get("inner")
        for kind in INNER_KINDS:
            if inner is None or inner["kind"] != kind:
                add(f"{pattern}: inner {inner and inner['kind']} -> {kind}",
                    lambda m, k=kind, at=at: at(m).update(inner={"call": "attention", "kind": k}))
        if inner is not None:
            add(f"{pattern}: inner dropped", lambda m, at=at: at(m).pop("inner"))
        region = body.get("region")
        for kind in REGION_KINDS:
            if region is None or region["kind"] != kind:
                add(f"{pattern}: region {region and region['kind']} -> {kind}",
                    lambda m, k=kind, at=at: at(m).update(region={**(at(m).get("region") or {}), "kind": k}))
        if region is not None:
            add(f"{pattern}: region dropped", lambda m, at=at: at(m).pop("region"))
            for name in region.get("replicated", []):
                add(f"{pattern}: region replicated {name} dropped",
                    lambda m, n=name, at=at: at(m)["region"].update(replicated=[
                        x for x in at(m)["region"]["replicated"] if x != n]))
        for other in patterns:
            if other != pattern and plan["boundary_classes"][other] != plan["boundary_classes"][pattern]:
                add(f"{pattern}: boundary class -> {plan['boundary_classes'][other]}",
                    lambda m, o=other, p=pattern: m["boundary_classes"].update({p: m["boundary_classes"][o]}))
        add(f"{pattern}: unknown param", lambda m, at=at: at(m).setdefault("params", {}).update(nope={axes[0]: "S(0)"}))
    return make.out


def run(rank: int, world: int, family: str, cls: str, plan: dict[str, Any], path: str, ids, cache: str,
        dtype: str = "float32") -> dict:
    """Activate ``plan`` afresh, import the modeling module through it, train one step; rank 0 also
    returns the full gradients. Every rank feeds the same batch: tp and cp ranks must, and ep's dp
    ranks then average equal gradients, one process's. ``dtype``: see :func:`load_options`."""
    import importlib
    import sys

    import hp_lazy
    from hp_lazy.errors import HpLazyError

    name = module_name(family)
    hp_lazy.deactivate()
    sys.modules.pop(name, None)
    try:
        hp_lazy.activate(plan, cache_dir=cache)
        model_cls = getattr(importlib.import_module(name), cls)
        model = model_cls.from_pretrained(path, **load_options(dtype))
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        logits = hp_lazy.gather_sequence(out.logits.detach()) if "cp" in plan["mesh"] else out.logits.detach()
        grads = hp_lazy.full_grads(model)
    except HpLazyError as error:
        return {"refused": f"{type(error).__name__}: {error}"}
    except Exception as error:  # noqa: BLE001 - reported as a defect of hp_lazy by the verdict
        return {"crashed": f"{type(error).__name__}: {str(error)[:160]}"}
    finally:
        hp_lazy.deactivate()
        sys.modules.pop(name, None)
    result = {"loss": out.loss.detach(), "logits": logits}
    return {**result, "grads": grads} if rank == 0 else result


def load_options(dtype: str) -> dict[str, Any]:
    """``from_pretrained`` options for ``dtype``: float64 for a model whose float32 gradients one
    process cannot hold to 1e-5 of itself (a Gated DeltaNet's ``A_log``), with eager experts
    (torch's grouped_mm takes no float64)."""
    import torch

    return {} if dtype == "float32" else {"dtype": getattr(torch, dtype), "experts_implementation": "eager"}


def verdict(got: list[dict], ref: dict) -> str:
    if all("refused" in g for g in got):
        return "refused"
    crashed = [g["crashed"] for g in got if "crashed" in g]
    if crashed:
        return f"unclear: not an hp_lazy error: {crashed[0]}"
    if any("refused" in g for g in got):
        return "unclear: refused on some ranks only"
    logits, want = got[0]["logits"], ref["logits"]
    if logits.shape != want.shape and not (logits.shape[:-1] == want.shape[:-1]
                                           and logits.shape[-1] * len(got) == want.shape[-1]):
        return f"wrong: logits of shape {list(logits.shape)}, one process's {list(want.shape)}"
    # vocab-sharded logits (a head whose out_dst keeps S(-1): the loss-parallel layout the plan asked
    # for) are this rank's slice; the loss and the gradients must still be one process's
    errors = [models.rel_err(logits, want.chunk(len(got), -1)[0] if logits.shape != want.shape else want),
              models.rel_err(got[0]["loss"], ref["loss"])]
    if set(got[0]["grads"]) != set(ref["grads"]):
        return "wrong: gradients of other parameters"
    errors += [models.rel_err(got[0]["grads"][n], g) for n, g in ref["grads"].items()]
    return "match" if max(errors) <= parity.TOL else f"wrong: max rel error {max(errors):.2e}"
