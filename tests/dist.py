"""Run test code on N ranks of one gloo process group that lives as long as the test module.

    from dist import DistPool, pool_fixture

    pool2 = pool_fixture(2)            # module-scoped fixture named "pool2"

    def _body(rank: int, world: int, n: int) -> float:   # module level: workers import it by name
        ...
        return value

    def test_x(pool2: DistPool) -> None:
        assert pool2.run(_body, 3) == [...]          # one result per rank, rank order

``pool.run(fn, *args, **kwargs)`` calls ``fn(rank, world, *args, **kwargs)`` on every rank and
returns the results. A worker's exception fails the call with its traceback text; a call that does
not finish within ``timeout`` seconds fails too, and the pool restarts on its next use (a rank
stuck in a collective cannot be recovered); start-up gets at least 120 s. Workers are forked from a forkserver that imported
torch and ``transformers.modeling_utils`` once for the whole session, so a pool starts in well under a second after the
first (importing ``modeling_utils`` in every worker cost the suite about 45% of its pool-heavy modules' time). The
modeling modules hp_lazy rewrites are imported in the workers, after ``activate``: the order of a script that imports
transformers first; scripts that activate first are run by the README, example and benchmark tests. Each
worker has the torchrun env (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK) set, one
intra-op thread, and ``GLOO_SOCKET_IFNAME=lo``.

Do not alias ``torch.distributed`` as ``dist`` in a test module that imports this one.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import socket
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from typing import Any

import pytest

_TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
_CTX: Any = None
_STARTUP_S = 120.0  # the first pool of a session waits for the forkserver to import torch


class WorkerError(AssertionError):
    """A worker raised, died or timed out; the message carries its traceback text."""


def _context() -> Any:
    global _CTX
    if _CTX is None:
        os.environ.setdefault("OMP_NUM_THREADS", "1")  # inherited by the forkserver
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(["torch", "torch.distributed", "transformers.modeling_utils"])
    return _CTX


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(rank: int, world: int, port: int, conn: Connection, timeout: float) -> None:
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1",
    )
    if _TESTS_DIR not in sys.path:
        sys.path.insert(0, _TESTS_DIR)
    import datetime

    import torch
    import torch.distributed as tdist

    torch.set_num_threads(1)
    tdist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=timeout),
    )
    conn.send_bytes(pickle.dumps(("ready", rank)))
    _serve(rank, world, conn)
    tdist.destroy_process_group()


def _serve(rank: int, world: int, conn: Connection) -> None:
    while True:
        try:
            message = conn.recv_bytes()
        except (EOFError, OSError):
            return
        try:
            fn, args, kwargs = pickle.loads(message)
            if fn is None:
                return
            reply = ("ok", fn(rank, world, *args, **kwargs))
        except BaseException:  # noqa: BLE001  (reported to the parent)
            reply = ("error", traceback.format_exc())
        try:
            conn.send_bytes(pickle.dumps(reply))
        except Exception:  # noqa: BLE001  (an unpicklable result)
            conn.send_bytes(pickle.dumps(("error", traceback.format_exc())))


class DistPool:
    """``world_size`` long-lived worker processes joined in one gloo process group."""

    def __init__(self, world_size: int, timeout: float = 60.0) -> None:
        self.world_size = world_size
        self.timeout = timeout
        self._procs: list[Any] = []
        self._conns: list[Connection] = []
        self._ready = False

    def start(self) -> None:
        """Start the workers (``run`` calls it when needed); returns without waiting for them."""
        ctx, port = _context(), _free_port()
        for rank in range(self.world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=_worker, args=(rank, self.world_size, port, child, self.timeout), daemon=True
            )
            proc.start()
            child.close()
            self._procs.append(proc)
            self._conns.append(parent)

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """``[fn(rank, world, *args, **kwargs) for every rank]``, run concurrently on the workers."""
        if not self._procs:
            self.start()
        if not self._ready:
            self._collect(time.monotonic() + max(self.timeout, _STARTUP_S), "start-up")
            self._ready = True
        message = pickle.dumps((fn, args, kwargs))
        for conn in self._conns:
            conn.send_bytes(message)
        return self._collect(time.monotonic() + self.timeout, getattr(fn, "__qualname__", repr(fn)))

    def _collect(self, deadline: float, what: str) -> list[Any]:
        replies: dict[int, tuple[str, Any]] = {}
        while len(replies) < self.world_size and time.monotonic() < deadline:
            if any(kind == "error" for kind, _ in replies.values()):
                deadline = min(deadline, time.monotonic() + 2.0)  # the others may be stuck
            for rank, conn in enumerate(self._conns):
                if rank not in replies and conn.poll(0.01):
                    replies[rank] = self._receive(rank, conn)
        errors = {r: text for r, (kind, text) in replies.items() if kind == "error"}
        if errors or len(replies) < self.world_size:
            self.close()
            raise WorkerError(self._failure(what, replies, errors))
        return [replies[rank][1] for rank in range(self.world_size)]

    def _receive(self, rank: int, conn: Connection) -> tuple[str, Any]:
        try:
            return pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return ("error", f"worker exited (exit code {self._procs[rank].exitcode})")

    def _failure(self, what: str, replies: dict[int, Any], errors: dict[int, str]) -> str:
        silent = [r for r in range(self.world_size) if r not in replies]
        lines = [f"{what} failed on a world of {self.world_size}"]
        lines += [f"--- rank {r} raised:\n{text}" for r, text in sorted(errors.items())]
        if silent:
            lines.append(f"--- ranks {silent} gave no answer within {self.timeout:.0f} s (hang?)")
        return "\n".join(lines)

    def close(self) -> None:
        """Stop the workers; a later ``run`` starts new ones."""
        for conn in self._conns:
            try:
                conn.send_bytes(pickle.dumps((None, (), {})))
            except (OSError, ValueError):
                pass
        for proc in self._procs:
            proc.join(timeout=2.0)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=2.0)
        for conn in self._conns:
            conn.close()
        self._procs, self._conns, self._ready = [], [], False


def pool_fixture(world_size: int, timeout: float = 60.0) -> Any:
    """A module-scoped pytest fixture yielding a started :class:`DistPool` of ``world_size``.

    The fixture takes the name of the module attribute it is assigned to.
    """

    @pytest.fixture(scope="module")
    def _pool() -> Iterator[DistPool]:
        pool = DistPool(world_size, timeout=timeout)
        pool.start()
        try:
            yield pool
        finally:
            pool.close()

    return _pool
