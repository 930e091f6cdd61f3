"""Run time: the walker (``bind``) and the styles it calls, one room per parallelism (``tp/``,
``sp/``; ``style`` is the protocol), the parameter layout table (``layout``), the gradient owner
(``grads``), per-instance bindings (``binding``), torch leaves (``leaves``), the mesh (``mesh``),
the collectives (``comm/``: the wire and the autograd pairs), the state-dict face of a bound model
(``checkpoint/``: shards as DTensors for DCP and ``save_pretrained``) and the names lowered code
calls (``rt``). ``docs/architecture.md`` has the picture.

Nothing is imported here, so ``import hp_lazy.runtime.mesh`` costs only what that module needs.
"""
