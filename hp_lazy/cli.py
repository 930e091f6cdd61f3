"""``python -m hp_lazy``: look at what a plan does to a module without importing it.

    show MODULE --plan PLAN [--tp N] [--cp N] [--cp-mode M] [--ep N] [--sequence-parallel]
                                                             lowered source (ast.unparse)
    diff MODULE --plan PLAN ...                              unified diff, original vs lowered
    check MODULE --plan PLAN ...                             each boundary class, its form and why
    layout MODEL_DIR --plan PLAN ...                         each parameter's placement per axis and
                                                             the bytes a rank holds against one process's
                                                             (the model built from its config.json on
                                                             the meta device; hp_lazy.layout(model) is
                                                             the same table for a bound model)
    cache info | cache clear [--cache-dir DIR]               the lowered-code cache
    demo ...                                                 hp_lazy.demo.main(argv)

PLAN is a path to a .json plan or ``auto``. MODULE is located with importlib.util.find_spec
(its parent packages are imported, the module itself is not executed). Plan and lowering errors
print their text and exit 1.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import importlib.util
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hp_lazy.errors import HpLazyError, PlanError


@dataclass(frozen=True)
class Located:
    module: str
    path: str
    source: str


def locate(module: str) -> Located:
    """The source of ``module`` without executing it."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError) as exc:
        raise PlanError(f"{module}: cannot be located ({exc}); check the module name and the environment") from None
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        where = "not found" if spec is None else f"has no Python source (origin {spec.origin!r})"
        raise PlanError(f"{module}: {where}; pass the dotted name of a .py module, e.g. "
                        "transformers.models.llama.modeling_llama")
    data = Path(spec.origin).read_bytes()
    return Located(module, spec.origin, importlib.util.decode_source(data))


def _plan(args: argparse.Namespace) -> Any:
    from hp_lazy.hook.api import load_plan

    return load_plan(args.plan, tp=args.tp, sequence_parallel=args.sequence_parallel, cp=args.cp,
                     cp_mode=args.cp_mode, ep=args.ep)


def _lowered(args: argparse.Namespace) -> tuple[Located, str]:
    from hp_lazy.lower import lower_source

    located = locate(args.module)
    return located, lower_source(located.source, _plan(args), located.module)


def cmd_show(args: argparse.Namespace) -> int:
    _, text = _lowered(args)
    sys.stdout.write(text if text.endswith("\n") else text + "\n")
    return 0


def cmd_diff(args: argparse.Namespace) -> int:
    located, text = _lowered(args)
    original = ast.unparse(ast.parse(located.source, located.path))
    lines = difflib.unified_diff(
        (original + "\n").splitlines(keepends=True),
        (text if text.endswith("\n") else text + "\n").splitlines(keepends=True),
        fromfile=f"{located.path} (original)",
        tofile=f"{located.path} (lowered)",
    )
    sys.stdout.writelines(lines)
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    located = locate(args.module)
    module_plan = _plan(args).slice(located.module, located.source)
    if module_plan is None:
        print(f"{located.module}: the plan targets nothing in this module")
        return 0
    print(f"{located.module}: plan slice {module_plan.hash[:12]} mesh {dict(module_plan.mesh)}")
    for row in boundary_report(located, module_plan):
        print(row)
    return 0


def boundary_report(located: Located, module_plan: Any) -> list[str]:
    """One line per contract: pattern, class, form and reasons, decided by the lowerer's own
    :func:`hp_lazy.lower.boundary_decisions` (the same path ``lower`` takes)."""
    from hp_lazy.lower import boundary_decisions

    decisions = boundary_decisions(located.source, module_plan)
    rows = []
    for contract in module_plan.contracts:
        name = module_plan.classes.get(contract.pattern, "?")
        if contract.pattern not in decisions:
            rows.append(f"  {contract.pattern} -> {name}: leaf (bound at run time, source not rewritten)")
            continue
        _, decision = decisions[contract.pattern]
        rows.append(f"  {contract.pattern} -> {name}: {decision.form} ({'; '.join(decision.reasons)})")
        rows += [f"      {op.describe()}" for op in (*decision.in_ops, *decision.out_ops)]
    return rows


def cmd_layout(args: argparse.Namespace) -> int:
    import torch
    import transformers

    from hp_lazy.runtime.report import planned

    plan = _plan(args)
    try:
        config = transformers.AutoConfig.from_pretrained(args.module)
    except (OSError, ValueError) as exc:
        raise PlanError(f"{args.module}: no model config to read ({exc}); pass a directory holding a config.json, "
                        "e.g. one written by save_pretrained") from None
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    found = {type(sub).__module__ for sub in model.modules()}
    names = sorted(m for m in found if m.startswith("transformers.models."))
    slices = [s for name in names if (s := plan.slice(name, locate(name).source)) is not None]
    degrees = {axis: n for axis, n in slices[0].mesh.items()} if slices else {}
    print(planned(model, slices, degrees))
    return 0


def cmd_cache(args: argparse.Namespace) -> int:
    from hp_lazy.hook.cache import Cache

    cache = Cache(args.cache_dir)
    if args.action == "clear":
        print(f"removed {cache.clear()} files from {cache.root}")
        return 0
    stats = cache.stats()
    print(f"cache dir: {stats.root}\nmode: {stats.mode}\nentries: {stats.entries}\n"
          f"bytes: {stats.bytes}\ntemp files: {stats.temp_files}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    import importlib

    demo = importlib.import_module("hp_lazy.demo")
    return int(demo.main(list(args.rest)) or 0)


def _add_plan_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("module", help="dotted module name, e.g. transformers.models.llama.modeling_llama")
    parser.add_argument("--plan", required=True, help="path to a .json plan, or 'auto'")
    parser.add_argument("--tp", type=int, default=None, help="tensor-parallel degree (required for auto)")
    parser.add_argument("--sequence-parallel", action="store_true", help="auto plan: sequence parallel")
    parser.add_argument("--cp", type=int, default=None, help="auto plan: context-parallel degree")
    parser.add_argument("--cp-mode", default=None, choices=("allgather", "ulysses"), help="auto plan: cp attention")
    parser.add_argument("--ep", type=int, default=None, help="auto plan: expert-parallel degree")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m hp_lazy", description="Look at what a plan does to a module without importing it."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name, func, text in [
        ("show", cmd_show, "print the lowered source of MODULE"),
        ("diff", cmd_diff, "unified diff of MODULE, original vs lowered"),
        ("check", cmd_check, "each boundary class of MODULE, its form and why"),
        ("layout", cmd_layout, "each parameter's placement and bytes per rank, for the model saved at MODULE"),
    ]:
        cmd = sub.add_parser(name, help=text)
        _add_plan_args(cmd)
        cmd.set_defaults(func=func)
    cache = sub.add_parser("cache", help="the lowered-code cache")
    cache.add_argument("action", choices=("info", "clear"))
    cache.add_argument("--cache-dir", default=None, help="default: $HP_LAZY_CACHE_DIR or ~/.cache/hp_lazy")
    cache.set_defaults(func=cmd_cache)
    demo = sub.add_parser("demo", help="run the hp_lazy demo (hp_lazy.demo)", add_help=False)
    demo.add_argument("rest", nargs=argparse.REMAINDER)
    demo.set_defaults(func=cmd_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["demo"]:  # everything after 'demo' belongs to the demo, --help included
        return cmd_demo(argparse.Namespace(rest=argv[1:]))
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except HpLazyError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # `python -m hp_lazy show ... | head`
        sys.stdout = None  # nothing more to flush at exit
        return 0
