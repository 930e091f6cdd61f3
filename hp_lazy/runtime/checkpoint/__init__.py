"""Checkpoints of bound models: shards presented as DTensors at the state-dict boundary only
(``present``: layout -> DTensor and back), and the hooks that put that face on ``state_dict`` /
``load_state_dict`` of models and optimizers and on transformers' ``save_pretrained`` (``hooks``),
and shard-on-read ``from_pretrained`` through transformers' own tp loader (``load``). The forward
never sees a DTensor."""
