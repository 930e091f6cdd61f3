"""The cache never hands back code that someone else could have written.

Each set-up plants a valid entry through the cache's own ``store`` (a fresh Cache reads it back
before the damage: the control), then makes one level foreign, writable, a link or a special
file, and asserts that a fresh Cache's lookup is a miss within 1 s with one warning naming the
path, the problem and the fix. The planted code would write a marker file if it ever ran.
Tests run as root, so uid 65534 (nobody) plays the other user.
"""

from __future__ import annotations

import hashlib
import logging
import marshal
import os
import re
import secrets
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest

from hp_lazy.errors import HpLazyError
from hp_lazy.hook import cache as cache_mod
from hp_lazy.hook.cache import Cache, CacheKeyWarning, CacheTrustError, CacheTrustWarning, cache_key

pytestmark = pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0,
                                reason="simulates another user with chown, which needs root")

OTHER = 65534
SRC_SHA = "ab" * 32
MODULE = "pkg.modeling_x"
ORIGIN = "/x/modeling_x.py"
TAG = cache_mod.sys.implementation.cache_tag


@dataclass(frozen=True)
class Planted:
    root: Path
    key: str
    entry: Path
    marker: Path

    @property
    def key_file(self) -> Path:
        return self.root / "key"


def _marker_code(marker: Path):
    return compile(f"open({str(marker)!r}, 'w').write('ran')\nVALUE = 7\n", ORIGIN, "exec", dont_inherit=True)


@pytest.fixture
def planted(tmp_path: Path) -> Planted:
    root, marker = tmp_path / "c", tmp_path / "ran"
    key = cache_key(slice_hash="s1", source_sha256=SRC_SHA, module=MODULE, origin=ORIGIN)
    entry = Cache(root, "rw").store(key, MODULE, SRC_SHA, _marker_code(marker), ORIGIN)
    assert entry is not None and Cache(root, "rw").load(key, MODULE, SRC_SHA) is not None
    return Planted(root, key, entry, marker)


def _lookup(cache: Cache, p: Planted) -> tuple:
    """``cache.lookup`` in a daemon thread that must be done within 1 s."""
    result: list = []
    worker = threading.Thread(target=lambda: result.append(cache.lookup(p.key, MODULE, SRC_SHA)), daemon=True)
    worker.start()
    worker.join(1.0)
    assert not worker.is_alive(), "lookup blocked"
    return result[0]


def _assert_refused(p: Planted, *fragments: str, mode: str | None = "rw", root: Path | None = None) -> str:
    """A miss, twice, with exactly one CacheTrustWarning holding every fragment; nothing ran."""
    cache = Cache(root or p.root, mode)  # type: ignore[arg-type]
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert _lookup(cache, p) == (None, None)
        assert _lookup(cache, p) == (None, None)
    trust = [w for w in record if issubclass(w.category, CacheTrustWarning)]
    assert len(trust) == 1, [str(w.message) for w in record]
    text = str(trust[0].message)
    for fragment in fragments:
        assert fragment in text, (fragment, text)
    assert not p.marker.exists()
    return text


def _chown_tree(path: Path, uid: int) -> None:
    for dirpath, dirnames, filenames in os.walk(path):
        for name in [dirpath, *(os.path.join(dirpath, n) for n in dirnames + filenames)]:
            os.chown(name, uid, -1, follow_symlinks=False)


# -- the root and the levels below it ------------------------------------------------------------
@pytest.mark.parametrize("mode", [0o777, 0o1777, 0o770, 0o720])
def test_writable_root_is_refused_on_read(planted: Planted, mode: int) -> None:
    planted.root.chmod(mode)
    _assert_refused(planted, f"{planted.root}: mode {oct(mode)} is group/world-writable",
                    f"chmod 700 {planted.root}, or set HP_LAZY_CACHE_DIR to a directory of your own")


def test_foreign_root_is_refused_on_read(planted: Planted) -> None:
    os.chown(planted.root, OTHER, -1)
    _assert_refused(planted, f"{planted.root}: owned by uid {OTHER}, not you (uid 0)",
                    "set HP_LAZY_CACHE_DIR to a directory of your own")


def test_symlinked_root_is_refused(planted: Planted, tmp_path: Path) -> None:
    link = tmp_path / "link"
    link.symlink_to(planted.root)
    _assert_refused(planted, f"{link}: is a symlink", "HP_LAZY_CACHE_DIR", root=link)


@pytest.mark.parametrize("level", ["v1", f"v1/{TAG}", f"v1/{TAG}/{MODULE}"])
def test_writable_intermediate_level_is_refused(planted: Planted, level: str) -> None:
    (planted.root / level).chmod(0o777)
    _assert_refused(planted, f"{planted.root / level}: mode 0o777 is group/world-writable",
                    f"chmod 700 {planted.root / level}")


