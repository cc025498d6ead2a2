"""A graph's constants and the prepared (reordered) weights its kernels read (seed 004: weights
are reordered once and kept).

Each constant is held as the caller's array (or a snapshot of it, ``mode="frozen"``), and in
each layout a plan reads it in, reordered on first use. ``mode="check"`` compares the caller's
array byte for byte with a copy kept at the reorder before each run and re-reorders what
changed (a checksum such as adler32 can be fooled by a few sign flips, a compare cannot, and it
is the cheaper of the two); ``set`` marks a constant changed under either mode. An *owned*
constant is an array nobody else holds (an ONNX importer's): made read-only and never compared
or copied, under either mode (int8 ResNet-50 from ONNX, 1 thread: 5 ms a run compared, with a
25 MB copy, against 22 ms of kernels). A *prepacked*
constant (a model build's packed weights) is held only in the layouts given: never reordered,
no plain copy.

The planner asks ``is_prepacked``, ``unpacked`` and ``warm``; execution asks ``refresh``,
``prepare`` and ``arrays``."""

from __future__ import annotations

import math
import threading

import numpy as np

from blockpad import winograd
from blockpad.errors import ArgumentError
from blockpad.layout import Layout, numpy_dtype

from ..library import fits_seven_bit
from ..memory import Memory, aligned_empty
from .kernels import MemoryRuntime, reorder, reorder_request, winograd_weights


