"""Process groups and the device mesh.

The mesh spans the launcher's world (torchrun env): ``world = dp * cp * tp``, axes outermost
first, restricted to those whose degree is above 1; ``tp`` is innermost, so a tp group is a run of
consecutive ranks, and ``dp`` is whatever the other degrees leave (``dp = world / (cp * tp)``).

``ep`` is not a factor of the world: an expert-parallel group is carved out of the ranks that hold
different tokens (``dp * cp``, as in torchtitan and Megatron), so ``ep`` must divide ``dp * cp``;
the ep group of a rank is its run of ``ep`` consecutive ranks among those with its tp rank.
:meth:`Mesh.group_of` gives the group spanning several axes at once (the gradient owner sums a
partial gradient over ``("dp", "tp")`` in one all-reduce), and ``group_of(("edp",))`` the
expert-data-parallel group: the ranks holding the same expert slice (one per ep group, the same
tp rank; ``dp * cp / ep`` of them), over which expert gradients are summed.

Building a mesh is a collective (it creates one process group per axis): every rank must call
:func:`get_mesh` with the same degrees, in the same order relative to other collectives. At world
size 1 with every degree 1 no process group is needed and none is created.

Every process group hp_lazy creates (the default group when it initialises it from the env, each
axis's group, the gradient owner's dedicated groups) has a finite timeout,
``HP_LAZY_PG_TIMEOUT_S`` seconds (default 600): a rank that fails or never arrives makes its
peers' next collective raise within that bound instead of torch's 30-minute default.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from hp_lazy.errors import ShardingError

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh

AXES: tuple[str, ...] = ("dp", "cp", "ep", "tp")
"""Plan axes, in the plan's order."""
WORLD_AXES: tuple[str, ...] = ("dp", "cp", "tp")
"""The axes that factor the world, outermost first (the device mesh dims)."""
EDP = "edp"
"""The expert-data-parallel group's name (:meth:`Mesh.group_of`)."""
EDP_TP = "edp+tp"
"""The expert-data-parallel ranks of every tp rank: those holding an expert slice that tp leaves
whole, where each tp rank dispatches its own share of the tokens (:meth:`Mesh.group_of`)."""

_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
TIMEOUT_ENV = "HP_LAZY_PG_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 600
ARRIVAL_ENV = "HP_LAZY_ARRIVAL_TIMEOUT_S"
DEFAULT_ARRIVAL_S = 30
_MESHES: dict[tuple[tuple[str, int], ...], Mesh] = {}


@dataclass(frozen=True)
class Group:
    """One mesh axis as seen by this rank: its process group, size and rank within the axis.

    ``pg`` is ``None`` exactly when ``size == 1`` (every collective is then a no-op).
    """

    axis: str
    pg: ProcessGroup | None
    size: int
    rank: int

    @classmethod
    def solo(cls, axis: str) -> Group:
        """The group of an axis of degree 1: this rank alone, no process group."""
        return cls(axis=axis, pg=None, size=1, rank=0)


def ensure_process_group(wanted: int = 1) -> int:
    """Initialise the default process group from the torchrun env if none exists; return the world size.

    Backend: nccl when CUDA is available (the device is set from ``LOCAL_RANK``), gloo otherwise.
    Without a process group and without the env, returns 1 when ``wanted == 1`` and raises a
    :class:`ShardingError` when ``wanted > 1`` processes are needed.
    """
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    missing = [name for name in _ENV if name not in os.environ]
    if missing:
        if wanted > 1:
            raise ShardingError(
                f"hp_lazy mesh: {wanted} processes are needed but no process group exists and the "
                f"launcher env is incomplete (missing {', '.join(missing)}); launch with "
                f"`torchrun --nproc-per-node {wanted} script.py` or call "
                "torch.distributed.init_process_group() before hp_lazy"
            )
        return 1
    if not dist.is_available():
        raise ShardingError(
            "hp_lazy mesh: torch.distributed is not available in this torch build; install a torch "
            "build with distributed support"
        )
    _init_from_env()
    return dist.get_world_size()


def pg_timeout() -> timedelta:
    """The timeout of the process groups hp_lazy creates: ``HP_LAZY_PG_TIMEOUT_S`` seconds."""
    return _seconds(TIMEOUT_ENV, DEFAULT_TIMEOUT_S)


