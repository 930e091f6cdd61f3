"""``python -m hp_lazy``: show, diff, check, cache, and the demo slot."""

from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from hp_lazy import cli

PKGS = Path(__file__).parent / "pkgs"
MODULE = "hp_toymodel.modeling_toy"


def _cli(*args: str, cwd: Path = PKGS) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(PKGS), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "hp_lazy", *args], capture_output=True, text=True,
                          timeout=300, cwd=cwd, env=env)


def test_show_prints_the_lowered_source() -> None:
    out = _cli("show", MODULE, "--plan", str(PKGS / "toy_plan.json"))
    assert out.returncode == 0, out.stderr
    assert "import hp_lazy.runtime.rt as __hp_rt__" in out.stdout
    assert "    def _forward_impl(self, hidden_states):\n        return self.o_proj(" in out.stdout
    assert "hidden_states = __hp_rt__.copy_to(hidden_states, _hp_b.tp)" in out.stdout
    assert "_hp_out = __hp_rt__.reduce_from(_hp_out, _hp_b.tp)" in out.stdout


def test_module_is_not_executed(tmp_path: Path) -> None:
    """find_spec + reading the file: the module body never runs (its parents do)."""
    pkg = tmp_path / "hp_sidefx"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    source = (PKGS / "hp_toymodel" / "modeling_toy.py").read_text()
    (pkg / "modeling_toy.py").write_text(source + "\nopen(__file__ + '.ran', 'w').close()\n")
    plan = (PKGS / "toy_plan.json").read_text().replace("hp_toymodel", "hp_sidefx")
    (tmp_path / "plan.json").write_text(plan)
    out = _cli("show", "hp_sidefx.modeling_toy", "--plan", str(tmp_path / "plan.json"), "--tp", "4", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "__hp_rt__.copy_to(hidden_states, _hp_b.tp)" in out.stdout
    assert not (pkg / "modeling_toy.py.ran").exists()


def test_diff_shows_only_what_changed() -> None:
    out = _cli("diff", MODULE, "--plan", str(PKGS / "toy_plan.json"))
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].endswith("modeling_toy.py (original)") and lines[1].endswith("modeling_toy.py (lowered)")
    assert "-        return self.o_proj(torch.relu(self.q_proj(hidden_states)))" in lines
    assert "+    def _forward_impl(self, hidden_states):" in lines
    assert "+        __hp_rt__.ensure_parallel(self)" in lines
    assert not any(line.startswith(("-", "+")) and "ToyLayer" in line for line in lines)


def test_check_reports_each_boundary_form() -> None:
    out = _cli("check", MODULE, "--plan", str(PKGS / "toy_plan.json"))
    assert out.returncode == 0, out.stderr
    assert "layers.*.attn -> ToyAttention: tp_collective (" in out.stdout
    assert "hidden_states: tp R -> R into sharded params ==> copy_to" in out.stdout
    assert "output: tp P(sum) -> R ==> reduce_from" in out.stdout


def test_check_exits_1_with_the_plan_error() -> None:
    out = _cli("check", MODULE, "--plan", str(PKGS / "toy_plan_bad.json"))
    assert out.returncode == 1
    assert "error: hp_toymodel.modeling_toy: boundary_classes['layers.*.attn'] = 'MissingAttention'" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize(
    "args, text",
    [
        (("check", MODULE, "--plan", "auto"), "tp is not given"),
        (("check", "hp_no_such_pkg.modeling_x", "--plan", "auto", "--tp", "2"), "hp_no_such_pkg.modeling_x: "),
        (("show", MODULE, "--plan", "missing.json"), "missing.json': cannot be read"),
    ],
)
def test_user_errors_exit_1(args: tuple[str, ...], text: str) -> None:
    out = _cli(*args)
    assert out.returncode == 1 and text in out.stderr and "Traceback" not in out.stderr


def test_check_auto_llama() -> None:
    out = _cli("check", "transformers.models.llama.modeling_llama", "--plan", "auto", "--tp", "2")
    assert out.returncode == 0, out.stderr
    assert "-> LlamaAttention: tp_collective" in out.stdout and "-> LlamaMLP: " in out.stdout


def test_layout_prints_placements_and_bytes_per_rank(tmp_path: Path) -> None:
    """A saved Qwen3-MoE at tp=2: every expert weight split by expert (0.500x per rank), the router
    whole on every rank and listed as such; the same model at ep=2 takes --ep (every axis the API
    takes)."""
    sys.path.insert(0, str(Path(__file__).parent))
    import models

    path = models.build("qwen3_moe", str(tmp_path))
    out = _cli("layout", path, "--plan", "auto", "--tp", "2")
    assert out.returncode == 0, out.stderr
    row = next(line for line in out.stdout.splitlines() if line.startswith("model.layers.1.mlp.experts.gate_up_proj"))
    assert row.split()[-2:] == ["S(0)", "0.500x"], row
    assert "whole on every rank: " in out.stdout and "mlp.gate.weight" in out.stdout
    out = _cli("layout", path, "--plan", "auto", "--ep", "2")
    assert out.returncode == 0, out.stderr
    row = next(line for line in out.stdout.splitlines() if line.startswith("model.layers.1.mlp.experts.down_proj"))
    assert row.split()[-2:] == ["S(0)", "0.500x"], row
    out = _cli("check", "transformers.models.llama.modeling_llama", "--plan", "auto", "--cp", "2")
    assert out.returncode == 0, out.stderr


def test_layout_without_a_config_exits_1(tmp_path: Path) -> None:
    out = _cli("layout", str(tmp_path), "--plan", "auto", "--tp", "2")
    assert out.returncode == 1 and "no model config to read" in out.stderr and "Traceback" not in out.stderr


def test_cache_info_and_clear(tmp_path: Path) -> None:
    from hp_lazy.hook.cache import Cache

    cache = Cache(tmp_path / "c", "rw")
    cache.store("ab" * 32, "m", "cd" * 32, compile("x = 1", "/m.py", "exec"), "/m.py")
    info = _cli("cache", "info", "--cache-dir", str(tmp_path / "c"))
    assert info.returncode == 0 and "entries: 1" in info.stdout and str(tmp_path / "c") in info.stdout
    clear = _cli("cache", "clear", "--cache-dir", str(tmp_path / "c"))
    assert clear.returncode == 0 and clear.stdout.startswith("removed 1 files")
    assert cache.stats().entries == 0


def test_cache_dir_from_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setenv("HP_LAZY_CACHE_DIR", str(tmp_path / "envdir"))
    assert cli.main(["cache", "info"]) == 0
    assert f"cache dir: {tmp_path / 'envdir'}" in capsys.readouterr().out


def test_demo_slot_passes_every_argument(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[list[str]] = []
    fake = types.ModuleType("hp_lazy.demo")
    fake.main = lambda argv: seen.append(argv) or 3  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "hp_lazy.demo", fake)
    assert cli.main(["demo", "--tp", "2", "--help"]) == 3
    assert seen == [["--tp", "2", "--help"]]
