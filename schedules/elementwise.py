"""Elementwise ops (eltwise, binary, quantize, dequantize) on every CPU target: outer loops in parallel, the
innermost loop vectorised to the register width.

Their kernels carry conditions that TVM's vectoriser cannot keep in a vector: the block
predicate of a valid-region-only store (``dst_stage``, ``on_handle``, ``user``: padding never
written), the ``if_then_else`` of a masked source read (``src``: source padding ignored) and
the ``Select`` of ``dst_fused``'s zero store. A condition that differs between the lanes of a
vector makes TVM scalarise the whole loop (or, for a Select, blend every vector). So the loops
are partitioned where such a condition changes (the last, partial channel block; a vector that
straddles a tensor's end) until it is the same for every lane of each piece, and the simplifier
folds it away; a Select that still differs between the lanes of one vector is a blend. The
threads run over the whole first piece (one parallel launch, not one per channel block); the
tail's loops are its own, and it runs on the calling thread (a second launch measured slower
at 2 threads than the 1/16 of the work it would share). exp, erf, tanh and sigmoid become
polynomials first (``vector_math``).
"""

from __future__ import annotations

import math

import tvm
import tvm_ffi
from tvm import s_tir

from . import generic
from .common import SPATIAL, is_true, vector_lanes
from .nest import Nest
from .rule import ScheduleRule
from .vector_math import vector_math

TASK_ELEMS = 4096      # a parallel task gets at least this many elements...
SERIAL_ELEMS = 16384   # ...and a kernel this small runs on one thread


class Elementwise(ScheduleRule):
    """Eltwise and binary ops: outer loops in parallel, innermost loop vectorised to the
    register width, loops partitioned so that no condition varies across the lanes."""

    ops = ("eltwise", "binary", "quantize", "dequantize")

    def schedule(self, func, target):
        sch = s_tir.Schedule(vector_math(func))
        try:
            for block in generic.root_blocks(sch):
                _elementwise(sch, block, target)
        except s_tir.ScheduleError:
            return None   # a nest this rule did not foresee: the fallback's plain schedule
        return sch


def _elementwise(sch, block, target):
    loops = sch.get_loops(block)
    if not loops or any(iv.iter_type != SPATIAL for iv in sch.get(block).iter_vars):
        return
    lanes = vector_lanes(target, str(sch.get(block).writes[0].source.dtype))
    if int(sch.get(loops[-1]).extent) > lanes:
        sch.split(loops[-1], [None, lanes])   # a tail that does not divide becomes a predicate
    # threads first, over the outer loops the lane conditions do not use (those get
    # partitioned, which a fused loop cannot be); if none is left, inside each piece
    done = _parallel(sch, block, skip=0)
    for leaf in _partition(sch, block, vector=False):
        if not done and not any(_Nest(sch, leaf).mins):   # the first piece; the tail: serial
            _parallel(sch, leaf, skip=0)
        for piece in _partition(sch, leaf, vector=True):
            vec = sch.get_loops(piece)[-1]
            if int(sch.get(vec).extent) > 1:
                sch.vectorize(vec)


def _parallel(sch, block, skip) -> bool:
    """Fuse outer loops (after the first ``skip``, before the vector loop and before any loop
    a lane condition uses) until a task holds at most TASK_ELEMS elements, and run them in
    parallel. True when the nest is done with: parallel now, or too small to want threads."""
    nest = _Nest(sch, block)
    loops, extents = nest.loops[:-1], nest.extents[:-1]
    if math.prod(nest.extents) <= SERIAL_ELEMS:
        return True
    conds = nest.lane_conditions()
    work, fused = math.prod(nest.extents[skip:]), []
    for i in range(skip, len(loops)):
        if any(nest.uses(c, i) for c in conds):
            break
        fused.append(loops[i])
        work //= extents[i]
        if work <= TASK_ELEMS:
            break
    if math.prod(extents[skip:skip + len(fused)]) < 2:
        return False
    sch.parallel(sch.fuse(*fused) if len(fused) > 1 else fused[0])
    return True


def _partition(sch, block, vector):
    """Partition ``block``'s loops where a condition that depends on the innermost (vector)
    loop changes value, until each piece sees it the same in every lane; return the leaf blocks
    (each piece's nest begins with its piece of the partitioned loop). ``vector``: partition
    the vector loop itself (the last step) rather than the loops around it, and only for the
    conditions a vector cannot keep: a Select that differs between lanes stays one blend
    (cutting 8 lanes into 2 + 6 costs more). Loops are cut where they are: ``reorder`` refuses
    the padding predicates (not an affine binding)."""
    nest = _Nest(sch, block)
    conds = nest.lane_conditions(blends=not vector)
    if not conds:
        return [block]
    lane = len(nest.loops) - 1
    candidates = [lane] if vector else [
        i for i in range(lane) if nest.extents[i] > 1 and any(nest.uses(c, i) for c in conds)]
    for i in candidates:
        segments = nest.segments(i, conds)
        if len(segments) < 2:
            continue
        parts = sch.loop_partition(nest.loops[i], [b - a for a, b in segments[:-1]])
        return [leaf for part in parts for child in sch.get_child_blocks(part)
                for leaf in _partition(sch, child, vector)]
    return [block]


class _Nest(Nest):
    """The nest with its conditions: the block predicate and every ``if_then_else`` test."""

    def __init__(self, sch, block):
        super().__init__(sch, block)
        self.conditions, self.blends = [], []
        if not is_true(self.predicate):
            self.conditions.append(self.predicate)

        def visit(call):
            if getattr(call.op, "name", "").endswith("if_then_else"):
                self.conditions.append(self.over_loops(call.args[0]))

        def visit_select(select):   # an index test (dst_fused's zero store), not a data test
            if not _reads(select.condition):
                self.blends.append(self.over_loops(select.condition))
        tvm_ffi.structural_walk(self.block.body, [(tvm.ir.expr.Call, visit),
                                                  (tvm.tirx.Select, visit_select)])

    def lane_conditions(self, blends=True) -> list:
        """The conditions that may differ between lanes: they use the vector loop, and the
        ranges of the loops (a partitioned piece's included) do not decide them. ``blends``:
        the Selects' too."""
        lane = len(self.loops) - 1
        conds = self.conditions + (self.blends if blends else [])
        return [c for c in conds
                if self.uses(c, lane) and self.status(c) is None] if self.loops else []


def _reads(expr) -> bool:
    loads = []
    tvm_ffi.structural_walk(expr, (tvm.ir.expr.TensorLoad, loads.append))
    return bool(loads)
