import hp_lazy.runtime.rt as __hp_rt__

class Star:
    _hp_form = 'generic'
    _hp_b = __hp_rt__.unbound('golden.generic.Star')

    def _forward_impl(self, hidden_states, *args, **kwargs):
        return (hidden_states, args)

    def forward(self, hidden_states, *args, **kwargs):
        _hp_b = self._hp_b
        if _hp_b is None:
            return self._forward_impl(hidden_states, *args, **kwargs)
        'generic form: forward takes *args'
        _hp_call = __hp_rt__.begin(_hp_b)
        'hidden_states: tp S(1) -> R ==> gather_from(1)'
        hidden_states = __hp_rt__.enter(_hp_b, 'hidden_states', hidden_states, _hp_call)
        _hp_out = self._forward_impl(hidden_states, *args, **kwargs)
        'output: tp R -> S(1) ==> scatter_to(1)'
        _hp_out = __hp_rt__.exit(_hp_b, _hp_out, _hp_call)
        return _hp_out

class Bare:
    _hp_form = 'generic'
    _hp_b = __hp_rt__.unbound('golden.generic.Bare')

    def _forward_impl(self, x, out):
        out.append(x)
        if x is None:
            return
        return x

    def forward(self, x, out):
        _hp_b = self._hp_b
        if _hp_b is None:
            return self._forward_impl(x, out)
        'generic form: forward can return without a value (line 10); the output layout is not fixed by the returns (bare, value)'
        _hp_call = __hp_rt__.begin(_hp_b)
        _hp_out = self._forward_impl(x, out)
        'output: tp P(sum) -> R ==> reduce_from'
        _hp_out = __hp_rt__.exit(_hp_b, _hp_out, _hp_call)
        return _hp_out

class ViaKwargs:
    _hp_form = 'generic'
    _hp_b = __hp_rt__.unbound('golden.generic.ViaKwargs')

    def _forward_impl(self, hidden_states, **kwargs):
        return hidden_states + kwargs['mask']

    def forward(self, hidden_states, **kwargs):
        _hp_b = self._hp_b
        if _hp_b is None:
            return self._forward_impl(hidden_states, **kwargs)
        "generic form: inputs ['mask'] are not named forward parameters"
        _hp_call = __hp_rt__.begin(_hp_b)
        'mask: tp S(1) -> R ==> gather_from(1)'
        if 'mask' in kwargs:
            kwargs['mask'] = __hp_rt__.enter(_hp_b, 'mask', kwargs['mask'], _hp_call)
        _hp_out = self._forward_impl(hidden_states, **kwargs)
        'output: tp P(sum) -> R ==> reduce_from'
        'output: deferred biases are added by exit, once, after the reduction'
        _hp_out = __hp_rt__.exit(_hp_b, _hp_out, _hp_call)
        return _hp_out
