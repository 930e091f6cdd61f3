"""Import time: the ``sys.meta_path`` finder, the lowering loader and the lowered-code cache.

Nothing here imports torch (or torch.distributed) at import time; the runtime alias module is
imported by the loader just before a lowered module executes.
"""

from __future__ import annotations

from hp_lazy.hook.api import Handle, activate, active_plan, deactivate

__all__ = ["Handle", "activate", "active_plan", "deactivate"]
