"""A two-layer toy model with a llama-shaped attention boundary (hook and CLI tests)."""

import torch
from torch import nn


class ToyAttention(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.q_proj = nn.Linear(hidden, hidden, bias=False)
        self.o_proj = nn.Linear(hidden, hidden, bias=False)

    def forward(self, hidden_states):
        return self.o_proj(torch.relu(self.q_proj(hidden_states)))


class ToyLayer(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.attn = ToyAttention(hidden)

    def forward(self, x):
        return x + self.attn(x)


class ToyModel(nn.Module):
    def __init__(self, hidden=8, layers=2):
        super().__init__()
        self.layers = nn.ModuleList([ToyLayer(hidden) for _ in range(layers)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x
