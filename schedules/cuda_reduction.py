"""CUDA schedules for softmax and pooling: one kernel each, reductions never repeated per
element.

Softmax (``codegen.ops.softmax``: row statistics ``max`` and ``sum``, the stage ``exp``, the
row's ``norm``, then ``dst``): a thread block takes ``ty`` rows (``threadIdx.y``) and spreads
each row's elements over ``tx`` lanes (``threadIdx.x``, consecutive lanes on consecutive
elements of the destination's innermost dim along the axis, so loads and stores coalesce).
Per block, in order:

* ``max``: each lane reduces its strided share of the row, then the lanes combine
  (``threadIdx.x`` on the reduction loop: TVM's cross-thread all-reduce, warp shuffles), into
  shared memory, followed by a barrier of its own (``_barrier_after_statistics``);
* ``exp``: computed once per element into shared memory (a ``ty x`` row-length tile); where
  the tile would not fit, or the destination is laid out unlike the source, ``exp`` is
  recomputed in ``sum`` and ``dst`` instead (two exps per element; log-softmax never keeps
  it: its ``dst`` does not read it);
* ``sum``: like ``max``;
* ``norm``: one reciprocal (log: one log) per thread and row, in a register;
* ``dst``: each lane its elements, from shared memory.

Pooling: ``dst`` (the average's division, the padding store) gets one output element per
thread; ``acc``, the window's reduction, is computed by that thread into a register right
before it (``compute_at``), its window loops unrolled.

Both keep the destination's predicates (``dst_stage``'s valid region) and every guard of the
reads. The rules read block names and index expressions, never layout tags.
"""

from __future__ import annotations

import math

import tvm_ffi
from tvm import s_tir, tirx

from blockpad.vocabulary import ACC, DST, EXP, MAX, NORM, SUM

from .common import SPATIAL
from .cuda import THREADS, bind_spatial, loop_depth, pow2_above, predicated_schedule
from .nest import uses
from .rule import ScheduleRule

EXP_BYTES = 32 << 10   # the largest exp tile kept in shared memory


class Softmax(ScheduleRule):
    ops = ("softmax",)

    def schedule(self, func, target):
        sch = predicated_schedule(func, _softmax)
        return None if sch is None else s_tir.Schedule(_barrier_after_statistics(sch.mod["main"]))


class Pool(ScheduleRule):
    ops = ("pool",)

    def schedule(self, func, target):
        return predicated_schedule(func, _pool)


def _pool(sch):
    dst, acc = sch.get_sblock(DST), sch.get_sblock(ACC)
    bind_spatial(sch, dst)
    sch.set_scope(acc, 0, "local")
    sch.compute_at(acc, sch.get_loops(dst)[-1])
    for loop in sch.get_loops(acc)[len(sch.get_loops(dst)):]:
        sch.unroll(loop)


