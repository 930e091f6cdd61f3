"""Where stock training stacks meet hp_lazy: each module routes one library's calls that would be
wrong on a parallel model (wrapping, data sharding, clipping) to hp_lazy's own. Installed by
``hp_lazy.activate`` when the library is imported; nothing to call."""
