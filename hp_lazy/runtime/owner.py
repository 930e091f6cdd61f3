"""The lifecycle of a bound model: lay out, bind, refresh after a change, present for saving.

::

    from_pretrained ──► lay_out_before_load ──► (weights read into the shards) ──┐
                         (bind.bind_layout: the walker)                          │
    first forward / parallelize ─────────────────────────────────────────────────┴─► parallelize
         gradient owner · input checks · clip routing · state-dict face (checkpoint.hooks)
    a submodule replaced (PEFT, resize, a wrapper) ──► watch.dirty ──► refresh
         adapters cut like their base · the same style instances re-run · a new gradient owner

One :class:`~hp_lazy.runtime.record.BoundModel` per top-level model holds what each step knows;
the walker (:mod:`hp_lazy.runtime.bind`) builds it, this module completes and renews it. The
checkpoint room (:mod:`hp_lazy.runtime.checkpoint`) is given the record's table and mesh; it never
imports this module or the walker.
"""

from __future__ import annotations

from torch import nn
from torch.nn.modules.module import register_module_module_registration_hook

from hp_lazy.errors import ShardingError
from hp_lazy.names import BINDING, BOUND, LAID_OUT, OWNER, WATCH
from hp_lazy.runtime import adapters, clip, inputs, leaves, options, record, registry, replicas
from hp_lazy.runtime.bind import bind_layout, outermost_roots, tied_to_a_shard
from hp_lazy.runtime.binding import Binding
from hp_lazy.runtime.grads import GradOwner, rules_for
from hp_lazy.runtime.layout import LayoutTable, ParamLayout
from hp_lazy.runtime.mesh import EDP, EDP_TP
from hp_lazy.runtime.record import BoundModel, Watch
from hp_lazy.runtime.style import BindContext
from hp_lazy.runtime.tp import logprobs

__all__ = ["lay_out_before_load", "parallelize", "refresh"]


def parallelize(model: nn.Module, *, data_parallel: bool | None = None) -> nn.Module:
    """Shard ``model`` in place per the active plan, bind its boundaries and give its gradients
    an owner; idempotent.

    Call it before building DDP/FSDP or an optimizer that inspects shapes; otherwise the first
    forward of a lowered model does it. ``data_parallel`` overrides ``activate``'s. A model that
    ``from_pretrained`` loaded shard on read was laid out and bound before its weights were read
    (:func:`lay_out_before_load`); this call only gives it its gradient owner and state-dict face.
    """
    if model.__dict__.get(BOUND):
        watch = model.__dict__.get(WATCH)
        if watch is not None and watch.dirty:
            refresh(model)
        return model
    tops = [m for _, m in model.named_modules() if m is not model and record.of(m) is not None]
    owned = {id(p) for top in tops for p in top.parameters()}
    wrapper = registry.lowered_for(type(model)) is None and all(id(p) in owned for p in model.parameters())
    if tops and wrapper:  # a plain wrapper (PEFT's PeftModel) of bound or laid-out models, all its parameters theirs
        for top in tops:
            parallelize(top)  # re-binds what changed since
        return model
    _refuse_bound_inside(model)
    part_of = model.__dict__.get(LAID_OUT)
    if part_of is not None:
        raise ShardingError(
            f"{type(model).__qualname__}: from_pretrained laid this module out as part of {part_of} (its "
            "parameters are already this rank's shards); call parallelize on that top-level model"
        )
    bound = record.of(model)
    if bound is None:
        bound = model.__dict__[OWNER] = bind_layout(model)
    else:
        _check_after_load(model, bound.table)
    watch = model.__dict__.get(WATCH)
    changed = watch is not None and watch.dirty  # submodules replaced since loading (PEFT applied before the forward)
    _own_gradients(model, bound, data_parallel)
    if not changed:  # else refresh does it, once the names PEFT gave are in the table
        replicas.agree(model, bound.table)
    for root in bound.roots:
        inputs.install(root, bound.mesh.group_of(("cp", "tp")))
    logprobs.register_head(model, bound.table)
    clip.register(model)
    clip.install()  # torch's clip_grad_norm_ on this model's gradients: one process's norm
    from hp_lazy.runtime.checkpoint import hooks as checkpoint  # DTensor is imported only when a model binds

    checkpoint.install(model, bound.table, bound.mesh)
    for module in model.modules():
        if registry.lowered_for(type(module)) is not None:
            module.__dict__[BOUND] = True
    model.__dict__[BOUND] = True
    _watch(model)
    if changed:
        refresh(model)
    return model


def lay_out_before_load(model: nn.Module) -> BoundModel:
    """:func:`~hp_lazy.runtime.bind.bind_layout` now, the rest at :func:`parallelize`
    (from_pretrained's shard-on-read); the lowered modules inside remember whose layout they are
    part of."""
    bound = model.__dict__[OWNER] = bind_layout(model)
    for name, module in model.named_modules():
        if name and registry.lowered_for(type(module)) is not None:
            module.__dict__[LAID_OUT] = type(model).__qualname__
    _watch(model)  # a submodule replaced before the first forward (PEFT) is bound then
    return bound


