"""The gradient owner: the one place that decides, for every parameter, which ranks' gradient
contributions are summed, what the sum is divided by, and when.

Rules, per parameter (a :class:`GradRule`; the styles say which parameters are partial sums):

- a partial sum over an axis (Qwen3's q/k norms between a colwise and a rowwise Linear: each tp
  rank normalises its own heads; norms and biases on sequence-sharded activations): summed over
  that axis;
- a shard held by several ranks of an axis (a K/V head kept on ``tp / kv`` ranks): summed over
  those ranks only, by stacking it into its piece's slot of a zero stack, so one all-reduce over
  the whole axis sums every piece at once;
- with data parallel ranks (``dp > 1``) and ``data_parallel=True`` (the default): every parameter
  is also averaged over dp, DDP's convention, so after ``loss.backward()`` on each data rank's own
  part of the batch every gradient equals one process's gradient of the mean loss over the
  concatenated global batch. A partial sum over tp and the dp average are one all-reduce over the
  ``dp x tp`` ranks, divided by dp.
- an expert shard under expert parallel (the ep style marks it partial over ``"edp"``): its local
  gradient already sums the contributions of every token of its ep group (the all-to-all's
  backward brought them), so it is summed over the expert-data-parallel ranks only (those
  holding the same slice, ``dp * cp / ep``) and divided by dp like every dense gradient, which
  makes it one process's gradient over the concatenated global batch; where the experts are whole
  on tp and each tp rank dispatched its own share of the tokens, over the edp ranks of every tp
  rank (``"edp+tp"``). With FSDP2 owning dp (``data_parallel=False``) the experts module is
  sharded over its edp ranks (``fully_shard(experts, mesh=hp_lazy.mesh().edp_mesh())``, FSDP2's
  default divisor): FSDP2 averages the slice over them, and hp_lazy scales the gradient by
  ``edp / dp`` in the hook before (and sums it over tp for ``"edp+tp"``), which makes the same sum
  divided by dp. The check before each forward refuses an experts module FSDP2 shards over other
  ranks, with a divide factor of its own, or together with dense parameters, and torch DDP, which
  would average the expert slices over every dp rank.

When (:class:`BucketReducer`, hp_lazy owns every reduction): parameters are grouped into buckets
per (group, dtype, device), in reverse registration order (about the order backward produces
them), capped at ``bucket_cap_mb``. When a bucket's last gradient is accumulated its all-reduce
starts (asynchronously, during backward; buckets start in one fixed order on every rank); the
end-of-backward callback starts the rest, waits, and writes the results back. What is reduced is
the gradient accumulated since the last reduction: under :func:`no_sync` nothing is sent and the
next synchronised backward reduces the sum of the micro-batches (DDP's ``no_sync``); a ``.grad``
that existed before (accumulation without ``no_sync``, or no ``zero_grad``) is kept and the
reduced contribution added to it. Each bucket carries one extra element per parameter, set to 1
by a rank that produced a gradient: a parameter no rank used keeps ``grad = None`` (as in one
process), one used by another rank only gets the reduced gradient (zeros included) rather than
``None``.

With ``data_parallel=False`` (torch DDP or FSDP2 own dp) only the partial sums are done, by
:class:`EagerSums`, inside the gradient hook, before autograd accumulates the gradient, so DDP's
reducer and FSDP2's reduce-scatter see the summed value; the hook is (re)attached to whatever
tensor the owning module holds when it runs (FSDP2 swaps the Parameter objects).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from hp_lazy.errors import ShardingError
from hp_lazy.runtime import record
from hp_lazy.runtime.comm import wire
from hp_lazy.runtime.mesh import EDP, EDP_TP, Group, Mesh

__all__ = ["GradOwner", "GradRule", "no_sync"]


@dataclass(frozen=True, kw_only=True)
class GradRule:
    """Sum the gradient over the ranks of ``axes`` (world axes), then divide by ``average``;
    with ``slots > 1`` only ranks holding the same piece (``slot``) are summed. ``scale``: a
    factor applied last (an expert slice under FSDP2, which averages it over its edp ranks:
    ``edp / dp`` makes that one process's gradient; with ``data_parallel=False`` only)."""

    axes: tuple[str, ...]
    average: int = 1
    slots: int = 1
    slot: int = 0
    scale: float = 1.0

    def describe(self) -> str:
        held = f" (piece {self.slot} of {self.slots})" if self.slots > 1 else ""
        mean = f", / {self.average}" if self.average > 1 else ""
        scaled = f", x {self.scale:g}" if self.scale != 1.0 else ""
        return f"sum over {'x'.join(self.axes) or 'nothing'}{held}{mean}{scaled}"


def owner_of(root: nn.Module) -> GradOwner | None:
    found = record.of(root)
    return found.grads if found is not None else None


@contextlib.contextmanager
def no_sync(model: nn.Module) -> Iterator[None]:
    """Accumulate gradients locally inside the block (micro-batches): the first backward after it
    reduces everything accumulated, like DDP's ``no_sync``."""
    owners = [o for m in model.modules() if (o := owner_of(m)) is not None]
    for owner in owners:
        owner.sync = False
    try:
        yield
    finally:
        for owner in owners:
            owner.sync = True


@dataclass(eq=False)
class _Entry:
    fqn: str
    param: nn.Parameter
    rule: GradRule
    offset: int = 0
    flag: int = 0  # index of its used-flag in the bucket
    base: torch.Tensor | None = None  # copy of a .grad that existed before this window
    in_window: bool = False  # this rank accumulated a contribution since the last reduction
    ready: bool = False  # ... and it is in the bucket's buffer

    @property
    def numel(self) -> int:
        return self.param.numel()

    def contribution(self) -> torch.Tensor:
        grad = self.param.grad
        assert grad is not None, self.fqn
        return grad if self.base is None else grad - self.base


class _Bucket:
    """Parameters reduced in one all-reduce: ``[slots*numel for each] + [one flag each]``.

    The buffer is allocated once and reused: a pass overwrites the slices of the gradients it
    produced, zeroes the others' when it launches, and the flags are cleared after write-back.
    """

    def __init__(self, entries: list[_Entry], group: Group) -> None:
        self.entries, self.group = entries, group
        self.average = entries[0].rule.average  # one rule's axes per bucket, so one divisor
        offset = 0
        for entry in entries:
            entry.offset = offset
            offset += entry.rule.slots * entry.numel
        for i, entry in enumerate(entries):
            entry.flag = offset + i
        self.grads_numel = offset
        first = entries[0].param
        self.buffer = torch.zeros(offset + len(entries), dtype=first.dtype, device=first.device)
        self.pending: wire.Pending | None = None
        self.waiting = len(entries)

    def _region(self, entry: _Entry) -> torch.Tensor:
        return self.buffer[entry.offset : entry.offset + entry.rule.slots * entry.numel]

    def fill(self, entry: _Entry) -> None:
        grad, rule = entry.contribution(), entry.rule
        if grad.dtype != self.buffer.dtype or grad.device != self.buffer.device:  # model.to(...) after binding
            self.buffer = grad.new_zeros(self.buffer.numel())
        region = self._region(entry)
        if rule.slots > 1:
            region.zero_()
        region[rule.slot * entry.numel : (rule.slot + 1) * entry.numel].copy_(grad.reshape(-1))
        self.buffer[entry.flag] = 1
        entry.ready = True
        self.waiting -= 1

    def launch(self) -> None:
        for entry in self.entries:
            if entry.ready:
                continue
            if entry.in_window and entry.param.grad is not None:  # accumulated under no_sync only
                self.fill(entry)
            else:  # this rank produced no gradient for it: it sends zeros
                self._region(entry).zero_()
        self.pending = wire.all_reduce_async(self.buffer, self.group)

    def write_back(self) -> None:
        assert self.pending is not None
        summed = self.pending.wait()
        if self.average > 1:
            summed[: self.grads_numel].div_(self.average)
        for entry in self.entries:
            _write(entry, summed)
        summed[self.grads_numel :].zero_()
        self.pending, self.waiting = None, len(self.entries)


def _write(entry: _Entry, summed: torch.Tensor) -> None:
    rule, param, size = entry.rule, entry.param, entry.numel
    start = entry.offset + rule.slot * size
    part = summed[start : start + size].view_as(param)
    if entry.ready:  # grad = what was there before + the reduced contribution
        assert param.grad is not None
        param.grad.copy_(part if entry.base is None else entry.base.add_(part))
    elif param.grad is not None:  # unused on this rank: keep what was there
        param.grad.add_(part)
    elif summed[entry.flag] > 0:  # another rank used it: one process would have a gradient
        param.grad = part.clone()
    entry.base, entry.in_window, entry.ready = None, False, False


class BucketReducer:
    """hp_lazy owns every reduction (see the module docstring): bucketed, launched in backward."""

    def __init__(self, entries: list[_Entry], groups: Callable[[tuple[str, ...]], Group], cap_bytes: int) -> None:
        self.buckets = _bucketize(entries, groups, cap_bytes)
        self.sync = True
        self._armed = False
        self._next = 0
        self.handles: list[Any] = []
        for bucket in self.buckets:
            for entry in bucket.entries:
                self.handles.append(entry.param.register_hook(self._pre(entry)))
                self.handles.append(entry.param.register_post_accumulate_grad_hook(self._post(entry, bucket)))

    def _pre(self, entry: _Entry) -> Callable[[torch.Tensor], torch.Tensor]:
        def hook(grad: torch.Tensor) -> torch.Tensor:
            if not entry.in_window:  # first contribution since the last reduction
                entry.in_window = True
                grad_now = entry.param.grad
                entry.base = None if grad_now is None else grad_now.detach().clone()
            if self.sync and not self._armed:
                self._armed = True
                torch.autograd.Variable._execution_engine.queue_callback(self._finish)
            return grad

        return hook

    def _post(self, entry: _Entry, bucket: _Bucket) -> Callable[[nn.Parameter], None]:
        def hook(param: nn.Parameter) -> None:
            # no .grad: an autograd.Function returned None for it (no gradient; it sends zeros at launch)
            if self.sync and not entry.ready and param.grad is not None:
                bucket.fill(entry)
                self._launch_ready()

        return hook

    def _launch_ready(self) -> None:
        while self._next < len(self.buckets) and self.buckets[self._next].waiting == 0:
            self.buckets[self._next].launch()
            self._next += 1

    def _finish(self) -> None:
        """End of a synchronised backward: start what is left (in order), wait, write back."""
        for bucket in self.buckets[self._next :]:
            bucket.launch()
        for bucket in self.buckets:
            bucket.write_back()
        self._armed, self._next = False, 0

    @property
    def launches_per_step(self) -> int:
        return len(self.buckets)

    def unreduced(self) -> list[str]:
        """Parameters holding a contribution not reduced yet (accumulated under ``no_sync``)."""
        return [entry.fqn for bucket in self.buckets for entry in bucket.entries if entry.in_window]

    def check_params(self, root: nn.Module) -> None:
        """One parameter per bucket (FSDP2 may wrap only some layers): a few lookups per forward."""
        for bucket in self.buckets:
            entry = bucket.entries[0]
            if root.get_parameter(entry.fqn) is not entry.param:
                raise ShardingError(
                    f"{entry.fqn}: this parameter was replaced after hp_lazy bound the model (by FSDP2's "
                    "fully_shard?), so hp_lazy's gradient reduction would never see its gradient; with FSDP2 "
                    "activate with data_parallel=False (FSDP2 then reduces over dp, hp_lazy only sums over tp)"
                )


def _bucketize(entries: list[_Entry], groups: Callable[[tuple[str, ...]], Group], cap_bytes: int) -> list[_Bucket]:
    by_key: dict[tuple[Any, ...], list[list[_Entry]]] = {}
    sizes: dict[tuple[Any, ...], int] = {}  # bytes in the last run of each key
    for entry in reversed(entries):  # about the order backward produces gradients
        p = entry.param
        key = (entry.rule.axes, p.dtype, p.device)
        runs = by_key.setdefault(key, [[]])
        nbytes = entry.numel * entry.rule.slots * p.element_size()
        if runs[-1] and sizes[key] + nbytes > cap_bytes:
            runs.append([])
            sizes[key] = 0
        runs[-1].append(entry)
        sizes[key] = sizes.get(key, 0) + nbytes
    return [_Bucket(run, groups(key[0])) for key, runs in by_key.items() for run in runs]


class EagerSums:
    """Only the partial sums, inside the gradient hook (torch DDP or FSDP2 own dp)."""

    def __init__(self, root: nn.Module, entries: list[_Entry], groups: Callable[[tuple[str, ...]], Group]) -> None:
        self.sync = True  # DDP's or FSDP2's no_sync governs dp; partial sums always run
        self._hooked: dict[int, weakref.ref[torch.Tensor]] = {}  # id -> the tensor (ids are reused)
        self.handles: list[Any] = []
        for entry in entries:
            group = groups(entry.rule.axes)
            owner_name, _, leaf = entry.fqn.rpartition(".")
            owner = root.get_submodule(owner_name)
            self._attach(owner._parameters[leaf], entry.rule, group)
            self.handles.append(owner.register_forward_pre_hook(self._reattach(leaf, entry.rule, group)))

    def _attach(self, tensor: torch.Tensor | None, rule: GradRule, group: Group) -> None:
        if tensor is None or not tensor.requires_grad:
            return
        seen = self._hooked.get(id(tensor))
        if seen is not None and seen() is tensor:
            return
        self._hooked[id(tensor)] = weakref.ref(tensor)
        self.handles.append(tensor.register_hook(lambda grad: _summed(grad, rule, group)))

    def _reattach(self, leaf: str, rule: GradRule, group: Group) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            self._attach(module._parameters.get(leaf), rule, group)

        return hook

    launches_per_step = 0

    def unreduced(self) -> list[str]:
        return []  # the partial sums run inside every backward; dp is DDP's or FSDP2's


def _summed(grad: torch.Tensor, rule: GradRule, group: Group) -> torch.Tensor:
    if group.size == 1 and rule.slots == 1:  # nothing to sum (an expert slice's scale alone): no copy
        out = grad
    else:
        stack = grad.new_zeros((rule.slots, grad.numel()))
        stack[rule.slot] = grad.reshape(-1)
        wire.all_reduce_(stack, group)
        out = stack[rule.slot].view_as(grad)
    out = out / rule.average if rule.average > 1 else out
    return out * rule.scale if rule.scale != 1.0 else out


class GradOwner:
    """Every parameter's :class:`GradRule`, and the reducer that applies them."""

    def __init__(
        self,
        root: nn.Module,
        rules: Mapping[str, GradRule],
        mesh: Mesh,
        *,
        data_parallel: bool,
        bucket_cap_mb: float = 25.0,
        experts: frozenset[str] = frozenset(),
    ) -> None:
        self.rules = dict(rules)
        self.mesh = mesh
        self.data_parallel = data_parallel
        self.experts = experts  # the expert slices' FQNs (FSDP2 owning dp must shard them over edp)
        self._fsdp_checked: list[weakref.ref[nn.Module]] = []  # the FSDP2 modules last found in order
        params = dict(root.named_parameters())
        entries = [_Entry(fqn=fqn, param=params[fqn], rule=rule) for fqn, rule in self.rules.items()]
        self.owns_dp = data_parallel and mesh.degree("dp") > 1
        if data_parallel:
            cap = int(bucket_cap_mb * 2**20)
            self.reducer: BucketReducer | EagerSums = BucketReducer(entries, _dedicated(mesh), cap)
        else:
            self.reducer = EagerSums(root, entries, mesh.group_of)

    @property
    def sync(self) -> bool:
        return self.reducer.sync

    @sync.setter
    def sync(self, value: bool) -> None:
        self.reducer.sync = value

    @property
    def all_reduces_per_step(self) -> int:
        """All-reduces of one synchronised backward (the buckets; 0 for the eager sums' count,
        which is one per partial parameter)."""
        return self.reducer.launches_per_step

    def describe(self) -> str:
        return "\n".join(f"{fqn}: {rule.describe()}" for fqn, rule in self.rules.items())

    def close(self) -> None:
        """Remove every hook (the model changed and gets a new owner)."""
        for handle in self.reducer.handles:
            handle.remove()
        self.reducer.handles.clear()

    def unreduced(self) -> list[str]:
        """FQNs whose gradient holds contributions not reduced yet (``no_sync`` accumulation)."""
        return self.reducer.unreduced()

    def check(self, root: nn.Module) -> None:
        """Before a forward: nobody else reduces what this owner reduces (run by the root prologue).

        hp_lazy averaging over dp and torch DDP doing it too would average twice and race; FSDP2
        replaces the Parameter objects, so the owner's hooks (partial sums included) would never
        run and gradients would be silently wrong.
        """
        if self.owns_dp and DistributedDataParallel._get_active_ddp_module() is not None:
            raise ShardingError(
                "hp_lazy: this model runs inside torch DistributedDataParallel, but hp_lazy already averages "
                "gradients over the dp ranks (activate(..., data_parallel=True), the default); either drop the "
                "DDP wrapper or activate with data_parallel=False and give DDP hp_lazy.mesh().group('dp').pg"
            )
        if not self.owns_dp and dist.is_initialized():
            self._check_wrapper_groups(root)
        if isinstance(self.reducer, BucketReducer):
            self.reducer.check_params(root)

    def _check_wrapper_groups(self, root: nn.Module) -> None:
        """torch DDP or FSDP2 owning dp must reduce over the dp ranks alone: over the default group
        DDP broadcasts rank 0's shards to its tp peers and averages different shards together."""
        dp = _ranks(self.mesh.group("dp"))
        ddp = DistributedDataParallel._get_active_ddp_module()
        if ddp is not None and self.experts:
            raise ShardingError(
                f"hp_lazy: this model runs inside torch DistributedDataParallel, which averages every gradient over "
                f"the dp ranks {_pg_ranks(ddp.process_group)}, but under expert parallel (ep={self.mesh.ep}) each "
                f"expert slice ({sorted(self.experts)[0]}, ...) is held only by its expert-data-parallel ranks; drop "
                "DDP (data_parallel=True: hp_lazy reduces every gradient) or use FSDP2 with the experts over "
                "hp_lazy.mesh().edp_mesh()"
            )
        if ddp is not None and _pg_ranks(ddp.process_group) != dp:
            raise ShardingError(
                f"hp_lazy: this model runs inside torch DistributedDataParallel over ranks "
                f"{_pg_ranks(ddp.process_group)}, but its parameters are shards that only the data-parallel "
                f"ranks {dp} hold alike (DDP broadcast rank 0's shards to the others when it was built); "
                "wrap it as DistributedDataParallel(model, process_group=hp_lazy.mesh().group('dp').pg)"
            )
        from torch.distributed.fsdp import FSDPModule  # imported by then (accelerate, transformers)

        found: list[tuple[str, nn.Module]] = []
        for name, module in root.named_modules():
            sharded = isinstance(module, FSDPModule)  # a type test per module, no attribute lookups: every forward
            if sharded:
                found.append((name, module))
        if len(found) == len(self._fsdp_checked) and all(
            ref() is module for ref, (_, module) in zip(self._fsdp_checked, found, strict=True)
        ):
            return  # the same FSDP2 modules as at the last check
        held: list[str] = []
        for name, module in found:
            mesh = _fsdp_mesh(module)
            where = name or type(root).__name__
            managed = _fsdp_managed(module, name)
            experts = [f for f in managed if f in self.experts]
            held += experts
            if experts:
                self._check_fsdp_experts(where, module, mesh, experts, managed)
            elif mesh is not None and mesh.ndim == 1 and _pg_ranks(mesh.get_group()) != dp:
                raise ShardingError(
                    f"hp_lazy: {where} is sharded by FSDP2 over ranks "
                    f"{_pg_ranks(mesh.get_group())}, but hp_lazy's shards are held alike only by the data-parallel "
                    f"ranks {dp}; pass fully_shard(module, mesh=hp_lazy.mesh().device_mesh['dp'])"
                )
        edp = _ranks(self.mesh.group_of((EDP,))) if self.experts else []
        left = sorted(self.experts - set(held)) if found and len(edp) > 1 else []
        if left:
            raise ShardingError(
                f"hp_lazy: FSDP2 owns dp, but no FSDP2 module holds the expert slices {left[:2]} (ignored_params?): "
                f"nobody sums their gradients over the expert-data-parallel ranks {edp} that hold them alike; call "
                "fully_shard(<experts module>, mesh=hp_lazy.mesh().edp_mesh()) on each experts module"
            )
        self._fsdp_checked = [weakref.ref(module) for _, module in found]

    def _check_fsdp_experts(self, where: str, module: nn.Module, mesh: Any, experts: list[str],
                            managed: list[str]) -> None:
        """An FSDP2 module holding expert slices: over the edp ranks, FSDP2's own average, nothing else."""
        dense = [f for f in managed if f not in self.experts]
        if dense:
            raise ShardingError(
                f"hp_lazy: {where} is sharded by FSDP2 with the expert slices {experts[:2]} and the dense parameters "
                f"{dense[:2]} together, but the slices are held alike only by their expert-data-parallel ranks; "
                f"call fully_shard(<experts module>, mesh=hp_lazy.mesh().edp_mesh()) before fully_shard({where}, ...)"
            )
        edp = _ranks(self.mesh.group_of((EDP,)))
        ranks = _pg_ranks(mesh.get_group()) if mesh is not None and mesh.ndim == 1 else None
        if ranks != edp:
            raise ShardingError(
                f"hp_lazy: {where} holds the expert slices {experts[:2]} and is sharded by FSDP2 over ranks {ranks}, "
                f"but they are held alike only by the expert-data-parallel ranks {edp}; pass "
                "fully_shard(module, mesh=hp_lazy.mesh().edp_mesh())"
            )
        state = getattr(module, "_get_fsdp_state")()  # noqa: B009 - an FSDPModule, typed nn.Module here
        factor = getattr(state._fsdp_param_group, "gradient_divide_factor", None)
        if factor is not None:
            raise ShardingError(
                f"hp_lazy: {where} holds expert slices and FSDP2 divides their gradients by {factor} (its divide "
                f"factor), but hp_lazy already scales them by edp/dp for FSDP2's average over the {len(edp)} edp "
                "ranks (one process's gradient is their sum divided by dp); leave the divide factor unset"
            )


def _fsdp_managed(module: nn.Module, name: str) -> list[str]:
    """The FQNs of the parameters FSDP2's ``fully_shard(module)`` manages (its parameter groups:
    submodules sharded on their own and ``ignored_params`` left out; ``name``: the module's FQN in
    the bound model)."""
    state = getattr(module, "_get_fsdp_state")()  # noqa: B009 - an FSDPModule, typed nn.Module here
    held = {(id(p._module_info.module), p._module_info.param_name)
            for group in getattr(state, "_fsdp_param_groups", ()) for p in group.fsdp_params}
    prefix = f"{name}." if name else ""
    return [f"{prefix}{sub}.{leaf}" if sub else f"{prefix}{leaf}"
            for sub, owner in module.named_modules() for leaf in owner._parameters if (id(owner), leaf) in held]


def _fsdp_mesh(module: Any) -> Any:
    """The mesh FSDP2's ``fully_shard`` put ``module``'s parameters on (torch keeps it on the
    module's state's parameter group; None where it has none)."""
    group = getattr(module._get_fsdp_state(), "_fsdp_param_group", None)
    return getattr(getattr(group, "mesh_info", None), "mesh", None)


def _ranks(group: Group) -> list[int]:
    return [dist.get_rank()] if group.pg is None else _pg_ranks(group.pg)


def _pg_ranks(pg: Any) -> list[int]:
    return sorted(dist.get_process_group_ranks(pg if pg is not None else dist.group.WORLD))


def _dedicated(mesh: Mesh) -> Callable[[tuple[str, ...]], Group]:
    return lambda axes: mesh.group_of(axes, dedicated=True)


def rules_for(
    root: nn.Module,
    partial: Mapping[str, tuple[str, int, int]],
    mesh: Mesh,
    *,
    data_parallel: bool,
) -> dict[str, GradRule]:
    """Every trainable parameter's rule: ``partial`` maps FQN -> (axis, slots, slot) for the
    parameters whose gradient is a partial sum over an axis (from the styles); dp averaging is
    added to every parameter when hp_lazy owns dp, and a sum over cp under context parallel;
    expert shards (axis ``"edp"``) are summed over the ranks holding the same slice only."""
    dp = mesh.degree("dp") if data_parallel else 1
    edp = mesh.degree("dp") * mesh.degree("cp") // max(mesh.ep, 1)  # ranks holding one expert slice
    rules: dict[str, GradRule] = {}
    for fqn, param in root.named_parameters():
        if not param.requires_grad:
            continue
        axes: tuple[str, ...] = ("dp",) if dp > 1 else ()
        if mesh.degree("cp") > 1:  # each cp rank's backward gives its own tokens' part: summed
            axes = (*axes, "cp")
        slots, slot = 1, 0
        kind = partial.get(fqn, ("",))[0]
        if kind in (EDP, EDP_TP) and not data_parallel:  # FSDP2 averages over the edp mesh (GradOwner.check)
            scale = edp / mesh.degree("dp")
            if kind == EDP_TP or scale != 1.0:  # and the tp ranks' token shares are summed here
                rules[fqn] = GradRule(axes=("tp",) if kind == EDP_TP else (), scale=scale)
            continue
        if kind == EDP:
            if mesh.degree("dp") * mesh.degree("cp") > mesh.ep or dp > 1:  # edp ranks, or the dp mean
                rules[fqn] = GradRule(axes=(EDP,), average=dp)
            continue
        if kind == EDP_TP:  # and the tp ranks' token shares
            rules[fqn] = GradRule(axes=(EDP_TP,), average=dp)
            continue
        if fqn in partial:
            axis, slots, slot = partial[fqn]
            axes = (*axes, axis)
        if axes:
            rules[fqn] = GradRule(axes=axes, average=dp if "dp" in axes else 1, slots=slots, slot=slot)
    return rules
