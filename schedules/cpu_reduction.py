"""CPU schedules (x86 AVX2 and AVX-512, Arm NEON) for softmax and pooling: memory-bound
reductions that read each source element a few times and write each destination element once.

Softmax (``codegen.ops.softmax``: row statistics ``max``, ``sum``, ``norm``, then ``dst``) is
computed one tile of rows at a time: the destination's loops along the softmax axis, and the
row loops physically inside them (``nChw16c``'s ``w``, ``nchw``'s ``w``), go inside the tile
while it holds at most ``TILE_BYTES``; the row statistics are computed per tile, right before
the tile is written. The tile's source elements are read three times (max, sum, store) while
they are in L1/L2, and the DRAM sees each byte once. Per tile, every stage walks the source in
memory order with vectors along its contiguous dim:

* along the axis (``nChw16c``'s channel block, ``nhwc``'s channels), a statistic is factorised
  over the vector lanes (``rfactor``): a vector of partial maxima / sums per row, reduced
  across the lanes once per row;
* along the rows (``nchw``'s ``w`` for a channel softmax), a statistic is a vector of rows and
  the reduction walks the axis outside it.

(A tile of one ``nChw16c`` pixel is slower: its 16 channel blocks lie a multiple of 4 KiB
apart, so they all fall in one 8-way L1 set and evict each other between the passes.)

Pooling (``acc``, the window reduction, and ``dst``, the average's division and the padding
store): ``acc`` is computed for a few vectors of the destination at a time (``POOL_VECTORS``
along its last dim outside the vector), in a register-sized local buffer, with the window
loops outside those vectors, so their reductions run side by side; a window cell outside the
image is a select of a clamped read (``halo.clamped_source``), not a branch.

The loops outside the tile run in parallel (fused into one) unless the kernel is too small for
threads to pay. The rules read block names, loops and index expressions, never layout tags; a
nest they did not foresee raises a ScheduleError and is left to the generic rule.
"""

from __future__ import annotations

import math

import tvm
import tvm_ffi
from tvm import s_tir, tirx
from tvm.sym.analyzer import Analyzer

from blockpad.vocabulary import ACC, DST, EXP, MAX, NORM, SOFTMAX_STAGES, SUM

from .common import REDUCE, SPATIAL, divisor_at_most, element_strides, vector_lanes
from .data_movement import SERIAL_BYTES
from .halo import clamped_source
from .rule import ScheduleRule

TILE_BYTES = 64 << 10    # softmax rows computed together: their source stays in L2 between passes
POOL_VECTORS = 8         # destination vectors a pooling task reduces side by side

_realize = tvm.get_global_func("s_tir.schedule.GetSBlockRealize")


class _RowTiled(ScheduleRule):
    """A reduction whose rows are tiled by ``tile(sch, lanes)`` (False: not its shape), with the
    padding of a preserved destination stored back."""

    tile = None   # staticmethod(sch, lanes) -> bool; a lambda where the function is defined below
    prepare = staticmethod(lambda func: func)   # rewrites of the function before it is scheduled

    def schedule(self, func, target):
        sch = s_tir.Schedule(self.prepare(_store_padding_back(func)))
        try:
            return sch if self.tile(sch, vector_lanes(target, "float32")) else None
        except s_tir.ScheduleError:
            return None


class Softmax(_RowTiled):
    ops = ("softmax",)
    tile = staticmethod(lambda sch, lanes: _softmax(sch, lanes))


class Pool(_RowTiled):
    ops = ("pool",)
    tile = staticmethod(lambda sch, lanes: _pool(sch, lanes))
    # the window's cells outside the image as selects of clamped reads, not branches
    prepare = staticmethod(clamped_source)