def _seconds(env: str, default: int) -> timedelta:
    raw = os.environ.get(env, "").strip()
    if not raw:
        return timedelta(seconds=default)
    try:
        seconds = float(raw)
    except ValueError:
        seconds = -1.0
    if not 0 < seconds < 10**7:
        raise ShardingError(
            f"hp_lazy: {env}={raw[:40]!r} is not a positive number of seconds below 10**7; "
            f"set e.g. {env}={default} (the default) or unset it"
        )
    return timedelta(seconds=seconds)


def _init_from_env() -> None:
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend="nccl", timeout=pg_timeout())
    else:
        dist.init_process_group(backend="gloo", timeout=pg_timeout())


def mesh_shape(degrees: Mapping[str, int], world: int) -> tuple[tuple[str, int], ...]:
    """The mesh axes in use with their sizes, outermost first, ``dp`` derived from ``world``.

    ``{"tp": 2}`` at world 8 -> ``(("dp", 4), ("tp", 2))``. Axes of degree 1 are left out.
    """
    _check_degrees(degrees)
    others = {axis: int(n) for axis, n in degrees.items() if axis not in ("dp", "ep")}
    product = math.prod(others.values())
    spelled = " * ".join(f"{a}={n}" for a, n in others.items()) or "1"
    if "dp" in degrees:
        if product * int(degrees["dp"]) != world:
            raise ShardingError(
                f"hp_lazy mesh {dict(degrees)}: dp={degrees['dp']} * {spelled} = "
                f"{product * int(degrees['dp'])} does not equal the world size {world}; leave dp out "
                f"(it is derived as world / {product}) or launch {product * int(degrees['dp'])} processes"
            )
        dp = int(degrees["dp"])
    else:
        if world % product:
            raise ShardingError(
                f"hp_lazy mesh {dict(degrees)}: the product of the degrees {spelled} = {product} does "
                f"not divide the world size {world}; launch a multiple of {product} processes "
                f"(e.g. --nproc-per-node {product}) or choose degrees whose product divides {world}"
            )
        dp = world // product
    sizes = {**others, "dp": dp}
    _check_ep(degrees, dp * sizes.get("cp", 1))
    return tuple((axis, sizes[axis]) for axis in WORLD_AXES if sizes.get(axis, 1) > 1)


def _check_ep(degrees: Mapping[str, int], token_ranks: int) -> None:
    ep = int(degrees.get("ep", 1))
    if token_ranks % ep:
        raise ShardingError(
            f"hp_lazy mesh {dict(degrees)}: ep={ep} does not divide dp * cp = {token_ranks}, the ranks that "
            f"hold different tokens (an expert-parallel group is carved out of them); use an ep in "
            f"{[d for d in range(1, token_ranks + 1) if token_ranks % d == 0]}"
        )


def _check_degrees(degrees: Mapping[str, int]) -> None:
    for axis, n in degrees.items():
        if axis not in AXES:
            raise ShardingError(
                f"hp_lazy mesh {dict(degrees)}: axis {axis!r} is unknown; use axes from {AXES}"
            )
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ShardingError(
                f"hp_lazy mesh {dict(degrees)}: {axis}={n!r} is not a positive integer; use e.g. {axis}=2"
            )