def test_foreign_intermediate_level_is_refused(planted: Planted) -> None:
    os.chown(planted.root / "v1" / TAG, OTHER, -1)
    _assert_refused(planted, f"{planted.root / 'v1' / TAG}: owned by uid {OTHER}")


def test_symlinked_module_dir_is_refused(planted: Planted, tmp_path: Path) -> None:
    module_dir = planted.entry.parent
    module_dir.rename(tmp_path / "elsewhere")
    module_dir.symlink_to(tmp_path / "elsewhere")
    _assert_refused(planted, f"{module_dir}: is a symlink")


# -- the entry ----------------------------------------------------------------------------------
def test_foreign_entry_is_refused(planted: Planted) -> None:
    os.chown(planted.entry, OTHER, -1)
    _assert_refused(planted, f"{planted.entry}: owned by uid {OTHER}, not you (uid 0)", f"rm {planted.entry}")


def test_writable_entry_is_refused(planted: Planted) -> None:
    planted.entry.chmod(0o666)
    _assert_refused(planted, f"{planted.entry}: mode 0o666 is group/world-writable", f"rm {planted.entry}")


def test_entry_symlink_to_a_valid_entry_is_refused(planted: Planted, tmp_path: Path) -> None:
    planted.entry.rename(tmp_path / "valid.hplz")
    planted.entry.symlink_to(tmp_path / "valid.hplz")
    _assert_refused(planted, f"{planted.entry}: is a symlink", f"rm {planted.entry}")


def test_entry_symlink_to_dev_zero_is_a_prompt_miss(planted: Planted) -> None:
    planted.entry.unlink()
    planted.entry.symlink_to("/dev/zero")
    _assert_refused(planted, f"{planted.entry}: is a symlink")


def test_fifo_entry_is_a_prompt_miss(planted: Planted) -> None:
    planted.entry.unlink()
    os.mkfifo(planted.entry, 0o600)
    _assert_refused(planted, f"{planted.entry}: is a FIFO, not a regular file", f"rm {planted.entry}")


def test_oversized_entry_is_a_plain_miss(planted: Planted, monkeypatch: pytest.MonkeyPatch,
                                         caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(cache_mod, "MAX_ENTRY", planted.entry.stat().st_size - 1)
    with warnings.catch_warnings(), caplog.at_level(logging.DEBUG, logger="hp_lazy.hook"):
        warnings.simplefilter("error")
        assert Cache(planted.root, "rw").lookup(planted.key, MODULE, SRC_SHA) == (None, None)
    assert "byte cap" in caplog.text and str(planted.entry) in caplog.text


# -- the HMAC and its key -----------------------------------------------------------------------
def _forge(p: Planted, secret: bytes, plain_sha256: bool = False) -> None:
    """Replace the entry's payload by the marker code, signed with ``secret`` (or a bare sha256)."""
    meta = cache_mod._meta(MODULE, ORIGIN, p.key)
    blob = bytearray(cache_mod._encode(_marker_code(p.marker), p.key, SRC_SHA, meta, secret))
    if plain_sha256:  # what format 1 checked: anyone can recompute it
        blob[76:108] = hashlib.sha256(marshal.dumps(_marker_code(p.marker))).digest()
    p.entry.write_bytes(bytes(blob))


@pytest.mark.parametrize("forgery", ["plain_sha256", "another_key"])
def test_tampered_entry_is_a_miss(planted: Planted, forgery: str, caplog: pytest.LogCaptureFixture) -> None:
    """Same owner, same mode, valid header: only the HMAC tells it was not written by this cache."""
    _forge(planted, secrets.token_bytes(32), plain_sha256=forgery == "plain_sha256")
    with warnings.catch_warnings(), caplog.at_level(logging.DEBUG, logger="hp_lazy.hook"):
        warnings.simplefilter("error")
        assert Cache(planted.root, "rw").lookup(planted.key, MODULE, SRC_SHA) == (None, None)
    assert "HMAC mismatch" in caplog.text and str(planted.entry) in caplog.text
    _forge(planted, planted.key_file.read_bytes())  # control: signed with the real key, it is read
    assert Cache(planted.root, "rw").load(planted.key, MODULE, SRC_SHA) is not None


def test_a_new_key_invalidates_every_entry(planted: Planted) -> None:
    planted.key_file.write_bytes(secrets.token_bytes(32))
    assert Cache(planted.root, "rw").load(planted.key, MODULE, SRC_SHA) is None


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o620])
def test_key_readable_by_others_makes_the_cache_untrusted(planted: Planted, mode: int) -> None:
    planted.key_file.chmod(mode)
    _assert_refused(planted, f"{planted.key_file}: mode {oct(mode)} lets group/others at it",
                    f"rm {planted.key_file}")


