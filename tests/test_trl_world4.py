"""TRL's ``SFTTrainer`` at dp=2 x tp=2 (world 4), against one process: the data loader splits the
global batch over dp, the fused head's softmax runs over the tp shards of the vocabulary."""

from __future__ import annotations

import parity
import pytest
import trlwork
from dist import DistPool, pool_fixture

pytest.importorskip("trl")

pool4 = pool_fixture(4, timeout=300)


@pytest.fixture
def pool(pool4: DistPool) -> DistPool:
    return parity.activated(pool4, tp=2)


@pytest.mark.parametrize("variant", [{}, {"packing": True}], ids=["plain", "packing"])
def test_sft_trainer_dp_tp(pool: DistPool, refs, tmp_path, variant: dict) -> None:
    path, _ = refs("llama")
    ref = trlwork.sft(0, 1, path, str(tmp_path / "ref"), **variant)
    got = pool.run(trlwork.sft, path, str(tmp_path / "hp"), **variant)
    trlwork.compare(got[0], ref)
    for other in got[1:]:
        trlwork.compare(other, {k: v for k, v in ref.items() if k != "state"})


def test_sft_trainer_cp_tp(pool4: DistPool, refs, tmp_path) -> None:
    """cp=2 x tp=2: the fused head runs on each rank's zigzag rows over the tp shards of the vocabulary."""
    import cpwork

    path, _ = refs("llama")
    pool4.close()  # new workers: the modeling code is lowered for the cp x tp plan
    parity.once(pool4, cpwork.activate, 2, 2)
    ref = trlwork.sft(0, 1, path, str(tmp_path / "ref"))
    got = pool4.run(trlwork.sft, path, str(tmp_path / "hp"))
    trlwork.compare(got[0], ref)
    for other in got[1:]:
        trlwork.compare(other, {k: v for k, v in ref.items() if k != "state"})
