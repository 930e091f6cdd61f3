"""Import time: the ``sys.meta_path`` finder, the lowering loader and the lowered-code cache.

Nothing here imports torch (or torch.distributed), and nothing here names the runtime: the lowerer,
the registry and the runtime module come in as arguments (from :mod:`hp_lazy.api`).
"""

from __future__ import annotations

from hp_lazy.hook.api import Handle, active_plan, deactivate

__all__ = ["Handle", "active_plan", "deactivate"]
