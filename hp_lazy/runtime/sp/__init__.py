"""Sequence parallel: the decoder-layer stack as the boundary, and which gradients it makes partial."""
