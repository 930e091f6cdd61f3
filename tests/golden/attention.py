"""A llama-like attention: decorated forward, **kwargs, tuple return, deferred bias."""

from __future__ import annotations

import functools


def deprecate_kwarg(old, new):
    def wrap(fn):
        @functools.wraps(fn)
        def inner(self, *args, **kwargs):
            if old in kwargs:
                kwargs[new] = kwargs.pop(old)
            return fn(self, *args, **kwargs)

        return inner

    return wrap


class Attention:
    """Attention with an output projection."""

    def __init__(self, scale=1.0):
        self.scale = scale

    @deprecate_kwarg("past", "cache")
    def forward(self, hidden_states, position_embeddings, attention_mask=None, cache=None, **kwargs):
        """Returns (attn_output, attn_weights)."""
        attn_output = hidden_states * self.scale
        if attention_mask is not None:
            attn_output = attn_output + attention_mask
        return attn_output, None
