"""Benchmark ranks: started from a forkserver that imported torch once, and their results collected
without hanging on a rank that died."""

from __future__ import annotations

import queue as queues
import time
from typing import Any


def context() -> Any:
    """The multiprocessing context ranks start from: a forkserver that imported torch,
    torch.distributed and transformers' ``modeling_utils`` once, so each rank starts without importing
    them (~2 s a rank for torch, ~3.5 s more for transformers, on 2 CPU cores). The modeling modules
    hp_lazy rewrites are imported in each rank after its hook is active, as in a script that imports
    transformers first (the test pools start their workers the same way). A memory baseline a rank
    takes after its imports (``load_memory.py``) is unchanged by what the forkserver preloaded. The
    scripts call this before building their checkpoint, so the server's imports overlap the build
    (its ``sys.path`` is the caller's at that call)."""
    import torch.multiprocessing as tmp  # its queues share tensors as the ranks return them

    ctx = tmp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "transformers.modeling_utils"])
    from multiprocessing import forkserver

    forkserver.ensure_running()  # it imports them now: a caller that starts it first builds its model meanwhile
    return ctx


def collect(procs: list[Any], queue: Any, what: str, timeout: float = 3600) -> dict[int, Any]:
    """Every rank's ``(rank, result)`` from ``queue``; raises, killing the others, as soon as a rank has
    exited with an error (its traceback is on stderr) or after ``timeout`` seconds."""
    results: dict[int, Any] = {}
    start = time.perf_counter()
    while len(results) < len(procs):
        try:
            rank, value = queue.get(timeout=2)
            results[rank] = value
        except queues.Empty:
            failed = any(p.exitcode not in (None, 0) for p in procs)
            if failed or time.perf_counter() - start > timeout:
                for p in procs:
                    if p.is_alive():
                        p.kill()
                raise RuntimeError(f"{what}: a rank failed or timed out (exit codes {[p.exitcode for p in procs]}); "
                                   "its traceback is above") from None
    return results
