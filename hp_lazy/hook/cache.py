"""The lowered-code cache: one content-addressed, HMAC-signed file per (plan slice, source,
lowerer, Python), read and written only inside directories that no one else can write.

Layout: ``<root>/v1/<cache_tag>/<module>/<key[:32]>.hplz`` and ``<root>/key``; ``root`` is
``activate(cache_dir=)``, else ``$HP_LAZY_CACHE_DIR``, else ``${XDG_CACHE_HOME:-~/.cache}/hp_lazy``.

Key: sha256 of the canonical JSON of the file format, the plan slice hash, the source sha256, the
hp_lazy version, the lowerer's own code hash (``hp_lazy/lower/*.py`` + ``hp_lazy/plan/*.py`` + ``names.py``, once
per process), the bytecode magic and cache tag, ``sys.flags.optimize``, the module name and the
origin's realpath. Nothing is overwritten in place: any change of input gives a new file.

File, format 2 (little-endian)::

    0   4  b"HPLZ"              8  4  importlib.util.MAGIC_NUMBER
    4   2  format version (2)   12 32 sha256(source bytes)
    6   2  flags (0)            44 32 key digest
    76  32 HMAC-SHA256(<root>/key, the whole file with these 32 bytes zeroed)
    108 4  len(meta)
    112 n  meta (UTF-8 JSON: module, origin, key, hp_lazy, created, host, pid)
    ..     payload: marshal.dumps(code)

A reader checks every header field, then the HMAC, and only then unmarshals; any failure is a miss
(logged at debug), never a crash. Writes go to a unique 0600 temp file created through the checked
descriptor of the entry's directory and renamed onto the entry through it (``os.replace`` with
``src_dir_fd``/``dst_dir_fd``), so ranks importing at once neither corrupt nor block each other (no locks); a
``*.tmp`` older than 10 minutes (a killed writer's) is removed by the next write to its directory.

Trust model: an entry is code that runs as you on import, so it is used only if no one but you
(and root) could have written it. Every read and every write walks from ``root`` to the entry with
``O_NOFOLLOW`` directory descriptors (POSIX only); each level must be a real directory (not a
symlink), owned by your euid (in ``ro`` mode root-owned is accepted too) and not group/world-writable.
The entry (and the key) is opened ``O_NOFOLLOW | O_NONBLOCK`` and ``fstat``-ed: a regular file of
an accepted owner, not group/world-writable, at most 64 MiB, read with a bounded read (a FIFO or a
symlink to ``/dev/zero`` cannot hang an import). ``<root>/key`` holds 32 random bytes, is made 0600
by the first writer and must stay private (no group/other bits): a file written without it - by
another user through a hole this model missed, or by another tool running as you - fails the HMAC
and is a miss. Directories hp_lazy creates are 0700 whatever the umask.

A shared read-only cache (populated by root, read by everyone with ``HP_LAZY_CACHE=ro``): a root-owned
key may be readable by others there (``chmod 0644 <root>/key``; never writable), since the root-owned,
not-writable tree is what keeps others from writing entries. A key a reader cannot open is said once
(:class:`CacheKeyWarning`, with that fix) instead of every import silently lowering again.

A location that fails these checks is never read again by this process: lowered code is kept in
memory and one :class:`CacheTrustWarning` names the path, what is wrong and the fix
(``HP_LAZY_STRICT=1``: :class:`CacheTrustError` instead); the checks are :mod:`hp_lazy.hook.trust`.
An unusable directory (read-only, not a directory) also makes the cache fall back to memory, logged
once.

``HP_LAZY_CACHE=off|ro|rw`` (default ``rw``; ``HP_LAZY_DISABLE_CACHE=1`` = off).
PYTHONDONTWRITEBYTECODE / ``-B`` is deliberately
*not* obeyed: it governs CPython's ``__pycache__`` next to sources, while this cache lives in its
own directory under its own switch (container images set the variable routinely, which would
silently turn every import into a miss). Lowered bytecode is never written to ``__pycache__``.
"""

from __future__ import annotations

import hashlib
import hmac
import importlib.util
import json
import logging
import marshal
import os
import secrets
import shutil
import socket
import stat
import struct
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from types import CodeType

from hp_lazy.hook.trust import (
    FILE_FLAGS,
    KEY_NAME,
    MAX_ENTRY,
    NEW_FLAGS,
    CacheTrustError,
    Mode,
    Trust,
    make_key,
    open_below,
    open_dir,
    read_bounded,
    read_file,
    read_key,
    sweep_stale,
)

logger = logging.getLogger("hp_lazy.hook")

_MODES: tuple[str, ...] = ("off", "ro", "rw")
_MAGIC = b"HPLZ"
_FORMAT = 2
_HEADER = struct.Struct("<4sHH4s32s32s32sI")
_MAC = slice(76, 108)  # the HMAC field of _HEADER
_SUFFIX = ".hplz"
_LAYOUT = "v1"


