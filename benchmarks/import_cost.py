"""Whole-process import cost of three transformers modeling modules: plain vs hp_lazy hook.

Each sample is a fresh interpreter that imports one module (``python -c``), timed from the
parent (process wall time) and inside the child (the import statement itself, and the hook's
own ``__hp_lazy__.ms``: read + slice + cache lookup or lower + compile). Modes:

- ``plain``: no hook;
- ``cold``: ``hp_lazy.activate`` with an empty cache dir (a miss: lower + compile + store);
- ``warm``: the same plan with a populated cache dir (a hit).

Rounds are interleaved (model, then mode in a shuffled order, per round) so drift on a shared
machine hits every mode alike; the table gives medians and ratios of medians.
``auto`` is used where it lowers the module; qwen3_moe and deepseek_v3 carry ``moe_tp_experts``,
which ``auto`` rejects, so they get an explicit plan for attention + the dense MLP.

    python benchmarks/import_cost.py [--rounds 3] [--models llama,qwen3_moe,deepseek_v3]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

MODELS = ("llama", "qwen3_moe", "deepseek_v3")
MODES = ("plain", "cold", "warm")


def _colwise_rowwise(cols: list[str], rows: list[str], inp: str) -> dict[str, Any]:
    params = {f"{c}.weight": {"tp": "S(0)"} for c in cols}
    params.update({f"{r}.weight": {"tp": "S(1)"} for r in rows})
    return {
        "in_src": {inp: {"tp": "R"}}, "in_dst": {inp: {"tp": "R"}},
        "out_src": {"output": {"tp": "P(sum)"}}, "out_dst": {"output": {"tp": "R"}},
        "params": params,
    }


EXPLICIT_PLANS: dict[str, dict[str, Any]] = {
    "qwen3_moe": {
        "version": 1, "mesh": {"tp": 2},
        "modules": ["transformers.models.qwen3_moe.modeling_qwen3_moe"],
        "boundaries": {
            "model.layers.*.self_attn": {
                **_colwise_rowwise(["q_proj", "k_proj", "v_proj"], ["o_proj"], "hidden_states"),
                "grad_sum_params": ["q_norm.weight", "k_norm.weight"],
            },
            "model.layers.*.mlp": _colwise_rowwise(["gate_proj", "up_proj"], ["down_proj"], "x"),
        },
        "boundary_classes": {"model.layers.*.self_attn": "Qwen3MoeAttention", "model.layers.*.mlp": "Qwen3MoeMLP"},
    },
    "deepseek_v3": {
        "version": 1, "mesh": {"tp": 2},
        "modules": ["transformers.models.deepseek_v3.modeling_deepseek_v3"],
        "boundaries": {
            "model.layers.*.self_attn": _colwise_rowwise(["q_b_proj", "kv_b_proj"], ["o_proj"], "hidden_states"),
            "model.layers.*.mlp": _colwise_rowwise(["gate_proj", "up_proj"], ["down_proj"], "x"),
        },
        "boundary_classes": {"model.layers.*.self_attn": "DeepseekV3Attention", "model.layers.*.mlp": "DeepseekV3MLP"},
    },
}

CHILD = """
import json, sys, time
mode, module, plan, cache_dir = sys.argv[1:5]
t0 = time.perf_counter()
if mode != "plain":
    import hp_lazy
    hp_lazy.activate(plan, tp=2 if plan == "auto" else None, cache_dir=cache_dir)
import importlib
mod = importlib.import_module(module)
t1 = time.perf_counter()
info = getattr(mod, "__hp_lazy__", None)
if mode != "plain" and (info is None or info.hit != (mode == "warm")):
    raise SystemExit(f"{module}: expected a {'hit' if mode == 'warm' else 'miss'}, got {info}")
print(json.dumps({"import_s": t1 - t0, "hook_ms": info.ms if info else None,
                  "own_ms": info.ms - info.slice_ms if info else None}))
