class Mlp:
    def forward(self, x, /, y, *, scale, bias=None):
        def act(t):
            return t

        helper = lambda t: t
        out = act(x) * scale + helper(y)
        if bias is not None:
            return out + bias
        return out


class Pair:
    def forward(self, hidden_states, cache):
        if cache is None:
            return hidden_states, hidden_states * 2, cache
        return hidden_states, cache, None, None
