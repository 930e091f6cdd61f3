"""The context-parallel masks against transformers' own mask functions, on every (local query row,
gathered key row) pair of both zigzag ranks: causal, causal sliding window, bidirectional, and
bidirectional sliding window (transformers' attention functions get ``sliding_window`` with
``|q - k| < window``; its bidirectional mask function takes ``window - 1``: ``|q - k| <= window - 1``)."""

from __future__ import annotations

import pytest
import torch
from transformers import masking_utils as mu

from hp_lazy.runtime.cp.state import CallState
from hp_lazy.runtime.cp.zigzag import zigzag
from hp_lazy.runtime.mesh import Group

SEQ, WINDOW = 16, 5


def _hf(causal: bool, window: int | None):
    if causal and window is None:
        return mu.causal_mask_function
    if causal:
        return mu.and_masks(mu.causal_mask_function, mu.sliding_window_overlay(window))
    if window is None:
        return mu.bidirectional_mask_function
    return mu.sliding_window_bidirectional_overlay(window - 1)


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize(("causal", "window"), [(True, None), (True, WINDOW), (False, None), (False, WINDOW)])
def test_masks_match_transformers(rank: int, causal: bool, window: int | None) -> None:
    zig = zigzag(SEQ, 2, rank, torch.device("cpu"))
    state = CallState(group=Group.solo("cp"), zig=zig, mode="cp_allgather_kv", positions=torch.arange(SEQ)[None],
                      docs=None, key_padding=None)
    got = state.mask(causal, window)
    fn = _hf(causal, window)
    zero = torch.tensor(0)
    want = torch.tensor([[bool(fn(zero, zero, q, k)) for k in zig.gathered] for q in zig.local])
    assert torch.equal(torch.ones_like(want) if got is None else got[0, 0], want)
