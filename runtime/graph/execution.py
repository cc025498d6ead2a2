"""Running a plan: a ``Runner`` holds the arenas of one ``Plan`` (one ``_Execution`` per
concurrent run, reused run after run), prepares the weights through the graph's
``WeightCache``, binds each step's memories to its kernel once, and calls the steps in order.

Padding policy: every memory the graph makes follows the graph's policy (its kernels are built
or picked for it): a buffer is given to its memory (``set_data_handle``) when its producer is
about to write it, so ``on_handle`` zero-pads there, and ``tracked`` zero-pads only where a
consumer needs clean padding that its producer did not leave. ``user`` is seed 001's option
B/C: the graph tells each ``set_data_handle`` whether the buffer is clean (an arena buffer
whose zeros an earlier run left and nothing overwrote since), the caller says which inputs are
(``run(..., clean=["x"])``), and the zero-pads that remain go on ``run(..., stream=)``,
asynchronously.

What a runner reads of its plan is the plan's documented data (``steps``, ``bufs``,
``outputs``, ``weight_bufs``, ``slots``, ``bind_at``); it never plans."""

from __future__ import annotations

import math
import threading
import time
from contextlib import contextmanager

import numpy as np

from blockpad.errors import ArgumentError
from blockpad.layout import numpy_dtype
from blockpad.vocabulary import KERNEL_ZEROS

from .. import counters
from ..memory import CLEAN, UNKNOWN, Memory, aligned_empty
from ..padding import zero_pad
from . import native
from .kernels import MemoryRuntime, numpy_reorder
from .ops import GRAPH_OPS
from .planning import Plan
from .results import Report, Result, Results
from .weights import WeightCache

BIND_LABEL = "(bind)"   # the label of a memory's creation among a run's calls
# An output storage this small is written into a buffer of the arena's, kept from run to run,
# and copied out to the caller; a larger one is a new buffer each run, written in place. Each
# new buffer remakes its kernel's bound arguments, which costs ~0.1 ms with the interpreter's
# data out of cache after a network (MobileNetV2's classifier: 0.17 -> 0.30 ms a run), where
# copying a 4 KB result costs a microsecond; at a few MiB the copy costs more.
OUTPUT_COPY_BYTES = 1 << 20


