"""A plan's kernel calls made by one compiled function instead of a Python loop.

A built model's run calls its kernels one by one from Python: about 1.7 us a bound call, more
with the interpreter's data out of cache after each kernel, 0.1-0.3 ms a run for MobileNetV2's
60 steps, as much as a tenth of a 2-thread run. Where a plan is nothing but kernel calls whose
arguments the graph keeps by construction (``describe``), the model build compiles a function
(``plan.so``, ``codegen/plan_function.py``) that makes the same calls, in the same order, on
the same views: each argument a DLTensor made on the stack from a pointer into one of the
run's backing buffers (an arena slot, an input, the weights, a result), each kernel looked up in
the model's library by the symbol this pool size calls. A run then passes its backing buffers
in one call (``Native``).

``describe`` is the one statement of those calls: the build writes the function from it, and
the first run of each arena describes its own plan again and calls the function only if the
description's digest is the one the build recorded (a runtime that would bind differently runs
its Python calls instead, with the same results). The first run always binds and calls from
Python: it checks every argument as a direct call would.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import numpy as np

from blockpad.vocabulary import KERNEL_ZEROS

from ..memory import CLEAN, _readable_alias

#: the plan function a pool of any size calls; ``<PLAN_FUNCTION>__threads<N>`` where some
#: kernel has a variant for a pool of N threads (``Library.symbol``)
PLAN_FUNCTION = "blockpad_plan"


@dataclass(frozen=True)
class Arg:
    """One kernel argument: a view ``offset`` bytes into backing buffer ``backing``, of
    ``shape`` and ``dtype``, with element ``strides`` (None: row-major)."""

    backing: int
    offset: int
    shape: tuple
    dtype: str
    strides: tuple | None


@dataclass(frozen=True)
class Call:
    """A kernel (by name) and its arguments."""

    kernel: str
    args: tuple


@dataclass(frozen=True)
class Description:
    """The calls of a plan over ``backings`` buffers (arena slots first, then the shared
    buffer and the other memories, in order of first use)."""

    backings: int
    calls: tuple

    def digest(self) -> str:
        doc = [self.backings, [[c.kernel, [[a.backing, a.offset, list(a.shape), a.dtype,
                                            list(a.strides) if a.strides else None]
                                           for a in c.args]] for c in self.calls]]
        return hashlib.sha256(json.dumps(doc).encode()).hexdigest()


def describe(exe, shared=None) -> tuple:
    """``(Description, sources)`` of an ``_Execution``'s plan, or ``(None, reason)`` where its
    run needs more than kernel calls: a step that is not a kernel, a policy whose kernels do
    not zero their destinations' padding (the run zero-pads between calls), a kernel whose
    contract is not the plain one (a destination stage, padding preserved or inherited: what
    ``BoundCall.trusted`` keeps checked), a sub-memory argument.

    ``shared`` (default: the execution's ``WeightCache.backing``): one buffer that memories
    may lie in, a loaded model's weights as ``weights.bin`` is read: every memory inside it is
    an offset into one backing, not a backing of its own. DenseNet-121's plan function took
    334 buffers so, one per weight and bias, and compiled in 17.5 s; with 30, in 4.7 s
    (LLVM's code for unpacking and checking each argument was most of it).

    ``sources``, one per backing in the description's order: an array (an arena slot, the
    shared buffer) or the Memory whose current buffer a run passes (an input, a result)."""
    plan = exe.plan
    if plan.policy not in KERNEL_ZEROS:
        return None, f"policy {plan.policy!r} zero-pads between kernel calls"
    if shared is None and exe.weights is not None:
        shared = exe.weights.backing
    index = {}
    sources = list(exe.slots)
    calls = []
    for st in plan.steps:
        if st.kernel is None:
            return None, f"step {st.label!r} is not a kernel call"
        sig = st.kernel.signature
        produces = sig.padding["produces"] if sig.padding else CLEAN
        if sig.stage or produces != CLEAN:
            return None, f"kernel {sig.name} has a padding contract the run checks per call"
        args = []
        for b, a in zip(st.args, sig.args):
            mem = exe.mems[b.id]
            if mem.parent is not None:
                return None, f"kernel {sig.name} takes a sub-memory"
            view = mem.physical_view(a.storage)
            if b.storage.kind == "arena":
                i = b.storage.slot
                base = sources[i]
            else:
                inside = shared is not None and _within(mem.buffer, shared)
                key = "shared" if inside else id(mem)
                i = index.setdefault(key, len(sources))
                if i == len(sources):
                    sources.append(shared if inside else mem)
                base = shared if inside else mem.buffer
            offset = _address(view) - _address(base)
            row_major = view.flags.c_contiguous
            args.append(Arg(i, int(offset), tuple(int(n) for n in view.shape), view.dtype.name,
                            None if row_major else tuple(s // view.itemsize for s in view.strides)))
        calls.append(Call(sig.name, tuple(args)))
    return Description(len(sources), tuple(calls)), sources


def _address(a) -> int:
    return a.__array_interface__["data"][0]


def _within(buf, shared) -> bool:
    start, end = _address(shared), _address(shared) + shared.nbytes
    return start <= _address(buf) and _address(buf) + buf.nbytes <= end


class Native:
    """The compiled plan bound to one execution's buffers (``describe``'s ``sources``):
    ``run()`` makes every call of the plan. The arguments are made once; only the memories
    whose buffer a run may change (an input given as a new array, a large result's new
    buffer) are looked at per run. New weights or constants describe the execution again
    (``_Execution``): a description that changed means no plan function."""

    def __init__(self, function, exe, sources):
        from ..tvm_runtime import as_tensor

        self._as_tensor = as_tensor
        self._function = function
        volatile = {id(m) for _, m in exe.inputs} | {id(m) for _, m in exe.fresh_outputs}
        self._volatile = [(i, m) for i, m in enumerate(sources) if id(m) in volatile]
        # what a checked call would mark clean and a run does not leave so: the results
        # given a new buffer each run (the arena's stay clean from the first, checked run)
        self._written = [m for _, m in exe.fresh_outputs]
        self._args = [self._tensor(s if isinstance(s, np.ndarray) else s.buffer)
                      for s in sources]
        self._buffers = {i: m.buffer for i, m in self._volatile}

    def _tensor(self, buf):
        raw = buf if buf.flags.writeable else _readable_alias(buf)   # as Memory.kernel_arg
        return self._as_tensor(raw.view("uint8"))

    def run(self):
        args = self._args
        for i, mem in self._volatile:
            buf = mem.buffer
            if buf is not self._buffers[i]:
                args[i] = self._tensor(buf)
                self._buffers[i] = buf
        self._function(*args)
        for mem in self._written:
            mem.state = CLEAN