def _softmax(sch, lanes) -> bool:
    dst = sch.get_sblock(DST)
    if not any(r.source.name == EXP for r in sch.get(dst).reads):
        sch.compute_inline(sch.get_sblock(EXP))   # log-softmax: the sum is its only reader
    stages = [name for name in SOFTMAX_STAGES if _has_block(sch, name)]
    loops = sch.get_loops(dst)
    extents = [int(sch.get(l).extent) for l in loops]
    row_vars = _vars(r.min for r in _read_of(sch, dst, NORM).region)
    is_row = [any(v.same_as(iv.var) for v in row_vars) for iv in sch.get(dst).iter_vars]
    if all(is_row) or not any(is_row):
        return False
    # the tile: the axis loops, the innermost loop (the vectors), and the row loops inside the
    # outermost axis loop, innermost first, while the tile holds at most TILE_BYTES
    inner = {i for i, r in enumerate(is_row) if not r} | {len(loops) - 1}
    size = 4 * math.prod(extents[i] for i in inner)
    for i in reversed(range(is_row.index(False), len(loops))):
        if i not in inner:
            if size * extents[i] > TILE_BYTES:
                break
            inner.add(i)
            size *= extents[i]
    outer = [l for i, l in enumerate(loops) if i not in inner]
    if not outer:
        return False
    rf = {}   # reduction stage -> its partial results per lane, when vectors run along the axis
    for name in (MAX, SUM):
        block = sch.get_sblock(name)
        strides = _strides(sch, block)
        contiguous = min(range(len(strides)), key=lambda i: strides[i])
        loop = sch.get_loops(block)[contiguous]
        extent = int(sch.get(loop).extent)
        if strides[contiguous] == 1 and _loop_kinds(sch, block, [loop]) == [REDUCE] \
                and extent % lanes == 0:
            if _width(extent, lanes) != extent:   # up to 4 registers of independent partials
                loop = sch.split(loop, [None, lanes])[1]
            rank = len(sch.get(block).writes[0].source.shape)
            rf[name] = sch.rfactor(loop, rank)   # lanes innermost
    sch.reorder(*outer, *(l for i, l in enumerate(loops) if i in inner))
    outer = _parallel(sch, outer)
    for name in reversed(stages):
        sch.compute_at(sch.get_sblock(name), outer)
        if name in rf:
            sch.compute_at(rf[name], outer)
    for name in stages:
        block = sch.get_sblock(name)
        if name in rf:
            _vectorize(sch, rf[name], lanes)
            loops = _memory_order(sch, block)   # the lanes' partial results, reduced
            sch.reorder(*loops)
            sch.unroll(loops[-1])
        else:
            _vectorize(sch, block, lanes)
    _vectorize(sch, dst, lanes)
    return True

def _pool(sch, lanes) -> bool:
    acc, dst = sch.get_sblock(ACC), sch.get_sblock(DST)
    *outer, inner = sch.get_loops(dst)
    if not outer:
        return False
    if int(sch.get(inner).extent) > _width(int(sch.get(inner).extent), lanes):
        outer.append(sch.split(inner, [None, lanes])[0])
    # a few vectors of the destination a task, their window reductions interleaved: one
    # vector's reduction is a chain of dependent selects (the NaN-aware max: compare, blend,
    # NaN test, blend per cell), which left the vector units idle
    pixels = divisor_at_most(int(sch.get(outer[-1]).extent), POOL_VECTORS)
    if pixels > 1:
        outer[-1] = sch.split(outer[-1], [None, pixels])[0]
    outer = _parallel(sch, outer)
    sch.compute_at(acc, outer)
    _vectorize(sch, acc, lanes, interleave=pixels > 1)
    _vectorize(sch, dst, lanes)
    return True


def _vectorize(sch, block, lanes, interleave=False):
    """Vectorise ``block`` below the kernel's outer loop: its spatial loop of least stride in
    the buffer it walks (``_walked``) goes innermost and is vectorised (split to ``_width`` lanes); the reduction
    loops go right outside it, so that the partial results stay in registers across the
    reduction; the other spatial loops outside those, walking ``buffer`` in memory order
    (``interleave``: inside the reduction loops and unrolled, so that the reductions of a
    few vectors run side by side, each in its registers).
    Then the reduction's initialisation is split off, vectorised too, and the loops are
    partitioned where the vectors' Selects become uniform (``_partition_selects``)."""
    walk = _memory_order(sch, block)
    kinds = _loop_kinds(sch, block, walk)
    spatial = [l for l, k in zip(walk, kinds) if k == SPATIAL]
    reduce = [l for l, k in zip(walk, kinds) if k == REDUCE]
    vec = spatial.pop() if spatial else None
    extent = sch.get(vec).extent if vec is not None else None
    if isinstance(extent, tirx.IntImm):
        if int(extent) > _width(int(extent), lanes):
            part, vec = sch.split(vec, [None, lanes])
            spatial.append(part)
        if interleave:
            sch.reorder(*reduce, *spatial, vec)
            for loop in spatial:
                sch.unroll(loop)
        else:
            sch.reorder(*spatial, *reduce, vec)
        sch.vectorize(vec)
    elif vec is not None:   # a region compute_at left symbolic (a clamped block of rows): scalar
        spatial.append(vec)
        vec = None
    if reduce:
        init = sch.decompose_reduction(block, reduce[0])
        if vec is not None:
            sch.vectorize(sch.get_loops(init)[-1])
    _partition_selects(sch, block)


