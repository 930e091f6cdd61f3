"""Layouts as DTensors, at the state-dict boundary only.

A bound model computes on plain local shards; torch's checkpointing (``torch.distributed.checkpoint``,
``get_state_dict``/``set_state_dict``) and transformers' saving understand sharding only through
DTensors. :class:`Presentation` turns a shard and its layout (:mod:`hp_lazy.runtime.layout`) into a
DTensor that aliases the shard's storage (so ``dcp.load`` into it writes the parameter itself), and
turns what a caller hands back into this rank's shard. Layouts, on the mesh's ``tp`` dim::

    S(d)                   Shard(d)
    SS(d,k)  (packed)      _StridedShard(d, split_factor=k); DCP sees the k blocks as k chunks
    S(d), kept on m ranks  Shard(d) on a tp sub-mesh of n/m pieces x m copies (K/V heads)

Every other mesh dim is ``Replicate``. Expert slices (cut on ``ep``, which is carved out of the
token ranks ``dp * cp`` and is no dim of the world's mesh) are presented on an expert mesh
``(edp, ep, tp)``: the token ranks regrouped into runs of ``ep`` (the ep groups) and their
positions (the ranks holding the same slice), with tp as it is; an expert weight cut ``S(0)`` on
ep and ``SS(-2,2)`` on tp is ``[Replicate, Shard(0), _StridedShard(-2, 2)]`` there, and DCP sees
one chunk per (expert slice, packed block). Under FSDP2 over dp (``fully_shard(...,
mesh=device_mesh["dp"])``), FSDP2 holds each shard as a DTensor over dp chunking the shard's dim ``k``;
that is presented as the full tensor with ``Shard(k)`` on dp beside the cut (``_StridedShard(k,
pieces)`` where the cut is on ``k`` too), DCP told the exact blocks; an expert slice FSDP2 shards
over its edp ranks (``fully_shard(experts, mesh=hp_lazy.mesh().edp_mesh())``) likewise, with
``Shard(k)`` on the expert mesh's edp dim. Refused, naming the tensor: two
axes cutting one dim, a packed piece kept on several ranks, an optimizer state that is not shaped like
its parameter's shard, an FSDP2 DTensor on another mesh (HSDP) or chunking a packed dim. Accepted on
load: a DTensor laid out exactly as this rank's shard, or the full tensor (sliced here); a tensor of
the shard's shape is refused (which rank's shard it is cannot be known; the old silent case).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor import Shard as DShard
from torch.distributed.tensor.placement_types import Placement as DPlacement
from torch.distributed.tensor.placement_types import _StridedShard

from hp_lazy.errors import ShardingError
from hp_lazy.runtime.layout import AxisShard, LayoutTable, ParamLayout
from hp_lazy.runtime.mesh import EDP, Mesh

_SUB_MESHES: dict[tuple[int, int], Any] = {}
"""(id of the root device mesh, copies) -> its tp dim split into pieces x copies (built once)."""


def _fix(what: str) -> str:
    return (
        f"save it with hp_lazy.full_state_dict(model) (full tensors) instead of {what}, or leave the "
        "parameter out of the plan"
    )


class Presentation:
    """The DTensor face of one bound model's layout table (names relative to that model)."""

    def __init__(self, table: LayoutTable, mesh: Mesh) -> None:
        if mesh.device_mesh is None:
            raise ShardingError("hp_lazy checkpoint: a sharded model without a device mesh; this is a bug")
        self.table = table
        self.mesh = mesh
        self.device_mesh = mesh.device_mesh
        self._specs: dict[str, tuple[Any, tuple[DPlacement, ...], tuple[AxisShard, ...]]] = {}
        copies = sorted({cut.replicas for fqn in table for cut in _cuts(table, fqn) if cut.replicas > 1})
        for m in copies:  # a collective the first time: every rank binds the same table
            self._sub_mesh(m)
        if any(cut.axis == "ep" for fqn in table for cut in _cuts(table, fqn)):
            self.mesh.expert_mesh()  # a collective the first time, as above

    # -- save side

    def present(self, fqn: str, local: torch.Tensor, what: str = "") -> DTensor:
        """``local`` (this rank's shard of ``fqn``, or an optimizer state shaped like it) as a DTensor;
        under FSDP2 over dp, the DTensor FSDP2 holds of that shard (:meth:`_present_over_dp`)."""
        if isinstance(local, DTensor):
            return self._present_over_dp(fqn, local, what)
        layout = self._layout(fqn)
        if tuple(local.shape) != layout.local_shape:
            raise ShardingError(
                f"{fqn}: {what or 'the tensor'} has shape {list(local.shape)}, but the parameter's shard is "
                f"{list(layout.local_shape)} ({layout.describe()} of {list(layout.full_shape)}); hp_lazy presents "
                "only tensors shaped like the shard to torch.distributed.checkpoint; " + _fix("DCP")
            )
        device_mesh, placements, cuts = self._spec(fqn)
        full = torch.Size(layout.full_shape)
        out = DTensor.from_local(
            local, device_mesh, placements, run_check=False, shape=full, stride=_contiguous_strides(full)
        )
        if any(cut.blocks > 1 for cut in cuts):
            _chunk_protocol(out, fqn, layout, cuts)
        out.__reduce_ex__ = _not_picklable(fqn)  # type: ignore[method-assign]
        return out

    def _present_over_dp(self, fqn: str, value: DTensor, what: str) -> DTensor:
        """FSDP2 over dp on top of this rank's shard: ``value`` is FSDP2's DTensor of the shard (dim
        ``k`` of the shard chunked over dp), presented as one DTensor of the full tensor: ``Shard(k)``
        on dp (``_StridedShard(k, pieces)`` where the shard's cut is on ``k`` too, which FSDP2 then
        splits again) beside the layout's own placements. DCP is told this rank's blocks directly."""
        layout = self._layout(fqn)
        name = what or "the tensor"
        axis = _fsdp_axis(layout)
        fsdp = _fsdp_cut(value, axis)
        cuts = layout.shards
        if fsdp is None or tuple(value.shape) != layout.local_shape:
            mesh = "edp_mesh()" if axis == EDP else "device_mesh['dp']"
            raise ShardingError(
                f"{fqn}: {name} is a DTensor of shape {list(value.shape)} placed {list(value.placements)} on "
                f"{value.device_mesh}; hp_lazy presents FSDP2's DTensors of its shards ({layout.describe()} of "
                f"{list(layout.full_shape)}, shaped {list(layout.local_shape)}) only as fully_shard(..., "
                f"mesh=hp_lazy.mesh().{mesh}) makes them (one Shard placement on {axis}); " + _fix("DCP")
            )
        rank = len(layout.full_shape)
        dim = fsdp.dim % rank
        if any(cut.dim % rank == dim and cut.blocks > 1 for cut in cuts):
            raise ShardingError(
                f"{fqn}: FSDP2 chunks dim {dim} of a packed shard ({layout.describe()}) over {axis}, which crosses "
                "its blocks; hp_lazy cannot present that to checkpoints; shard it on another dim (fully_shard's "
                "shard_placement_fn) or " + _fix("DCP")
            )
        device_mesh, placements, _ = self._spec(fqn)
        same = [cut for cut in cuts if cut.dim % rank == dim]  # FSDP2 splits the piece that cut made again
        on_axis = _StridedShard(dim, split_factor=same[0].pieces) if same else DShard(dim)
        names = list(device_mesh.mesh_dim_names or ())
        if axis not in names and fsdp.ranks > 1:
            raise ShardingError(f"{fqn}: FSDP2 shards it over {axis}, which the mesh {names} lacks; this is a bug")
        placements = tuple(on_axis if n == axis else p for n, p in zip(names, placements, strict=True))
        full = torch.Size(layout.full_shape)
        out = DTensor.from_local(
            value._local_tensor, device_mesh, placements, run_check=False, shape=full, stride=_contiguous_strides(full)
        )
        _chunk_protocol(out, fqn, layout, cuts, _over_dp(_blocks(layout, cuts), fsdp))
        out.__reduce_ex__ = _not_picklable(fqn)  # type: ignore[method-assign]
        return out

    # -- load side

    def accept(self, fqn: str, value: Any, what: str = "", like: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's shard of ``fqn`` from what a caller loads: our DTensor or the full tensor. ``like``
        (the live parameter or state) a DTensor of FSDP2's: the shard as FSDP2's DTensor of it."""
        if isinstance(like, DTensor):
            return self._accept_over_dp(fqn, value, what, like)
        layout = self._layout(fqn)
        name = what or "the tensor"
        if isinstance(value, DTensor):
            if tuple(value.shape) == layout.full_shape and _chunks(value) == self.chunks(fqn):
                return value.to_local()
            raise ShardingError(
                f"{fqn}: {name} is a DTensor of shape {list(value.shape)} placed {list(value.placements)} on "
                f"{value.device_mesh}, which is not this rank's shard ({layout.describe()} of "
                f"{list(layout.full_shape)}); load through torch.distributed.checkpoint (dcp.load into "
                "model.state_dict() / get_state_dict), which reshards, or pass full tensors"
            )
        if not isinstance(value, torch.Tensor):
            raise ShardingError(f"{fqn}: {name} is a {type(value).__name__}, not a tensor; pass a tensor")
        shape = tuple(value.shape)
        if shape == layout.full_shape:
            return layout.local(value)
        if shape == layout.local_shape:
            raise ShardingError(
                f"{fqn}: {name} has the shape of one rank's shard {list(shape)} ({layout.describe()} of "
                f"{list(layout.full_shape)}), and which rank's shard it is cannot be known; load the full tensor "
                "or the DTensors model.state_dict() gives (torch.distributed.checkpoint)"
            )
        raise ShardingError(
            f"{fqn}: {name} has shape {list(shape)}, but the parameter's full shape is {list(layout.full_shape)} "
            f"(this rank holds {list(layout.local_shape)}); load a checkpoint of this model"
        )

    def _accept_over_dp(self, fqn: str, value: Any, what: str, like: DTensor) -> DTensor:
        """FSDP2's DTensor (placed like ``like``) of what a caller loads: our DTensor over dp (DCP wrote
        into it) or the full tensor, cut to the shard and then to FSDP2's chunk."""
        layout = self._layout(fqn)
        fsdp = _fsdp_cut(like, _fsdp_axis(layout))
        if fsdp is None:  # present() refused this parameter's face already
            raise ShardingError(f"{fqn}: FSDP2's DTensor placed {list(like.placements)} has no face; this is a bug")
        spec = (like.device_mesh, like.placements)
        same = isinstance(value, DTensor) and (value.device_mesh, value.placements) == spec
        if same and value.shape == like.shape:
            local = value.to_local()  # FSDP2's own DTensor of the shard (a state dict taken inside local_shards)
        elif same and tuple(value.shape) == layout.full_shape:
            # torch's full-state-dict helpers (set_model_state_dict(full_state_dict=True)) distribute the full
            # tensor over the live parameter's placements, as if the shard were the whole: gathered over dp
            # here (a collective; every rank loads the same keys in order), then cut as a full tensor
            return self._accept_over_dp(fqn, value.full_tensor(), what, like)
        elif isinstance(value, DTensor):
            want = _over_dp(_blocks(layout, layout.shards), fsdp)
            if tuple(value.shape) != layout.full_shape or _chunks(value) != [(off, size) for off, size, _ in want]:
                raise ShardingError(
                    f"{fqn}: {what or 'the tensor'} is a DTensor of shape {list(value.shape)} placed "
                    f"{list(value.placements)}, which is not this rank's FSDP2 chunk of its shard ({layout.describe()} "
                    f"of {list(layout.full_shape)}); load through torch.distributed.checkpoint, which reshards, or "
                    "pass full tensors"
                )
            local = value.to_local()
        else:
            shard = self.accept(fqn, value, what)
            local = shard.narrow(fsdp.dim, fsdp.start, fsdp.size)
        return DTensor.from_local(local, like.device_mesh, like.placements, run_check=False, shape=like.shape,
                                  stride=like.stride())

    def chunks(self, fqn: str) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        """(offsets, sizes) in the full tensor of every block this rank holds."""
        layout = self._layout(fqn)
        return [(off, size) for off, size, _ in _blocks(layout, self._spec(fqn)[2])]

    # -- layouts

    def _layout(self, fqn: str) -> ParamLayout:
        layout = self.table.get(fqn)
        if layout is None:
            raise ShardingError(f"{fqn}: not a sharded parameter of this model; this is a bug")
        return layout

    def _spec(self, fqn: str) -> tuple[Any, tuple[DPlacement, ...], tuple[AxisShard, ...]]:
        found = self._specs.get(fqn)
        if found is None:
            found = self._specs[fqn] = self._build_spec(fqn)
        return found

    def _build_spec(self, fqn: str) -> tuple[Any, tuple[DPlacement, ...], tuple[AxisShard, ...]]:
        layout = self._layout(fqn)
        rank = len(layout.full_shape)
        dims = [cut.dim % rank for cut in layout.shards]
        if len(set(dims)) != len(dims):
            raise ShardingError(
                f"{fqn}: laid out {layout.describe()}; two axes cut the same dim, which hp_lazy cannot present to "
                "checkpoints; " + _fix("model.state_dict()")
            )
        if layout.on("ep") is not None:
            return self._expert_spec(fqn, layout)
        names = list(self.device_mesh.mesh_dim_names or ())
        if len(layout.shards) != 1 or layout.shards[0].axis not in names:
            raise ShardingError(
                f"{fqn}: laid out {layout.describe()}; hp_lazy presents to checkpoints only parameters cut on ep "
                f"and one axis of the device mesh {names}; " + _fix("model.state_dict()")
            )
        cut = layout.shards[0]
        if cut.blocks > 1 and cut.replicas > 1:
            raise ShardingError(
                f"{fqn}: a packed parameter ({cut.describe()}) kept on several ranks has no DTensor form; "
                + _fix("model.state_dict()")
            )
        if cut.replicas > 1:
            sub = self._sub_mesh(cut.replicas)
            sub_names = list(sub.mesh_dim_names)
            piece = sub_names.index(_piece_name(cut.replicas))
            on_sub: tuple[DPlacement, ...] = tuple(
                DShard(cut.dim) if i == piece else Replicate() for i in range(len(sub_names))
            )
            return sub, on_sub, (cut,)
        placements = tuple(_placement(cut) if name == cut.axis else Replicate() for name in names)
        return self.device_mesh, placements, (cut,)

    def _expert_spec(self, fqn: str, layout: ParamLayout) -> tuple[Any, tuple[DPlacement, ...], tuple[AxisShard, ...]]:
        if any(cut.replicas > 1 for cut in layout.shards):
            raise ShardingError(
                f"{fqn}: an expert weight laid out {layout.describe()} has a piece kept on several ranks, which "
                "hp_lazy cannot present to checkpoints; " + _fix("model.state_dict()")
            )
        mesh = self.mesh.expert_mesh()
        by_axis = {cut.axis: cut for cut in layout.shards}
        placements = tuple(_placement(by_axis[name]) if name in by_axis else Replicate()
                           for name in mesh.mesh_dim_names or ())
        return mesh, placements, layout.shards

    def _sub_mesh(self, copies: int) -> Any:
        key = (id(self.device_mesh), copies)
        found = _SUB_MESHES.get(key)
        if found is None:
            names = list(self.device_mesh.mesh_dim_names or ())
            n = self.mesh.degree("tp")
            found = self.device_mesh._unflatten(
                names.index("tp"), (n // copies, copies), (_piece_name(copies), f"tp_copy{copies}")
            )
            _SUB_MESHES[key] = found
        return found


def _piece_name(copies: int) -> str:
    return f"tp_piece{copies}"


def _cuts(table: LayoutTable, fqn: str) -> tuple[AxisShard, ...]:
    layout = table.get(fqn)
    return layout.shards if layout is not None else ()


def _contiguous_strides(shape: torch.Size) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return tuple(reversed(strides))


def _placement(cut: AxisShard) -> DPlacement:
    return _StridedShard(cut.dim, split_factor=cut.blocks) if cut.blocks > 1 else DShard(cut.dim)


def _blocks(
    layout: ParamLayout, cuts: tuple[AxisShard, ...]
) -> list[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]:
    """(offsets and sizes in the full tensor, start in the local tensor) of each contiguous block
    this rank holds: every combination of each cut's blocks (the cuts are on different dims)."""
    full = layout.full_shape
    out: list[tuple[list[int], list[int], list[int]]] = [([0] * len(full), list(layout.local_shape), [0] * len(full))]
    for cut in cuts:
        dim = cut.dim % len(full)
        block = full[dim] // cut.blocks
        piece = block // cut.pieces
        grown = []
        for offsets, sizes, starts in out:
            for b in range(cut.blocks):
                o, z, st = list(offsets), list(sizes), list(starts)
                o[dim], z[dim], st[dim] = b * block + cut.piece * piece, piece, b * piece
                grown.append((o, z, st))
        out = grown
    return [(tuple(o), tuple(z), tuple(st)) for o, z, st in out]


def _narrowed(local: torch.Tensor, starts: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
    for dim, (start, size) in enumerate(zip(starts, sizes, strict=True)):
        if size != local.shape[dim]:
            local = local.narrow(dim, start, size)
    return local


def _chunks(value: DTensor) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    return [(tuple(c.offsets), tuple(c.sizes)) for c in value.__create_chunk_list__()]


def _not_picklable(fqn: str) -> Callable[..., Any]:
    """``torch.save`` (pickle) of a presented shard: its device mesh names process groups that no
    other process has, so it would load nowhere ("Could not resolve the process group")."""

    def refuse(protocol: Any = None) -> Any:
        raise ShardingError(
            f"{fqn}: torch.save of an hp_lazy model's state_dict() would pickle this rank's shard as a DTensor "
            "over this job's process groups, which no other process can load; save with "
            "model.save_pretrained(d) on every rank (rank 0 writes full tensors), or torch.save("
            "hp_lazy.full_state_dict(model)) (a collective: call full_state_dict on every rank, save on one), or "
            "torch.distributed.checkpoint.save(model.state_dict(), ...) for a resharding checkpoint"
        )

    return refuse


@dataclass(frozen=True)
class _FsdpCut:
    """FSDP2's chunk of this rank's shard: ``size`` elements of dim ``dim`` from ``start``, one of
    ``ranks`` chunks."""

    dim: int
    start: int
    size: int
    ranks: int


def _fsdp_axis(layout: ParamLayout) -> str:
    """The axis FSDP2 shards a parameter over: an expert slice's edp ranks, anything else's dp."""
    return EDP if layout.on("ep") is not None else "dp"


def _fsdp_cut(value: DTensor, axis: str) -> _FsdpCut | None:
    """Where FSDP2's DTensor ``value`` (of this rank's shard) keeps its local part: one ``Shard(k)``
    on a 1-D mesh named ``axis`` (hp_lazy's dp, or an expert slice's edp mesh; torch.chunk's sizes:
    the last ranks' chunks may be short or empty), else ``None``."""
    if value.device_mesh.mesh_dim_names != (axis,) or len(value.placements) != 1:
        return None
    placement = value.placements[0]
    if type(placement) is not DShard:
        return None
    ranks, index = value.device_mesh.size(0), value.device_mesh.get_local_rank(0)
    dim = placement.dim % value.dim()
    step = -(-value.shape[dim] // ranks)
    start = min(index * step, value.shape[dim])
    return _FsdpCut(dim, start, min(step, value.shape[dim] - start), ranks)


def _over_dp(
    blocks: list[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]], fsdp: _FsdpCut
) -> list[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]:
    """The shard's ``blocks`` (offsets and sizes in the full tensor, start in the shard) cut to FSDP2's
    chunk of the shard: the parts inside it, their starts now in the chunk."""
    d, lo, hi = fsdp.dim, fsdp.start, fsdp.start + fsdp.size
    out = []
    for off, size, start in blocks:
        a, b = max(start[d], lo), min(start[d] + size[d], hi)
        if a < b:
            o, z, st = list(off), list(size), list(start)
            o[d], z[d], st[d] = off[d] + a - start[d], b - a, a - lo
            out.append((tuple(o), tuple(z), tuple(st)))
    return out


def _chunk_protocol(out: DTensor, fqn: str, layout: ParamLayout, cuts: tuple[AxisShard, ...],
                    blocks: list[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]] | None = None) -> None:
    """DCP's view of a packed shard: one chunk per block (torch's own DCP code describes a
    ``_StridedShard`` as one contiguous chunk, which would overlap and misplace the blocks), or
    of ``blocks`` (FSDP2's chunk of a shard)."""
    blocks = _blocks(layout, cuts) if blocks is None else blocks
    local = out._local_tensor
    views = {off: _narrowed(local, start, size) for off, size, start in blocks}

    def chunk_list() -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=torch.Size(off), sizes=torch.Size(size)) for off, size, _ in blocks]

    def write_items(key: str, _obj: object) -> list[WriteItem]:
        from torch.distributed.checkpoint.metadata import TensorProperties

        props = TensorProperties.create_from_tensor(local)
        return [
            WriteItem(
                index=MetadataIndex(key, torch.Size(off)),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=torch.Size(off), sizes=torch.Size(size)),
                    properties=props,
                    size=torch.Size(layout.full_shape),
                ),
            )
            for off, size, _ in blocks
        ]

    def tensor_shard(index: MetadataIndex) -> torch.Tensor:
        found = views.get(tuple(index.offset or ()))
        if found is None:
            raise ShardingError(f"{fqn}: no block of this rank's packed shard starts at {index.offset}; this is a bug")
        return found

    hooks: dict[str, Callable[..., Any]] = {
        "__create_chunk_list__": chunk_list,
        "__create_write_items__": write_items,
        "__get_tensor_shard__": tensor_shard,
    }
    for name, fn in hooks.items():
        setattr(out, name, fn)
