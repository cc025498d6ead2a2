"""What a graph run gives back: its ``Report`` and its results, each held in the layout its
producer wrote and reordered to plain only when read (seed 004: reordered back lazily)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from blockpad.layout import Layout, numpy_dtype

from ..memory import Memory, aligned_empty
from .kernels import reorder
from .ops import plain


@dataclass
class Report:
    policy: str
    ops: int = 0                    # graph ops run
    kernels: int = 0                # kernel calls (reorders included)
    reorders: int = 0               # activation reorders run (inserted by layout propagation)
    weight_reorders: int = 0        # weight reorders run (first run, or after a change)
    output_reorders: int = 0        # results reordered to plain because the caller read them
    inplace: list = field(default_factory=list)     # ops run in place
    fused: list = field(default_factory=list)       # ops run as a convolution's post-op
    fallbacks: dict = field(default_factory=dict)   # op -> "plain" / "numpy": no blocked kernel
    zero_pad_calls: int = 0
    zero_pad_bytes: int = 0
    zero_pad_blocking: int = 0
    peak_bytes: int = 0             # peak of live intermediate and result buffers (liveness)
    arena_bytes: int = 0            # bytes the planned arena holds (slots reused)
    weight_bytes: int = 0           # prepared (reordered) weights, kept between runs
    cache: dict = field(default_factory=dict)       # kernel-cache counters during this run
    seconds: float = 0.0            # the whole run() call: plan_seconds + run_seconds
    plan_seconds: float = 0.0       # planning, with the kernels it compiled or loaded (a first
    #                                 run for these input layouts; a lookup afterwards)
    run_seconds: float = 0.0        # weights checked/reordered, the steps run
    native: bool = False            # the kernel calls made by a built model's plan function
    #                                 (graph/native.py), not one by one from Python

    def as_dict(self):
        return dict(self.__dict__)

    def __str__(self):
        kib = lambda n: f"{n / 1024:.1f} KiB"  # noqa: E731
        cache = ", ".join(f"{k} {v}" for k, v in self.cache.items() if v)
        lines = [
            f"policy {self.policy}: {self.ops} ops, {self.kernels} kernel calls, "
            f"{1e3 * self.seconds:.2f} ms ({1e3 * self.plan_seconds:.2f} ms planning and "
            f"compiling, {1e3 * self.run_seconds:.2f} ms running)",
            f"  reorders      {self.reorders} activation, {self.weight_reorders} weight, "
            f"{self.output_reorders} result (lazy)",
            f"  in place      {len(self.inplace)}: {', '.join(self.inplace) or '-'}",
            f"  fused         {', '.join(self.fused) or '-'}",
            f"  fallbacks     {', '.join(f'{k} ({v})' for k, v in self.fallbacks.items()) or '-'}",
            f"  zero-pads     {self.zero_pad_calls} calls, {self.zero_pad_bytes} bytes, "
            f"{self.zero_pad_blocking} blocking",
            f"  memory        peak {kib(self.peak_bytes)} live, arena {kib(self.arena_bytes)}, "
            f"weights {kib(self.weight_bytes)}",
            f"  kernel cache  {cache or '-'}",
            f"  calls made    {'by the plan function' if self.native else 'from Python'}",
        ]
        return "\n".join(lines)


# ---- results ----------------------------------------------------------------------------------

class Result:
    """A graph result: held in whatever layout its producer wrote (``memory``), reordered to
    plain only when ``numpy()`` is called (then kept)."""

    def __init__(self, name, memory: Memory, cache, report: Report, lock):
        self.name = name
        self.memory = memory
        self._cache = cache
        self._report = report
        self._array = None
        self._lock = lock

    @property
    def layout(self) -> Layout:
        return self.memory.layout

    @property
    def shape(self):
        return self.memory.layout.shape

    def numpy(self) -> np.ndarray:
        with self._lock:
            if self._array is None:
                self._array = _to_plain(self._cache, self.memory, self._report)
            return self._array

    def __array__(self, dtype=None, copy=None):
        a = self.numpy()
        return a.astype(dtype) if dtype is not None else a

    def __repr__(self):
        return f"<Result {self.name} {self.layout}>"


def _to_plain(cache, mem: Memory, report: Report) -> np.ndarray:
    lay = mem.layout
    if lay.is_plain:
        return mem.buffer[:lay.alloc_len].reshape(lay.shape)
    dst = Memory(plain(lay.shape, lay.dtype),
                 aligned_empty(int(np.prod(lay.shape)), numpy_dtype(lay.dtype)))
    reorder(cache, mem, dst)
    report.output_reorders += 1
    return dst.buffer.reshape(lay.shape)


class Results(dict):
    """``{output name: Result}`` plus the run's ``report``. ``finish``: fills the report's
    figures when it is first read, not on every run: with the interpreter's data out of cache
    after a network the filling cost ~20 us a run (MobileNetV2), for a report most callers
    never read."""

    def __init__(self, items, report, finish=None):
        super().__init__(items)
        self._report = report
        self._finish = finish

    @property
    def report(self) -> Report:
        if self._finish is not None:
            finish, self._finish = self._finish, None
            finish()
        return self._report

    def numpy(self) -> dict:
        return {k: v.numpy() for k, v in self.items()}