def _memory_order(sch, block) -> list:
    """The loops of ``block`` under the kernel's outer loop, by decreasing stride in the buffer
    it walks (see ``_strides``): the order that walks it in memory order."""
    loops = sch.get_loops(block)[1:]
    strides = _strides(sch, block)[1:]
    return [loops[i] for i in sorted(range(len(loops)), key=lambda i: -strides[i])]


def _width(extent, lanes) -> int:
    """Lanes of the vectors along a loop of ``extent``: the whole loop when it is at most four
    registers (LLVM splits a long vector into registers: independent operations, and no
    predicated tail, which TVM would not vectorise), else ``lanes``."""
    return extent if extent <= 4 * lanes else lanes


def _parallel(sch, loops):
    """The outer ``loops`` of the kernel fused into one, which runs in parallel when the kernel
    moves enough bytes for threads to pay (else on one thread: a launch costs more than it
    saves)."""
    loop = sch.fuse(*loops) if len(loops) > 1 else loops[0]
    nbytes = sum(math.prod(int(n) for n in p.shape) * tvm_ffi.dtype(p.dtype).itemsize
                 for p in sch.mod["main"].params)
    if nbytes >= SERIAL_BYTES:
        sch.parallel(loop)
    return loop


def _store_padding_back(func):
    """``func`` with the ``valid`` plan's predicate on block ``dst`` (store only where the
    destination is not padding) turned into a store everywhere of ``Select(predicate, value,
    old value)``: the padding gets its own bits back, untouched as the plan promises. No loop
    transformation accepts the predicated block (its binding is not affine), and a vector loop
    whose lanes disagree on it is not vectorised; the Select is a blend, and its load hits the
    cache line the store fetches anyway. A value with a guarded read (``if_then_else``: a
    destination padded further than what it reads, e.g. a halo on an outer dim) takes an
    ``if_then_else`` instead: TVM simplifies a Select's branch under its condition, which drops
    the guard, and a blend evaluates the branch in the padding lanes too, loading past a stage's
    allocation (undefined behaviour LLVM exploits: it wrote the padding)."""
    def rewrite(realize):
        block, pred = realize.block, realize.predicate
        if block.name_hint != DST or isinstance(pred, tirx.IntImm):
            return realize
        store = block.body
        # unscheduled TE: the block binds one loop var per iter var
        cond = _substitute(pred, {v: iv.var for v, iv in zip(realize.iter_values,
                                                              block.iter_vars)})
        old = tirx.BufferLoad(store.buffer, list(store.indices))
        guards = []
        tvm_ffi.structural_walk(store.value, (tvm.ir.expr.Call, lambda c: guards.append(c)
                                              if c.op.name == "prim.if_then_else" else None))
        blend = tirx.if_then_else if guards else tirx.Select
        body = tirx.BufferStore(store.buffer, blend(cond, store.value, old), list(store.indices))
        # the block still declares no read of dst: each element reads back only the element it
        # writes, and a declared read would make the block neither complete nor parallel
        block = s_tir.SBlock(block.iter_vars, block.reads, block.writes, block.name_hint, body,
                             block.init, block.alloc_buffers, block.match_buffers,
                             block.annotations)
        return s_tir.SBlockRealize(realize.iter_values, tirx.const(True, "bool"), block)

    return tvm_ffi.structural_map(func, (s_tir.SBlockRealize, rewrite))


