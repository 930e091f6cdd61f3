"""Attention head counts under tp: which K/V projections must be replicated, and the cached
counts a module keeps (``num_key_value_groups`` and friends) after its projections are sharded.

Attention code that reshapes with ``-1`` needs nothing; a module that caches a head count gets it
divided here. With ``num_key_value_heads`` < tp, each K/V head is kept on ``tp / kv`` ranks
(those whose query heads use it); its gradient is summed over them by
the gradient owner (:mod:`hp_lazy.runtime.grads`).
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn

from hp_lazy.errors import ShardingError
from hp_lazy.plan.model import Contract
from hp_lazy.plan.placement import Shard
from hp_lazy.runtime.adapters import adapter_ids, plain
from hp_lazy.runtime.mesh import Group
from hp_lazy.runtime.style import get_param

_HEAD_ATTRS = ("num_heads", "num_attention_heads", "n_heads")
_KV_ATTRS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads")


def _config_int(config: object, name: str) -> object:
    try:  # some configs raise (not AttributeError) for per-layer attributes read globally
        return getattr(config, name, None)
    except Exception:  # noqa: BLE001
        return None


def _head_counts(module: nn.Module) -> tuple[int, int, int] | None:
    """(heads, kv heads, head_dim) of an attention module (one that has a ``head_dim``), else None.

    The K/V heads are the module's own where its ``num_key_value_groups`` says so: a layer may
    have more than the config's (MiMo-V2-Flash's sliding-window layers double them)."""
    if not isinstance(getattr(module, "head_dim", None), int):
        return None
    config = getattr(module, "config", None)
    heads = _config_int(config, "num_attention_heads")
    kv = _config_int(config, "num_key_value_heads") or heads
    groups = getattr(module, "num_key_value_groups", None)
    if isinstance(heads, int) and isinstance(groups, int) and groups > 0 and heads % groups == 0:
        kv = heads // groups
    head_dim = module.head_dim
    if not isinstance(heads, int) or not isinstance(kv, int) or not isinstance(head_dim, int):
        return None
    return heads, kv, head_dim


def _tp_sharded_rows(contract: Contract) -> list[str]:
    return [
        name for name, placements in contract.params.items()
        if (p := placements.get("tp")) is not None and type(p) is Shard and p.dim == 0
    ]


def kv_replicas(fqn: str, module: nn.Module, contract: Contract, groups: Mapping[str, Group]) -> dict[str, int]:
    """Parameter name -> how many tp ranks share each of its row blocks (K/V heads when tp > kv)."""
    group = groups.get("tp")
    counts = _head_counts(module)
    if group is None or group.size == 1 or counts is None or not _tp_sharded_rows(contract):
        return {}
    heads, kv, head_dim = counts
    tp = group.size
    if heads % tp:
        choices = sorted(d for d in range(1, heads + 1) if heads % d == 0)
        raise ShardingError(f"{fqn}: num_attention_heads={heads} is not divisible by tp={tp}; use tp in {choices}")
    if kv == heads or kv % tp == 0:
        return {}
    if tp % kv:
        divisors = {d for d in range(1, kv + 1) if kv % d == 0}
        choices = sorted(divisors | {m for m in range(kv, heads + 1, kv) if heads % m == 0})
        raise ShardingError(
            f"{fqn}: num_key_value_heads={kv} is not divisible by tp={tp} and tp is not a multiple of it; "
            f"use tp in {choices}"
        )
    replicas: dict[str, int] = {}
    for name in _tp_sharded_rows(contract):
        param = get_param(module, name)
        if param is not None and param.shape[0] == kv * head_dim:
            replicas[name] = tp // kv  # its gradient is summed over the replicas (tp style -> gradient owner)
    return replicas


def check_projections(fqn: str, module: nn.Module, contract: Contract, groups: Mapping[str, Group]) -> None:
    """An attention module whose head counts tp divides must have every projection to heads planned:
    a q/k/v Linear the plan leaves out would give every rank all heads of it, silently."""
    group = groups.get("tp")
    counts = _head_counts(module)
    if group is None or group.size == 1 or counts is None or not _tp_sharded_rows(contract):
        return
    heads, kv, head_dim = counts
    planned = {
        name[: -len("weight")].rstrip(".")
        for name, spec in contract.params.items()
        if (name == "weight" or name.endswith(".weight")) and isinstance(spec.get("tp"), Shard)
    }
    adapter_layers = adapter_ids(module)
    for name, sub in module.named_modules():
        if id(sub) in adapter_layers or plain(name) in planned:
            continue  # a LoRA adapter's Linear follows its base; a base PEFT wrapped is planned by its plain name
        if isinstance(sub, nn.Linear) and sub.out_features in (heads * head_dim, kv * head_dim):
            raise ShardingError(
                f"{fqn}.{name}: projects to {sub.out_features} features ({heads} heads or {kv} kv heads of "
                f"{head_dim}) but the plan does not shard it, while the plan shards the other head projections "
                f"on tp={group.size}; add {name}.weight with S(0) on tp to the plan's params"
            )


def fit_attention_heads(
    fqn: str, module: nn.Module, contract: Contract, groups: Mapping[str, Group], replicas: Mapping[str, int]
) -> None:
    """Divide the head counts an attention module caches by tp (K/V: 1 head when replicated)."""
    group = groups.get("tp")
    counts = _head_counts(module)
    if group is None or group.size == 1 or counts is None or not _tp_sharded_rows(contract):
        return
    heads, kv, _ = counts
    tp = group.size
    local_heads = heads // tp
    local_kv = 1 if replicas else kv // tp
    for attr in _HEAD_ATTRS:
        if isinstance(getattr(module, attr, None), int):
            setattr(module, attr, local_heads)
    for attr in _KV_ATTRS:
        if isinstance(getattr(module, attr, None), int):
            setattr(module, attr, local_kv)
    if isinstance(getattr(module, "num_key_value_groups", None), int):
        setattr(module, "num_key_value_groups", local_heads // local_kv)
