"""Run time: process groups and mesh (``mesh``), autograd collectives (``collectives``), parameter
sharding and binding (``shard``, ``bind``), and the names lowered code calls (``rt``).

Nothing is imported here, so ``import hp_lazy.runtime.mesh`` costs only what that module needs.
"""
