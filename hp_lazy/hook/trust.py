"""The cache's trust checks: open a path from the cache root down without following symlinks or
blocking, and accept a directory, entry or key file only if nobody else could have written it.

Who may have written: this euid (and root too for a cache only read, ``HP_LAZY_CACHE=ro``).
Directories must be real directories of an accepted owner and not group/world-writable; files
regular files of an accepted owner without group/other write (the HMAC key: no group/other bits
at all), under a size cap. Everything hp_lazy creates is 0700 (directories) or 0600 (files)
whatever the umask. A refusal is a :class:`CacheTrustError` naming the path, what is wrong and the
fix; :mod:`hp_lazy.hook.cache` turns it into a miss and one warning (or raises it under
``HP_LAZY_STRICT=1``).
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
import time
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from hp_lazy.errors import HpLazyError

Mode = Literal["off", "ro", "rw"]
KEY_NAME = "key"
KEY_BYTES = 32
MAX_ENTRY = 64 << 20
STALE_TMP_S = 600.0
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
NEW_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
DIR_FIX = "set HP_LAZY_CACHE_DIR to a directory of your own"


class CacheTrustError(HpLazyError, PermissionError):
    """A cache directory, entry or key file could have been written by someone else."""



@dataclass(frozen=True)
class Trust:
    """Who may have written what the cache reads: this euid, and root too in ``ro`` mode."""

    euid: int
    root_ok: bool

    @classmethod
    def for_mode(cls, mode: Mode) -> Trust:
        return cls(os.geteuid(), mode == "ro")

    def owner(self, st: os.stat_result, shown: Path, fix: str) -> None:
        if st.st_uid == self.euid or (self.root_ok and st.st_uid == 0):
            return
        you = f"you (uid {self.euid})" + (" or root" if self.root_ok and self.euid != 0 else "")
        raise refusal(shown, f"owned by uid {st.st_uid}, not {you}", fix)

    def directory(self, st: os.stat_result, shown: Path) -> None:
        self.owner(st, shown, DIR_FIX)
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            mode = oct(stat.S_IMODE(st.st_mode))
            raise refusal(shown, f"mode {mode} is group/world-writable", f"chmod 700 {shown}, or {DIR_FIX}")

    def file(self, st: os.stat_result, shown: Path, fix: str, *, private: bool) -> None:
        """A regular file of an accepted owner; ``private``: no group/other bits at all."""
        if not stat.S_ISREG(st.st_mode):
            raise refusal(shown, f"is a {file_kind(st.st_mode)}, not a regular file", fix)
        self.owner(st, shown, fix)
        banned, what = (0o077, "lets group/others at it") if private else (0o022, "is group/world-writable")
        if st.st_mode & banned:
            raise refusal(shown, f"mode {oct(stat.S_IMODE(st.st_mode))} {what}", fix)


def refusal(shown: Path, problem: str, fix: str) -> CacheTrustError:
    return CacheTrustError(
        f"hp_lazy cache: {shown}: {problem}, so someone else could have written the code it holds; "
        f"{fix}. Lowered code is kept in memory for this process"
    )


_KINDS = ((stat.S_ISFIFO, "FIFO"), (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device"),
          (stat.S_ISDIR, "directory"), (stat.S_ISSOCK, "socket"), (stat.S_ISLNK, "symlink"))


def file_kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "special file")


def open_checked(name: str, flags: int, dir_fd: int | None, shown: Path, fix: str) -> int:
    """``os.open`` that names a symlink as such (O_NOFOLLOW fails with ELOOP or ENOTDIR)."""
    try:
        return os.open(name, flags, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
            raise
        if stat.S_ISLNK(os.lstat(name, dir_fd=dir_fd).st_mode):
            raise refusal(shown, "is a symlink", fix) from None
        raise NotADirectoryError(exc.errno, "not a directory", str(shown)) from None


def open_dir(name: str, parent_fd: int | None, shown: Path, trust: Trust, create: bool) -> int:
    """A checked directory fd; ``create``: make it (and, for the root, its ancestors) 0700 first."""
    made = False
    try:
        fd = open_checked(name, DIR_FLAGS, parent_fd, shown, DIR_FIX)
    except FileNotFoundError:
        if not create:
            raise
        if parent_fd is None:
            make_parents(shown)
        made = make_dir(name, parent_fd)
        fd = open_checked(name, DIR_FLAGS, parent_fd, shown, DIR_FIX)
    try:
        if made:
            os.fchmod(fd, 0o700)  # whatever the umask took away or left
        trust.directory(os.fstat(fd), shown)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_below(top_fd: int, top: Path, parts: tuple[str, ...], trust: Trust, create: bool) -> int:
    """A new fd of ``top/parts...`` (at least one part), each level checked."""
    fd, shown = top_fd, top
    for part in parts:
        shown = shown / part
        try:
            child = open_dir(part, fd, shown, trust, create)
        finally:
            if fd != top_fd:
                os.close(fd)
        fd = child
    return fd


def make_dir(name: str, parent_fd: int | None) -> bool:
    """True if this call made the directory (mode fixed by the caller)."""
    try:
        os.mkdir(name, 0o700, dir_fd=parent_fd)
    except FileExistsError:
        return False
    return True


def make_parents(path: Path) -> None:
    """The missing ancestors of the cache root, each 0700 whatever the umask."""
    for parent in reversed([p for p in path.parents if not p.exists()]):
        if make_dir(str(parent), None):
            os.chmod(parent, 0o700)


def read_file(name: str, dir_fd: int, shown: Path, trust: Trust, fix: str, *, limit: int,
               private: bool = False) -> bytes:
    """The bytes of a checked regular file, at most ``limit``; never follows a link, never blocks."""
    fd = open_checked(name, FILE_FLAGS, dir_fd, shown, fix)
    try:
        st = os.fstat(fd)
        trust.file(st, shown, fix, private=private)
        if st.st_size > limit:
            raise OSError(errno.EFBIG, f"{st.st_size} bytes, over the {limit}-byte cap", str(shown))
        return read_bounded(fd, limit)
    finally:
        os.close(fd)


def read_bounded(fd: int, limit: int) -> bytes:
    chunks: list[bytes] = []
    total = 0
    while total <= limit:
        chunk = os.read(fd, min(limit + 1 - total, 1 << 20))
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)
        total += len(chunk)
    raise OSError(errno.EFBIG, f"grew past the {limit}-byte cap while being read")


def read_key(root_fd: int, shown: Path, trust: Trust) -> bytes:
    """The secret, private to its owner, except a root-owned key read in ``ro`` mode: a shared
    cache's, which its readers must read (``chmod 0644``; still never writable); the root-owned,
    not-writable tree is what keeps others from writing entries there."""
    fix = f"remove it (rm {shown}); the next write makes a new key, and entries signed with the old one become misses"
    shared = trust.root_ok and os.stat(KEY_NAME, dir_fd=root_fd, follow_symlinks=False).st_uid == 0
    secret = read_file(KEY_NAME, root_fd, shown, trust, fix, limit=4096, private=not shared)
    if len(secret) != KEY_BYTES:
        raise refusal(shown, f"holds {len(secret)} bytes, not {KEY_BYTES}", fix)
    return secret


def make_key(root_fd: int) -> None:
    """Publish 32 random bytes as <root>/key, 0600; link(2) never replaces a concurrent writer's."""
    tmp = f"{KEY_NAME}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    fd = os.open(tmp, NEW_FLAGS, 0o600, dir_fd=root_fd)
    try:
        try:
            os.fchmod(fd, 0o600)
            if os.write(fd, secrets.token_bytes(KEY_BYTES)) != KEY_BYTES:
                raise OSError(errno.EIO, "short write of the cache key")
        finally:
            os.close(fd)
        os.link(tmp, KEY_NAME, src_dir_fd=root_fd, dst_dir_fd=root_fd)
    except FileExistsError:
        pass
    finally:
        os.unlink(tmp, dir_fd=root_fd)


def sweep_stale(dir_fd: int, euid: int) -> None:
    """Remove our own ``*.tmp`` regular files older than 10 minutes (killed writers' leftovers)."""
    cutoff = time.time() - STALE_TMP_S
    with os.scandir(dir_fd) as entries:
        for entry in entries:
            if not entry.name.endswith(".tmp"):
                continue
            with suppress(FileNotFoundError):
                st = entry.stat(follow_symlinks=False)
                if stat.S_ISREG(st.st_mode) and st.st_uid == euid and st.st_mtime < cutoff:
                    os.unlink(entry.name, dir_fd=dir_fd)