def test_foreign_key_makes_the_cache_untrusted(planted: Planted) -> None:
    os.chown(planted.key_file, OTHER, -1)
    _assert_refused(planted, f"{planted.key_file}: owned by uid {OTHER}", f"rm {planted.key_file}")


def test_symlinked_or_short_key_makes_the_cache_untrusted(planted: Planted, tmp_path: Path) -> None:
    planted.key_file.rename(tmp_path / "real_key")
    planted.key_file.symlink_to(tmp_path / "real_key")
    _assert_refused(planted, f"{planted.key_file}: is a symlink")
    planted.key_file.unlink()
    planted.key_file.write_bytes(b"short")
    planted.key_file.chmod(0o600)
    _assert_refused(planted, f"{planted.key_file}: holds 5 bytes, not 32")


def test_key_file_is_private_and_created_once(tmp_path: Path) -> None:
    cache = Cache(tmp_path / "c", "rw")
    cache.store("aa" * 32, "m", SRC_SHA, _marker_code(tmp_path / "ran"), ORIGIN)
    key_file = tmp_path / "c" / "key"
    st = key_file.lstat()
    assert st.st_size == 32 and st.st_mode & 0o777 == 0o600
    first = key_file.read_bytes()
    Cache(tmp_path / "c", "rw").store("bb" * 32, "m", SRC_SHA, _marker_code(tmp_path / "ran"), ORIGIN)
    assert key_file.read_bytes() == first and sorted(p.name for p in (tmp_path / "c").iterdir()) == ["key", "v1"]


# -- modes, owners, strictness ------------------------------------------------------------------
def test_ro_on_a_foreign_dir_is_refused(planted: Planted, monkeypatch: pytest.MonkeyPatch) -> None:
    _chown_tree(planted.root, OTHER)
    monkeypatch.setenv("HP_LAZY_CACHE", "ro")
    _assert_refused(planted, f"{planted.root}: owned by uid {OTHER}, not you (uid 0)", mode=None)


def test_root_owned_cache_is_trusted_for_reads_only(planted: Planted, monkeypatch: pytest.MonkeyPatch) -> None:
    """As uid 1000: a root-made cache is read in ro mode, refused in rw mode; a nobody-made one never."""
    monkeypatch.setattr(cache_mod.os, "geteuid", lambda: 1000)
    assert Cache(planted.root, "ro").load(planted.key, MODULE, SRC_SHA) is not None
    _assert_refused(planted, f"{planted.root}: owned by uid 0, not you (uid 1000),")
    _chown_tree(planted.root, OTHER)
    _assert_refused(planted, f"owned by uid {OTHER}, not you (uid 1000) or root,", mode="ro")


