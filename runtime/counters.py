"""Zero-pad accounting: every zero-pad the runtime runs, whatever the policy, is counted here,
so the policies' costs are measured rather than argued (seed 000, Appendix A).

The totals are process-wide. A ``scope`` counts only what its own thread runs, and what that
thread queues on a stream, so that two graphs run at once on two threads each get an exact
report."""

from __future__ import annotations

import contextlib
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
_local = threading.local()   # .scopes: the stats of the scopes open on this thread


def record(nbytes: int, seconds: float, blocking: bool) -> None:
    with _lock:
        for stats in (_stats, *_scopes()):
            stats.calls += 1
            stats.bytes += nbytes
            stats.seconds += seconds
            stats.blocking_calls += int(blocking)


@contextlib.contextmanager
def scope():
    """``with scope() as stats:`` counts in ``stats`` the zero-pads this thread runs inside the
    block, and those of the stream work it submits there."""
    stats = ZeroPadStats()
    outer = _scopes()
    _local.scopes = (*outer, stats)
    try:
        yield stats
    finally:
        _local.scopes = outer


def carry(fn):
    """``fn`` wrapped to count, on whichever thread runs it, in the scopes open here now."""
    scopes = _scopes()

    def run(*args):
        saved = _scopes()
        _local.scopes = scopes
        try:
            return fn(*args)
        finally:
            _local.scopes = saved
    return run


def _scopes() -> tuple:
    return getattr(_local, "scopes", ())


def snapshot() -> ZeroPadStats:
    with _lock:
        return ZeroPadStats(**_stats.as_dict())


def reset() -> None:
    global _stats
    with _lock:
        _stats = ZeroPadStats()
