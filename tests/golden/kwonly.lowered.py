import hp_lazy.runtime.rt as __hp_rt__

class Mlp:
    _hp_form = 'tp_collective'
    _hp_b = __hp_rt__.unbound('golden.kwonly.Mlp')

    def _forward_impl(self, x, /, y, *, scale, bias=None):

        def act(t):
            return t
        helper = lambda t: t
        out = act(x) * scale + helper(y)
        if bias is not None:
            return out + bias
        return out

    def forward(self, x, /, y, *, scale, bias=None):
        _hp_b = self._hp_b
        if _hp_b is None:
            return self._forward_impl(x, y, scale=scale, bias=bias)
        'x: tp S(1) -> R into sharded params ==> gather_to(1)'
        x = __hp_rt__.gather_to(x, _hp_b.tp, 1)
        'scale: tp S(-1) -> R into sharded params ==> gather_to(-1)'
        scale = __hp_rt__.gather_to(scale, _hp_b.tp, -1)
        _hp_out = self._forward_impl(x, y, scale=scale, bias=bias)
        'output: tp P(sum) -> S(1) ==> reduce_scatter_to(1)'
        _hp_out = __hp_rt__.reduce_scatter_to(_hp_out, _hp_b.tp, 1)
        return _hp_out

class Pair:
    _hp_form = 'tp_collective'
    _hp_b = __hp_rt__.unbound('golden.kwonly.Pair')

    def _forward_impl(self, hidden_states, cache):
        if cache is None:
            return (hidden_states, hidden_states * 2, cache)
        return (hidden_states, cache, None, None)

    def forward(self, hidden_states, cache):
        _hp_b = self._hp_b
        if _hp_b is None:
            return self._forward_impl(hidden_states, cache)
        'hidden_states: tp S(1) -> R ==> gather_from(1)'
        hidden_states = __hp_rt__.gather_from(hidden_states, _hp_b.tp, 1)
        _hp_out = self._forward_impl(hidden_states, cache)
        'output.1: tp P(sum) -> R ==> reduce_from'
        _hp_out = (_hp_out[0], __hp_rt__.reduce_from(_hp_out[1], _hp_b.tp), *_hp_out[2:])
        return _hp_out