@dataclass(frozen=True)
class Mesh:
    """The named axes over the world; ``device_mesh`` is ``None`` when every axis has size 1.

    ``shape`` holds the world's factors (``dp``, ``cp``, ``tp``); ``ep`` is the expert-parallel
    degree carved out of ``dp * cp`` (1 when there is none).
    """

    shape: tuple[tuple[str, int], ...]
    world: int
    device_mesh: DeviceMesh | None = field(default=None, compare=False)
    ep: int = 1
    _groups: dict[tuple[str, ...], Group] = field(default_factory=dict, compare=False, repr=False)
    _expert: list[DeviceMesh] = field(default_factory=list, compare=False, repr=False)
    _edp: list[DeviceMesh] = field(default_factory=list, compare=False, repr=False)
    control: Any = field(default=None, compare=False, repr=False)
    """A gloo group over the world for arrival checks (:func:`check_arrival`); None at world 1."""

    def degree(self, axis: str) -> int:
        """Size of ``axis`` (1 for an axis not in the mesh)."""
        return self.ep if axis == "ep" else dict(self.shape).get(axis, 1)

    def group(self, axis: str) -> Group:
        """This rank's group along ``axis``; :meth:`Group.solo` for an axis of size 1."""
        if axis not in AXES:
            raise ShardingError(f"hp_lazy mesh: axis {axis!r} is unknown; use one of {AXES}")
        if self.degree(axis) == 1 or self.device_mesh is None:
            return Group.solo(axis)
        if axis == "ep":
            return self._enumerated(("ep",), self._ep_runs())
        pg = self.device_mesh.get_group(axis)
        return Group(axis=axis, pg=pg, size=self.degree(axis), rank=self.device_mesh.get_local_rank(axis))

    def group_of(self, axes: tuple[str, ...], *, dedicated: bool = False) -> Group:
        """This rank's group spanning the world axes ``axes`` together (ranks in mesh order).

        ``dedicated``: a process group of its own (the gradient owner's all-reduces run
        asynchronously during backward and must not queue behind, or between, the forward and
        backward collectives of the same ranks). Building one is a collective the first time:
        every rank must ask for the same ``axes`` in the same order.
        """
        if axes == (EDP,):
            if self.device_mesh is None or self.ep == 1 or len(self._edp_runs()[0]) == 1:
                return Group.solo(EDP)
            return self._enumerated((EDP, "dedicated") if dedicated else (EDP,), self._edp_runs(),
                                    reuse_world=not dedicated)
        if axes == (EDP_TP,):
            if self.degree("tp") == 1:
                return self.group_of((EDP,), dedicated=dedicated)
            if self.device_mesh is None or self.ep == 1:
                return Group.solo(EDP_TP)
            return self._enumerated((EDP_TP, "dedicated") if dedicated else (EDP_TP,), self._edp_tp_runs(),
                                    reuse_world=not dedicated)
        used = tuple(a for a in WORLD_AXES if a in axes and self.degree(a) > 1)
        unknown = [a for a in axes if a not in WORLD_AXES]
        if unknown:
            raise ShardingError(
                f"hp_lazy mesh: group_of{axes}: {unknown} do not factor the world; use axes from {WORLD_AXES}"
            )
        if not used:
            return Group.solo("+".join(axes) or "none")
        if len(used) == 1 and not dedicated:
            return self.group(used[0])
        key = (*used, "dedicated") if dedicated else used
        return self._enumerated(key, self._runs(used), reuse_world=not dedicated)

    def expert_mesh(self) -> DeviceMesh:
        """The token ranks regrouped as ``(edp, ep)`` — ``ep`` the ep groups of :meth:`group`,
        ``edp`` the ranks at the same position of theirs (the same expert slice) — times ``tp``, as a
        torch ``DeviceMesh`` (dims of size 1 left out): where checkpoints see expert slices. Built
        once (a collective the first time)."""
        if self._expert:
            return self._expert[0]
        from torch.distributed.device_mesh import DeviceMesh

        assert self.device_mesh is not None and self.ep > 1, "an expert mesh needs ep > 1"
        names = [a for a, _ in self.shape]
        tokens = [i for i, name in enumerate(names) if name in ("dp", "cp")]
        rest = [i for i in range(len(names)) if i not in tokens]
        ranks = self.device_mesh.mesh.permute(*tokens, *rest).reshape(-1, self.ep, self.degree("tp"))
        sizes = {EDP: int(ranks.shape[0]), "ep": self.ep, "tp": self.degree("tp")}
        kept = [name for name, size in sizes.items() if size > 1]
        groups = [(self.group_of((EDP,)) if name == EDP else self.group(name)).pg for name in kept]
        assert all(pg is not None for pg in groups), "every kept dim has more than one rank"
        self._expert.append(DeviceMesh.from_group(
            groups if len(groups) > 1 else groups[0], self.device_mesh.device_type,  # type: ignore[arg-type]
            mesh=ranks.reshape(tuple(sizes[name] for name in kept)), mesh_dim_names=tuple(kept),
        ))
        return self._expert[0]

    def edp_mesh(self) -> DeviceMesh:
        """This rank's expert-data-parallel ranks (those holding its expert slice) as a 1-D torch
        ``DeviceMesh`` named ``edp`` — one rank where ``ep = dp * cp``: the mesh FSDP2 shards the
        experts over under expert parallel (``fully_shard(experts, mesh=hp_lazy.mesh().edp_mesh())``
        with FSDP2's divide factor left unset: hp_lazy scales its average, :mod:`hp_lazy.runtime.grads`).
        Built once (a collective the first time: every rank calls it)."""
        if self._edp:
            return self._edp[0]
        from torch.distributed.device_mesh import DeviceMesh

        if self.device_mesh is None or self.ep == 1:
            raise ShardingError(
                f"hp_lazy mesh: edp_mesh() needs expert parallel (ep={self.ep}); activate with ep > 1"
            )
        group = self.group_of((EDP,))
        pg = group.pg
        if pg is None:  # one rank per expert slice: a mesh of this rank alone
            pg, _ = dist.new_subgroups(group_size=1)  # a collective over the world
        ranks = sorted(dist.get_process_group_ranks(pg))
        self._edp.append(DeviceMesh.from_group(
            pg, self.device_mesh.device_type, mesh=torch.tensor(ranks), mesh_dim_names=(EDP,)
        ))
        return self._edp[0]

    def _runs(self, axes: tuple[str, ...]) -> list[list[int]]:
        assert self.device_mesh is not None
        names = [a for a, _ in self.shape]
        ranks = self.device_mesh.mesh
        keep = [names.index(a) for a in axes]
        rest = [i for i in range(len(names)) if i not in keep]
        return ranks.permute(*rest, *keep).reshape(-1, math.prod(self.degree(a) for a in axes)).tolist()

    def _ep_runs(self) -> list[list[int]]:
        token_axes = tuple(a for a in ("dp", "cp") if self.degree(a) > 1)
        runs = self._runs(token_axes) if len(token_axes) > 1 else self._axis_runs(token_axes[0])
        return [run[i : i + self.ep] for run in runs for i in range(0, len(run), self.ep)]

    def _edp_runs(self) -> list[list[int]]:
        """Per tp rank, the token ranks at the same position of their ep run (same expert slice)."""
        token_axes = tuple(a for a in ("dp", "cp") if self.degree(a) > 1)
        runs = self._runs(token_axes) if len(token_axes) > 1 else self._axis_runs(token_axes[0])
        return [run[j :: self.ep] for run in runs for j in range(self.ep)]

    def _edp_tp_runs(self) -> list[list[int]]:
        """The ranks holding the same expert slice when the experts are whole on tp: the edp ranks
        of every tp rank (:func:`hp_lazy.runtime.ep.dispatch.split_tokens`)."""
        token_axes = tuple(a for a in ("dp", "cp") if self.degree(a) > 1)
        tp = self.degree("tp")
        return [[rank for f, rank in enumerate(run) if (f // tp) % self.ep == j]
                for run in self._runs((*token_axes, "tp")) for j in range(self.ep)]

    def _axis_runs(self, axis: str) -> list[list[int]]:
        return self._runs((axis,)) if self.device_mesh is not None else []

    def _enumerated(self, axes: tuple[str, ...], runs: list[list[int]], reuse_world: bool = True) -> Group:
        found = self._groups.get(axes)
        if found is not None:
            return found
        me = dist.get_rank()
        if reuse_world and len(runs) == 1 and len(runs[0]) == self.world:
            pg = dist.group.WORLD
        else:
            pg, _ = dist.new_subgroups_by_enumeration(runs, timeout=pg_timeout())
        mine = next(run for run in runs if me in run)
        name = "+".join(a for a in axes if a != "dedicated")
        group = Group(axis=name, pg=pg, size=len(mine), rank=mine.index(me))
        self._groups[axes] = group
        return group


def get_mesh(degrees: Mapping[str, int]) -> Mesh:
    """The mesh for ``degrees`` (e.g. ``{"tp": 2}``) over the world, built once per degrees.

    Initialises the default process group from the env when the degrees need more than one
    process (see :func:`ensure_process_group`). Every rank must call it with the same degrees.
    """
    _check_degrees(degrees)
    wanted = math.prod(int(n) for a, n in degrees.items() if a != "ep")
    world = ensure_process_group(wanted)
    key = (*sorted((a, int(n)) for a, n in degrees.items()), ("world", world))
    mesh = _MESHES.get(key)
    if mesh is None:
        shape = mesh_shape(degrees, world)
        if shape:
            await_world("/".join(f"{a}{n}" for a, n in key))
        mesh = _build(shape, world, int(degrees.get("ep", 1)))
        _MESHES[key] = mesh
    return mesh


def await_world(key: str) -> None:
    """Before the first collective of a new mesh (every rank creates its groups together): each rank
    marks its arrival in the default store and waits up to :func:`pg_timeout` for the others; a rank
    that never comes (it failed, or only some ranks build the model) is named in hp_lazy's error
    instead of torch's ``DistStoreError``, which names none. Setting a rank's key is idempotent, so
    a rank that retries after an error arrives again."""
    store = _default_store()
    if store is None:
        return
    world, rank = dist.get_world_size(), dist.get_rank()
    keys = [f"hp_lazy/arrive/{key}/{r}" for r in range(world)]
    store.set(keys[rank], "1")
    limit = pg_timeout()
    try:
        store.wait(keys, limit)
    except Exception as exc:  # torch raises DistStoreError (a RuntimeError) on timeout
        missing = [r for r, k in enumerate(keys) if not store.check([k])]
        raise ShardingError(
            f"hp_lazy mesh {key}: rank {rank} came to build the mesh (the first model bound under this plan), but "
            f"rank(s) {missing} of {world} did not within {limit.total_seconds():g} s ({type(exc).__name__}); "
            "every rank must build the model (from_pretrained / hp_lazy.parallelize) — look for an exception on "
            f"those ranks or a branch that builds it on some ranks only (or raise {TIMEOUT_ENV} if they are only slow)"
        ) from exc


def _default_store() -> Any:
    try:
        return dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return None


def _build(shape: tuple[tuple[str, int], ...], world: int, ep: int) -> Mesh:
    """One process group per axis, with :func:`pg_timeout` (``init_device_mesh`` would give its
    groups torch's 30-minute default), wrapped as a named torch ``DeviceMesh``."""
    if not shape:
        return Mesh(shape=shape, world=world, ep=ep)
    from torch.distributed.device_mesh import DeviceMesh

    ranks = torch.arange(world).reshape(tuple(n for _, n in shape))
    groups = []
    for dim, (_, n) in enumerate(shape):
        runs = ranks.movedim(dim, -1).reshape(-1, n).tolist()
        pg, _ = dist.new_subgroups_by_enumeration(runs, timeout=pg_timeout())
        groups.append(pg)
    device_type = "cuda" if "nccl" in str(dist.get_backend()) else "cpu"
    device_mesh = DeviceMesh.from_group(
        groups if len(groups) > 1 else groups[0], device_type, mesh=ranks, mesh_dim_names=tuple(a for a, _ in shape)
    )
    control = dist.new_group(backend="gloo", timeout=pg_timeout())
    return Mesh(shape=shape, world=world, device_mesh=device_mesh, ep=ep, control=control)


def arrival_timeout() -> timedelta:
    """How long :func:`check_arrival` waits for the other ranks: ``HP_LAZY_ARRIVAL_TIMEOUT_S`` (30) seconds."""
    return _seconds(ARRIVAL_ENV, DEFAULT_ARRIVAL_S)


def check_arrival(mesh: Mesh, what: str, fix: str) -> None:
    """Before a collective that user code may call on some ranks only (``if rank == 0: ...``):
    every rank of the world arrives within :func:`arrival_timeout`, or this rank raises, naming
    ``what`` was entered and ``fix``, instead of waiting for the process-group timeout."""
    if mesh.control is None:
        return
    limit = arrival_timeout()
    try:
        dist.monitored_barrier(group=mesh.control, timeout=limit, wait_all_ranks=True)
    except RuntimeError as exc:
        detail = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
        raise ShardingError(
            f"hp_lazy: rank {dist.get_rank()} entered {what}, but not every rank of the world did within "
            f"{limit.total_seconds():g} s ({detail}); it is a collective over every rank: {fix} "
            f"(or raise {ARRIVAL_ENV} if the other ranks are only slow)"
        ) from exc
