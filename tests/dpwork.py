"""Worker-side runs for data parallel next to tp: each dp rank feeds its own rows of one global
batch, and the result must equal one process over the whole batch (the DDP convention).

``wrap`` says who reduces over dp: ``"hp"`` (hp_lazy's own gradient owner, the default),
``"ddp"`` (torch DDP over ``hp_lazy.mesh().group("dp").pg``), ``"fsdp"`` (FSDP2 ``fully_shard``
over the dp sub-mesh), ``"none"`` (nobody: the negative control, which must differ).
"""

from __future__ import annotations

from typing import Any

import models
import parity

STEPS = 3


def global_batch(dp: int):
    """``[2 * dp, 16]`` ids: dp rank ``d`` feeds rows ``2d, 2d + 1``."""
    return models.batch(seed=3, batch_size=2 * dp)


def optimizer(kind: str, params):
    import torch

    if kind == "adamw":
        return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)
    return torch.optim.SGD(params, lr=0.1, weight_decay=0.01)


def step_losses(model, ids, opt, *, micro: int, no_sync=None) -> list[float]:
    """``STEPS`` optimizer steps; each step's batch in ``micro`` micro-batches (loss / micro)."""
    import contextlib

    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        total = 0.0
        for i, part in enumerate(ids.chunk(micro)):
            quiet = no_sync(model) if (no_sync is not None and i < micro - 1) else contextlib.nullcontext()
            with quiet:
                loss = model(input_ids=part, labels=part).loss / micro
                loss.backward()
            total += float(loss.detach())
        opt.step()
        losses.append(total)
    return losses


def reference(path: str, ids, kind: str = "sgd", micro: int = 1) -> dict[str, Any]:
    """One process over the global batch: loss, grads of the first backward, losses, params."""
    model = parity._load(path)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    opt = optimizer(kind, model.parameters())
    losses = step_losses(model, ids, opt, micro=micro)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"loss": out.loss.detach(), "grads": grads, "losses": losses, "state": state}


def _wrapped(model, wrap: str):
    import hp_lazy

    mesh = hp_lazy.mesh()
    if wrap in ("ddp", "ddp_default"):
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, process_group=mesh.group("dp").pg if wrap == "ddp" else None)
    if wrap in ("fsdp", "fsdp_default"):
        from torch.distributed.fsdp import fully_shard

        if wrap == "fsdp_default":  # the default mesh: every rank
            return fully_shard(model)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh.device_mesh["dp"])
        return fully_shard(model, mesh=mesh.device_mesh["dp"])
    return model


def train(rank: int, world: int, path: str, wrap: str = "hp", kind: str = "sgd", micro: int = 1) -> dict[str, Any]:
    """This rank's part of the global batch, through ``wrap``; rank 0 returns full tensors."""
    import hp_lazy
    from hp_lazy.runtime.grads import owner_of

    model = hp_lazy.parallelize(parity._load(path), data_parallel=(wrap == "hp"))
    dp = hp_lazy.mesh().group("dp")
    ids = global_batch(dp.size).chunk(dp.size)[dp.rank]
    net = _wrapped(model, wrap)
    out = net(input_ids=ids, labels=ids)
    with hp_lazy.collective_counter() as counter:
        out.loss.backward()
    grads = hp_lazy.full_grads(model)
    no_sync = hp_lazy.no_sync if wrap == "hp" else ((lambda m: m.no_sync()) if wrap == "ddp" else None)
    losses = step_losses(net, ids, optimizer(kind, net.parameters()), micro=micro, no_sync=no_sync)
    state = hp_lazy.full_state_dict(model)
    owner = owner_of(model)
    result = {"loss": out.loss.detach(), "losses": losses, "backward": counter.by_phase("backward"),
              "buckets": owner.all_reduces_per_step if owner is not None else None}
    if rank == 0:
        result.update(grads=grads, state=state)
    return result


def compare(got: dict[str, Any], ref: dict[str, Any], tol: float = parity.TOL) -> dict[str, float]:
    """Every gradient and every parameter after the steps; the per-step losses averaged over dp
    must equal the global losses (checked by the caller)."""
    errors = {f"grad {n}": models.rel_err(got["grads"][n], g) for n, g in ref["grads"].items()}
    errors.update({f"param {n}": models.rel_err(got["state"][n], v) for n, v in ref["state"].items()})
    assert set(got["grads"]) == set(ref["grads"]), set(got["grads"]) ^ set(ref["grads"])
    bad = {k: v for k, v in errors.items() if not v <= tol}
    assert not bad, f"relative errors above {tol}: {dict(list(bad.items())[:6])}"
    return errors


def mean_losses(results: list[dict[str, Any]], key: str = "losses") -> list[float]:
    """Each dp rank's loss is the mean over its rows: the global mean is their average (tp ranks
    of one dp rank agree)."""
    per_rank = [r[key] for r in results]
    return [sum(step) / len(per_rank) for step in zip(*per_rank, strict=True)]


_REFS: dict[tuple[Any, ...], dict[str, Any]] = {}


def check(pool, refs, name: str, wrap: str, *, dp: int, kind: str = "sgd", micro: int = 1) -> list[dict[str, Any]]:
    """Run :func:`train` on every rank of the (activated) pool and compare with one process."""
    import torch

    path, _ = refs(name)
    key = (path, dp, kind, micro)
    if key not in _REFS:
        _REFS[key] = reference(path, global_batch(dp), kind, micro)
    ref = _REFS[key]
    got = pool.run(train, path, wrap, kind, micro)
    compare(got[0], ref)
    assert models.rel_err(torch.tensor(mean_losses(got)), torch.tensor(ref["losses"])) <= parity.TOL
    return got
