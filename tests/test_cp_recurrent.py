"""runtime/cp/recurrent: Gated DeltaNet layers under context parallel. The gated delta rule split
into zigzag chunks with the state passed between ranks, against one call over the whole sequence
(outputs and every input's gradient, at world 1 and 2; the kernel computes in float32), with bytes gathered per layer
independent of the sequence length; and a Qwen3-Next hybrid (linear attention + full attention)
against one process: plain, padded and packed batches, cp=2 (all-gather and Ulysses) and cp=4.

The kernel computes in float32 and two gradients of a Gated DeltaNet layer (``A_log``, ``dt_bias``:
sums over every token of the decay's gradient) are ill-conditioned: one process differs from
itself by ~1.2e-5 when the kernel only changes its chunk size. Those entries may reach twice that
floor, measured in each test (:func:`cpwork.chunking_floor`); every other entry is held to 1e-5."""

from __future__ import annotations

import cpwork
import models
import parity
import pytest
from dist import DistPool, pool_fixture

pool2 = pool_fixture(2, timeout=180)
pool4 = pool_fixture(4, timeout=180)


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("models"))


def _ready(pool: DistPool, cp: int, mode: str = "allgather") -> DistPool:
    parity.once(pool, cpwork.activate, cp, 1, mode)
    return pool


KERNELS = sorted(cpwork.KERNELS)  # gated delta rule, KDA (per-channel decay), Mamba2's SSD scan, Mamba1's scan


@pytest.mark.parametrize("which", KERNELS)
def test_kernel_split_into_two_chunks_at_world_1(which: str) -> None:
    got = cpwork.recurrent_rule(0, 1, 24, False, which)
    assert max(got["errors"].values()) <= parity.TOL, got  # the kernels compute in float32


def test_mamba1_carry_in_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mamba1's chunk state and carried outputs summed / joined over blocks of tokens (12-token
    chunks in blocks of 5, 5 and 2), each recomputed in backward."""
    from hp_lazy.runtime.cp import recurrent

    monkeypatch.setattr(recurrent, "CARRY_TOKENS", 5)
    got = cpwork.recurrent_rule(0, 1, 24, False, "mamba1")
    assert max(got["errors"].values()) <= parity.TOL, got


@pytest.mark.parametrize("which", KERNELS)
@pytest.mark.parametrize("seq", [16, 32])
def test_kernel_state_passed_between_ranks(pool2: DistPool, seq: int, which: str) -> None:
    results = _ready(pool2, 2).run(cpwork.recurrent_rule, seq, False, which)
    for got in results:
        assert max(got["errors"].values()) <= parity.TOL, got  # the kernels compute in float32


@pytest.mark.parametrize("which", KERNELS)
def test_kernel_bytes_per_layer_do_not_grow_with_the_sequence(pool2: DistPool, which: str) -> None:
    pool = _ready(pool2, 2)
    short, long = (pool.run(cpwork.recurrent_rule, seq, False, which)[0]["gathered"] for seq in (16, 64))
    b, h, dk, dv = 2, 3, 8, 6  # the maps (A, F) of this rank's 2 chunks, float32: [Dk, Dk + Dv] / [P + N, N]
    per_batch = {"gdn": h * dk * (dk + dv), "kda": h * dk * (dk + dv), "ssd": h * (dv + dk) * dk,
                 "mamba1": (h * dv) * (dk + 1)}  # Mamba1: F over the state [D, N] and sum dt [D], float64 here
    assert short == long == 2 * b * per_batch[which] * (4 if which != "mamba1" else 8)


@pytest.mark.parametrize("which", KERNELS)
def test_negative_control_chunks_without_the_state_are_wrong(pool2: DistPool, which: str) -> None:
    results = _ready(pool2, 2).run(cpwork.recurrent_rule, 16, True, which)
    assert results[1]["errors"]["out"] > 1e-2  # rank 1's chunks start after rank 0's tokens


@pytest.mark.parametrize("kind", ["plain", "padded", "packed"])
def test_qwen3_next_cp2(pool2: DistPool, root: str, kind: str) -> None:
    path, data = models.build("qwen3_next", root), cpwork.batch(kind)
    cpwork.check(_ready(pool2, 2), path, data, cpwork.chunking_floor(path, data))


def test_qwen3_next_ulysses_cp2(pool2: DistPool, root: str) -> None:
    path, data = models.build("qwen3_next", root), cpwork.batch("padded")
    cpwork.check(_ready(pool2, 2, "ulysses"), path, data, cpwork.chunking_floor(path, data))


@pytest.mark.parametrize("kind", ["plain", "packed"])
def test_qwen3_next_cp4(pool4: DistPool, root: str, kind: str) -> None:
    """Chunks of 2 tokens, shorter than the convolution's halo of 3: the halo spans two chunks."""
    path, data = models.build("qwen3_next", root), cpwork.batch(kind)
    cpwork.check(_ready(pool4, 4), path, data, cpwork.chunking_floor(path, data))


@pytest.mark.parametrize("name", ["bamba", "lfm3", "jamba"])
@pytest.mark.parametrize("kind", ["plain", "padded", "packed"])
def test_recurrent_hybrids_cp2(pool2: DistPool, root: str, name: str, kind: str) -> None:
    """Bamba (Mamba2's SSD scan), LFM3 (a gated short convolution of kernel 7) and Jamba (Mamba1's
    selective scan: a per-channel decay, beside MoE layers) under cp=2."""
    cpwork.check(_ready(pool2, 2), models.build(name, root), cpwork.batch(kind))


@pytest.mark.parametrize(("name", "kind", "cp", "mode"), [
    ("bamba", "padded", 4, "allgather"),  # each rank's chunks of 2 tokens, shorter than the SSD's chunks of 4
    ("lfm3", "plain", 4, "allgather"),  # the convolution's halo of 6 spans the 3 rows-of-2 chunks before
    ("jamba", "packed", 4, "allgather"),  # Mamba1's state through 3 chunks before the last, its halo of 3 over 2
    ("bamba", "plain", 2, "ulysses"), ("lfm3", "padded", 2, "ulysses"),  # recurrent layers beside Ulysses attention
    ("jamba", "padded", 2, "ulysses"),
], ids=["bamba-cp4", "lfm3-cp4", "jamba-cp4", "bamba-ulysses", "lfm3-ulysses", "jamba-ulysses"])
def test_recurrent_hybrids_cp4_and_ulysses(pool2: DistPool, pool4: DistPool, root: str, name: str,
                                                       kind: str, cp: int, mode: str) -> None:
    pool = _ready(pool4 if cp == 4 else pool2, cp, mode)
    cpwork.check(pool, models.build(name, root), cpwork.batch(kind))
