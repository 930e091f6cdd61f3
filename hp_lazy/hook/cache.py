"""The lowered-code cache: one content-addressed file per (plan slice, source, lowerer, Python).

Layout: ``<root>/v1/<cache_tag>/<module>/<key[:32]>.hplz``; ``root`` is ``activate(cache_dir=)``,
else ``$HP_LAZY_CACHE_DIR``, else ``${XDG_CACHE_HOME:-~/.cache}/hp_lazy``.

Key: sha256 of the canonical JSON of the plan slice hash, the source sha256, the hp_lazy version,
the lowerer's own code hash (``hp_lazy/lower/*.py`` + ``hp_lazy/plan/*.py``, once per process),
the bytecode magic and cache tag, ``sys.flags.optimize``, the module name and the origin's realpath.
Nothing is overwritten in place: any change of input gives a new file.

File (little-endian)::

    0   4  b"HPLZ"              8  4  importlib.util.MAGIC_NUMBER
    4   2  format version (1)   12 32 sha256(source bytes)
    6   2  flags (0)            44 32 key digest
    76  32 sha256(payload)      108 4 len(meta)
    112 n  meta (UTF-8 JSON: module, origin, hp_lazy, plan, created, host, pid)
    ..     payload: marshal.dumps(code)

A reader checks every header field, then the payload digest, then unmarshals; any failure is a
miss (logged at debug), never a crash. Writes go to a unique temp file in the same directory and
``os.replace`` it, so ranks importing at once neither corrupt nor block each other (no locks).
An unusable directory (read-only, not a directory, group/world-writable, foreign-owned) makes the
cache fall back to memory, logged once.

``HP_LAZY_CACHE=off|ro|rw`` (default ``rw``; ``HP_LAZY_DISABLE_CACHE=1`` = off). PYTHONDONTWRITEBYTECODE / ``-B`` is deliberately
*not* obeyed: it governs CPython's ``__pycache__`` next to sources, while this cache lives in its
own directory under its own switch (container images set the variable routinely, which would
silently turn every import into a miss). Lowered bytecode is never written to ``__pycache__``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import marshal
import os
import shutil
import socket
import stat
import struct
import sys
import tempfile
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from types import CodeType
from typing import Literal

logger = logging.getLogger("hp_lazy.hook")

Mode = Literal["off", "ro", "rw"]
_MODES: tuple[str, ...] = ("off", "ro", "rw")
_MAGIC = b"HPLZ"
_FORMAT = 1
_HEADER = struct.Struct("<4sHH4s32s32s32sI")
_SUFFIX = ".hplz"
_LAYOUT = "v1"


def default_root() -> Path:
    """``$HP_LAZY_CACHE_DIR``, else ``${XDG_CACHE_HOME:-~/.cache}/hp_lazy``."""
    explicit = os.environ.get("HP_LAZY_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(xdg) / "hp_lazy"


def mode_from_env() -> Mode:
    """``HP_LAZY_CACHE`` (default rw); ``HP_LAZY_DISABLE_CACHE=1`` (DESIGN.md's name) means off."""
    if os.environ.get("HP_LAZY_DISABLE_CACHE", "0").strip() not in ("", "0"):
        return "off"
    value = os.environ.get("HP_LAZY_CACHE", "rw").strip().lower() or "rw"
    if value not in _MODES:
        from hp_lazy.errors import PlanError

        raise PlanError(
            f"HP_LAZY_CACHE={value!r}: must be one of off, ro, rw; "
            "unset it for the default (rw)"
        )
    return value  # type: ignore[return-value]


@lru_cache(maxsize=1)
def lowerer_code_hash() -> str:
    """sha256 over the sources of hp_lazy/lower/*.py and hp_lazy/plan/*.py (once per process)."""
    package = Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    for sub in ("lower", "plan"):
        for path in sorted((package / sub).glob("*.py")):
            digest.update(f"{sub}/{path.name}\0".encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


def cache_key(*, slice_hash: str, source_sha256: str, module: str, origin: str) -> str:
    """The hex key of one lowered module (see the module docstring for what it covers)."""
    from hp_lazy import __version__

    material = {
        "fmt": _FORMAT,
        "hp_lazy": __version__,
        "lowerer": lowerer_code_hash(),
        "magic": importlib.util.MAGIC_NUMBER.hex(),
        "cache_tag": sys.implementation.cache_tag,
        "optimize": sys.flags.optimize,
        "module": module,
        "origin": os.path.realpath(origin),
        "source_sha256": source_sha256,
        "plan": slice_hash,
    }
    canonical = json.dumps(material, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


@dataclass(frozen=True)
class CacheStats:
    root: str
    mode: str
    entries: int
    bytes: int
    temp_files: int
    memory_entries: int


class Cache:
    """Read/write lowered code objects; thread- and process-safe without locks."""

    def __init__(self, root: Path | str | None = None, mode: Mode | None = None) -> None:
        self.root = Path(root).expanduser() if root is not None else default_root()
        self.mode: Mode = mode if mode is not None else mode_from_env()
        self._memory: dict[str, CodeType] = {}
        self._disk_ok: bool | None = None  # None: not checked yet
        self._logged = False

    # -- paths -------------------------------------------------------------------------------
    def path_for(self, key: str, module: str) -> Path:
        return self.root / _LAYOUT / sys.implementation.cache_tag / module / f"{key[:32]}{_SUFFIX}"

    # -- read --------------------------------------------------------------------------------
    def load(self, key: str, module: str, source_sha256: str) -> CodeType | None:
        return self.lookup(key, module, source_sha256)[0]

    def lookup(self, key: str, module: str, source_sha256: str) -> tuple[CodeType | None, Path | None]:
        """(code, the file it came from; None when from memory), or (None, None) on a miss."""
        if self.mode == "off":
            return None, None
        if key in self._memory:
            return self._memory[key], None
        path = self.path_for(key, module)
        try:
            blob = path.read_bytes()
        except OSError:
            return None, None
        code, why = _decode(blob, key, source_sha256)
        if code is None:
            logger.debug("hp_lazy: cache entry %s ignored (%s); lowering again", path, why)
            return None, None
        return code, path

    # -- write -------------------------------------------------------------------------------
    def store(self, key: str, module: str, source_sha256: str, code: CodeType, origin: str) -> Path | None:
        """Write ``code`` atomically; returns the file, or None when kept in memory/not cached."""
        if self.mode == "off":
            return None
        if self.mode == "ro" or not self._usable():
            self._memory[key] = code
            return None
        path = self.path_for(key, module)
        blob = _encode(code, key, source_sha256, _meta(module, origin, key))
        try:
            _write_atomic(path, blob)
        except OSError as exc:
            self._fall_back(f"cannot write {path}: {exc}")
            self._memory[key] = code
            return None
        return path

    def _usable(self) -> bool:
        if self._disk_ok is None:
            problem = _check_root(self.root)
            self._disk_ok = problem is None
            if problem is not None:
                self._fall_back(problem)
        return bool(self._disk_ok)

    def _fall_back(self, why: str) -> None:
        if not self._logged:
            logger.warning("hp_lazy: cache dir unusable (%s); keeping lowered code in memory only", why)
            self._logged = True
        self._disk_ok = False

    # -- maintenance -------------------------------------------------------------------------
    def stats(self) -> CacheStats:
        entries = size = temps = 0
        base = self.root / _LAYOUT
        if base.is_dir():
            for path in base.rglob("*"):
                if path.name.endswith(_SUFFIX):
                    entries += 1
                    size += path.stat().st_size
                elif path.name.endswith(".tmp"):
                    temps += 1
        return CacheStats(str(self.root), self.mode, entries, size, temps, len(self._memory))

    def clear(self) -> int:
        """Remove every entry and temp file; returns how many files were removed."""
        self._memory.clear()
        base = self.root / _LAYOUT
        if not base.is_dir():
            return 0
        removed = sum(1 for p in base.rglob("*") if p.is_file())
        shutil.rmtree(base)
        return removed


def _check_root(root: Path) -> str | None:
    """None if ``root`` may hold code we execute later, else why not."""
    try:
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = root.stat()
    except OSError as exc:
        return f"{root}: {exc}"
    if not stat.S_ISDIR(st.st_mode):
        return f"{root} is not a directory"
    if hasattr(os, "getuid") and st.st_uid != os.getuid():
        return f"{root} is owned by uid {st.st_uid}, not by this user; use a cache dir of your own"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"{root} is group- or world-writable; chmod 700 it or use another HP_LAZY_CACHE_DIR"
    if not os.access(root, os.W_OK | os.X_OK):
        return f"{root} is not writable"
    return None


def _meta(module: str, origin: str, key: str) -> bytes:
    from hp_lazy import __version__

    meta = {
        "module": module,
        "origin": os.path.realpath(origin),
        "key": key,
        "hp_lazy": __version__,
        "created": time.time(),
        "host": socket.gethostname(),
        "pid": os.getpid(),
    }
    return json.dumps(meta, sort_keys=True).encode()


def _encode(code: CodeType, key: str, source_sha256: str, meta: bytes) -> bytes:
    payload = marshal.dumps(code)
    header = _HEADER.pack(
        _MAGIC,
        _FORMAT,
        0,
        importlib.util.MAGIC_NUMBER,
        bytes.fromhex(source_sha256),
        bytes.fromhex(key),
        hashlib.sha256(payload).digest(),
        len(meta),
    )
    return header + meta + payload


def _decode(blob: bytes, key: str, source_sha256: str) -> tuple[CodeType | None, str]:
    if len(blob) < _HEADER.size:
        return None, "truncated header"
    magic, fmt, _flags, py_magic, src, key_digest, digest, meta_len = _HEADER.unpack_from(blob)
    checks = (
        (magic == _MAGIC, "not an hp_lazy cache file"),
        (fmt == _FORMAT, f"format {fmt}"),
        (py_magic == importlib.util.MAGIC_NUMBER, "another Python's bytecode"),
        (src.hex() == source_sha256, "source hash differs"),
        (key_digest.hex() == key, "key differs"),
    )
    for ok, why in checks:
        if not ok:
            return None, why
    payload = blob[_HEADER.size + meta_len :]
    if hashlib.sha256(payload).digest() != digest:
        return None, "payload checksum mismatch"
    try:
        code = marshal.loads(payload)
    except Exception as exc:  # marshal raises several types on bad input
        return None, f"unmarshal failed: {exc!r}"
    if not isinstance(code, CodeType):
        return None, f"payload is a {type(code).__name__}, not code"
    return code, ""


def read_meta(path: Path) -> dict[str, object] | None:
    """The meta JSON of one cache file (no unmarshalling), or None if unreadable."""
    try:
        blob = path.read_bytes()
        meta_len = _HEADER.unpack_from(blob)[-1]
        return json.loads(blob[_HEADER.size : _HEADER.size + meta_len])
    except (OSError, struct.error, ValueError):
        return None


def _write_atomic(path: Path, blob: bytes) -> None:
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(blob)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
