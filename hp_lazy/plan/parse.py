"""Plan JSON -> validated, normalised parts of a :class:`~hp_lazy.plan.Plan` (strict).

The JSON format is DESIGN.md section 2. Every error is a :class:`PlanError` whose text starts with
where the value sits (``plan.boundaries['model.layers.*.self_attn'].in_src['x']``), then the value,
the rule it breaks and the fix; a value is shown through :func:`~hp_lazy.plan.fqn.shown` (cut to 80
characters). Bad input of any kind (any type, any nesting, any key) is a ``PlanError``, never another
exception. :func:`plan_fields` returns the fields ``Plan`` is built from, so this module needs nothing
above :mod:`hp_lazy.plan.model`.

``plan.modules`` never reaches hp_lazy's own machinery (:func:`check_module`): an entry starts with a
literal package name that is not in :data:`OWN_DEPENDENCIES`, and a ``transformers`` entry continues
with ``models.<...>``. Lowering torch, the standard library or transformers' utilities would rewrite
the code that runs the lowering.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Mapping
from typing import Any, TypedDict, cast

from hp_lazy.errors import PlanError
from hp_lazy.names import RESERVED_PREFIXES
from hp_lazy.plan.fqn import check_glob, is_glob, shown
from hp_lazy.plan.model import (
    CP_MODES,
    IMPLEMENTED,
    INNER_CALLS,
    INNER_KINDS,
    REGION_AXES,
    REGION_KINDS,
    AutoFlags,
    Contract,
    InnerCall,
    InnerKind,
    InnerOp,
    Region,
    RegionKind,
    check_implemented,
    one_of,
)
from hp_lazy.plan.placement import AXES, Placement, Shard
from hp_lazy.plan.transitions import output_index

TOP_KEYS = ("version", "mesh", "modules", "boundaries", "boundary_classes", "auto")
PLACEMENT_SIDES = ("in_src", "in_dst", "out_src", "out_dst", "params")
CONTRACT_KEYS = (
    *PLACEMENT_SIDES, "deferred_bias_params", "grad_sum_params", "optional_params", "skip_source_lowering", "optional",
    "inner", "region",
)
INNER_KEYS = ("call", "kind")
REGION_KEYS = ("kind",)
AUTO_KEYS = ("tp", "sequence_parallel", "loss_parallel", "vocab_parallel_embedding", "cp", "cp_mode", "ep")
AUTO_MODULES = ("transformers.models.*.modeling_*",)
MAX_NAME_CHARS = 256
"""The longest name (pattern, param, input, module, class) a plan may hold."""
MAX_DEGREE = 1 << 20
"""The largest mesh degree (ranks on one axis) a plan may ask for."""
OWN_DEPENDENCIES: frozenset[str] = frozenset(sys.stdlib_module_names) | {
    "__main__", "__mp_main__", "_distutils_hack", "accelerate", "anyio", "certifi", "charset_normalizer",
    "filelock", "fsspec", "functorch", "h11", "hf_xet", "hp_lazy", "httpcore", "httpx", "huggingface_hub", "idna",
    "jinja2", "markupsafe", "mpmath", "networkx", "numpy", "packaging", "pkg_resources", "psutil", "regex",
    "requests", "safetensors", "setuptools", "sympy", "tokenizers", "torch", "torchgen", "tqdm", "triton",
    "typing_extensions", "urllib3", "yaml",
}
"""Top-level packages no ``plan.modules`` entry may name or match: the standard library, hp_lazy and
what it, torch and transformers import to run (``transformers`` itself is allowed only under
``transformers.models``)."""
MAX_PLACEMENT_CHARS = 32
"""The longest placement text read (``'SS(-1, 2)'`` is 9); it keeps ``'S(<5000 digits>)'`` from ``int``."""
_PATTERN_SEGMENT = re.compile(r"[\w*?\[\]!-]+")


class PlanFields(TypedDict):
    """The keyword arguments of ``Plan(...)``, validated."""

    version: int
    mesh: dict[str, int]
    modules: tuple[str, ...]
    boundaries: tuple[Contract, ...]
    boundary_classes: dict[str, str]
    auto_flags: AutoFlags | None


def _check_keys(where: str, data: object, allowed: tuple[str, ...]) -> Mapping[str, Any]:
    if not isinstance(data, Mapping):
        raise PlanError(f"{where}: {shown(data)} is not an object; write a JSON object with keys from {list(allowed)}")
    for key in data:
        if key not in allowed:
            raise PlanError(f"{where}: unknown key {shown(key)}; allowed keys are {list(allowed)}; remove or rename it")
    return data


def check_name(where: str, name: object, what: str = "name") -> str:
    """A dotted name (pattern, param, input) must be a non-empty string of at most
    :data:`MAX_NAME_CHARS` characters with no reserved segment."""
    if not isinstance(name, str) or not name:
        raise PlanError(f"{where}: {what} {shown(name)} is not a non-empty string; fix the plan")
    if len(name) > MAX_NAME_CHARS:
        raise PlanError(f"{where}: {what} {shown(name)} is longer than {MAX_NAME_CHARS} characters; shorten it")
    for segment in name.split("."):
        if segment.startswith(RESERVED_PREFIXES):
            raise PlanError(
                f"{where}: {what} {shown(name)} uses the reserved prefix '_hp_'/'__hp_' "
                "(hp_lazy generates such names); rename it"
            )
        if not _PATTERN_SEGMENT.fullmatch(segment):
            raise PlanError(
                f"{where}: {what} {shown(name)} has an empty or invalid segment {shown(segment)}; fix the plan"
            )
    return check_glob(where, name) if is_glob(name) else name


def check_degree(where: str, degree: object, example: str) -> int:
    """A mesh degree: an int (not a bool) from 1 to :data:`MAX_DEGREE`."""
    if isinstance(degree, bool) or not isinstance(degree, int) or degree < 1:
        raise PlanError(f"{where}: degree {shown(degree)} is not a positive integer; use e.g. {example}")
    if degree > MAX_DEGREE:
        raise PlanError(f"{where}: degree {shown(degree)} is above {MAX_DEGREE}; use the number of ranks on the axis")
    return degree


def _parse_mesh(data: object) -> dict[str, int]:
    if not isinstance(data, Mapping) or not data:
        raise PlanError(f"plan.mesh: {shown(data)} is not a non-empty object; write e.g. {{\"tp\": 2}}")
    mesh: dict[str, int] = {}
    for axis, degree in data.items():
        if axis not in AXES:
            raise PlanError(f"plan.mesh: axis {shown(axis)} is not one of {list(AXES)}; rename it")
        mesh[axis] = check_degree(f"plan.mesh[{axis!r}]", degree, "2")
    return {axis: mesh[axis] for axis in AXES if axis in mesh}


def _parse_axes(where: str, data: object, mesh: Mapping[str, int]) -> dict[str, Placement]:
    if not isinstance(data, Mapping):
        raise PlanError(
            f"{where}: {shown(data)} is not an object of axis -> placement; write e.g. {{\"tp\": \"S(0)\"}}"
        )
    axes: dict[str, Placement] = {}
    for axis, text in data.items():
        if axis not in mesh:
            raise PlanError(
                f"{where}: axis {shown(axis)} is not in the mesh {sorted(mesh)}; add it to plan.mesh or remove it"
            )
        if isinstance(text, str) and len(text) > MAX_PLACEMENT_CHARS:  # no placement is spelt longer
            raise PlanError(
                f"{where}[{axis!r}]: placement {shown(text)} is not one of 'R', 'S(d)', 'SS(d,k)', 'P(sum)'; "
                "fix the plan"
            )
        axes[axis] = Placement.parse(text, where=f"{where}[{axis!r}]")
    return axes


def _parse_side(where: str, side: str, data: object, mesh: Mapping[str, int]) -> dict[str, dict[str, Placement]]:
    if not isinstance(data, Mapping):
        raise PlanError(f"{where}.{side}: {shown(data)} is not an object of name -> {{axis: placement}}; fix the plan")
    out: dict[str, dict[str, Placement]] = {}
    for name, axes in data.items():
        check_name(f"{where}.{side}", name, "param" if side == "params" else "name")
        if side.startswith("out"):
            output_index(name, where=f"{where}.{side}")
        if side.startswith("in") and not name.isidentifier():
            raise PlanError(f"{where}.{side}: input key {shown(name)} is not a forward parameter name; fix the plan")
        out[name] = _parse_axes(f"{where}.{side}[{shown(name)}]", axes, mesh)
    return out


def _parse_names(where: str, data: object) -> tuple[str, ...]:
    if not isinstance(data, (list, tuple)):
        raise PlanError(f"{where}: {shown(data)} is not a list of parameter names; write e.g. [\"o_proj.bias\"]")
    return tuple(check_name(where, name, "param") for name in data)


def _check_deferred_biases(where: str, contract: Contract) -> None:
    for bias in contract.deferred_bias_params:
        if bias != "bias" and not bias.endswith(".bias"):
            raise PlanError(
                f"{where}.deferred_bias_params: {shown(bias)} does not end in '.bias'; "
                "list only the biases of rowwise Linears, e.g. 'o_proj.bias'"
            )
        weight = bias[: -len("bias")] + "weight"
        dims = {p.dim for p in contract.params.get(weight, {}).values() if type(p) is Shard}
        if not dims & {1, -1}:
            raise PlanError(
                f"{where}.deferred_bias_params: {shown(bias)} needs its sibling {shown(weight)} sharded rowwise "
                f"(S(1) or S(-1)) in params, found {_axes_text(contract.params.get(weight))}; "
                f"add \"{weight}\": {{\"tp\": \"S(1)\"}} or drop the bias from deferred_bias_params"
            )


def _axes_text(axes: Mapping[str, Placement] | None) -> str:
    return "nothing" if not axes else "{" + ", ".join(f"{a}: {p}" for a, p in axes.items()) + "}"


def _parse_inner(where: str, data: object) -> InnerOp:
    body = _check_keys(where, data, INNER_KEYS)
    _require(where, body, INNER_KEYS, '{"call": "attention", "kind": "cp_allgather_kv"}')
    call = one_of(f"{where}.call", "call", body["call"], INNER_CALLS)
    kind = one_of(f"{where}.kind", "kind", body["kind"], INNER_KINDS)
    return InnerOp(call=cast(InnerCall, call), kind=cast(InnerKind, kind))


def _parse_region(where: str, data: object) -> Region:
    body = _check_keys(where, data, (*REGION_KEYS, "replicated"))
    _require(where, body, REGION_KEYS, '{"kind": "ep_dispatch"}')
    kind = cast(RegionKind, one_of(f"{where}.kind", "kind", body["kind"], REGION_KINDS))
    replicated = body.get("replicated", [])
    if not isinstance(replicated, list):
        raise PlanError(f"{where}.replicated: {shown(replicated)} is not a list; write e.g. [\"post_expert_norm\"]")
    names = tuple(check_name(f"{where}.replicated", name, "parameter or submodule") for name in replicated)
    return Region(kind=kind, replicated=names)


def _require(where: str, body: Mapping[str, Any], keys: tuple[str, ...], example: str) -> None:
    missing = [key for key in keys if key not in body]
    if missing:
        raise PlanError(f"{where}: {shown(dict(body))} has no {missing}; write e.g. {example}")


def contract_from_dict(pattern: str, data: object, mesh: Mapping[str, int]) -> Contract:
    """Validate one ``boundaries[pattern]`` entry against the mesh."""
    check_name("plan.boundaries", pattern, "pattern")
    where = f"plan.boundaries[{shown(pattern)}]"
    body = _check_keys(where, data, CONTRACT_KEYS)
    sides = {side: _parse_side(where, side, body.get(side, {}), mesh) for side in PLACEMENT_SIDES}
    skip, optional = body.get("skip_source_lowering", False), body.get("optional", False)
    for key, value in (("skip_source_lowering", skip), ("optional", optional)):
        if not isinstance(value, bool):
            raise PlanError(f"{where}.{key}: {shown(value)} is not true/false; fix the plan")
    contract = Contract(
        pattern=pattern,
        **sides,
        deferred_bias_params=_parse_names(f"{where}.deferred_bias_params", body.get("deferred_bias_params", [])),
        grad_sum_params=_parse_names(f"{where}.grad_sum_params", body.get("grad_sum_params", [])),
        optional_params=_parse_names(f"{where}.optional_params", body.get("optional_params", [])),
        skip_source_lowering=skip,
        optional=optional,
        inner=_parse_inner(f"{where}.inner", body["inner"]) if "inner" in body else None,
        region=_parse_region(f"{where}.region", body["region"]) if "region" in body else None,
    )
    _check_deferred_biases(where, contract)
    check_implemented(where, contract)
    if contract.inner is not None and contract.inner.kind.startswith("cp_") and mesh.get("cp", 1) < 2:
        raise PlanError(
            f"{where}.inner: kind {contract.inner.kind!r} splits the sequence over the cp axis, but plan.mesh "
            f"{dict(mesh)} has no cp above 1; add \"cp\": N to plan.mesh or remove the inner op"
        )
    region = contract.region
    if region is not None and mesh.get(REGION_AXES[region.kind], 1) < 2:
        axis = REGION_AXES[region.kind]
        raise PlanError(
            f"{where}.region: kind {region.kind!r} splits the experts over the {axis} axis, but plan.mesh "
            f"{dict(mesh)} has no {axis} above 1; add \"{axis}\": N to plan.mesh or remove the region"
        )
    return contract


def _parse_modules(data: object) -> tuple[str, ...]:
    if not isinstance(data, (list, tuple)) or not data:
        raise PlanError(
            f"plan.modules: {shown(data)} is not a non-empty list of module names; "
            "write e.g. [\"transformers.models.llama.modeling_llama\"]"
        )
    for name in data:
        check_module(name)
    return tuple(data)


def check_module(name: object) -> str:
    """One ``plan.modules`` entry: a dotted module name or glob that cannot reach hp_lazy's own machinery.

    The rule: the first segment is literal (no ``*``, ``?``, ``[``) and not in :data:`OWN_DEPENDENCIES`;
    an entry under ``transformers`` continues with the literal segment ``models`` and at least one more
    (``transformers.models.*.modeling_*``, ``transformers.models.llama.modeling_llama``).
    """
    if not isinstance(name, str) or not name or not all(_PATTERN_SEGMENT.fullmatch(p) for p in name.split(".")):
        raise PlanError(f"plan.modules: {shown(name)} is not a dotted module name (globs allowed); fix the plan")
    if len(name) > MAX_NAME_CHARS:
        raise PlanError(f"plan.modules: {shown(name)} is longer than {MAX_NAME_CHARS} characters; shorten it")
    check_glob("plan.modules", name)
    parts = name.split(".")
    if is_glob(parts[0]):
        raise PlanError(
            f"plan.modules: {shown(name)} starts with the glob {shown(parts[0])}, which could match hp_lazy's own "
            f"dependencies (torch, the standard library); start with the package's literal name, {_MODULES_FIX}"
        )
    if parts[0] in OWN_DEPENDENCIES:
        raise PlanError(
            f"plan.modules: {shown(name)} is in {parts[0]!r}, a package hp_lazy itself runs on (lowering it "
            f"would rewrite the code that does the lowering); name the modeling modules, {_MODULES_FIX}"
        )
    if parts[0] == "transformers" and (len(parts) < 3 or parts[1] != "models"):
        raise PlanError(
            f"plan.modules: {shown(name)} can match transformers' own machinery, which hp_lazy runs on, not only "
            f"its modeling modules; name them under transformers.models, {_MODULES_FIX}"
        )
    return name


_MODULES_FIX = "e.g. 'transformers.models.llama.modeling_llama' or 'transformers.models.*.modeling_*'"


def _parse_classes(data: object, patterns: set[str]) -> dict[str, str]:
    if not isinstance(data, Mapping):
        raise PlanError(f"plan.boundary_classes: {shown(data)} is not an object of pattern -> class name; fix the plan")
    for pattern, name in data.items():
        where = f"plan.boundary_classes[{shown(pattern)}]"
        if pattern not in patterns:
            raise PlanError(
                f"{where}: the pattern has no entry in plan.boundaries; add a boundary for it or remove the class"
            )
        if not isinstance(name, str) or not all(part.isidentifier() for part in name.split(".")):
            raise PlanError(
                f"{where}: {shown(name)} is not a class name; "
                "write a bare name ('LlamaAttention') or a dotted one ('torch.nn.Linear')"
            )
        check_name(where, name, "class")
    return dict(data)


def parse_auto(data: object) -> AutoFlags:
    body = _check_keys("plan.auto", data, AUTO_KEYS)
    tp = check_degree("plan.auto.tp", body.get("tp", 2), "tp=2")
    flags = {}
    for name, default in (("sequence_parallel", False), ("loss_parallel", False), ("vocab_parallel_embedding", True)):
        flags[name] = body.get(name, default)
        if not isinstance(flags[name], bool):
            raise PlanError(f"plan.auto.{name}: {shown(flags[name])} is not true/false; fix the plan")
    cp = check_degree("plan.auto.cp", body.get("cp", 1), "cp=2")
    mode = one_of("plan.auto.cp_mode", "mode", body.get("cp_mode", "allgather"), CP_MODES)
    if CP_MODES[mode] not in IMPLEMENTED:
        raise PlanError(
            f"plan.auto.cp_mode: {mode!r} (inner op {CP_MODES[mode]!r}) is not implemented yet; use "
            f"cp_mode='allgather' (K/V all-gathered along the sequence)"
        )
    ep = check_degree("plan.auto.ep", body.get("ep", 1), "ep=2")
    return AutoFlags(tp=tp, **flags, cp=cp, cp_mode=mode, ep=ep)


def _refuse_injections(body: Mapping[str, Any]) -> None:
    if "injections" in body:
        raise PlanError(
            f"plan.injections: {shown(body['injections'])} is no longer read; the untyped injections list was "
            "replaced by typed fields of a boundary's body: \"inner\": {\"call\": \"attention\", \"kind\": "
            "\"cp_allgather_kv\"} (context parallel) or \"region\": {\"kind\": \"ep_dispatch\"} (expert "
            "parallel); remove the key and write the field under plan.boundaries[pattern]"
        )


def plan_fields(data: object) -> PlanFields:
    """Validate and normalise a plan given as JSON data: the fields of ``Plan(...)``."""
    if isinstance(data, Mapping):
        _refuse_injections(data)
    body = _check_keys("plan", data, TOP_KEYS)
    version = body.get("version", 1)
    if isinstance(version, bool) or not isinstance(version, int) or version != 1:
        raise PlanError(f"plan.version: {shown(version)} is not a supported version; use 1")
    auto = parse_auto(body["auto"]) if "auto" in body else None
    mesh = _parse_mesh(body.get("mesh", auto.mesh if auto else None))
    if auto is not None and mesh.get("tp") != auto.tp:
        raise PlanError(f"plan.mesh: tp={mesh.get('tp')!r} differs from plan.auto.tp={auto.tp}; make them equal")
    if auto is not None and mesh.get("cp", 1) != auto.cp:
        raise PlanError(f"plan.mesh: cp={mesh.get('cp', 1)!r} differs from plan.auto.cp={auto.cp}; make them equal")
    if auto is not None and mesh.get("ep", 1) != auto.ep:
        raise PlanError(f"plan.mesh: ep={mesh.get('ep', 1)!r} differs from plan.auto.ep={auto.ep}; make them equal")
    modules = _parse_modules(body.get("modules", list(AUTO_MODULES) if auto else None))
    raw = body.get("boundaries", {})
    if not isinstance(raw, Mapping):
        raise PlanError(f"plan.boundaries: {shown(raw)} is not an object of pattern -> contract; fix the plan")
    patterns = [check_name("plan.boundaries", pattern, "pattern") for pattern in raw]  # all str before sorting
    boundaries = tuple(contract_from_dict(p, raw[p], mesh) for p in sorted(patterns))
    if not boundaries and auto is None:
        raise PlanError("plan.boundaries: the plan has no boundary; add at least one, or use Plan.auto()")
    classes = _parse_classes(body.get("boundary_classes", {}), set(patterns))
    return PlanFields(
        version=1, mesh=mesh, modules=modules, boundaries=boundaries, boundary_classes=classes, auto_flags=auto
    )
