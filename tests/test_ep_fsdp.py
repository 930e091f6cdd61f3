"""Expert parallel with FSDP2 owning dp (``data_parallel=False``), torchtitan's layout: each experts
module sharded by FSDP2 over its expert-data-parallel ranks (``fully_shard(experts,
mesh=hp_lazy.mesh().edp_mesh())``), each decoder layer and the root over dp. World 4, ep=2: dp=4,
two ranks per expert slice, so FSDP2 splits each rank's two experts in two again (a quarter of the
experts per rank). One process's loss, logits, every gradient, ``clip_grad_norm_``'s norm and 3
SGD+wd steps; checkpoints through DCP (resumed at the same layout, under hp_lazy's own dp, in one
plain process) and ``save_pretrained``; the wrong layouts refused by name; negative control: FSDP2's
average over edp left unscaled. Then ep=2 x cp=2 (the edp ranks spanning dp and cp)."""

from __future__ import annotations

import epwork
import models
import parity
import pytest
from dist import DistPool, pool_fixture

pool4 = pool_fixture(4, timeout=180)

SAME = 1e-6  # the same layout: the same arithmetic
OTHER = 1e-5  # another layout: other reduction orders (fp32 round-off)


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("models"))


def _at(pool: DistPool, **degrees: int) -> DistPool:
    """``pool`` activated with ``degrees``: new worker processes when it ran another plan (a lowered
    module keeps the plan it was lowered for); once per set of workers."""
    if getattr(pool, "_ep_fsdp", degrees) != degrees:
        pool.close()
    parity.once(pool, epwork.activate, **degrees)
    pool._ep_fsdp = degrees  # type: ignore[attr-defined]
    return pool


@pytest.fixture
def ready(pool4: DistPool, root: str):
    """Activated per test: a pool restarts its workers after a worker error."""
    return _at(pool4, ep=2), root


@pytest.mark.parametrize(("name", "impl"), [("qwen3_moe", "grouped_mm"), ("gpt_oss", "eager")])
def test_fsdp2_over_edp_matches_one_process(ready, name: str, impl: str) -> None:
    pool, root = ready
    results = epwork.check_fsdp(pool, models.build(name, root), epwork.batch(rows=4), impl)
    for got in results:  # 4 experts / ep 2 / edp 2: one per rank
        assert all(mesh == ("edp",) and shape[0] == 1 for shape, mesh in got["experts"].values()), got["experts"]


def test_unscaled_edp_average_is_wrong(ready) -> None:
    """Negative control: FSDP2 averages an expert slice over its 2 edp ranks; one process's gradient
    is the sum over them divided by dp=4. Without hp_lazy's scale the experts' gradients are 2x."""
    pool, root = ready
    path, data = models.build("qwen3_moe", root), epwork.batch(rows=4)
    ref = epwork.reference(path, data)
    got = pool.run(epwork.fsdp_train, path, data, "grouped_mm", "unscaled")[0]
    errors = parity.relative_errors(got, ref)
    assert min(v for k, v in errors.items() if k.startswith("grad ") and ".experts." in k) > 0.5, errors
    assert max(v for k, v in errors.items() if k.startswith("grad ") and ".experts." not in k) <= parity.TOL


@pytest.mark.parametrize(("wrap", "text"), [
    ("inside", r"ShardingError: hp_lazy: model\.layers\.1 is sharded by FSDP2 with the expert slices "
               r"\['model\.layers\.1\.mlp\.experts\.gate_up_proj', 'model\.layers\.1\.mlp\.experts\.down_proj'\] and "
               r"the dense parameters .* together, but the slices are held alike only by their expert-data-parallel "
               r"ranks; call fully_shard\(<experts module>, mesh=hp_lazy\.mesh\(\)\.edp_mesh\(\)\) before "
               r"fully_shard\(model\.layers\.1, \.\.\.\)"),
    ("dp", r"ShardingError: hp_lazy: model\.layers\.1\.mlp\.experts holds the expert slices .* and is sharded by "
           r"FSDP2 over ranks \[0, 1, 2, 3\], but they are held alike only by the expert-data-parallel ranks "
           r"\[\d, \d\]; pass fully_shard\(module, mesh=hp_lazy\.mesh\(\)\.edp_mesh\(\)\)"),
    ("factor", r"ShardingError: hp_lazy: model\.layers\.1\.mlp\.experts holds expert slices and FSDP2 divides their "
               r"gradients by 4\.0 \(its divide factor\), but hp_lazy already scales them by edp/dp for FSDP2's "
               r"average over the 2 edp ranks .*; leave the divide factor unset"),
    ("ignored", r"ShardingError: hp_lazy: FSDP2 owns dp, but no FSDP2 module holds the expert slices "
                r"\['model\.layers\.1\.mlp\.experts\.down_proj', 'model\.layers\.1\.mlp\.experts\.gate_up_proj'\] "
                r"\(ignored_params\?\): nobody sums their gradients over the expert-data-parallel ranks \[\d, \d\]"),
    ("ddp", r"ShardingError: hp_lazy: this model runs inside torch DistributedDataParallel, which averages every "
            r"gradient over the dp ranks \[0, 1, 2, 3\], but under expert parallel \(ep=2\) each expert slice .* is "
            r"held only by its expert-data-parallel ranks; drop DDP"),
])
def test_wrong_layouts_are_refused(ready, wrap: str, text: str) -> None:
    import re

    pool, root = ready
    for got in pool.run(epwork.fsdp_error, models.build("qwen3_moe", root), wrap):
        assert re.match(text, got), got


def test_fsdp2_over_edp_checkpoints(ready, tmp_path) -> None:
    """AdamW through DCP and save_pretrained (:func:`epwork.fsdp_checkpoint_errors`): resumed at the
    same layout with both APIs, under hp_lazy's own dp, in one plain process, and hp_lazy's own
    checkpoint under FSDP2."""
    pool, root = ready
    errors = epwork.fsdp_checkpoint_errors(pool, models.build("qwen3_moe", root), str(tmp_path))
    print("FSDP2 x ep resume errors:", errors)
    assert max(v for k, v in errors.items() if "-> same" in k) <= SAME, errors
    assert max(errors.values()) <= OTHER, errors


def test_fsdp2_over_edp_with_context_parallel(pool4: DistPool, root: str) -> None:
    """ep=2 x cp=2 (dp=2): the edp mesh of a slice spans the dp and cp ranks holding it, FSDP2's
    average over it is already the sum over cp divided by dp; the dense layers' FSDP2 over dp with
    hp_lazy's sum over cp in the hook. One process's numbers."""
    pool = _at(pool4, ep=2, cp=2)
    for got in epwork.check_fsdp(pool, models.build("qwen3_moe", root), epwork.batch(rows=2)):
        assert all(mesh == ("edp",) and shape[0] == 1 for shape, mesh in got["experts"].values()), got["experts"]