def _refuse_bound_inside(model: nn.Module) -> None:
    bound_inside = [name for name, m in model.named_modules() if name and m.__dict__.get(BOUND)]
    if bound_inside:
        raise ShardingError(
            f"{type(model).__qualname__}: its submodule {bound_inside[0]!r} was bound by an earlier "
            "hp_lazy.parallelize call, so its parameters already have a gradient owner; call parallelize "
            "once, on the top-level model (the one whose forward you call)"
        )


def _watch(model: nn.Module) -> None:
    global _REGISTRATION_HOOK
    watch = model.__dict__.get(WATCH) or Watch(model)
    watch.dirty = False
    for module in model.modules():
        module.__dict__[WATCH] = watch
    if _REGISTRATION_HOOK is None:
        _REGISTRATION_HOOK = register_module_module_registration_hook(_on_registration)


_REGISTRATION_HOOK: object = None


def _on_registration(parent: nn.Module, name: str, module: nn.Module | None) -> None:
    watch = parent.__dict__.get(WATCH)
    if watch is not None and module is not None:
        watch.dirty = True
        for sub in module.modules():
            sub.__dict__.setdefault(WATCH, watch)


def refresh(model: nn.Module) -> None:
    """Bind what changed under a bound model: a PEFT tuner layer around a planned Linear gets its
    adapters cut like the base (:mod:`hp_lazy.runtime.adapters`), a bound torch leaf's ops move to
    the layer that wraps it, every parameter's new name joins the layout table, the style instances
    that bound the model mark the partial sums again, and the gradient owner is rebuilt for the
    parameters that are trainable now."""
    bound = record.of(model)
    assert bound is not None and bound.table is not None  # refresh follows a bind with a table
    table = bound.table
    leaves.move_leaves(model)
    by_param: dict[int, ParamLayout] = {}
    live = dict(model.named_parameters(remove_duplicate=False))
    for name, param in live.items():
        before = adapters.old_name(name, live)  # PEFT wrapped it since the bind
        layout = table.get(name) or (table.get(before) if before else None)
        if layout is not None:
            table.alias(name, layout)
            by_param[id(param)] = layout
    found = [(n, m, b.contract) for n, m in model.named_modules() if isinstance(b := m.__dict__.get(BINDING), Binding)]
    for fqn, module, _ in found:
        adapters.lay_out(fqn, module, table, by_param, table.groups)
    adapters.lay_out_parameter_adapters(model, table, by_param, table.groups)
    _, _, lowered = next(outermost_roots(model))
    ctx = BindContext(root=model, plan=lowered.plan, mesh=bound.mesh, groups=table.groups, table=table, bound=found)
    ctx.by_param = by_param
    for style in bound.styles.values():
        style.gradients(ctx)
    names = {id(p): n for n, p in model.named_parameters()}
    bound.partial = {names[pid]: rule for pid, rule in ctx.partial.items() if pid in names}
    old = bound.grads
    assert old is not None  # bound
    old.close()
    _own_gradients(model, bound, old.data_parallel)
    replicas.agree(model, table)
    _watch(model)


def _own_gradients(model: nn.Module, bound: BoundModel, data_parallel: bool | None) -> None:
    opts = options.current()
    dp = opts.data_parallel if data_parallel is None else data_parallel
    rules = rules_for(model, bound.partial, bound.mesh, data_parallel=dp)
    experts = frozenset(fqn for fqn, (axis, *_) in bound.partial.items() if axis in (EDP, EDP_TP))
    bound.grads = GradOwner(model, rules, bound.mesh, data_parallel=dp, bucket_cap_mb=opts.bucket_cap_mb,
                            experts=experts)


def _check_after_load(model: nn.Module, table: LayoutTable | None) -> None:
    """A model laid out before its weights were read: loading ties weights afterwards (transformers'
    ``tie_weights``), so check again that every planned name holds its shard and that no parameter
    is both planned and not."""
    names: dict[int, list[str]] = {}
    params = dict(model.named_parameters(remove_duplicate=False))
    for name, param in params.items():
        names.setdefault(id(param), []).append(name)
    for group in names.values():
        planned = [n for n in group if table is not None and n in table]
        if not planned or table is None:
            continue
        layout = table.get(planned[0])
        assert layout is not None
        plain = [n for n in group if n not in planned]
        if plain:
            raise tied_to_a_shard(plain[0], layout, plain[0].rpartition(".")[0] or type(model).__name__)
        if tuple(params[planned[0]].shape) != layout.local_shape:
            raise ShardingError(
                f"{planned[0]}: after loading, the parameter has shape {list(params[planned[0]].shape)}, but its "
                f"layout holds {list(layout.local_shape)} ({layout.describe()} of {list(layout.full_shape)}); "
                "do not replace parameters between from_pretrained and the first forward"
            )