"""


def module_name(model: str) -> str:
    return f"transformers.models.{model}.modeling_{model}"


def plan_for(model: str, workdir: Path) -> str:
    """'auto' if it lowers the module, else the path of an explicit plan written to workdir."""
    if model not in EXPLICIT_PLANS:
        return "auto"
    path = workdir / f"{model}_plan.json"
    path.write_text(json.dumps(EXPLICIT_PLANS[model], indent=2))
    return str(path)


def snapshot_package(workdir: Path) -> dict[str, str]:
    """Copy hp_lazy into workdir and return the child env that imports the copy: edits made to
    the tree while the benchmark runs would otherwise change the lowerer hash (a new cache key)."""
    import os
    import shutil

    import hp_lazy

    dest = workdir / "src" / "hp_lazy"
    shutil.copytree(Path(hp_lazy.__file__).parent, dest, ignore=shutil.ignore_patterns("__pycache__"))
    path = os.pathsep.join(p for p in (str(dest.parent), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path}


_ENV: dict[str, str] | None = None


def run_child(mode: str, model: str, plan: str, cache_dir: str) -> dict[str, float]:
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", CHILD, mode, module_name(model), plan, cache_dir],
                         capture_output=True, text=True, timeout=600, env=_ENV)
    wall = time.perf_counter() - start
    if out.returncode != 0:
        raise SystemExit(f"{mode} {model} failed:\n{out.stderr[-3000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result["wall_s"] = wall
    return result


def measure(models: list[str], rounds: int, workdir: Path, seed: int) -> dict[tuple[str, str], list[dict]]:
    global _ENV
    _ENV = snapshot_package(workdir)
    rng = random.Random(seed)
    plans = {m: plan_for(m, workdir) for m in models}
    warm_dirs = {m: str(workdir / f"warm_{m}") for m in models}
    for m in models:  # populate the warm caches (and the OS page cache) once
        run_child("cold", m, plans[m], warm_dirs[m])
        run_child("plain", m, plans[m], "")
    samples: dict[tuple[str, str], list[dict]] = {(m, k): [] for m in models for k in MODES}
    for r in range(rounds):
        for m in models:
            for mode in rng.sample(MODES, len(MODES)):
                cache = warm_dirs[m] if mode == "warm" else tempfile.mkdtemp(dir=workdir, prefix="cold_")
                samples[(m, mode)].append(run_child(mode, m, plans[m], cache))
        print(f"round {r + 1}/{rounds} done", file=sys.stderr)
    return samples


def table(samples: dict[tuple[str, str], list[dict]], models: list[str], rounds: int) -> str:
    med = lambda m, k, f: statistics.median(s[f] for s in samples[(m, k)])  # noqa: E731
    rows = [
        f"Whole-process import, median of {rounds} interleaved rounds (fresh interpreter per sample).",
        "",
        "| module | plain s | cold s | warm s | warm/plain | cold/plain | import stmt warm/plain "
        "| hook miss ms | hook hit ms | miss ms excl. slice | hit ms excl. slice |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for m in models:
        plain, cold, warm = (med(m, k, "wall_s") for k in MODES)
        stmt = med(m, "warm", "import_s") / med(m, "plain", "import_s")
        rows.append(
            f"| {m} | {plain:.2f} | {cold:.2f} | {warm:.2f} | {warm / plain:.3f} | {cold / plain:.3f} "
            f"| {stmt:.3f} | {med(m, 'cold', 'hook_ms'):.1f} | {med(m, 'warm', 'hook_ms'):.1f} "
            f"| {med(m, 'cold', 'own_ms'):.1f} | {med(m, 'warm', 'own_ms'):.2f} |"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="also write the raw samples here")
    parser.add_argument("--smoke", action="store_true", help="one round of llama: does every variant run?")
    args = parser.parse_args(argv)
    if args.smoke:
        args.rounds, args.models = 1, "llama"
    models = [m for m in args.models.split(",") if m]
    with tempfile.TemporaryDirectory(prefix="hp_lazy_bench_") as tmp:
        samples = measure(models, args.rounds, Path(tmp), args.seed)
    print(table(samples, models, args.rounds))
    if args.json:
        raw = {f"{m}/{k}": v for (m, k), v in samples.items()}
        Path(args.json).write_text(json.dumps(raw, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
