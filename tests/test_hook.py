"""The import hook with stand-in plan/lowerer (hookfakes): finder, loader, cache use, activation."""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import inspect
import json
import os
import subprocess
import sys
import traceback
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "pkgs"))

import hookfakes  # noqa: E402
from hookfakes import BOOM_LINE, TOY_SOURCE, install_fake, make_pkg  # noqa: E402

import hp_lazy  # noqa: E402
from hp_lazy.errors import PlanError  # noqa: E402
from hp_lazy.hook import api  # noqa: E402
from hp_lazy.hook.cache import Cache  # noqa: E402
from hp_lazy.hook.finder import (  # noqa: E402
    ForeignLoaderWarning,
    HpLazyFinder,
    NameMatcher,
    UnmatchedModelingWarning,
)
from hp_lazy.hook.loader import HookState, HpLazyLoader  # noqa: E402
from hp_lazy.plan import AutoFlags  # noqa: E402

CHILD = str(Path(__file__).parent / "pkgs" / "hookfakes.py")
REPO = str(Path(__file__).resolve().parent.parent)


@pytest.fixture
def toy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, Path, Path]]:
    """(module name, module file, cache dir) of a fresh package; everything undone afterwards."""
    pkg = f"hp_toy_{uuid.uuid4().hex[:8]}"
    path = make_pkg(tmp_path / "src", pkg)
    monkeypatch.syspath_prepend(str(tmp_path / "src"))
    hookfakes.LOWER_CALLS.clear()
    hookfakes.BIND_CALLS.clear()
    yield f"{pkg}.modeling_toy", path, tmp_path / "cache"
    api.deactivate()
    for name in [n for n in sys.modules if n == pkg or n.startswith(pkg + ".")]:
        del sys.modules[name]


def _fresh_import(name: str):
    sys.modules.pop(name, None)
    return importlib.import_module(name)


def _hook_finders() -> list[object]:
    return [f for f in sys.meta_path if isinstance(f, HpLazyFinder)]


def test_miss_then_hit(toy) -> None:
    name, path, cache_dir = toy
    install_fake((name,), cache_dir)
    first = _fresh_import(name)
    assert first.__lowered_by__ == "fake" and first.__hp_lazy__.hit is False
    assert first.__hp_rt__ is hookfakes.FAKE_RT
    second = _fresh_import(name)
    info = second.__hp_lazy__
    assert info.hit is True and info.cache_key == first.__hp_lazy__.cache_key
    assert second.__lowered_by__ == "fake"
    assert hookfakes.LOWER_CALLS == [name]
    assert Path(info.cache_path).is_file() and Path(info.cache_path).is_relative_to(cache_dir)
    assert [c[0] for c in hookfakes.BIND_CALLS] == [name, name]
    assert hookfakes.BIND_CALLS[0][2] == info.source_sha256 and info.plan_hash == "fakeplan0"


def test_hit_survives_a_new_activation_and_source_change_misses(toy) -> None:
    name, path, cache_dir = toy
    install_fake((name,), cache_dir)
    _fresh_import(name)
    install_fake((name,), cache_dir)
    assert _fresh_import(name).__hp_lazy__.hit is True
    path.write_text(TOY_SOURCE + "\nEXTRA = 1\n")
    changed = _fresh_import(name)
    assert changed.__hp_lazy__.hit is False and changed.EXTRA == 1


def test_corrupt_entry_is_relowered(toy) -> None:
    name, _, cache_dir = toy
    install_fake((name,), cache_dir)
    entry = Path(_fresh_import(name).__hp_lazy__.cache_path)
    entry.write_bytes(entry.read_bytes()[:-10] + b"\x00" * 10)
    again = _fresh_import(name)
    assert again.__hp_lazy__.hit is False and again.__lowered_by__ == "fake"
    assert _fresh_import(name).__hp_lazy__.hit is True


def test_read_only_cache_dir_still_lowers(toy, tmp_path: Path) -> None:
    name, _, _ = toy
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the cache dir should be")
    install_fake((name,), blocked)
    first = _fresh_import(name)
    assert first.__lowered_by__ == "fake" and first.__hp_lazy__.cache_path is None
    assert _fresh_import(name).__hp_lazy__.hit is True  # from memory
    assert hookfakes.LOWER_CALLS == [name]


