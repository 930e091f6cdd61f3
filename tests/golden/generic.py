class Star:
    def forward(self, hidden_states, *args, **kwargs):
        return hidden_states, args


class Bare:
    def forward(self, x, out):
        out.append(x)
        if x is None:
            return
        return x


class ViaKwargs:
    def forward(self, hidden_states, **kwargs):
        return hidden_states + kwargs["mask"]