class Runner:
    """A plan and the arenas that run it. ``weights``: the graph's WeightCache; ``cache``: its
    KernelCache (results read to plain reorder with it); ``ops``: the graph's op count (for
    the report)."""

    def __init__(self, plan: Plan, weights: WeightCache, cache, ops: int, native_plan=None):
        self.plan = plan
        self.weights = weights
        self.cache = cache
        self.ops = ops
        # (compiled plan function, the digest of the calls it makes): a built model's, or None
        self.native_plan = native_plan
        self.runtime = MemoryRuntime(plan.policy, cache)
        self._pool: list = []
        self._pool_lock = threading.Lock()
        self._weights = None   # buffer id -> prepared Memory, the same objects every run
        # what the report says of the plan, the same every run
        self._inplace = [s.label for s in plan.steps if s.inplace]
        self._fused = [" + ".join(names) for names in plan.fused]
        self._weight_bytes = sum(b.layout.nbytes for _, b in plan.weight_bufs)
        self._kernels = sum(1 for s in plan.steps if s.kernel is not None)
        self._reorders = sum(1 for s in plan.steps if s.kind == "reorder")

    @contextmanager
    def arena(self):
        """An ``_Execution`` of the plan to run on, back in the pool afterwards: its ``calls``
        are the bound steps (after a first run), which a benchmark may time one by one."""
        with self._pool_lock:
            exe = self._pool.pop() if self._pool else None
        if exe is None:
            exe = _Execution(self.plan, self.runtime, self.weights, self.native_plan)
        try:
            yield exe
        finally:
            with self._pool_lock:
                self._pool.append(exe)

    def run_arrays(self, given: dict) -> dict | None:
        """The results as numpy arrays, for a caller that wants nothing else (``Model``'s
        call): an idle arena's plan function on the given arrays, the results copied out;
        no Report, no Results. None where the run needs ``run``: no idle arena whose calls the
        plan function makes, weights to reorder, an input that is not a row-major array of
        its dtype, a result that is not plain. A run of MobileNetV2 costs ~0.1 ms less so
        (Zen 4, 1 and 2 threads: 6.26 -> 6.17 ms, 3.37 -> 3.27), with the interpreter's data
        out of cache after the network every operation counts."""
        if not self.weights.current():
            return None
        with self._pool_lock:
            exe = self._pool.pop() if self._pool else None
        if exe is None:
            return None
        try:
            return exe.run_arrays(given, self._weights, self.weights.version)
        finally:
            with self._pool_lock:
                self._pool.append(exe)

    def run(self, given, before_cache, plan_seconds=0.0, clean=frozenset(),
            stream=None) -> Results:
        plan = self.plan
        report = Report(plan.policy, plan_seconds=plan_seconds)
        start = time.perf_counter()
        with counters.scope() as zp:
            self.weights.refresh(report)
            if self._weights is None:
                # prepared once: a change of a constant re-reorders into the same Memory
                self._weights = {buf.id: self.weights.prepare(cname, buf.layout, report)
                                 for cname, buf in plan.weight_bufs}
            with self.arena() as exe:
                outs = exe.run(given, self._weights, report, clean, stream)
        run_seconds = time.perf_counter() - start
        after_cache = self.cache.stats()

        def finish():   # the rest of the report, filled when the caller first reads it
            report.zero_pad_calls = zp.calls
            report.zero_pad_bytes = zp.bytes
            report.zero_pad_blocking = zp.blocking_calls
            report.run_seconds = run_seconds
            report.seconds = plan_seconds + run_seconds
            report.ops = self.ops
            report.kernels, report.reorders = self._kernels, self._reorders
            report.inplace = list(self._inplace)
            report.fused = list(self._fused)
            report.fallbacks = dict(plan.fallbacks)
            report.peak_bytes = plan.peak_bytes
            report.arena_bytes = plan.arena_bytes
            report.weight_bytes = self._weight_bytes
            report.cache = (after_cache - before_cache).as_dict()
        lock = threading.Lock()
        return Results({n: Result(n, m, self.cache, report, lock) for n, m in outs.items()},
                       report, finish)


def describe_plan(plan: Plan, cache, shared=None, views=None) -> tuple:
    """``native.describe`` of ``plan`` over a fresh arena (the build writes the plan function
    from it): ``(Description, sources)`` or ``(None, reason)``. ``views``: ``{(constant name,
    Layout): array}``, where each constant lies in ``shared`` as the loaded model's will (the
    offsets of ``weights.bin``); a step reading a constant as it is reads its plain one."""
    exe = _Execution(plan, MemoryRuntime(plan.policy, cache), None)
    views = views or {}
    weight = {buf.id: name for name, buf in plan.weight_bufs}
    plain = {name: v for (name, lay), v in views.items() if lay.is_plain}
    for b in plan.bufs:
        s = b.storage
        if views and s.kind == "weight":
            exe.mems[b.id].buffer = views[(weight[b.id], b.layout)]
        elif views and s.kind == "constant" and s.last is not None:   # read by a step
            exe.mems[b.id].buffer = plain[s.value]
    return native.describe(exe, shared)