def test_cache_off_lowers_every_time(toy, monkeypatch: pytest.MonkeyPatch) -> None:
    name, _, cache_dir = toy
    monkeypatch.setenv("HP_LAZY_CACHE", "off")
    install_fake((name,), cache_dir)
    _fresh_import(name)
    assert _fresh_import(name).__hp_lazy__.hit is False
    assert hookfakes.LOWER_CALLS == [name, name] and not cache_dir.exists()


def test_file_source_and_tracebacks_are_the_original(toy) -> None:
    name, path, cache_dir = toy
    install_fake((name,), cache_dir)
    for _ in range(2):  # miss, then hit
        module = _fresh_import(name)
        assert module.__file__ == str(path) and module.__spec__.origin == str(path)
        assert inspect.getsource(module) == TOY_SOURCE
        assert inspect.getsource(module.Block).startswith("class Block:")
        assert module.Block.forward.__code__.co_filename == str(path)
        with pytest.raises(RuntimeError) as excinfo:
            module.boom()
        last = traceback.extract_tb(excinfo.value.__traceback__)[-1]
        assert (last.filename, last.lineno, last.line) == (str(path), BOOM_LINE, 'raise RuntimeError("boom")')


def test_get_code_is_usable_standalone(toy) -> None:
    name, path, cache_dir = toy
    plan = hookfakes.FakePlan((name,))
    state = HookState(plan=plan, cache=Cache(cache_dir, "rw"), lower=hookfakes.fake_lower,
                      bind=hookfakes.fake_bind, runtime=hookfakes.fake_runtime)
    loader = HpLazyLoader(name, str(path), state)
    namespace: dict = {"__name__": name}
    exec(loader.get_code(name), namespace)
    assert namespace["__lowered_by__"] == "fake" and namespace["Block"]().forward(1) == 2
    assert loader.get_source(name) == TOY_SOURCE
    assert hookfakes.BIND_CALLS == []  # only exec_module binds


def test_slice_none_compiles_the_stock_way(toy) -> None:
    name, path, cache_dir = toy
    path.write_text(TOY_SOURCE + "# HP_SKIP\n")
    install_fake((name,), cache_dir)
    module = _fresh_import(name)
    assert not hasattr(module, "__hp_lazy__") and not hasattr(module, "__lowered_by__")
    assert isinstance(module.__loader__, HpLazyLoader) and not cache_dir.exists()


def test_deactivate_restores_plain_import(toy) -> None:
    name, _, cache_dir = toy
    before = list(sys.meta_path)
    with install_fake((name,), cache_dir) as handle:
        assert handle.active and sys.meta_path[0] is handle.finder
        assert _fresh_import(name).__lowered_by__ == "fake"
    assert sys.meta_path == before and api.active_plan() is None and not handle.active
    plain = _fresh_import(name)
    assert not hasattr(plain, "__lowered_by__") and not hasattr(plain, "__hp_lazy__")
    assert type(plain.__loader__).__name__ == "SourceFileLoader"


def test_activating_again_replaces_the_plan(toy) -> None:
    name, _, cache_dir = toy
    install_fake(("other.module",), cache_dir)
    second = install_fake((name,), cache_dir)
    assert _hook_finders() == [second.finder] and api.active_plan() is second.plan
    assert _fresh_import(name).__lowered_by__ == "fake"


def test_already_imported_target_warns_with_the_fix(toy) -> None:
    name, _, cache_dir = toy
    importlib.import_module(name)
    with pytest.warns(api.AlreadyImportedWarning) as record:
        install_fake((name,), cache_dir)
    text = str(record[0].message)
    assert name in text and "will not be lowered" in text
    assert "call hp_lazy.activate(...) before importing transformers models" in text


def test_already_imported_target_is_an_error_when_strict(toy, monkeypatch: pytest.MonkeyPatch) -> None:
    name, _, cache_dir = toy
    importlib.import_module(name)
    monkeypatch.setenv("HP_LAZY_STRICT", "1")
    with pytest.raises(PlanError, match=rf"{name} imported before hp_lazy.activate\(\); it will not be lowered"):
        install_fake((name,), cache_dir)
    assert _hook_finders() == []


