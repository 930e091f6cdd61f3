"""Every benchmark's ``--smoke`` mode runs to the end on the CPU and its table holds real rows.

The benchmarks are run rarely and by hand (``device_check.py`` once, on a borrowed GPU): a script that
crashes on main (``cp_step.py``'s "K/V saved" variant did, patching a changed signature) is found here.
Each runs in a fresh interpreter (hp_lazy rewrites modeling modules at import), tiny sizes, one round.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _run(script: str, tmp_path: Path, *args: str) -> str:
    env = dict(os.environ, HP_LAZY_CACHE_DIR=str(tmp_path / "hp_cache"), TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), "--smoke", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"{script} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc.stdout


def _rows(table: str) -> list[list[str]]:
    """The cells of every markdown table row that is not a header or a rule."""
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in table.splitlines()
            if line.startswith("|") and not line.startswith("|---")]
    return [r for r in rows if r[0] not in ("check", "variant", "S")]


def test_device_check_smoke(tmp_path: Path) -> None:
    out = tmp_path / "device_check.md"
    _run("device_check.py", tmp_path, "--out", str(out))
    rows = _rows(out.read_text())
    bad = [r for r in rows if re.match(r"(error|skipped)", r[2])]
    assert not bad, bad
    cases = {(r[0], r[1].split(" ")[0]) for r in rows}
    assert cases == {(check, case) for check in ("step time", "parity bfloat16", "parity float32", "graph breaks")
                     for case in ("tp=1", "cp=1", "ep=1")} | {("cp attention", "S=64"), ("cp attention", "S=128")}
    for r in rows:
        if r[0] == "step time":
            assert re.match(r"\d+\.\d{3}x \((ok|over) vs <= 1.02x\)", r[2]), r
            assert "through the hook" in r[3] and "NOT through" not in r[3], r  # the hp_lazy variant is hp_lazy's
        if r[0] == "parity float32":  # world 1 runs the same kernels as plain transformers
            loss, logits = map(float, re.fullmatch(r"loss rel (\S+), logits max rel (\S+)", r[2]).groups())
            assert loss <= 1e-6 and logits <= 1e-6, r
        if r[0] == "graph breaks":
            hp, plain = map(int, re.fullmatch(r"hp_lazy (\d+), plain (\d+)", r[2]).groups())
            assert hp == plain, r
        if r[0] == "cp attention":  # blockwise flash calls merged by log-sum-exp: no S x S mask
            assert "[S/C x S] tensors: 0 " in r[2] and "_scaled_dot_product_flash_attention_for_cpu" in r[3], r


@pytest.mark.parametrize("script, variants", [
    ("cp_step.py", ("one process", "cp", "cp ulysses", "cp, K/V saved")),
    ("ep_step.py", ("one process", "ep", "ep + FSDP2", "experts-TP", "transformers ep_plan")),
    ("step_time.py", ("ref_solo", "ref_both", "hp_lazy", "hp_lazy_digest", "hf_tp", "dtensor_tp", "bare_tp")),
    ("dp_step.py", ("hp_lazy", "ddp", "local")),
    ("coverage.py", ("llama",)),
    ("import_cost.py", ("llama",)),
    ("load_memory.py", ("plain", "hp_lazy", "tp_plan")),
    ("mutants.py", ("llama_bias.tp2",)),
])
def test_benchmark_smoke(script: str, variants: tuple[str, ...], tmp_path: Path) -> None:
    rows = _rows(_run(script, tmp_path))
    named = [r for r in rows if any(c in variants for c in r[:3])]
    at = [next(i for i, c in enumerate(r[:3]) if c in variants) for r in named]  # cp_step: S | batch | variant
    assert sorted({r[i] for r, i in zip(named, at, strict=True)}) == sorted(variants), rows
    if script not in ("step_time.py", "coverage.py"):  # the first number after the name
        assert all(re.fullmatch(r"[\d.]+", r[i + 1]) for r, i in zip(named, at, strict=True)), named
    if script == "step_time.py":
        assert all(re.match(r"[\d.]+ / [\d.]+", r[1]) for r in named), named  # a time, not "skipped: ..."
    if script == "ep_step.py":  # the step's loss against one process's
        assert all(float(r[3]) <= 1e-4 for r in named), named
    if script == "coverage.py":  # the tp=2 parity run of the family passes
        assert named[0][1] == "pass", named
    if script == "mutants.py":  # mutants, refused, exact, wrong, unclear: some of each kind that may occur, none wrong
        mutants, refused, exact, wrong, unclear = map(int, named[0][1:6])
        assert mutants == refused + exact and refused > 0 and exact > 0 and wrong == unclear == 0, named


def test_release_check_smoke(tmp_path: Path) -> None:
    out = _run("release_check.py", tmp_path)
    assert "| torch | " in out and "| transformers | " in out
    assert re.search(r"\| tests/test_plan_auto.py \| 1 \| 0 \| 0 \| \d+ \|", out), out


def test_ep_step_ep_x_tp_smoke(tmp_path: Path) -> None:
    """ep=2 x tp=2 on 4 ranks, with and without sequence parallel, and ep=2 with FSDP2 owning dp
    (the experts over two edp ranks): its loss is one process's and it moves all-to-all rows; FSDP2
    holds fewer experts per rank than ep x tp (a quarter of them against a half)."""
    rows = {r[0]: r for r in _rows(_run("ep_step.py", tmp_path, "--world", "4", "--variants",
                                                   "ep x tp,ep x tp+sp,ep + FSDP2"))}
    assert set(rows) == {"one process", "ep x tp", "ep x tp+sp", "ep + FSDP2"}, rows
    for variant in ("ep x tp", "ep x tp+sp", "ep + FSDP2"):
        assert float(rows[variant][3]) <= 1e-4 and "all_to_all" in rows[variant][4], rows
    assert float(rows["ep + FSDP2"][6]) < float(rows["ep x tp"][6]) < float(rows["one process"][6]), rows


def test_coverage_every_axis_smoke(tmp_path: Path) -> None:
    """The 8-rank sweep (dp=2 x cp=2 x tp=2 with sp, ep=2) on Qwen3-MoE: it passes, and each rank's
    shards were checked against their slices of the reference gradient."""
    rows = {r[0]: r for r in _rows(_run("coverage.py", tmp_path, "--ep", "2", "--cp", "2", "--sp")) if r[0] != "family"}
    assert set(rows) == {"qwen3_moe"}, rows
    assert rows["qwen3_moe"][1] == "pass" and re.search(r", (\d+) local shards checked", rows["qwen3_moe"][2]), rows
    assert int(re.search(r", (\d+) local shards checked", rows["qwen3_moe"][2]).group(1)) > 0, rows


@pytest.mark.parametrize("model", ["qwen3_next", "jamba", "minimax"])
def test_cp_step_hybrid_smoke(tmp_path: Path, model: str) -> None:
    """The hybrid rows (Gated DeltaNet, Mamba1 or lightning attention layers split with their state passed)."""
    rows = _rows(_run("cp_step.py", tmp_path, "--model", model))
    assert sorted(r[2] for r in rows) == ["cp", "cp ulysses", "one process"], rows
    assert all(re.fullmatch(r"[\d.]+", r[3]) for r in rows), rows


def test_cp_step_tp_smoke(tmp_path: Path) -> None:
    """cp=2 x tp=2 on 4 ranks, with and without sequence parallel."""
    rows = _rows(_run("cp_step.py", tmp_path, "--tp", "2"))
    assert sorted(r[2] for r in rows) == ["cp x tp", "cp x tp+sp", "one process"], rows
    assert all(re.fullmatch(r"[\d.]+", r[3]) for r in rows), rows


def test_step_time_olmo2_smoke(tmp_path: Path) -> None:
    """OLMo 2 (q/k norms over every head): hp_lazy and transformers' gathered plan run and match one
    process; the Llama-only recipes say why they are skipped."""
    rows = {r[0]: r for r in _rows(_run("step_time.py", tmp_path, "--family", "olmo2", "--variants",
                                        "hp_lazy,hf_tp,bare_tp"))}
    assert set(rows) == {"ref_solo", "hp_lazy", "hf_tp", "bare_tp"}, rows
    assert all(re.match(r"[\d.]+ / [\d.]+", rows[v][1]) for v in ("hp_lazy", "hf_tp")), rows
    assert float(rows["hp_lazy"][-1]) <= 1e-5 and float(rows["hp_lazy"][-2]) <= 1e-4, rows["hp_lazy"]
    assert "own counter: fwd all_gather 1, all_reduce 17" in rows["hp_lazy"][-3], rows["hp_lazy"]
    assert rows["bare_tp"][1].startswith("skipped: a recipe written for Llama's modules"), rows["bare_tp"]
