"""Zero-pad accounting: every zero-pad the runtime runs, whatever the policy, is counted here,
so the policies' costs are measured rather than argued (seed 000, Appendix A)."""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass


@dataclass
class ZeroPadStats:
    calls: int = 0            # zero-pad passes run
    bytes: int = 0            # bytes of padding written
    seconds: float = 0.0      # time spent in them
    blocking_calls: int = 0   # passes run on the caller's thread at memory creation / set handle

    def as_dict(self):
        return asdict(self)


_stats = ZeroPadStats()
_lock = threading.Lock()


def record(nbytes: int, seconds: float, blocking: bool) -> None:
    with _lock:
        _stats.calls += 1
        _stats.bytes += nbytes
        _stats.seconds += seconds
        _stats.blocking_calls += int(blocking)


def snapshot() -> ZeroPadStats:
    with _lock:
        return ZeroPadStats(**_stats.as_dict())


def reset() -> None:
    global _stats
    with _lock:
        _stats = ZeroPadStats()
