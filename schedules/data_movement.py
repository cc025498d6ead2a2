"""CPU schedules (x86 AVX2 and AVX-512, Arm NEON) for data movement: reorders and zero fills.

A reorder is declared over the destination's physical index space, so walking it in order gives
contiguous stores; its loads are contiguous only along the one loop that walks the source's
innermost dim (the loop with the smallest source stride). When that loop is not the innermost
(nchw <-> nChw16c), a vector store gathers its lanes from elements far apart in the source, and a
plain walk leaves each source cache line before it has used all of it (nChw16c -> nchw reads
one element of a line per plane and comes back to the line only after a whole plane). So the
nest is tiled, as a cache-blocked transpose is: that loop moves inside, next to the destination's
innermost loop, split to ``TILE_ROWS`` steps (unrolled) when the tile would outgrow
``TILE_BYTES``. Every source line is then used whole while it sits in L1, and every store is a
whole vector; the loads stay gathers (LLVM does not turn the unrolled tile into a register
transpose).

Padding makes the kernel write ``if_then_else(is_padding, 0, src[...])``. When the condition
differs between the lanes of a vector (the last, partial block of a blocked dim; a halo on the
innermost dim), TVM gives up vectorising the loop. The loops are therefore partitioned where the
condition changes, so that in every piece it is provably all padding or all data, and the
simplifier folds it away.

Threads: the loops outside the tile are fused and run in parallel (TVM's pool gives each thread
one contiguous chunk of the range); kernels under ``SERIAL_BYTES`` run on one thread, where a
parallel launch costs more than it saves (measured on 2 cores).

The rule looks only at the loops and the index expressions of the block, never at layout tags.
"""

from __future__ import annotations

import functools
import math

import tvm
import tvm_ffi
from tvm import s_tir, tirx

from .common import divisor_at_most, vector_lanes
from .generic import root_blocks
from .nest import Nest, uses
from .rule import ScheduleRule

TILE_BYTES = 8 << 10     # a tile (source-contiguous loop x destination's innermost) this small
                         # is taken whole: the walk stays the plain one, streams stay long
TILE_ROWS = 16           # else: this many steps of the source-contiguous loop (unrolled), a
                         # 64-byte line of fp32; measured no better for bf16 or int8 with more
LINE_BYTES = 64          # a destination row up to a cache line is written whole per step
TASK_ELEMS = 4096        # parallel tasks at least this many elements...
SERIAL_BYTES = 128 << 10  # ...and no threads at all below this many bytes (measured crossover)


class DataMovement(ScheduleRule):
    """Reorders (tiled transpose, partitioned at padding edges) and zero fills (vectorised
    along the innermost dim, outer dims in parallel)."""

    ops = ("reorder", "zero_pad")

    def schedule(self, func, target):
        sch = s_tir.Schedule(func)
        try:
            for block in root_blocks(sch):
                if _Nest(sch, block).offset is None:
                    _fill(sch, block, target)
                else:
                    _move(sch, block, target)
        except s_tir.ScheduleError:
            # a nest this rule did not foresee: the plain schedule is slower, but always valid
            sch = s_tir.Schedule(func)
            for block in root_blocks(sch):
                _fill(sch, block, target)
        return sch


def _move(sch, block, target):
    """Schedule one reorder block: partition at padding edges, tile, parallelise, vectorise."""
    nest = _Nest(sch, block)
    lanes = vector_lanes(target, nest.dtype)
    itemsize = tvm_ffi.dtype(nest.dtype).itemsize
    # padding edges along outer loops (the last, partial channel block) get loop nests of their
    # own: the partitioned loop is moved to the top, so that the rest stays one nest to tile
    for leaf in _partition(sch, block, 0, len(nest.loops) - 1, to_top=True):
        _tile(sch, leaf, lanes, itemsize)


def _tile(sch, block, lanes, itemsize):
    """Tile one loop nest for the transpose, run its outer loops in parallel, partition its
    vector loop at padding edges and vectorise it."""
    nest = _Nest(sch, block)
    loops, n = nest.loops, len(nest.loops)
    # a partitioned loop (it starts past 0) can be neither split nor fused: it stays on top
    top = 0 if n == 1 or nest.mins[0] == 0 else 1
    d = n - 1
    strides = [nest.src_stride(i) for i in range(n)]
    s = min((i for i in range(top, n) if nest.extents[i] > 1), default=d,
            key=lambda i: (strides[i], -i))

    d_loops = [loops[d]]
    if nest.extents[d] > lanes and nest.mins[d] == 0:
        d_loops = list(sch.split(loops[d], [None, lanes]))
    inner = d_loops
    if s != d and strides[d] != 1:
        # tile: rows along the source-contiguous loop s, one vector of the destination each
        rows = nest.extents[s]
        if rows * nest.extents[d] * itemsize > TILE_BYTES:
            rows = divisor_at_most(rows, TILE_ROWS)
        s_loops = list(sch.split(loops[s], [None, rows])) if rows < nest.extents[s] else [loops[s]]
        outer = [s_loops[0] if i == s else loops[i] for i in range(top, d)
                 if not (i == s and len(s_loops) == 1)]
        # a destination row of at most a cache line is written whole per source step
        whole = nest.extents[d] * itemsize <= LINE_BYTES
        inner = [s_loops[-1]] + d_loops if whole else d_loops[:-1] + [s_loops[-1], d_loops[-1]]
        sch.reorder(*outer, *inner)
        if rows <= TILE_ROWS:
            sch.unroll(s_loops[-1])
    loops = sch.get_loops(block)
    outer = loops[top:len(loops) - len(inner)]

    # parallel over the outer loops, leaving enough work inside each task to amortise it
    extents = [int(sch.get(l).extent) for l in outer]
    work = math.prod(extents) * math.prod(int(sch.get(l).extent) for l in inner)
    if work * itemsize >= SERIAL_BYTES:
        fused = []
        for loop, ext in zip(outer, extents):
            fused.append(loop)
            work //= ext
            if work <= TASK_ELEMS:
                break
        if math.prod(extents[: len(fused)]) > 1:
            sch.parallel(sch.fuse(*fused) if len(fused) > 1 else fused[0])

    # padding edges along the vector lanes (a partial block, a halo on the innermost dim)
    m = len(sch.get_loops(block))
    for leaf in _partition(sch, block, m - len(inner), m, to_top=False):
        vec = sch.get_loops(leaf)[-1]
        if int(sch.get(vec).extent) > 1:
            sch.vectorize(vec)


