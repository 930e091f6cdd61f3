"""Which keys context parallel's attention lets each query see, against transformers' own mask
functions, on every (local query row, key) pair of both zigzag ranks: the blockwise plan (tiles
skipped, unmasked, causal diagonals, masked tiles with their masks) read back as one dense mask.
Causal, causal sliding window, bidirectional, and bidirectional sliding window (transformers'
attention functions get ``sliding_window`` with ``|q - k| < window``; its bidirectional mask
function takes ``window - 1``: ``|q - k| <= window - 1``); and packed documents with key padding."""

from __future__ import annotations

import pytest
import torch
from transformers import masking_utils as mu

from hp_lazy.runtime.cp import blocks
from hp_lazy.runtime.cp.state import CallState
from hp_lazy.runtime.cp.zigzag import zigzag
from hp_lazy.runtime.mesh import Group

SEQ, WINDOW = 32, 5


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(blocks, "TILE", 4)  # the 8-row chunks are two tiles: every kind of tile occurs


def _hf(causal: bool, window: int | None):  # type: ignore[no-untyped-def]
    if causal and window is None:
        return mu.causal_mask_function
    if causal:
        return mu.and_masks(mu.causal_mask_function, mu.sliding_window_overlay(window))
    if window is None:
        return mu.bidirectional_mask_function
    return mu.sliding_window_bidirectional_overlay(window - 1)


def _dense(state: CallState, causal: bool, window: int | None) -> torch.Tensor:
    """``[B, S/C, S]``: the plan's calls as one mask over local rows x keys in sequence order."""
    vis = state.visibility(causal, window)
    batch = 1 if state.docs is None else state.docs.shape[0]
    dense = torch.zeros(batch, state.zig.local_len, state.zig.seq, dtype=torch.bool)
    for call in state.plan(vis, state.zig.runs(), None).calls:
        (r0, r1), (k0, k1) = call.rows, call.keys
        if call.kind == "full":
            block = torch.ones(r1 - r0, k1 - k0, dtype=torch.bool)
        elif call.kind == "causal":
            block = torch.ones(r1 - r0, k1 - k0, dtype=torch.bool).tril()
        else:
            block = vis.mask(call.span[0], call.span[1], k0, k1, torch.device("cpu"))[:, 0]
        assert not dense[:, r0:r1, k0:k1].any(), "two calls cover the same (query, key) pair"
        dense[:, r0:r1, k0:k1] = block
    return dense


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize(("causal", "window"), [(True, None), (True, WINDOW), (False, None), (False, WINDOW)])
def test_visibility_matches_transformers(rank: int, causal: bool, window: int | None) -> None:
    zig = zigzag(SEQ, 2, rank, torch.device("cpu"))
    state = CallState(group=Group.solo("cp"), zig=zig, mode="cp_allgather_kv", positions=torch.arange(SEQ)[None],
                      docs=None, key_padding=None)
    fn = _hf(causal, window)
    zero = torch.tensor(0)
    want = torch.tensor([[bool(fn(zero, zero, q, k)) for k in range(SEQ)] for q in zig.local])
    assert torch.equal(_dense(state, causal, window)[0], want)


@pytest.mark.parametrize("rank", [0, 1])
def test_packed_documents_and_padding_match_transformers(rank: int) -> None:
    docs = torch.zeros(2, SEQ, dtype=torch.long)
    docs[0, 10:], docs[0, 21:], docs[1, 16:] = 1, 2, 1
    pad = torch.ones(2, SEQ, dtype=torch.bool)
    pad[0, :3], pad[1, 29:] = False, False
    zig = zigzag(SEQ, 2, rank, torch.device("cpu"))
    state = CallState(group=Group.solo("cp"), zig=zig, mode="cp_allgather_kv", positions=torch.arange(SEQ)[None],
                      docs=docs, key_padding=pad, model_separates=True)
    fn = mu.and_masks(mu.causal_mask_function, mu.packed_sequence_mask_function(docs), mu.padding_mask_function(pad))
    want = torch.tensor([[[bool(fn(torch.tensor(b), torch.tensor(0), q, k)) for k in range(SEQ)] for q in zig.local]
                         for b in range(2)])
    assert torch.equal(_dense(state, True, None), want)
    # a model whose mask code never saw the position ids (gpt-oss) lets the documents see each other
    state = CallState(group=Group.solo("cp"), zig=zig, mode="cp_allgather_kv", positions=torch.arange(SEQ)[None],
                      docs=docs, key_padding=pad)
    fn = mu.and_masks(mu.causal_mask_function, mu.padding_mask_function(pad))
    want = torch.tensor([[[bool(fn(torch.tensor(b), torch.tensor(0), q, k)) for k in range(SEQ)] for q in zig.local]
                         for b in range(2)])
    assert torch.equal(_dense(state, True, None), want)