def _softmax(sch):
    dst = sch.get_sblock(DST)
    rows, axis = _rows_and_axis(sch, dst)
    extent = {id(l): int(sch.get(l).extent) for l in (*rows, *axis)}
    lanes = min(THREADS, pow2_above(math.prod(extent[id(l)] for l in axis)))
    ty = min(THREADS // lanes, pow2_above(extent[id(rows[-1])]))
    if not _keeps_exp(sch, dst, ty * lanes * -(-math.prod(extent[id(l)] for l in axis) // lanes)):
        sch.compute_inline(sch.get_sblock(EXP))
    sch.reorder(*rows, *axis)
    outer, ry = sch.split(rows[-1], [None, ty])
    bx = sch.fuse(*rows[:-1], outer) if len(rows) > 1 else outer
    a = sch.fuse(*axis) if len(axis) > 1 else axis[0]
    ao, ax = sch.split(a, [None, lanes])
    sch.reorder(ry, ax, ao)
    sch.bind(bx, "blockIdx.x")
    sch.bind(ry, "threadIdx.y")
    sch.bind(ax, "threadIdx.x")
    norm = sch.get_sblock(NORM)
    sch.set_scope(norm, 0, "local")
    sch.compute_at(norm, ax)
    for name in (SUM, EXP, MAX):
        if _has_block(sch, name):
            _row_stage(sch, sch.get_sblock(name), bx, ty, lanes)


def _barrier_after_statistics(func):
    """A ``__syncthreads()`` after the loop nest of each row statistic. TVM's all-reduce has
    lane 0 store a row's result to shared memory, and its barrier insertion misses that store
    when the lanes that read it index it the same way (it takes the same index for the same
    thread): on an H100 the other lanes read the row's old value (rows of garbage, NaN,
    inf). Keeping the statistic in each lane's registers instead fails where a later stage
    maps rows to threads differently (a halo in dst)."""
    sync = tirx.Evaluate(tirx.call_intrin("int32", "tirx.tvm_storage_sync", "shared"))

    def statistic(stmt) -> bool:
        names = []
        tvm_ffi.structural_walk(stmt, (s_tir.SBlock, lambda b: names.append(b.name_hint)))
        return MAX in names or SUM in names

    def add(seq):
        out = []
        for st in seq.seq:
            out.append(st)
            if isinstance(st, tirx.For) and statistic(st):
                out.append(sync)
        return tirx.SeqStmt(out)

    return tvm_ffi.structural_map(func, (tirx.SeqStmt, add))


def _row_stage(sch, block, bx, ty, lanes):
    """A stage computed per block of rows into shared memory: its row loops on ``ty``
    threads of ``threadIdx.y`` (more rows than that, as a halo can make, loop), its loop
    along the axis (a reduction's or ``exp``'s) split over the ``lanes`` of ``threadIdx.x``.
    Every stage binds the same extents as ``dst``: a CUDA kernel has one block shape, and TVM
    launches it with the extent of the first binding it meets, so a stage bound to more
    threads than that lost rows (a halo in dst: padding left unwritten on an H100)."""
    sch.set_scope(block, 0, "shared")
    sch.compute_at(block, bx, preserve_unit_loops=True)
    depth = loop_depth(sch, block, bx)
    loops = sch.get_loops(block)[depth:]
    kinds = [iv.iter_type for iv in sch.get(block).iter_vars]
    if all(k == SPATIAL for k in kinds):
        rows, axis = _rows_and_axis(sch, block, loops)
    else:
        rows = loops[:len(loops) - sum(k != SPATIAL for k in kinds)]
        axis = loops[len(rows):]
    sch.reorder(*rows, *axis)
    y = sch.fuse(*rows) if len(rows) > 1 else rows[0]
    a = sch.fuse(*axis) if len(axis) > 1 else axis[0]
    yo, yi = sch.split(y, [None, ty])
    _, x = sch.split(a, [None, lanes])
    sch.reorder(yo, yi, x)
    sch.bind(yi, "threadIdx.y")
    sch.bind(x, "threadIdx.x")


def _rows_and_axis(sch, block, loops=None):
    """``block``'s loops split into row loops (their iter vars index the row statistics it
    reads) and axis loops (the others), each in nest order. Assumes one iter var per loop, in
    order (a fresh TE nest, or its loops under a ``compute_at``)."""
    loops = loops if loops is not None else sch.get_loops(block)
    b = sch.get(block)
    stats = [r for r in b.reads if r.source.name in (MAX, NORM)]
    ivs = b.iter_vars[len(b.iter_vars) - len(loops):]
    row = [any(uses(x.min, iv.var) for r in stats for x in r.region) for iv in ivs]
    return ([l for l, r in zip(loops, row) if r], [l for l, r in zip(loops, row) if not r])


def _keeps_exp(sch, dst, tile) -> bool:
    """Whether ``exp`` stays a stage (in shared memory): ``dst`` reads it, it is laid out like
    ``dst`` (so the rows and lanes of one split cover both), and a block's tile fits."""
    if not _has_block(sch, EXP):
        return False
    reads = [r.source for r in sch.get(dst).reads if r.source.name == EXP]
    if not reads:
        return False
    out = sch.get(dst).writes[0].source
    return [int(x) for x in reads[0].shape] == [int(x) for x in out.shape] and \
        4 * tile <= EXP_BYTES


def _has_block(sch, name) -> bool:
    try:
        sch.get_sblock(name)
    except Exception:  # noqa: BLE001 - s_tir raises a generic error for a missing block
        return False
    return True


RULES = [Softmax(), Pool()]