class _Execution:
    """One arena of a plan: buffers and memories bound to the kernels, reused run after run
    (one per concurrent run)."""

    def __init__(self, plan: Plan, runtime: MemoryRuntime, weights: WeightCache,
                 native_plan=None):
        self.plan = plan
        self.runtime = runtime
        self.weights = weights
        self._native_plan = native_plan   # checked against this arena's calls at the bind
        self.native = None                # native.Native once the first run bound the calls
        self.slots = [aligned_empty(n, np.uint8) for n in plan.slots]
        self.mems = {}
        kept = {}   # storage id -> the buffer of a small output storage (OUTPUT_COPY_BYTES)
        for b in plan.bufs:
            s = b.storage
            dt = numpy_dtype(b.layout.dtype)
            if s.kind == "arena":
                raw = self.slots[s.slot]
                buf = raw[:b.layout.nbytes].view(dt)
            elif s.kind == "output" and s.nbytes <= OUTPUT_COPY_BYTES:
                if s.id not in kept:
                    kept[s.id] = aligned_empty(s.nbytes, np.uint8)
                buf = kept[s.id][:b.layout.nbytes].view(dt)
            else:   # input / constant / weight / output: given per run; a placeholder now
                buf = np.zeros(b.layout.alloc_len, dt)
            self.mems[b.id] = Memory(b.layout, buf, library=runtime)
        # values sharing a storage (in place) share one Memory, so their state is one state
        first = {}
        for b in plan.bufs:
            key = (b.storage.id, b.layout)
            if key in first:
                self.mems[b.id] = self.mems[first[key]]
            else:
                first[key] = b.id
        # the memories of each arena slot: binding one storage overwrites the others' bytes
        self._slot_mems = {}
        for b in plan.bufs:
            if b.storage.kind == "arena" and b.layout.has_padding:
                self._slot_mems.setdefault(b.storage.slot, set()).add(self.mems[b.id])
        # the buffers given per run, by kind, in plan order (an arena's are bound once)
        given = [(b, self.mems[b.id]) for b in plan.bufs if b.storage.kind != "arena"]
        self.inputs = [(b, m) for b, m in given if b.storage.kind == "input"]
        self._constants = [(b, m) for b, m in given
                           if b.storage.kind == "constant" and b.storage.last is not None]
        self._weight_mems = [(b, m) for b, m in given if b.storage.kind == "weight"]
        self.fresh_outputs = [(b, m) for b, m in given if b.storage.kind == "output"
                              and b.storage.id not in kept]   # a new buffer each run
        self._copied = set(kept)
        # (name, the result as an array of its shape) of each result where every one is plain
        # in a kept buffer (``run_arrays`` copies them out), else None; the kept buffers are
        # this arena's for its life, so the views are made once: slicing and reshaping per
        # run cost MobileNetV2 ~18 us at 1 thread, the interpreter's data out of cache
        outs = [(name, self.mems[b.id], b) for name, b in plan.outputs.items()]
        self._plain_outputs = [(name, mem.buffer[:math.prod(b.layout.shape)].reshape(
                                   b.layout.shape)) for name, mem, b in outs] \
            if all(b.storage.id in kept and b.layout.is_plain and b.storage.kind == "output"
                   for _, _, b in outs) else None
        self._unique_mems = list({id(m): m for m in self.mems.values()}.values())
        self._weights_of = None    # the weights dict the weight memories point into
        self._constants_of = None  # the WeightCache version the constant memories point into
        self.stream = None
        self.calls = []
        self.labels = []   # each call's step label, or BIND_LABEL for a memory's creation
        self._bound = False
        self._flats = {}   # constant name -> (its array, the flat view the kernels read)
        self._held = {}    # input name -> (the array given last run, its flat view), or None

    def run_arrays(self, given, weights, version) -> dict | None:
        """``Runner.run_arrays`` on this arena (None: not here, see there)."""
        outs = self._plain_outputs
        if (self.native is None or outs is None or self._weights_of is not weights
                or self._constants_of != version):
            return None
        for b, _ in self.inputs:
            value = given[b.storage.value]
            if not (type(value) is np.ndarray and value.flags.c_contiguous
                    and value.flags.aligned):
                return None
        for b, mem in self.inputs:
            value = given[b.storage.value]
            held = self._held.get(b.storage.value)
            if held is None or held[0] is not value:
                held = self._held[b.storage.value] = (value, value.reshape(-1))
            mem.buffer, mem.state = held[1], CLEAN
        self.native.run()
        return {name: view.copy() for name, view in outs}

    def _flat(self, name):
        """The constant ``name`` as a flat buffer, the same object run after run while the
        array is (a new object would make each bound kernel call rebuild its arguments and
        repeat its checks)."""
        arr = self.weights.arrays[name]
        held = self._flats.get(name)
        if held is None or held[0] is not arr:
            held = self._flats[name] = (arr, np.ascontiguousarray(arr).reshape(-1))
        return held[1]

    def _bind(self, weights):
        plan = self.plan
        calls, labels = [], []
        # under a policy whose kernels zero their destinations' padding, a memory's creation
        # does nothing: its producer writes it, and marks it clean, before anything reads it
        # (pruned ResNet-50, 51 padded arena buffers: 0.46 ms a run of bookkeeping saved)
        binds = plan.policy not in KERNEL_ZEROS
        as_planned = True   # every step bound to its planned kernel (not an in-place twin)
        for i, st in enumerate(plan.steps):
            for s in plan.bind_at.get(i, ()) if binds else ():
                if s.kind in ("arena", "output"):
                    for b in s.bufs:
                        if b.layout.has_padding:
                            calls.append(self._binder(b))
                            labels.append(BIND_LABEL)
            if st.kernel is not None:
                bound = st.kernel.bind(*(self.mems[b.id] for b in st.args))
                as_planned = as_planned and bound.kernel is st.kernel
                # under these policies the plan keeps every source clean (BoundCall.trusted)
                calls.append(bound.trusted() if plan.policy in KERNEL_ZEROS else bound)
            elif st.kind == "reorder":
                calls.append(self._np_reorder(self.mems[st.reads[0].id],
                                              self.mems[st.writes[0].id]))
            else:
                calls.append(self._numpy(st))
            labels.append(st.label)
        self.calls, self.labels = calls, labels
        self._bound = True
        self._as_planned = as_planned
        self._attach_native()

    def _attach_native(self):
        """The plan function over this arena's buffers as they are bound now, if its calls are
        the ones the build described (the digest), else None: the calls from Python."""
        self.native = None
        if self._native_plan is None or not self._as_planned:
            return
        function, digest = self._native_plan
        desc, sources = native.describe(self)
        if desc is not None and desc.digest() == digest:
            self.native = native.Native(function, self, sources)

    def _binder(self, b):
        """The policy's work at "memory creation" for the buffer ``b`` its producer is about
        to write. Under ``user`` the graph says what it knows, as seed 001 asks of a user:
        ``clean`` when the memory's padding is still the zeros an earlier run left (kernels
        preserve padding there; binding another storage of the slot makes it unknown), and
        the zero-pad of one that is not goes on the run's stream, if it has one."""
        mem = self.mems[b.id]
        user = self.plan.policy == "user"
        others = [m for m in self._slot_mems.get(b.storage.slot, ()) if m is not mem] \
            if b.storage.kind == "arena" else []

        def bind():
            for m in others:
                m.state = UNKNOWN
            mem.set_data_handle(mem.buffer, clean=user and mem.state == CLEAN,
                                stream=self.stream)
        return bind

    @staticmethod
    def _np_reorder(src, dst):
        def run():
            dst.wait()
            numpy_reorder(src, dst)
        return run

    def _numpy(self, st):
        info = GRAPH_OPS[st.node.op]
        ins = [self.mems[b.id] for b in st.reads]
        outs = [self.mems[b.id] for b in st.writes]

        def run():
            for m in ins + outs:
                m.wait()
            arrays = [_plain_view(m) for m in ins]
            results = info.reference(st.node, arrays)
            if len(results) != len(outs):
                raise ArgumentError(f"{st.label}: returned {len(results)} arrays; expected "
                                    f"{len(outs)}")
            for m, r in zip(outs, results):
                r = np.asarray(r)
                if r.shape != m.layout.shape:
                    raise ArgumentError(f"{st.label}: returned shape {r.shape}; expected "
                                        f"{m.layout.shape}")
                _plain_view(m)[...] = r
                m.state = CLEAN
        return run

    def run(self, given, weights, report, clean=frozenset(), stream=None):
        plan = self.plan
        self.stream = stream
        rebound = stream is not None   # a stream's zero-pads are waited for by checked calls
        for b, mem in self.inputs:
            s = b.storage
            value = given[s.value]
            held = self._held.get(s.value)
            if held is not None and held[0] is value:
                # the array of the last run again: its flat view again, so the kernels reading
                # it keep their bound arguments (remade, ~30 us after a network, cold)
                mem.buffer, mem.state = held[1], CLEAN
            else:
                mem.buffer, mem.state = _input_buffer(value, b.layout)
                # a view only: a copy (of a non-contiguous array) would miss later writes
                alias = isinstance(value, np.ndarray) and np.may_share_memory(mem.buffer, value)
                self._held[s.value] = (value, mem.buffer) if alias else None
            if s.value in clean:
                mem.state = CLEAN          # the caller vouches for its padding
            if mem.state != CLEAN and plan.policy == "user" and stream is not None:
                # set_data_handle(buf, clean=False, stream): zeroed on the stream; the
                # kernels reading it wait for that (a read-only buffer is copied there)
                mem.set_data_handle(mem.buffer, stream=stream)
            elif mem.state != CLEAN and plan.policy not in ("tracked", "src"):
                # the caller's memory has padding of unknown content: the policy's kernels
                # trust it clean, so zero it now (a read-only buffer is copied, not written)
                zero_pad(mem, blocking=True)
                if isinstance(value, Memory) and mem.buffer is value.buffer:
                    value.state = CLEAN
        if self._constants_of != self.weights.version:   # a constant read as it is by a step
            for b, mem in self._constants:
                mem.buffer, mem.state = self._flat(b.storage.value), CLEAN
            self._constants_of = self.weights.version
            rebound = True
        if self._weights_of is not weights:
            for b, mem in self._weight_mems:
                w = weights[b.id]
                mem.buffer, mem.state = w.buffer, w.state
            self._weights_of = weights
            rebound = True
        for b, mem in self.fresh_outputs:
            s = b.storage
            if b is s.bufs[0]:
                fresh = aligned_empty(s.nbytes, np.uint8)
            mem.buffer = fresh[:b.layout.nbytes].view(numpy_dtype(b.layout.dtype))
            mem.state = UNKNOWN                 # a new buffer: its padding is anything
        first = not self._bound
        if first:
            self._bind(weights)   # and the plan function, if its calls are these
            rebound = True
        report.native = self.native is not None and not rebound
        if report.native:
            self.native.run()
        else:   # the first run, or new weights or constants: every call checks its arguments
            for call in self.calls:
                call()
            if rebound and not first:
                self._attach_native()   # new weights or constants: described again
        if stream is not None:
            for mem in self._unique_mems:
                mem.wait()   # a zero-pad on the stream that no kernel waited for (none expected)
        outs = {}
        for name, b in plan.outputs.items():
            mem = self.mems[b.id]
            # the caller gets its own Memory: a large output's buffer is new each run, a small
            # one's is kept and copied out; a result that is a graph input or constant is a
            # copy, never the caller's array
            buf = mem.buffer
            if b.storage.kind in ("input", "constant", "weight") or b.storage.id in self._copied:
                buf = buf.copy()   # element-aligned, as a Memory needs (aligned_empty's
                #                    cache-line start costs ~60 us after a network, cold)
            outs[name] = Memory(mem.layout, buf, mem.state, library=self.runtime)
        return outs


def _input_buffer(value, layout):
    if isinstance(value, Memory):
        value.wait()
        return value.buffer, value.state
    arr = np.asarray(value)
    if arr.dtype != numpy_dtype(layout.dtype):
        raise ArgumentError(f"input: expected dtype {layout.dtype}; got {arr.dtype}")
    if not arr.flags.c_contiguous or arr.ctypes.data % arr.itemsize:
        arr = np.ascontiguousarray(arr).copy()
    return arr.reshape(-1), CLEAN


def _plain_view(mem: Memory) -> np.ndarray:
    lay = mem.layout
    return mem.buffer[:lay.alloc_len].reshape(lay.shape)