class WeightCache:
    """The constants of one graph (``arrays``: name -> array) and their prepared layouts."""

    def __init__(self, policy, cache, mode="check"):
        self.policy = policy
        self.cache = cache
        self.mode = mode
        self.arrays: dict = {}        # name -> array (the caller's, or a snapshot if frozen)
        self.version = 0              # bumped whenever ``arrays`` gets another object
        self._prepared: dict = {}     # (name, Layout) -> prepared Memory
        self._kept: dict = {}         # name -> a copy of its bytes when it was reordered
        self._stale: set = set()
        self._prepacked: set = set()  # constants held only in packed layouts
        self._seven_bit: set = set()  # int8 weights planned as weight_bits = 7 kernels' input
        self._owned: set = set()      # constants nobody else can write: never compared
        # the one buffer the constants lie in, where there is one (a loaded model's
        # weights.bin): the plan function takes it as one argument (native.describe)
        self.backing = None
        self._lock = threading.RLock()

    def add(self, name, array, owned=False) -> None:
        """``owned``: ``array`` is the graph's alone; it is made read-only, not copied."""
        if owned:
            array.setflags(write=False)
            self.arrays[name] = array
            self._owned.add(name)
        else:
            self.arrays[name] = self._keep(array)
        self.version += 1

    def add_prepacked(self, name, shape, dtype, memories) -> None:
        """``name`` known only in the layouts of ``memories`` (clean Memories of ``shape``, or
        of 3x3 weights' Winograd-domain transform: ``blockpad.winograd.domain_tile``)."""
        for mem in memories:
            if mem.layout.dtype != dtype or (math.prod(mem.layout.shape) != math.prod(shape)
                                             and winograd.domain_tile(mem.layout, shape) is None):
                raise ArgumentError(f"{name}: a prepacked memory of {list(shape)} {dtype} has "
                                    f"layout {mem.layout}")
            self._prepared[(name, mem.layout)] = mem
        # shape and dtype for planning, no data: a stride-0 view of one zero
        self.arrays[name] = np.broadcast_to(np.zeros((), numpy_dtype(dtype)), shape)
        self.version += 1
        self._prepacked.add(name)

    def set(self, name, array) -> None:
        """New values for ``name`` (shape and dtype checked by the caller): its prepared
        layouts are re-reordered at the next ``refresh``."""
        with self._lock:
            self.arrays[name] = self._keep(array)
            self.version += 1
            self._stale.add(name)
            self._prepacked.discard(name)
            self._owned.discard(name)   # the caller's array now
            if not fits_seven_bit(np.asarray(array)):
                self._seven_bit.discard(name)   # the graph plans again (Graph.set_constant)

    def _keep(self, array):
        if self.mode == "frozen":
            array = np.array(array, order="C")       # a snapshot: the caller's later writes
            array.setflags(write=False)              # do nothing until set
        return array

    # -- what the planner asks --
    def is_prepacked(self, name) -> bool:
        return name in self._prepacked

    def unpacked(self, name, layout) -> str:
        """The error message for a plan reading the prepacked ``name`` in ``layout``."""
        have = [str(lay) for c, lay in self._prepared if c == name]
        return (f"{name}: the plan reads this prepacked constant as {layout}; it is held only "
                f"as {', '.join(have) or 'nothing'} (rebuild the model, or set_constant a plain "
                f"array)")

    def seven_bit(self, name) -> bool:
        """Whether the int8 constant ``name`` fits 7 bits (every value in [-64, 64]), so its
        convolutions may take one ``vpmaddubsw`` a step (``weight_bits = 7``); a prepacked one
        is judged by its packed bytes. A yes is remembered: a later change that leaves the
        range is refused (``refresh``) or re-plans the graph (``Graph.set_constant``)."""
        with self._lock:
            if name in self._prepacked:
                arrays = [m.buffer for (c, _), m in self._prepared.items() if c == name]
            else:
                arrays = [self.arrays.get(name)]
            fits = all(a is not None and a.dtype == np.int8 and fits_seven_bit(a)
                       for a in arrays)
            if fits:
                self._seven_bit.add(name)
            return fits

    def leaves_seven_bit(self, name, array) -> bool:
        """Whether new values for ``name`` break a 7-bit plan (``seven_bit`` said yes)."""
        return name in self._seven_bit and not fits_seven_bit(np.asarray(array))

    def warm(self, name, layout) -> None:
        """Compile (or load) the kernel that will prepare ``name`` in ``layout`` now: planning
        time, not the first run's."""
        if name not in self._prepacked:
            self.cache.find(reorder_request(_weight_source(layout), layout))

    # -- what execution asks --
    def prepare(self, name, layout, report) -> Memory:
        """The constant ``name`` in ``layout``, reordered once (and again after a change)."""
        key = (name, layout)
        with self._lock:
            mem = self._prepared.get(key)
            if mem is not None:
                return mem
            if name in self._prepacked:
                raise ArgumentError(self.unpacked(name, layout))
            mem = Memory(layout, aligned_empty(layout.alloc_len, numpy_dtype(layout.dtype)),
                         library=MemoryRuntime(self.policy, self.cache))
            self._prepared[key] = mem
            self._reorder(name, mem, report)
            return mem

    def current(self) -> bool:
        """Whether ``refresh`` would reorder nothing, known without comparing an array: no
        constant ``set`` since, and none held to be compared (a loaded model's are all owned
        or prepacked)."""
        return not self._stale and not (self.mode == "check" and self._kept)

    def refresh(self, report) -> None:
        """Re-reorder prepared weights whose constant changed (checked, or ``set``)."""
        with self._lock:
            stale = set(self._stale)
            if self.mode == "check":   # kept copies: the constants nobody vouched for
                stale.update(name for name, kept in self._kept.items()
                             if not np.array_equal(_raw(self.arrays[name]), kept))
            if not stale:   # a loaded model (all owned or prepacked): nothing to walk per run
                return
            for (name, _lay), mem in self._prepared.items():
                if name in stale:
                    self._reorder(name, mem, report)
            self._stale.clear()

    def _reorder(self, name, mem, report):
        src = self.arrays[name]
        if name in self._seven_bit and not fits_seven_bit(src):
            raise ArgumentError(f"{name}: the graph's int8 convolutions were planned for weights "
                                f"in [-64, 64] (weight_bits = 7) and the array now holds "
                                f"[{int(src.min())}, {int(src.max())}]: give it with "
                                f"set_constant, which plans the graph again")
        lay = mem.layout
        if winograd.domain_tile(lay, np.shape(src)) is not None:
            # Winograd-domain weights (K, C, m + 2, m + 2) of 3x3 ones: transformed, not reordered
            src_mem = Memory(Layout("oihw", np.shape(src), lay.dtype),
                             np.ascontiguousarray(src).reshape(-1))
            winograd_weights(self.cache, src_mem, mem)
        else:
            src_mem = Memory(_weight_source(lay), np.ascontiguousarray(src).reshape(-1))
            reorder(self.cache, src_mem, mem)
        if report is not None:
            report.weight_reorders += 1
        if self.mode == "check" and name not in self._owned:
            self._kept[name] = _raw(src).copy()


def _weight_source(layout: Layout) -> Layout:
    """The caller's weight array as a layout: ``layout``'s letters in plain order (oihw,
    goihw), the same bytes."""
    return Layout(layout.dims, layout.shape, layout.dtype)


def _raw(array) -> np.ndarray:
    """The bytes of ``array`` as unsigned integers of its item size: compared exactly (a float
    compare would call NaN changed and -0.0 unchanged)."""
    a = np.ascontiguousarray(array).reshape(-1)
    return a.view(f"u{a.itemsize}") if a.itemsize in (1, 2, 4, 8) else a.view(np.uint8)
