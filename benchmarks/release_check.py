"""Check hp_lazy on the torch and transformers installed here (a release CI does not run).

CI runs the suite on torch 2.13.0 (the README's command on transformers 5.25, a second leg on 5.24).
A newer torch is checked with this script, in a virtualenv that has it (``pip install
torch==2.15.0``, with this checkout on ``PYTHONPATH``): the tests that depend most on torch's internals run against it, and the table
says which passed. They are the compile tests (binding stays outside dynamo; fullgraph with PEFT),
the collectives against one process, tensor parallel parity (MoE experts split by expert over tp
included), DCP checkpoints (torch's distributed checkpoint API), the guard rails, PEFT and hub kernels.
``--all`` runs the whole suite instead, in one pytest process (its worker pools and forkserver shared as
in CI), and reads the per-file counts from pytest's JUnit XML.

    python benchmarks/release_check.py                 # a few minutes on 2 cores
    python benchmarks/release_check.py --all           # the whole suite: about as long as CI's first leg
    python benchmarks/release_check.py --smoke         # one plan test: does the script run?
    python benchmarks/release_check.py --out benchmarks/release_check.md

The table: the versions, then per test file its passed / failed / skipped counts and wall time (under
``--all``: the summed time of its tests, setup and teardown included).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FILES = ("tests/test_compile.py", "tests/test_collectives.py", "tests/test_parity_tp.py", "tests/test_tp_experts.py",
         "tests/test_checkpoint_dcp.py", "tests/test_guard.py", "tests/test_peft.py", "tests/test_hub_kernels.py")
SMOKE = ("tests/test_plan_auto.py::test_moe_experts_are_split_by_expert_over_tp_and_dense_slots_pick_their_class",)


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in ("torch", "transformers", "accelerate", "peft", "trl"):
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = "-"
    return found


def _run(target: str) -> tuple[dict[str, int], float]:
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", target], cwd=ROOT,
                          capture_output=True, text=True, env=dict(os.environ))
    took = time.perf_counter() - start
    tail = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.stderr[-500:]
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|error)", tail)}
    if proc.returncode not in (0, 1) or not counts:
        counts["error"] = counts.get("error", 0) + 1
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-3000:])
    return counts, took


def _run_all() -> list[tuple[str, dict[str, int], float]]:
    """The whole suite in one pytest process; per test file its counts and summed time."""
    with tempfile.TemporaryDirectory() as tmp:
        xml = os.path.join(tmp, "junit.xml")
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}"],
                              cwd=ROOT, capture_output=True, text=True, env=dict(os.environ))
        if not os.path.exists(xml):
            sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-3000:])
            return [("(the suite)", {"error": 1}, 0.0)]
        cases = ET.parse(xml).getroot().iter("testcase")
    counts: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    took: dict[str, float] = defaultdict(float)
    for case in cases:
        name = case.get("classname", "").split(".")
        target = "tests/" + (name[1] if name[0] == "tests" and len(name) > 1 else name[0]) + ".py"
        outcome = next((c.tag for c in case if c.tag in ("failure", "error", "skipped")), "passed")
        counts[target]["failed" if outcome in ("failure", "error") else outcome] += 1
        took[target] += float(case.get("time", 0.0))
    if proc.returncode not in (0, 1):
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-3000:])
        counts["(the suite)"]["error"] += 1
    return [(t, dict(counts[t]), took[t]) for t in sorted(counts)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="one plan test only")
    parser.add_argument("--all", action="store_true", help="the whole suite (one pytest run) instead of the files")
    parser.add_argument("--out", default=None, help="also write the table to this file")
    args = parser.parse_args(argv)
    versions = _versions()
    lines = ["| package | version |", "|---|---|", *(f"| {k} | {v} |" for k, v in versions.items()), "",
             "| tests | passed | failed | skipped | seconds |", "|---|---|---|---|---|"]
    bad = 0
    if args.all:
        results = _run_all()
    else:
        results = [(target, *_run(target)) for target in (SMOKE if args.smoke else FILES)]
    for target, counts, took in results:
        bad += counts.get("failed", 0) + counts.get("error", 0)
        lines.append(f"| {target.split('::')[0]} | {counts.get('passed', 0)} | "
                     f"{counts.get('failed', 0) + counts.get('error', 0)} | {counts.get('skipped', 0)} | {took:.0f} |")
    if len(results) > 1:
        total = {k: sum(c.get(k, 0) for _, c, _ in results) for k in ("passed", "failed", "error", "skipped")}
        lines.append(f"| all | {total['passed']} | {total['failed'] + total['error']} | {total['skipped']} | "
                     f"{sum(t for _, _, t in results):.0f} |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        Path(args.out).write_text(table + "\n")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