def _partition_selects(sch, block):
    """Split the first loop of ``block`` along which the Selects that differ between vector
    lanes become uniform (the last, partial channel block): source guards ``Select(c < C, x,
    -inf)``, the zero store ``Select(is_padding, 0, value)`` and the padding
    ``_store_padding_back`` keeps. In the first piece the simplifier folds them away; they
    remain in the tail only (a blend per vector, and LLVM turns the kept padding's Select into
    a masked store, slow on AMD)."""
    loops = sch.get_loops(block)
    ranges = {sch.get(l).loop_var: (int(sch.get(l).min), int(sch.get(l).extent)) for l in loops}
    lane = sch.get(loops[-1]).loop_var
    realize = _realize(sch, block)
    bind = {iv.var: v for iv, v in zip(realize.block.iter_vars, realize.iter_values)}
    selects = []
    tvm_ffi.structural_walk(sch.get(block).body, (tirx.Select, selects.append))
    conds = [c for c in (_substitute(s.condition, bind) for s in selects)
             if any(v.same_as(lane) for v in _vars([c]))]
    if not conds:
        return
    for loop, var in list(zip(loops, ranges))[1:]:   # not the kernel's outer (parallel) loop
        if len(sch.get_child_blocks(loop)) > 1:
            # TVM 0.27's loop_partition segfaults on a loop holding more than one block (a
            # reduction's init beside its update: softmax over an outer axis of aBcdE8b8e)
            continue
        start, extent = ranges[var]
        uniform = 0
        while uniform < extent and all(_uniform(c, {**ranges, var: (start, uniform + 1)})
                                       for c in conds):
            uniform += 1
        if 0 < uniform < extent:
            sch.loop_partition(loop, [uniform])
            return


def _uniform(cond, ranges) -> bool:
    """``cond`` is provably true, or provably false, over the loop vars in ``ranges`` (var ->
    (min, extent)). A fresh analyzer per query: a rebound var does not reset its proof cache."""
    ana = Analyzer()
    for var, (start, extent) in ranges.items():
        ana.bind(var, tvm.ir.Range.from_min_extent(start, extent))
    return ana.can_prove(cond) or ana.can_prove(tirx.Not(cond))


def _walked(sch, block):
    """The access a block is scheduled to walk in memory order: a spatial block's output (its
    stores stay contiguous), a reduction's largest input."""
    out = sch.get(block).writes[0]
    if not any(int(iv.iter_type) == REDUCE for iv in sch.get(block).iter_vars):
        return out
    inputs = [r for r in sch.get(block).reads if not r.source.same_as(out.source)]
    return max(inputs, key=lambda r: math.prod(int(n) for n in r.source.shape))


def _strides(sch, block) -> list:
    """Elements of the buffer ``block`` walks (``_walked``) between two steps of each of its
    loops; ``math.inf`` for a loop that does not walk it (a step of 0, a single iteration) or
    whose step is not constant."""
    realize = _realize(sch, block)
    bind = {iv.var: v for iv, v in zip(realize.block.iter_vars, realize.iter_values)}
    region = _walked(sch, block)
    buf = region.source
    strides = element_strides(buf)
    offset = _substitute(sum(r.min * s for r, s in zip(region.region, strides)), bind)
    loops = sch.get_loops(block)
    loop_vars = [sch.get(l).loop_var for l in loops]
    zero = {v: tirx.const(0, str(v.ty.dtype)) for v in loop_vars}
    ana, out = Analyzer(), []
    for loop, v in zip(loops, loop_vars):
        step = ana.simplify(_substitute(offset, {**zero, v: tirx.const(1, str(v.ty.dtype))})
                            - _substitute(offset, zero))
        walks = isinstance(step, tirx.IntImm) and step.value != 0 and sch.get(loop).extent != 1
        out.append(abs(int(step)) if walks else math.inf)
    return out


def _loop_kinds(sch, block, loops) -> list:
    """SPATIAL or REDUCE for each of ``loops``, from the block's iter var bindings."""
    realize = _realize(sch, block)
    kinds = []
    for loop in loops:
        var = sch.get(loop).loop_var
        kinds.append(next((int(iv.iter_type) for iv, v in zip(realize.block.iter_vars,
                                                               realize.iter_values)
                           if any(u.same_as(var) for u in _vars([v]))), SPATIAL))
    return kinds


def _read_of(sch, block, name):
    return next(r for r in sch.get(block).reads if r.source.name == name)


def _vars(exprs) -> list:
    return [v for e in exprs for v in tirx.analysis.undefined_vars(e)]


def _substitute(expr, mapping: dict):
    return tvm_ffi.structural_map(
        expr, (tirx.Var, lambda v: next((new for old, new in mapping.items() if v.same_as(old)),
                                        v)))


def _has_block(sch, name) -> bool:
    try:
        sch.get_sblock(name)
        return True
    except Exception:  # noqa: BLE001 - s_tir raises a generic error for a missing block
        return False


RULES = [Softmax(), Pool()]