def _partition(sch, block, first, stop, to_top):
    """Partition loops ``first..stop-1`` of ``block`` (outer first) where the padding condition,
    as seen by the innermost loop's lanes, changes; return the resulting blocks. A partition
    wraps each piece in a block of its own, whose loops start with the piece of the partitioned
    loop. ``to_top`` moves a loop above loops ``first..`` before partitioning it."""
    nest = _Nest(sch, block)
    conds = nest.lane_conditions()
    if all(nest.status(c) is not None for c in conds):
        return [block]
    for i in range(first, stop):
        if nest.extents[i] == 1 or nest.kinds[i] != 0 \
                or not any(uses(c, nest.vars[i]) for c in conds):
            continue
        segments = nest.segments(i, conds)
        if len(segments) < 2:
            continue
        loop = nest.loops[i]
        if to_top and i != first:
            sch.reorder(loop, *(l for j, l in enumerate(nest.loops[first:], first) if j != i))
            i = first
        parts = sch.loop_partition(loop, [b - a for a, b in segments[:-1]])
        return [leaf for part in parts
                for child in sch.get_child_blocks(part)
                for leaf in _partition(sch, child, 1, stop - i, to_top)]
    return [block]


def _fill(sch, block, target):
    """Zero fills (and the fallback for any block): vectorise the innermost dim (split to the
    register width), outer dims in parallel."""
    loops = sch.get_loops(block)
    extents = [int(sch.get(l).extent) for l in loops]
    lanes = vector_lanes(target, _Nest(sch, block).dtype)
    inner = loops[-1]
    if extents[-1] > lanes:
        _, inner = sch.split(inner, [None, lanes])
        extents[-1] = lanes
    outer, work = [], math.prod(extents)
    for loop, n in zip(loops[:-1], extents[:-1]):
        outer.append(loop)
        work //= n
        if work <= TASK_ELEMS:
            break
    if outer and math.prod(extents[: len(outer)]) > 1:
        sch.parallel(sch.fuse(*outer) if len(outer) > 1 else outer[0])
    sch.vectorize(inner)


class _Nest(Nest):
    """The nest of a reorder or zero fill, with its padding condition and source offset
    rewritten over the loop vars."""

    def __init__(self, sch, block):
        super().__init__(sch, block)
        self.pad, self.offset, self.dtype = None, None, None
        body = self.block.body
        if isinstance(body, tirx.BufferStore):
            self.dtype = str(body.buffer.dtype)
            value = body.value
            if getattr(getattr(value, "op", None), "name", "").endswith("if_then_else"):
                self.pad = self.over_loops(value.args[0])
            loads = []
            tvm_ffi.structural_walk(value, (tvm.ir.expr.TensorLoad, loads.append))
            if len(loads) == 1:
                load = loads[0]
                offset = sum(i * s for i, s in zip(load.indices, load.source.strides))
                self.offset = self.over_loops(offset)

    def src_stride(self, i) -> int:
        """Source elements between two steps of loop ``i`` (from its first iteration)."""
        if self.extents[i] == 1:
            return math.inf
        base = dict(enumerate(self.mins))
        step = self.analyzer.simplify(self.at(self.offset, {**base, i: self.mins[i] + 1})
                                      - self.at(self.offset, base))
        return abs(int(step)) if isinstance(step, tirx.IntImm) else math.inf

    def lane_conditions(self) -> list:
        """What must be uniform across the innermost loop for it to vectorise: the padding
        tests that depend on it, and the block predicate (a split that does not divide)."""
        lane = self.vars[-1]
        atoms = [a for a in _disjuncts(self.pad) if uses(a, lane)] if self.pad is not None else []
        conds = [functools.reduce(tirx.Or, atoms)] if atoms else []
        if uses(self.predicate, lane):
            conds.append(self.predicate)
        return conds


def _disjuncts(cond) -> list:
    if isinstance(cond, tirx.Or):
        return _disjuncts(cond.a) + _disjuncts(cond.b)
    return [cond]


RULES = [DataMovement()]
