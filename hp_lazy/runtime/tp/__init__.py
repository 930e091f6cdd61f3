"""Tensor parallel: its style (validation, head counts, gradient and loss policy), the vocab-parallel
embedding and the vocab-parallel loss."""