def test_glob_targets_and_auto_already_imported_check(toy) -> None:
    name, _, cache_dir = toy
    pkg = name.split(".")[0]
    module = importlib.import_module(name)
    auto_plan = hookfakes.FakePlan((f"{pkg}.modeling_*",), auto_flags=AutoFlags(tp=2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no config with base_model_tp_plan: no warning
        api.install(auto_plan, cache=Cache(cache_dir), lower=hookfakes.fake_lower,
                    bind=hookfakes.fake_bind, runtime=hookfakes.fake_runtime)

    class ToyConfig:
        base_model_tp_plan = {"layers.*.q_proj": "colwise"}

    module.ToyConfig = ToyConfig
    with pytest.warns(api.AlreadyImportedWarning, match=name):
        api.install(auto_plan, cache=Cache(cache_dir), lower=hookfakes.fake_lower,
                    bind=hookfakes.fake_bind, runtime=hookfakes.fake_runtime)
    assert _fresh_import(name).__lowered_by__ == "fake"


def test_hp_lazy_0_makes_activate_a_no_op(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HP_LAZY", "0")
    before = list(sys.meta_path)
    handle = hp_lazy.activate({"this": "is not even a plan"})
    assert handle.active is False and handle.plan is None and sys.meta_path == before
    handle.deactivate()


def test_auto_needs_tp() -> None:
    with pytest.raises(PlanError, match=r"activate\('auto'\): tp is not given.*pass tp=N"):
        hp_lazy.activate("auto")


def test_unreadable_plan_path(tmp_path: Path) -> None:
    with pytest.raises(PlanError, match=r"missing\.json'?: cannot be read"):
        hp_lazy.activate(str(tmp_path / "missing.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(PlanError, match=r"bad\.json'?: invalid JSON at line 1"):
        hp_lazy.activate(bad)


def test_name_matcher() -> None:
    match = NameMatcher(["a.b", "transformers.models.*.modeling_*"])
    assert match("a.b") and not match("a.bc") and not match("a")
    assert match("transformers.models.llama.modeling_llama")
    assert not match("transformers.models.llama.configuration_llama")


def test_a_modeling_import_before_any_match_warns_once() -> None:
    """A glob with a typo (or a plan for another family): the first transformers modeling module
    imported while nothing matched warns, naming it and the plan's modules; the check is by name
    (find_spec answers None for a non-target before any finder or file is touched)."""
    finder = HpLazyFinder(None, NameMatcher(["transformers.models.lama.*"]))  # type: ignore[arg-type]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert finder.find_spec("transformers.models.auto.modeling_auto", None) is None  # the name map: no warning
        assert finder.find_spec("transformers.models.llama.configuration_llama", None) is None
        assert finder.find_spec("transformers.models.llama.modeling_llama", None) is None
        assert finder.find_spec("transformers.models.mistral.modeling_mistral", None) is None  # once
    texts = [str(w.message) for w in caught if w.category is UnmatchedModelingWarning]
    assert texts == [
        "hp_lazy: transformers.models.llama.modeling_llama is imported, but plan.modules ['transformers.models.lama.*'] "
        "has matched no module so far, so its models run unparallelized; fix plan.modules (e.g. "
        "'transformers.models.llama.modeling_llama' or 'transformers.models.*.modeling_*'), or ignore this if that "
        "model is meant to run whole"
    ]
    matched = HpLazyFinder(None, NameMatcher(["pkg_that_matches"]))  # type: ignore[arg-type]
    matched._matched_any = True  # a target was imported already: later modeling imports are the user's business
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        matched.find_spec("transformers.models.llama.modeling_llama", None)
    assert not [w for w in caught if w.category is UnmatchedModelingWarning]


def test_non_targets_and_foreign_loaders_are_left_alone(toy, monkeypatch: pytest.MonkeyPatch) -> None:
    name, path, cache_dir = toy
    finder = install_fake((name, "hp_no_such_module"), cache_dir).finder
    assert finder.find_spec("os.path", None) is None
    assert finder.find_spec("hp_no_such_module", None) is None
    spec = finder.find_spec(name, [str(path.parent)])
    assert isinstance(spec.loader, HpLazyLoader) and spec.origin == str(path)

    class OtherToolLoader(importlib.machinery.SourceFileLoader):
        pass

    class OtherToolFinder:
        @staticmethod
        def find_spec(fullname, search=None, target=None):
            return importlib.util.spec_from_file_location(fullname, path, loader=OtherToolLoader(fullname, str(path)))

    monkeypatch.setattr(sys, "meta_path", [finder, OtherToolFinder, *sys.meta_path[1:]])
    with pytest.warns(ForeignLoaderWarning, match=rf"{name} is loaded by .*OtherToolLoader, another tool's loader"):
        spec = finder.find_spec(name, [str(path.parent)])
    assert isinstance(spec.loader, OtherToolLoader)


def _child(root: Path, name: str, cache_dir: Path, **env: str) -> dict:
    full_env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    full_env.update(env)
    out = subprocess.run([sys.executable, CHILD, str(root), name, str(cache_dir)], env=full_env,
                         capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.mark.parametrize("first_env", [{}, {"PYTHONDONTWRITEBYTECODE": "1"}])
def test_dontwritebytecode_does_not_change_caching(toy, first_env: dict) -> None:
    """-B governs __pycache__ only: the hp_lazy cache is written and read with it set or unset."""
    name, path, cache_dir = toy
    root = path.parent.parent
    second_env = {} if first_env else {"PYTHONDONTWRITEBYTECODE": "1"}
    first = _child(root, name, cache_dir, **first_env)
    second = _child(root, name, cache_dir, **second_env)
    assert (first["hit"], second["hit"]) == (False, True) and first["key"] == second["key"]
    assert len(list(cache_dir.rglob("*.hplz"))) == 1


def test_lowered_code_never_reaches_pycache(toy) -> None:
    name, path, cache_dir = toy
    root = path.parent.parent
    assert _child(root, name, cache_dir)["lowered"] == "fake"  # bytecode writing on
    pycache = path.parent / "__pycache__"
    assert not any(p.name.startswith("modeling_toy") for p in pycache.glob("*"))
    plain = subprocess.run(
        [sys.executable, "-c", f"import sys; sys.path.insert(0, {str(root)!r}); import {name} as m; "
         "print(hasattr(m, '__lowered_by__'))"],
        capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONDONTWRITEBYTECODE": ""},
    )
    assert plain.stdout.strip() == "False", plain.stderr


def test_eight_processes_share_an_empty_cache(toy) -> None:
    name, path, cache_dir = toy
    root = path.parent.parent
    args = [sys.executable, CHILD, str(root), name, str(cache_dir)]
    procs = [subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
             for _ in range(8)]
    results = [p.communicate(timeout=180) for p in procs]
    assert all(p.returncode == 0 for p in procs), [r[1] for r in results]
    infos = [json.loads(out) for out, _ in results]
    assert len({i["key"] for i in infos}) == 1 and all(i["lowered"] == "fake" for i in infos)
    assert len(list(cache_dir.rglob("*.hplz"))) == 1 and not list(cache_dir.rglob("*.tmp"))
    assert Cache(cache_dir, "ro").load(infos[0]["key"], name, infos[0]["sha"]) is not None
    assert _child(root, name, cache_dir)["hit"] is True


def test_import_hook_does_not_import_torch_distributed() -> None:
    code = ("import sys, hp_lazy.hook, hp_lazy.plan, hp_lazy.lower, hp_lazy.hook.cache, "
            "hp_lazy.hook.finder, hp_lazy.hook.loader, hp_lazy.cli; "
            "print(sorted(m for m in sys.modules if m.startswith('torch.distributed')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


REMOTE_SCRIPT = """
import json, sys
sys.path.insert(0, {pkgs!r})
from hookfakes import install_fake
handle = install_fake(("transformers_modules.**.modeling_fake",), {cache!r})
import transformers.dynamic_module_utils as dmu
dmu.HF_MODULES_CACHE = {hf!r}
cls = dmu.get_class_in_module("Block", "transformers_modules/fakerepo/abc123/modeling_fake.py")
module = sys.modules[cls.__module__]
viewed = type(dmu.importlib).__name__
handle.deactivate()
print(json.dumps({{"name": module.__name__, "lowered": module.__lowered_by__, "file": module.__file__,
                  "hit": module.__hp_lazy__.hit, "view": viewed, "after": dmu.importlib.__name__}}))
"""


def _remote_repo(tmp_path: Path) -> Path:
    """A trust_remote_code module laid out as transformers' HF_MODULES_CACHE holds it."""
    hf = tmp_path / "hf_modules"
    return make_pkg(hf / "transformers_modules" / "fakerepo", "abc123", module="modeling_fake").parent.parent.parent.parent


def test_remote_code_loaded_by_transformers_is_lowered(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers' get_class_in_module execs remote code itself, bypassing sys.meta_path."""
    import transformers.dynamic_module_utils as dmu

    hf = _remote_repo(tmp_path)
    monkeypatch.setattr(dmu, "HF_MODULES_CACHE", str(hf))
    name = "transformers_modules.fakerepo.abc123.modeling_fake"
    try:
        with install_fake(("transformers_modules.**.modeling_fake",), tmp_path / "cache"):
            cls = dmu.get_class_in_module("Block", "transformers_modules/fakerepo/abc123/modeling_fake.py")
            module = sys.modules[name]
            assert cls.__module__ == name and module.__lowered_by__ == "fake"
            assert module.__hp_lazy__.hit is False and inspect.getsource(cls).startswith("class Block:")
        assert dmu.importlib is importlib
    finally:
        sys.modules.pop(name, None)


def test_remote_code_when_transformers_is_imported_after_activate(tmp_path: Path) -> None:
    hf = _remote_repo(tmp_path)
    script = REMOTE_SCRIPT.format(pkgs=str(Path(CHILD).parent), cache=str(tmp_path / "cache"), hf=str(hf))
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result == {
        "name": "transformers_modules.fakerepo.abc123.modeling_fake", "lowered": "fake",
        "file": str(hf / "transformers_modules" / "fakerepo" / "abc123" / "modeling_fake.py"),
        "hit": False, "view": "ImportlibView", "after": "importlib",
    }


def test_real_plan_lowers_on_import(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """activate(path) with the real plan, lowerer, runtime alias and registry."""
    from hp_lazy.runtime import registry

    monkeypatch.syspath_prepend(str(Path(CHILD).parent))
    name = "hp_toymodel.modeling_toy"
    sys.modules.pop(name, None)
    try:
        with hp_lazy.activate(str(Path(CHILD).parent / "toy_plan.json"), tp=4, cache_dir=tmp_path / "c") as handle:
            assert handle.plan.mesh["tp"] == 4 and api.active_plan() is handle.plan
            module = importlib.import_module(name)
        import hp_lazy.runtime.rt as rt

        assert module.__hp_rt__ is rt and module.ToyAttention._hp_form == "tp_collective"
        assert inspect.getsource(module.ToyAttention.forward).strip().startswith("def forward(self, hidden_states):")
        info = module.__hp_lazy__
        assert info.plan_hash == handle.plan.hash and info.hit is False
        lowered = registry.lookup(name)
        assert lowered is not None and lowered.source_sha256 == info.source_sha256
        assert lowered.plan.hash == info.slice_hash and lowered.plan.mesh["tp"] == 4
    finally:
        sys.modules.pop(name, None)


def test_tp_overrides_an_explicit_plan() -> None:
    from hp_lazy.plan import Plan

    path = Path(CHILD).parent / "toy_plan.json"
    plan = Plan.from_json(str(path))
    assert api.load_plan(plan) is plan and api.load_plan(plan, tp=2) is plan
    assert api.load_plan(plan, tp=4).mesh["tp"] == 4 and api.load_plan(str(path), tp=8).mesh["tp"] == 8
    auto = api.load_plan(Plan.auto(tp=2), tp=4)
    assert auto.mesh["tp"] == 4 and auto.auto_flags.tp == 4 and api.load_plan("auto", tp=4).hash == auto.hash
    with pytest.raises(PlanError, match=r"sequence_parallel=True applies to the 'auto' plan only"):
        api.load_plan(plan, sequence_parallel=True)


def test_uncompilable_lowering_is_a_lowering_error(toy) -> None:
    import ast

    from hp_lazy.errors import LoweringError

    name, _, cache_dir = toy

    def broken(source: str, module_plan, filename: str) -> ast.Module:
        return ast.Module(body=[ast.Expr(ast.Name("x", ast.Load()))], type_ignores=[])  # no locations

    api.install(hookfakes.FakePlan((name,)), cache=Cache(cache_dir), lower=broken,
                bind=hookfakes.fake_bind, runtime=hookfakes.fake_runtime)
    with pytest.raises(LoweringError, match=rf"{name}: the lowered module does not compile \(.*lineno"):
        _fresh_import(name)
