"""Model parity with sequence parallel: ``activate("auto", tp=N, sequence_parallel=True)``.

Between blocks each rank keeps ``seq / tp`` tokens; the model-level code (position ids, mask,
rotary, loss) still sees the whole sequence, and the results equal one process's."""

from __future__ import annotations

import models
import parity
import pytest
from dist import DistPool, WorkerError, pool_fixture

pool2 = pool_fixture(2, timeout=120)
pool4 = pool_fixture(4, timeout=180)


def _pool(world: int, pool2: DistPool, pool4: DistPool) -> DistPool:
    return parity.activated(pool2 if world == 2 else pool4, sequence_parallel=True)


# qwen3_moe: its experts take every tp rank's rows; glm4: its MLP's halved gate_up_proj packed (no gather)
@pytest.mark.parametrize("name", [*sorted(models.CONFIGS), "glm4"])
@pytest.mark.parametrize("world", [2, 4])
def test_parity(name: str, world: int, refs, pool2: DistPool, pool4: DistPool) -> None:
    errors = parity.check_parity(_pool(world, pool2, pool4), refs, name)
    assert len(errors) > 10 and max(errors.values()) <= parity.TOL


@pytest.mark.parametrize("world", [2, 4])
def test_collectives_sequence_parallel(world: int, refs, pool2: DistPool, pool4: DistPool) -> None:
    """Per block an all-gather in and a reduce-scatter out (each way); the stack's exit gathers
    the sequence once for the final norm and lm_head; the norm weights' partial gradients are
    summed over tp in one all-reduce at the end of the backward pass."""
    path, _ = refs("llama")
    layers = models.BASE["num_hidden_layers"]
    counts = _pool(world, pool2, pool4).run(parity.count, path, models.batch())
    assert counts[0]["forward"] == {"all_reduce": 1, "all_gather": 2 * layers + 2, "reduce_scatter": 2 * layers}
    assert counts[0]["backward"] == {
        "all_reduce": 2, "all_gather": 2 * layers + 1, "reduce_scatter": 2 * layers,
    }
    assert all(c == counts[0] for c in counts)


@pytest.mark.parametrize("world", [2, 4])
def test_hidden_states_are_whole(world: int, refs, pool2: DistPool, pool4: DistPool) -> None:
    """``output_hidden_states=True``: transformers records each layer's input, this rank's piece
    between the boundaries; they come back whole (they were pieces, silently), and a loss of the
    user's on them trains as one process's. Per recorded piece one all-gather of its bytes."""
    path, _ = refs("llama")
    ids = models.batch()
    ref = parity.whole_outputs_loss(0, 1, path, ids, whole=False)
    got = _pool(world, pool2, pool4).run(parity.whole_outputs_loss, path, ids, whole=False)
    for result in got:
        parity.compare_whole(result, ref)
    layers, hidden = models.BASE["num_hidden_layers"], models.BASE["hidden_size"]
    piece = ids.numel() // world * hidden * 4  # bytes of one [batch, seq / tp, hidden] piece
    logits = ids.numel() * models.VOCAB // world * 4  # the head's columns
    # as in training: the blocks' gathers (2 per layer), the stack's exit and the head; then the
    # pieces recorded at each layer's input
    assert [g["gathered"] for g in got] == [(2 * layers + 1) * piece + logits + layers * piece] * world
    pieces = _pool(world, pool2, pool4).run(_unjoined, path, ids)[0]["hidden"]  # the negative control
    assert [h.shape[1] for h in pieces] == [ids.shape[1] // world] * layers + [ids.shape[1]]


def _unjoined(rank: int, world: int, path: str, ids) -> dict:
    """The recorded hidden states as transformers leaves them under sequence parallel."""
    from hp_lazy.runtime.sp import stack

    with parity.swapped(stack, "_joined", lambda binding, layers, state, group, whole: state):
        return parity.whole_outputs_loss(rank, world, path, ids, whole=False, backward=False)


def _generate(rank: int, world: int, path: str):
    return parity._load(path).generate(models.batch()[:1, :8], max_new_tokens=2, do_sample=False)


def test_generation_is_refused_naming_the_stack(refs, pool2: DistPool, pool4: DistPool) -> None:
    """The 8-token prompt splits; the first decoded token, with the KV cache, cannot."""
    path, _ = refs("llama")
    with pytest.raises(WorkerError, match=r"model.layers: 1 tokens under sequence parallel do not split into tp=2 "
                                          r"equal pieces; generation appends one token at a time \(a KV cache is "
                                          r"passed\), .* generate with a plan without sequence_parallel"):
        _pool(2, pool2, pool4).run(_generate, path)
