"""The lowered-code cache on its own: keys, file format, corruption, modes, fallbacks."""

from __future__ import annotations

import errno
import logging
import os
import stat
from pathlib import Path

import pytest

from hp_lazy.errors import PlanError
from hp_lazy.hook import cache as cache_mod
from hp_lazy.hook.cache import (
    Cache,
    CacheTrustWarning,
    cache_key,
    default_root,
    lowerer_code_hash,
    read_meta,
)

SRC_SHA = "ab" * 32
BASE = dict(slice_hash="s1", source_sha256=SRC_SHA, module="pkg.modeling_x", origin="/x/modeling_x.py")


def _code(value: int = 1):
    return compile(f"VALUE = {value}\n", "/x/modeling_x.py", "exec", dont_inherit=True)


def _run(code) -> int:
    namespace: dict = {}
    exec(code, namespace)
    return namespace["VALUE"]


def _stored(tmp_path: Path) -> tuple[Cache, str, Path]:
    cache = Cache(tmp_path / "c", "rw")
    key = cache_key(**BASE)
    path = cache.store(key, BASE["module"], SRC_SHA, _code(7), BASE["origin"])
    assert path is not None and path.is_file()
    return cache, key, path


def test_key_is_stable_and_covers_every_input() -> None:
    key = cache_key(**BASE)
    assert key == cache_key(**BASE) and len(key) == 64
    for field, other in [("slice_hash", "s2"), ("source_sha256", "cd" * 32),
                         ("module", "pkg.modeling_y"), ("origin", "/y/modeling_x.py")]:
        assert cache_key(**{**BASE, field: other}) != key, field


def test_key_covers_interpreter_and_lowerer(monkeypatch: pytest.MonkeyPatch) -> None:
    key = cache_key(**BASE)
    monkeypatch.setattr(cache_mod.importlib.util, "MAGIC_NUMBER", b"\x00\x00\r\n")
    assert cache_key(**BASE) != key
    monkeypatch.undo()
    monkeypatch.setattr(cache_mod, "lowerer_code_hash", lambda: "0" * 64)
    assert cache_key(**BASE) != key


def test_lowerer_code_hash_covers_lower_plan_and_names_sources() -> None:
    import hashlib

    import hp_lazy

    package = Path(hp_lazy.__file__).parent
    digest = hashlib.sha256()
    digest.update(b"names.py\0" + (package / "names.py").read_bytes())  # the generated names
    for sub in ("lower", "plan"):
        for path in sorted((package / sub).glob("*.py")):
            digest.update(f"{sub}/{path.name}\0".encode() + path.read_bytes())
    assert lowerer_code_hash() == digest.hexdigest()


def test_round_trip_and_meta(tmp_path: Path) -> None:
    cache, key, path = _stored(tmp_path)
    fresh = Cache(tmp_path / "c", "rw")
    assert _run(fresh.load(key, BASE["module"], SRC_SHA)) == 7
    assert path.parent.name == BASE["module"] and path.name == key[:32] + ".hplz"
    meta = read_meta(path)
    assert meta is not None and meta["module"] == BASE["module"] and meta["key"] == key
    assert meta["pid"] == os.getpid()
    assert path.read_bytes()[4:6] == (2).to_bytes(2, "little")  # file format 2: HMAC-signed