def test_a_shared_root_cache_with_a_readable_key_hits_for_its_readers(
    planted: Planted, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As uid 1000: root populated the cache and made its key readable (0644): ro readers hit; the same
    key is still refused in rw mode and for root's own use (a private key is the rule there); a
    group/world-writable key is refused in every mode."""
    planted.key_file.chmod(0o644)
    monkeypatch.setattr(cache_mod.os, "geteuid", lambda: 1000)
    assert Cache(planted.root, "ro").load(planted.key, MODULE, SRC_SHA) is not None
    monkeypatch.setattr(cache_mod.os, "geteuid", lambda: 0)
    _assert_refused(planted, f"{planted.key_file}: mode 0o644 lets group/others at it")
    monkeypatch.setattr(cache_mod.os, "geteuid", lambda: 1000)
    planted.key_file.chmod(0o666)
    _assert_refused(planted, f"{planted.key_file}: mode 0o666 is group/world-writable", mode="ro")


def test_a_key_the_reader_cannot_open_is_said_once(planted: Planted, monkeypatch: pytest.MonkeyPatch) -> None:
    """A shared cache whose owner kept the key private (0600 root): a non-root reader gets EACCES
    (simulated: these tests run as root, which the kernel lets through) and would silently miss on
    every import; one CacheKeyWarning says so, with the fix."""
    real = cache_mod.read_key

    def denied(root_fd, shown, trust):
        raise PermissionError(13, "Permission denied", str(shown))

    monkeypatch.setattr(cache_mod, "read_key", denied)
    cache = Cache(planted.root, "ro")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            assert cache.load(planted.key, MODULE, SRC_SHA) is None
    texts = [str(w.message) for w in caught if w.category is CacheKeyWarning]
    assert texts == [
        f"hp_lazy: cannot read the cache key {planted.key_file} (Permission denied), so no entry of {planted.root} "
        "can be verified and every planned import is lowered again; in a shared read-only cache its owner makes the "
        f"key readable (chmod 0644 {planted.key_file}; readers set HP_LAZY_CACHE=ro), else set HP_LAZY_CACHE_DIR to a "
        "directory of your own"
    ]
    monkeypatch.setattr(cache_mod, "read_key", real)
    assert Cache(planted.root, "ro").load(planted.key, MODULE, SRC_SHA) is not None  # the control: readable, it hits


def test_strict_raises_with_the_text(planted: Planted, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HP_LAZY_STRICT", "1")
    planted.root.chmod(0o777)
    cache = Cache(planted.root, "rw")
    expected = f"{planted.root}: mode 0o777 is group/world-writable, so someone else could have written"
    for _ in range(2):  # every access raises; nothing is quietly remembered as a miss
        with pytest.raises(CacheTrustError, match=re.escape(expected)) as info:
            cache.lookup(planted.key, MODULE, SRC_SHA)
    assert isinstance(info.value, HpLazyError) and isinstance(info.value, PermissionError)
    with pytest.raises(CacheTrustError, match=re.escape(f"chmod 700 {planted.root}")):
        Cache(planted.root, "rw").store("cc" * 32, MODULE, SRC_SHA, _marker_code(planted.marker), ORIGIN)
    assert not planted.marker.exists()


def test_read_is_checked_even_after_a_good_write(planted: Planted) -> None:
    cache = Cache(planted.root, "rw")
    assert cache.load(planted.key, MODULE, SRC_SHA) is not None
    planted.entry.chmod(0o622)
    with pytest.warns(CacheTrustWarning, match=re.escape(f"{planted.entry}: mode 0o622")):
        assert cache.load(planted.key, MODULE, SRC_SHA) is None


@pytest.mark.parametrize("level", ["", "v1", f"v1/{TAG}/{MODULE}"])
def test_write_into_an_untrusted_level_writes_nothing(planted: Planted, level: str) -> None:
    target = planted.root / level if level else planted.root
    target.chmod(0o777)
    before = sorted(planted.root.rglob("*"))
    cache = Cache(planted.root, "rw")
    code = _marker_code(planted.marker)
    with pytest.warns(CacheTrustWarning, match=re.escape(f"{target}: mode 0o777")):
        assert cache.store("dd" * 32, MODULE, SRC_SHA, code, ORIGIN) is None
    assert sorted(planted.root.rglob("*")) == before
    assert cache.load("dd" * 32, MODULE, SRC_SHA) is code  # this process still has it, in memory


# -- what hp_lazy creates -----------------------------------------------------------------------
@pytest.mark.parametrize("umask", [0o000, 0o277])
def test_created_dirs_are_0700_and_files_0600_whatever_the_umask(tmp_path: Path, umask: int) -> None:
    root = tmp_path / "a" / "b" / "c"
    old = os.umask(umask)
    try:
        entry = Cache(root, "rw").store("ee" * 32, MODULE, SRC_SHA, _marker_code(tmp_path / "ran"), ORIGIN)
    finally:
        os.umask(old)
    assert entry is not None
    dirs = [tmp_path / "a", tmp_path / "a" / "b", root, root / "v1", root / "v1" / TAG, entry.parent]
    assert {str(d): d.stat().st_mode & 0o777 for d in dirs} == {str(d): 0o700 for d in dirs}
    assert [f.stat().st_mode & 0o777 for f in (root / "key", entry)] == [0o600, 0o600]


def test_stale_temp_files_are_collected_fresh_ones_kept(planted: Planted) -> None:
    directory = planted.entry.parent
    old = time.time() - 11 * 60

    def temp(name: str, uid: int = 0, mtime: float | None = None) -> Path:
        path = directory / name
        path.write_bytes(b"partial")
        os.chown(path, uid, -1)
        if mtime is not None:
            os.utime(path, (mtime, mtime))
        return path

    stale, fresh, foreign = temp("a.hplz.1.tmp", mtime=old), temp("b.hplz.2.tmp"), temp("c.hplz.3.tmp", OTHER, old)
    other_dir_stale = temp("d.hplz.4.tmp", mtime=old).rename(planted.root / "v1" / "d.hplz.4.tmp")
    Cache(planted.root, "rw").store("ff" * 32, MODULE, SRC_SHA, _marker_code(planted.marker), ORIGIN)
    assert (stale.exists(), fresh.exists(), foreign.exists()) == (False, True, True)
    assert other_dir_stale.exists()  # only the directory written to is swept


def test_concurrent_key_creation_keeps_one_key(tmp_path: Path) -> None:
    root = tmp_path / "c"
    caches = [Cache(root, "rw") for _ in range(8)]
    threads = [threading.Thread(target=lambda c=c, i=i: c.store(f"{i:02x}" * 32, MODULE, SRC_SHA,
                                                                   _marker_code(tmp_path / "ran"), ORIGIN))
               for i, c in enumerate(caches)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not [p for p in root.iterdir() if p.name.endswith(".tmp")]
    for i in range(8):
        assert Cache(root, "ro").load(f"{i:02x}" * 32, MODULE, SRC_SHA) is not None
