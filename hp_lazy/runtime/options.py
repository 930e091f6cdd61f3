"""Run-time options of the active plan that change no lowered code (so they are not in the
plan's hash): who reduces gradients over dp, and the bucket size. Set by ``hp_lazy.activate``."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class RuntimeOptions:
    data_parallel: bool = True
    """hp_lazy averages gradients over the dp ranks itself (``False``: torch DDP or FSDP2 do)."""
    bucket_cap_mb: float = 25.0
    """Size cap of one gradient all-reduce bucket, as DDP's ``bucket_cap_mb``."""


_CURRENT = RuntimeOptions()


def current() -> RuntimeOptions:
    return _CURRENT


def set_current(options: RuntimeOptions) -> None:
    global _CURRENT
    _CURRENT = options