@pytest.mark.parametrize(
    "damage",
    ["flip_payload", "truncate", "garbage", "empty", "bad_magic", "other_python"],
)
def test_corrupt_entry_is_a_miss(tmp_path: Path, damage: str, caplog: pytest.LogCaptureFixture) -> None:
    cache, key, path = _stored(tmp_path)
    blob = bytearray(path.read_bytes())
    if damage == "flip_payload":
        blob[-3] ^= 0xFF
    elif damage == "truncate":
        blob = blob[: len(blob) // 2]
    elif damage == "garbage":
        blob = bytearray(os.urandom(300))
    elif damage == "empty":
        blob = bytearray()
    elif damage == "bad_magic":
        blob[0:4] = b"NOPE"
    else:
        blob[8:12] = b"\x01\x02\r\n"
    path.write_bytes(bytes(blob))
    with caplog.at_level(logging.DEBUG, logger="hp_lazy.hook"):
        assert Cache(tmp_path / "c", "rw").load(key, BASE["module"], SRC_SHA) is None
    assert "ignored" in caplog.text and str(path) in caplog.text


def test_entry_for_other_source_or_key_is_a_miss(tmp_path: Path) -> None:
    cache, key, _ = _stored(tmp_path)
    assert cache.load(key, BASE["module"], "cd" * 32) is None
    other = key[:32] + "0" * 32  # same file name, different full key
    assert cache.load(other, BASE["module"], SRC_SHA) is None


def test_mode_off_reads_and_writes_nothing(tmp_path: Path) -> None:
    _, key, _ = _stored(tmp_path)
    off = Cache(tmp_path / "c", "off")
    assert off.load(key, BASE["module"], SRC_SHA) is None
    assert off.store("ff" * 32, "m", SRC_SHA, _code(), "/x.py") is None
    assert Cache(tmp_path / "c", "rw").stats().entries == 1


def test_mode_ro_reads_disk_but_writes_memory_only(tmp_path: Path) -> None:
    _, key, _ = _stored(tmp_path)
    ro = Cache(tmp_path / "c", "ro")
    assert _run(ro.load(key, BASE["module"], SRC_SHA)) == 7
    new_key = "ee" * 32
    assert ro.store(new_key, "m", SRC_SHA, _code(3), "/x.py") is None
    assert _run(ro.load(new_key, "m", SRC_SHA)) == 3
    assert ro.stats().entries == 1 and ro.stats().memory_entries == 1


def test_unusable_dir_falls_back_to_memory_and_logs_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("x")
    cache = Cache(blocker, "rw")
    with caplog.at_level(logging.WARNING, logger="hp_lazy.hook"):
        for value in (1, 2):
            key = f"{value:02d}" * 32
            assert cache.store(key, "m", SRC_SHA, _code(value), "/x.py") is None
            assert _run(cache.load(key, "m", SRC_SHA)) == value
    assert caplog.text.count("memory only") == 1 and str(blocker) in caplog.text


def test_write_failure_falls_back_without_leftovers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A read-only file system (EROFS on write): memory fallback, no temp file left."""
    real_replace = os.replace

    def read_only(src: str, dst: str, **dir_fds: int) -> None:
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(cache_mod.os, "replace", read_only)
    cache = Cache(tmp_path / "c", "rw")
    key = cache_key(**BASE)
    with caplog.at_level(logging.WARNING, logger="hp_lazy.hook"):
        assert cache.store(key, BASE["module"], SRC_SHA, _code(5), BASE["origin"]) is None
    monkeypatch.setattr(cache_mod.os, "replace", real_replace)
    assert _run(cache.load(key, BASE["module"], SRC_SHA)) == 5
    assert "Read-only file system" in caplog.text
    assert cache.stats().temp_files == 0 and cache.stats().entries == 0


def test_group_writable_dir_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "shared"
    root.mkdir()
    root.chmod(0o777)
    cache = Cache(root, "rw")
    with pytest.warns(CacheTrustWarning, match=r"shared: mode 0o777 is group/world-writable"):
        assert cache.store("aa" * 32, "m", SRC_SHA, _code(), "/x.py") is None
    assert not any(root.iterdir())
    assert _run(cache.load("aa" * 32, "m", SRC_SHA)) == 1  # kept in memory


def test_new_dirs_are_private(tmp_path: Path) -> None:
    _, _, path = _stored(tmp_path)
    assert stat.S_IMODE((tmp_path / "c").stat().st_mode) & 0o077 == 0


def test_stats_and_clear(tmp_path: Path) -> None:
    cache, _, path = _stored(tmp_path)
    (path.parent / (path.name + ".123.tmp")).write_bytes(b"partial")
    stats = cache.stats()
    assert (stats.entries, stats.temp_files) == (1, 1) and stats.bytes == path.stat().st_size
    assert cache.clear() == 2
    assert cache.stats().entries == 0 and not path.exists()


def test_env_settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HP_LAZY_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_root() == tmp_path / "xdg" / "hp_lazy"
    monkeypatch.setenv("HP_LAZY_CACHE_DIR", str(tmp_path / "explicit"))
    assert Cache().root == tmp_path / "explicit"
    assert Cache(tmp_path / "arg").root == tmp_path / "arg"
    monkeypatch.setenv("HP_LAZY_CACHE", "RO")
    assert Cache().mode == "ro"
    monkeypatch.setenv("HP_LAZY_DISABLE_CACHE", "1")
    assert Cache().mode == "off"
    monkeypatch.delenv("HP_LAZY_DISABLE_CACHE")
    monkeypatch.setenv("HP_LAZY_CACHE", "sometimes")
    with pytest.raises(PlanError, match=r"HP_LAZY_CACHE='sometimes': must be one of off, ro, rw"):
        Cache()


def test_temp_files_are_unique_per_writer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each write has its own temp name, renamed onto the entry through the checked directory's
    descriptor (never by path: the levels were checked through descriptors)."""
    renames: list[tuple[str, str, dict]] = []
    real = os.replace

    def spy(src, dst, **dir_fds):
        renames.append((src, dst, dir_fds))
        real(src, dst, **dir_fds)

    monkeypatch.setattr(cache_mod.os, "replace", spy)
    cache = Cache(tmp_path / "c", "rw")
    key = cache_key(**BASE)
    for _ in range(2):
        cache.store(key, BASE["module"], SRC_SHA, _code(), BASE["origin"])
    entry = cache.path_for(key, BASE["module"]).name
    assert len({src for src, _, _ in renames}) == 2
    for src, dst, dir_fds in renames:
        assert "/" not in src and src.startswith(entry + ".") and src.endswith(".tmp") and dst == entry
        assert set(dir_fds) == {"src_dir_fd", "dst_dir_fd"} and dir_fds["src_dir_fd"] == dir_fds["dst_dir_fd"]
    assert cache.stats().temp_files == 0
