"""Check hp_lazy on the torch and transformers installed here (a release CI does not run).

CI runs the suite on torch 2.13.0 (the README's command on transformers 5.25, a second leg on 5.24).
A newer torch is checked with this script, in a virtualenv that has it (``pip install
torch==2.14.1``): the tests that depend most on torch's internals run against it, and the table
says which passed. They are the compile tests (binding stays outside dynamo; fullgraph with PEFT),
the collectives against one process, tensor parallel parity (MoE experts split by expert over tp
included), DCP checkpoints (torch's distributed checkpoint API), the guard rails, PEFT and hub kernels.

    python benchmarks/release_check.py                 # a few minutes on 2 cores
    python benchmarks/release_check.py --smoke         # one plan test: does the script run?
    python benchmarks/release_check.py --out benchmarks/release_check.md

The table: the versions, then per test file its passed / failed / skipped counts and wall time.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="one plan test only")
    parser.add_argument("--out", default=None, help="also write the table to this file")
    args = parser.parse_args(argv)
    versions = _versions()
    lines = ["| package | version |", "|---|---|", *(f"| {k} | {v} |" for k, v in versions.items()), "",
             "| tests | passed | failed | skipped | seconds |", "|---|---|---|---|---|"]
    bad = 0
    for target in SMOKE if args.smoke else FILES:
        counts, took = _run(target)
        bad += counts.get("failed", 0) + counts.get("error", 0)
        lines.append(f"| {target.split('::')[0]} | {counts.get('passed', 0)} | "
                     f"{counts.get('failed', 0) + counts.get('error', 0)} | {counts.get('skipped', 0)} | {took:.0f} |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        Path(args.out).write_text(table + "\n")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
