"""Distributed-checkpoint steps shared by the checkpoint tests: save and resume through torch's
``get_state_dict``/``set_state_dict`` or the model's own ``state_dict()``, the worst error against the
uninterrupted run, and a pool under another tp degree."""

from __future__ import annotations

import models
import parity
from dist import DistPool


def save(model, opt, ckpt: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=ckpt)


def load(model, opt, ckpt: str, api: str) -> None:
    """``dsd``: get_state_dict -> dcp.load -> set_state_dict; ``plain``: the model through its own
    ``state_dict()`` / ``load_state_dict`` (the optimizer through torch's helpers either way: a fresh
    optimizer has no state for a plain ``dcp.load`` to fill)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import state_dict as dsd

    if api == "dsd":
        msd, osd = dsd.get_state_dict(model, opt)
        dcp.load({"model": msd, "optim": osd}, checkpoint_id=ckpt)
        dsd.set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
        return
    msd, osd = model.state_dict(), dsd.get_optimizer_state_dict(model, opt)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=ckpt)
    model.load_state_dict(msd)
    dsd.set_optimizer_state_dict(model, opt, osd)


def resume_plain(model, ckpt: str, steps) -> dict:
    """One process, no hp_lazy, no process group: ``model`` and a fresh AdamW resumed from ``ckpt``
    through torch's helpers, then ``steps(model, opt)``; the model's state after them."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import state_dict as dsd

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    msd, osd = dsd.get_state_dict(model, opt)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=ckpt, no_dist=True)
    dsd.set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
    steps(model, opt)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def errors(got: dict, ref: dict) -> float:
    assert got.keys() == ref.keys(), got.keys() ^ ref.keys()
    return max(models.rel_err(got[k], v) for k, v in ref.items())


def at(pool: DistPool, tp: int) -> DistPool:
    """``pool`` under ``Plan.auto(tp=tp)``: new worker processes when it ran another plan (a lowered
    module keeps the plan it was lowered for)."""
    if getattr(pool, "_ckpt_tp", tp) != tp:
        pool.close()
    parity.activated(pool, tp=tp)  # once per set of workers
    pool._ckpt_tp = tp  # type: ignore[attr-defined]
    return pool
