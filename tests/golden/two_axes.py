class Attention:
    def forward(self, hidden_states, mask=None):
        return hidden_states, mask, None


class Norm:
    def forward(self, hidden_states):
        return hidden_states


class Shared:
    def forward(self, x):
        return x
