"""A llama-like attention: decorated forward, **kwargs, tuple return, deferred bias."""
from __future__ import annotations
import hp_lazy.runtime.rt as __hp_rt__
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
    _hp_form = 'tp_collective'
    _hp_b = __hp_rt__.unbound('golden.attention.Attention')

    def __init__(self, scale=1.0):
        self.scale = scale

    def _forward_impl(self, hidden_states, position_embeddings, attention_mask=None, cache=None, **kwargs):
        """Returns (attn_output, attn_weights)."""
        attn_output = hidden_states * self.scale
        if attention_mask is not None:
            attn_output = attn_output + attention_mask
        return (attn_output, None)

    @deprecate_kwarg('past', 'cache')
    def forward(self, hidden_states, position_embeddings, attention_mask=None, cache=None, **kwargs):
        """Returns (attn_output, attn_weights)."""
        _hp_b = self._hp_b
        if _hp_b is None:
            return self._forward_impl(hidden_states, position_embeddings, attention_mask=attention_mask, cache=cache, **kwargs)
        'hidden_states: tp R -> R into sharded params ==> copy_to'
        hidden_states = __hp_rt__.copy_to(hidden_states, _hp_b.tp)
        _hp_out = self._forward_impl(hidden_states, position_embeddings, attention_mask=attention_mask, cache=cache, **kwargs)
        'output: tp P(sum) -> R ==> reduce_from, then deferred biases'
        _hp_out = (__hp_rt__.add_deferred_bias(__hp_rt__.reduce_from(_hp_out[0], _hp_b.tp), _hp_b), *_hp_out[1:])
        return _hp_out