class CacheKeyWarning(UserWarning):
    """The cache's key cannot be read (a shared cache whose owner kept it private): no entry can be
    verified, so every planned import lowers again."""


class CacheTrustWarning(UserWarning):
    """CacheTrustError's text when HP_LAZY_STRICT is unset: the cache is not used, code stays in memory."""


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
    """sha256 over the sources of hp_lazy/lower/*.py, hp_lazy/plan/*.py and hp_lazy/names.py (the
    generated names), once per process."""
    package = Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    digest.update(b"names.py\0" + (package / "names.py").read_bytes())
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
        self._secret: bytes | None = None  # the contents of <root>/key, once read
        self._writable = True  # False once a write failed (logged once)
        self._distrust: CacheTrustError | None = None  # set: the disk is never used again
        self._key_warned = False

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
        if self._distrust is not None:
            return None, None
        path = self.path_for(key, module)
        try:
            blob, secret = self._read(path)
        except CacheTrustError as exc:
            self._refuse(exc)
            return None, None
        except OSError as exc:
            if not isinstance(exc, FileNotFoundError):
                logger.debug("hp_lazy: cache entry %s unreadable (%s); lowering again", path, exc)
            return None, None
        code, why = _decode(blob, key, source_sha256, secret)
        if code is None:
            logger.debug("hp_lazy: cache entry %s ignored (%s); lowering again", path, why)
            return None, None
        return code, path

    def _read(self, path: Path) -> tuple[bytes, bytes]:
        """(entry bytes, key) after every trust check; FileNotFoundError while there is no key."""
        trust = Trust.for_mode(self.mode)
        with self._levels(path, trust, create=False) as (root_fd, dir_fd):
            try:
                secret = self._key(root_fd, trust, create=False)
            except PermissionError as exc:
                if not isinstance(exc, CacheTrustError):
                    self._warn_key(exc)
                raise
            fix = f"remove it (rm {path}); the next run writes a fresh one"
            return read_file(path.name, dir_fd, path, trust, fix, limit=MAX_ENTRY), secret

    # -- write -------------------------------------------------------------------------------
    def store(self, key: str, module: str, source_sha256: str, code: CodeType, origin: str) -> Path | None:
        """Write ``code`` atomically; returns the file, or None when kept in memory/not cached."""
        if self.mode == "off":
            return None
        path = self.path_for(key, module)
        if self.mode == "rw" and self._writable and self._distrust is None:
            meta = _meta(module, origin, key)
            try:
                self._write(path, lambda secret: _encode(code, key, source_sha256, meta, secret))
                return path
            except CacheTrustError as exc:
                self._refuse(exc)
            except OSError as exc:
                self._fall_back(f"cannot write {path}: {exc}")
        self._memory[key] = code
        return None

    def _write(self, path: Path, encode: Callable[[bytes], bytes]) -> None:
        trust = Trust.for_mode(self.mode)
        with self._levels(path, trust, create=True) as (root_fd, dir_fd):
            blob = encode(self._key(root_fd, trust, create=True))
            sweep_stale(dir_fd, trust.euid)
            _write_atomic(dir_fd, path.name, blob)

    # -- trust -------------------------------------------------------------------------------
    @contextmanager
    def _levels(self, path: Path, trust: Trust, create: bool) -> Iterator[tuple[int, int]]:
        """(fd of root, fd of the entry's directory), every level checked on the way down."""
        root_fd = open_dir(str(self.root), None, self.root, trust, create)
        try:
            below = path.relative_to(self.root).parts[:-1]
            dir_fd = open_below(root_fd, self.root, below, trust, create)
            try:
                yield root_fd, dir_fd
            finally:
                os.close(dir_fd)
        finally:
            os.close(root_fd)

    def _key(self, root_fd: int, trust: Trust, create: bool) -> bytes:
        """The secret in <root>/key, made first if ``create``; FileNotFoundError if there is none."""
        if self._secret is None:
            shown = self.root / KEY_NAME
            try:
                self._secret = read_key(root_fd, shown, trust)
            except FileNotFoundError:
                if not create:
                    raise
                sweep_stale(root_fd, trust.euid)
                make_key(root_fd)
                self._secret = read_key(root_fd, shown, trust)
        return self._secret

    def _refuse(self, exc: CacheTrustError) -> None:
        """HP_LAZY_STRICT=1: raise (every time). Else one warning, and off the disk for good."""
        if os.environ.get("HP_LAZY_STRICT", "0").strip() not in ("", "0"):
            raise exc
        if self._distrust is None:
            warnings.warn(str(exc), CacheTrustWarning, stacklevel=3)
        self._distrust = exc

    def _warn_key(self, exc: PermissionError) -> None:
        if self._key_warned:
            return
        self._key_warned = True
        key = self.root / KEY_NAME
        warnings.warn(
            f"hp_lazy: cannot read the cache key {key} ({exc.strerror}), so no entry of {self.root} can be verified "
            f"and every planned import is lowered again; in a shared read-only cache its owner makes the key readable "
            f"(chmod 0644 {key}; readers set HP_LAZY_CACHE=ro), else set HP_LAZY_CACHE_DIR to a directory of your own",
            CacheKeyWarning,
            stacklevel=4,
        )

    def _fall_back(self, why: str) -> None:
        if self._writable:
            logger.warning("hp_lazy: cache dir unusable (%s); keeping lowered code in memory only", why)
        self._writable = False

    # -- maintenance -------------------------------------------------------------------------
    def stats(self) -> CacheStats:
        entries = size = temps = 0
        base = self.root / _LAYOUT
        if base.is_dir():
            for path in base.rglob("*"):
                if path.name.endswith(_SUFFIX):
                    entries += 1
                    size += path.lstat().st_size
                elif path.name.endswith(".tmp"):
                    temps += 1
        return CacheStats(str(self.root), self.mode, entries, size, temps, len(self._memory))

    def clear(self) -> int:
        """Remove every entry and temp file (the key stays); returns how many files were removed."""
        self._memory.clear()
        base = self.root / _LAYOUT
        if not base.is_dir():
            return 0
        removed = sum(1 for p in base.rglob("*") if p.is_file())
        shutil.rmtree(base)
        return removed


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


