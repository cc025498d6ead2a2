"""What the running machine can execute: its architecture and CPU feature flags."""

from __future__ import annotations

import functools
import platform


def arch() -> str:
    return platform.machine()


@functools.lru_cache(maxsize=1)
def cpu_features() -> frozenset:
    """Feature flags as /proc/cpuinfo spells them (``avx2``, ``avx512f``, ``asimddp``...)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    return frozenset(value.split())
    except OSError:
        pass
    return frozenset()


def missing_features(required) -> list:
    have = cpu_features()
    return [f for f in required if f not in have]
