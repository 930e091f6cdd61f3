"""The mesh: axis order, dp derivation, sub-groups, and the errors a launch mistake gives."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as tdist
from dist import DistPool, pool_fixture

from hp_lazy.errors import ShardingError
from hp_lazy.runtime.comm import wire as C
from hp_lazy.runtime.mesh import Group, ensure_process_group, get_mesh, mesh_shape

pool4 = pool_fixture(4)


@pytest.mark.parametrize(
    "degrees,world,shape",
    [
        ({"tp": 2}, 8, (("dp", 4), ("tp", 2))),
        ({"tp": 4}, 4, (("tp", 4),)),
        ({"tp": 2, "cp": 2}, 8, (("dp", 2), ("cp", 2), ("tp", 2))),
        ({"tp": 2, "ep": 2, "cp": 1}, 4, (("dp", 2), ("tp", 2))),  # ep is carved out of dp * cp
        ({"dp": 2, "tp": 2}, 4, (("dp", 2), ("tp", 2))),
        ({"tp": 1}, 1, ()),
        ({}, 3, (("dp", 3),)),
    ],
)
def test_mesh_shape_derives_dp_and_orders_axes(degrees: dict[str, int], world: int, shape: tuple) -> None:
    assert mesh_shape(degrees, world) == shape


@pytest.mark.parametrize(
    "degrees,world,message",
    [
        ({"tp": 3}, 4, r"hp_lazy mesh \{'tp': 3\}: the product of the degrees tp=3 = 3 does not divide the world "
         r"size 4; launch a multiple of 3 processes \(e.g. --nproc-per-node 3\) or choose degrees whose "
         r"product divides 4"),
        ({"tp": 2, "cp": 2}, 6, r"cp=2 = 4 does not divide the world size 6; launch a multiple of 4"),
        ({"dp": 4, "tp": 2}, 4, r"dp=4 \* tp=2 = 8 does not equal the world size 4; leave dp out"),
        ({"xp": 2}, 4, r"axis 'xp' is unknown; use axes from \('dp', 'cp', 'ep', 'tp'\)"),
        ({"tp": 0}, 4, r"tp=0 is not a positive integer; use e.g. tp=2"),
    ],
)
def test_mesh_shape_errors(degrees: dict[str, int], world: int, message: str) -> None:
    with pytest.raises(ShardingError, match=message):
        mesh_shape(degrees, world)


def test_world_one_needs_no_process_group(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    mesh = get_mesh({"tp": 1})
    assert mesh.group("tp") == Group.solo("tp") and mesh.group("dp").size == 1
    assert get_mesh({"tp": 1}) is mesh
    assert not tdist.is_initialized()
    with pytest.raises(ShardingError, match=r"hp_lazy mesh: 2 processes are needed but no process group "
                       r"exists and the launcher env is incomplete \(missing RANK, WORLD_SIZE, MASTER_ADDR, "
                       r"MASTER_PORT\); launch with `torchrun --nproc-per-node 2 script.py`"):
        get_mesh({"tp": 2})
    assert ensure_process_group() == 1


def _members(rank: int, world: int, degrees: dict[str, int]) -> dict[str, Any]:
    mesh = get_mesh(degrees)
    assert get_mesh(dict(degrees)) is mesh and ensure_process_group() == world
    out: dict[str, Any] = {}
    for axis in ("dp", "cp", "ep", "tp"):
        g = mesh.group(axis)
        ranks = C.all_gather_list(torch.tensor(rank), g)
        out[axis] = (g.size, g.rank, [int(r) for r in ranks])
    return out


def test_groups_at_world_4(pool4: DistPool) -> None:
    tp2 = pool4.run(_members, {"tp": 2})
    assert [m["tp"] for m in tp2] == [(2, 0, [0, 1]), (2, 1, [0, 1]), (2, 0, [2, 3]), (2, 1, [2, 3])]
    assert [m["dp"] for m in tp2] == [(2, 0, [0, 2]), (2, 0, [1, 3]), (2, 1, [0, 2]), (2, 1, [1, 3])]
    assert all(m["cp"] == (1, 0, [r]) for r, m in enumerate(tp2))
    tp4 = pool4.run(_members, {"tp": 4})
    assert [m["tp"] for m in tp4] == [(4, r, [0, 1, 2, 3]) for r in range(4)]
    assert all(m["dp"] == (1, 0, [r]) for r, m in enumerate(tp4))
    cp_tp = pool4.run(_members, {"cp": 2, "tp": 2})
    assert [m["cp"] for m in cp_tp] == [(2, 0, [0, 2]), (2, 0, [1, 3]), (2, 1, [0, 2]), (2, 1, [1, 3])]
    ep_tp = pool4.run(_members, {"ep": 2, "tp": 2})  # ep carved out of the dp ranks of each tp rank
    assert [m["ep"] for m in ep_tp] == [(2, 0, [0, 2]), (2, 0, [1, 3]), (2, 1, [0, 2]), (2, 1, [1, 3])]
    assert [m["dp"] for m in ep_tp] == [m["ep"] for m in ep_tp]


def _spanning(rank: int, world: int) -> list[Any]:
    mesh = get_mesh({"tp": 2})
    out = []
    for axes, dedicated in ((("dp", "tp"), False), (("tp",), True), (("dp", "tp"), True)):
        g = mesh.group_of(axes, dedicated=dedicated)
        out.append((g.size, g.rank, [int(r) for r in C.all_gather_list(torch.tensor(rank), g)], g.pg is mesh.group("tp").pg))
    return out


def test_groups_spanning_axes(pool4: DistPool) -> None:
    got = pool4.run(_spanning)
    assert [g[0] for g in got] == [(4, r, [0, 1, 2, 3], False) for r in range(4)]
    assert [g[1][:3] for g in got] == [(2, 0, [0, 1]), (2, 1, [0, 1]), (2, 0, [2, 3]), (2, 1, [2, 3])]
    assert not any(g[1][3] for g in got)  # a dedicated tp group is not the forward's tp group
    assert [g[2][:3] for g in got] == [(4, r, [0, 1, 2, 3]) for r in range(4)]


def _error_text(rank: int, world: int, degrees: dict[str, int]) -> str:
    try:
        get_mesh(degrees)
    except ShardingError as error:
        return str(error)
    return "no error"


def test_non_dividing_degrees_at_world_4(pool4: DistPool) -> None:
    texts = pool4.run(_error_text, {"tp": 3})
    assert set(texts) == {
        "hp_lazy mesh {'tp': 3}: the product of the degrees tp=3 = 3 does not divide the world size 4; "
        "launch a multiple of 3 processes (e.g. --nproc-per-node 3) or choose degrees whose product divides 4"
    }