def _mac(secret: bytes, blob: bytes) -> bytes:
    """HMAC-SHA256 of the whole file with its HMAC field zeroed."""
    unsigned = blob[: _MAC.start] + bytes(_MAC.stop - _MAC.start) + blob[_MAC.stop :]
    return hmac.new(secret, unsigned, hashlib.sha256).digest()


def _encode(code: CodeType, key: str, source_sha256: str, meta: bytes, secret: bytes) -> bytes:
    payload = marshal.dumps(code)
    header = _HEADER.pack(
        _MAGIC,
        _FORMAT,
        0,
        importlib.util.MAGIC_NUMBER,
        bytes.fromhex(source_sha256),
        bytes.fromhex(key),
        bytes(32),
        len(meta),
    )
    blob = header + meta + payload
    return blob[: _MAC.start] + _mac(secret, blob) + blob[_MAC.stop :]


def _decode(blob: bytes, key: str, source_sha256: str, secret: bytes) -> tuple[CodeType | None, str]:
    if len(blob) < _HEADER.size:
        return None, "truncated header"
    magic, fmt, _flags, py_magic, src, key_digest, mac, meta_len = _HEADER.unpack_from(blob)
    checks = (
        (magic == _MAGIC, "not an hp_lazy cache file"),
        (fmt == _FORMAT, f"format {fmt}"),
        (py_magic == importlib.util.MAGIC_NUMBER, "another Python's bytecode"),
        (src.hex() == source_sha256, "source hash differs"),
        (key_digest.hex() == key, "key differs"),
        (hmac.compare_digest(_mac(secret, blob), mac), "HMAC mismatch: not written with this cache's key"),
    )
    for ok, why in checks:
        if not ok:
            return None, why
    try:
        code = marshal.loads(blob[_HEADER.size + meta_len :])
    except Exception as exc:  # marshal raises several types on bad input
        return None, f"unmarshal failed: {exc!r}"
    if not isinstance(code, CodeType):
        return None, f"payload is a {type(code).__name__}, not code"
    return code, ""


def read_meta(path: Path) -> dict[str, object] | None:
    """The meta JSON of one cache file (no unmarshalling, no trust check), or None if unreadable."""
    try:
        fd = os.open(path, FILE_FLAGS)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return None
            blob = read_bounded(fd, MAX_ENTRY)
        finally:
            os.close(fd)
        meta_len = _HEADER.unpack_from(blob)[-1]
        return json.loads(blob[_HEADER.size : _HEADER.size + meta_len])
    except (OSError, struct.error, ValueError):
        return None


def _write_atomic(dir_fd: int, name: str, blob: bytes) -> None:
    """A 0600 temp file in the checked entry directory, then a rename onto ``name``, both through
    the directory's descriptor (the path is never looked up again after the checks)."""
    tmp = f"{name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    fd = os.open(tmp, NEW_FLAGS, 0o600, dir_fd=dir_fd)
    try:
        with os.fdopen(fd, "wb") as handle:
            os.fchmod(handle.fileno(), 0o600)
            handle.write(blob)
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        try:
            os.unlink(tmp, dir_fd=dir_fd)
        except OSError:
            pass
        raise
