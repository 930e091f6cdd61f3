"""Multi-head latent attention (DeepSeek-V2/V3, MiniCPM3, GLM-4-MoE-Lite) tensor parallel:
``q_b_proj``/``q_proj`` and ``kv_b_proj`` colwise (heads), ``o_proj`` rowwise, the low-rank
down projections (``q_a_proj``, ``kv_a_proj_with_mqa``: ``mla_kv_a_proj``) and their norms
replicated with their gradients summed over tp — against one process."""

from __future__ import annotations

import parity
import pytest
from dist import DistPool, pool_fixture

pool2 = pool_fixture(2, timeout=180)
pool4 = pool_fixture(4, timeout=240)

MLA = ("deepseek_v2", "minicpm3", "glm4_moe_lite")


@pytest.mark.parametrize("name", MLA)
@pytest.mark.parametrize("world", [2, 4])
def test_mla_parity(name: str, world: int, refs, pool2: DistPool, pool4: DistPool) -> None:
    pool = parity.activated(pool2 if world == 2 else pool4, sequence_parallel=False)
    errors = parity.check_parity(pool, refs, name)
    assert any("kv_a_proj_with_mqa" in k for k in errors)
    assert len(errors) > 10 and max(errors.values()) <= parity.TOL, max(errors.items(), key=lambda kv: kv[1])


def train_without_latent_sum(rank: int, world: int, path: str, ids) -> dict:
    """Negative control: the tp sum of ``kv_a_proj_with_mqa``'s gradient (each rank holds its heads'
    part) left out."""
    from hp_lazy.runtime.style import BindContext

    original = BindContext.add_partial

    def add_partial(self, param, axis, slots=1, slot=0):
        latent = {id(p) for n, m in self.root.named_modules() if n.endswith("kv_a_proj_with_mqa") for p in m.parameters()}
        if id(param) not in latent:
            original(self, param, axis, slots, slot)

    BindContext.add_partial = add_partial
    try:
        return parity.train(rank, world, path, ids)
    finally:
        BindContext.add_partial = original


def test_mla_without_the_latent_gradient_sum_fails(refs, pool2: DistPool) -> None:
    import models

    path, ref = refs("deepseek_v2")
    got = parity.activated(pool2, sequence_parallel=False).run(train_without_latent_sum, path, models.batch())[0]
    assert models.rel_err(got["logits"], ref["logits"]) <= parity.TOL  # the forward is unaffected
    with pytest.raises(AssertionError, match="grad model.layers.0.self_attn.kv_a_proj_with_mqa"):
        parity.compare(got, ref)


def test_mla_heads_are_sharded(refs, pool2: DistPool) -> None:
    """Each rank holds half of the heads' up projections; the down projections stay whole."""
    path, _ = refs("deepseek_v2")
    shapes = parity.activated(pool2, sequence_parallel=False).run(_shapes, path)
    full = _shapes(0, 1, path, bind=False)
    attn = "model.layers.0.self_attn."
    for rank_shapes in shapes:
        for name in ("q_b_proj.weight", "kv_b_proj.weight"):
            assert rank_shapes[attn + name] == (full[attn + name][0] // 2, full[attn + name][1])
        assert rank_shapes[attn + "o_proj.weight"] == (full[attn + "o_proj.weight"][0], full[attn + "o_proj.weight"][1] // 2)
        for name in ("q_a_proj.weight", "kv_a_proj_with_mqa.weight"):
            assert rank_shapes[attn + name] == full[attn + name]


def _shapes(rank: int, world: int, path: str, bind: bool = True) -> dict[str, tuple[int, ...]]:
    import hp_lazy

    model = parity._load(path)
    if bind:
        hp_lazy.parallelize(model)
    return {n: tuple(p.shape) for n, p in model.named_parameters()}
