"""CPU schedule of depthwise convolutions on channel-blocked layouts (``nChw8c``/``nChw16c``
source and destination, ``Goihw8g``/``Goihw16g`` weights): a streaming kernel, vectorised over
the channel block.

A depthwise convolution does ``kh x kw`` multiply-adds per element it reads, so it is bound
by memory traffic and by loads, not by the FMA units; register_tiled's micro-kernel, made for
reductions over channels, stages the whole source into a zero-haloed copy first (one more
pass over memory each way) and streams all ``kh x kw`` weight vectors from cache for every
tile. Here:

* the threads split (image, channel block, block of output rows); the spatial padding is
  read as ``select(in_image, src[clamped], 0)`` (``halo.clamped_source``): the read is
  clamped into the source, so it is always safe, and the zero is a masked load, with no
  branch and no copy. Staging the task's source rows into a zero-haloed buffer instead
  (``halo.staged_source``, a tuning variant) cost one more pass over the rows, which took as
  long as the FMAs (AVX-512, 1 thread: C144 56x56 177 -> 111 us clamped, C96 112x112 stride
  2 220 -> 107 us, C576 14x14 38 -> 24 us; AVX2: 144 -> 123, 220 -> 130, 30 -> 23). A
  source whose layout already has the halo (written clean by its producer) is read as it is;
* in a task, per vector of ``lanes`` channels (the block's halves on AVX2), the output row is
  walked in tiles of ``mr`` pixels, ``mr`` accumulators in registers; the ``kh x kw`` weight
  vectors of that vector of channels do not change along the row, so LLVM keeps them in
  registers (``mr + kh * kw + 1 <= 16`` on AVX2: 9 weights, 6 accumulators) and each source
  vector loaded feeds up to ``kw`` FMAs of neighbouring outputs;
* bias and post-ops (relu6) are applied to the registers before the one store.

Rows past the end of the last tile are computed whole over clamped reads
(``tile_edges.whole_tiles``), only the store is predicated. The rule takes a conv2d whose
source read's innermost (vector) index is the destination's (a channel-blocked depthwise
nest) in float32; anything else is register_tiled's.
"""

from __future__ import annotations

import tvm_ffi
from tvm import s_tir, tirx

from blockpad.vocabulary import ACC, DST

from .common import REDUCE, SPATIAL, count_iters, divisor_at_most, tile_scope, vector_lanes
from .generic import root_blocks, spatial_parallel_vectorize
from .halo import clamped_source, staged_source
from .rule import ScheduleRule, distinct
from .tile_edges import unpredicated, whole_tiles
from .vector_math import vector_math

STAGE = "src_pad"          # the stage halo.staged_source adds
TASKS = 16                 # at least this many tasks where the rows allow (2..16 threads)


class Depthwise(ScheduleRule):
    ops = ("conv2d",)

    def takes(self, func, target) -> bool:
        return super().takes(func, target) and _nest(func) is not None

    def schedule(self, func, target):
        space = self.space(func, target, first=True)
        return space[0] if space else None

    def space(self, func, target, first=False) -> list:
        """Schedules for tuning: tile widths and rows per task around the default, which
        reads the source clamped; and the default's tiles over a staged copy of it."""
        if not self.takes(func, target):
            return []
        func = vector_math(func)   # a swish or gelu post-op: polynomials, not libm per lane
        cfgs = [(*c, False) for c in configs(func, target)]
        return distinct((_schedule(func, target, *c) for c in [*cfgs, (*cfgs[0][:2], True)]),
                        first)


def configs(func, target) -> list:
    """``(mr, rows)`` variants, the default first: ``mr`` output pixels per register tile
    (accumulators beside the ``kh x kw`` weight vectors), and output rows per task (as many as
    keep ``TASKS`` tasks, at most 8: a task that stages its source copies
    ``(rows - 1) * stride + kh`` source rows for ``rows`` output rows). Measured on AVX2 with
    staged rows (3x3, 1 thread, CPU time): 7 rows a task against 1: C144 56x56 0.21 against
    0.28 ms, C576 14x14 0.069 against 0.127, C960 7x7 0.040 against 0.075. The tile width:
    ``_tile_width``."""
    n_tasks, oh, ow, taps = _nest(func)
    widest = max(4, min(8, target.tile_registers - taps))
    mr = _tile_width(ow, widest)
    rows = divisor_at_most(oh, max(1, min(8, n_tasks * oh // TASKS)))
    out = [(mr, rows)]
    out += [(m, rows) for m in (4, 7, 8) if m != mr and m <= ow]
    out += [(mr, r) for r in (1, 2, 4) if r != rows and oh % r == 0]
    return out


def _tile_width(ow: int, widest: int) -> int:
    """Pixels per register tile, 4 to ``widest``: the fewest columns computed past the end of
    the row, then the widest (each source vector loaded feeds more FMAs). Reading the source
    clamped, 1 thread: AVX2 tiles of 7 against 4 on C144 56x56 112 against 127 us, C32 112x112
    115 against 130; AVX-512 tiles of 8 against 4 on C144 56x56 86 against 89, C96 112x112
    stride 2 94 against 100. Computing past the row costs more (C576 14x14 in tiles of 8:
    16 columns, 24.2 against 23.6 us in 7s)."""
    return min(range(4, widest + 1), key=lambda m: (-(-ow // m) * m, -m)) if ow > 4 else ow


def _nest(func):
    """``(tasks outside the rows, output rows, output columns, kernel taps)`` of a
    channel-blocked float32 depthwise nest (spatial dims n, c-block, oh, ow, c-lane; the
    source's innermost index follows the destination's lane, every reduction dim that does not
    reach it spans the window), or None."""
    sch = s_tir.Schedule(func)
    try:
        acc = sch.get(sch.get_sblock(ACC))
        sch.get_sblock(DST)
    except s_tir.ScheduleError:
        return None
    kinds = [int(iv.iter_type) for iv in acc.iter_vars]
    n_sp = kinds.count(SPATIAL)
    if n_sp != 5 or len(acc.reads) < 2 or str(acc.writes[0].source.dtype) != "float32":
        return None
    lane = acc.iter_vars[n_sp - 1].var
    src_last = acc.reads[0].region[-1].min
    wei_last = acc.reads[1].region[-1].min
    red = [iv for iv in acc.iter_vars[n_sp:]]
    if not _uses(src_last, lane) or not _uses(wei_last, lane):
        return None
    if any(_uses(src_last, iv.var) and int(iv.dom.extent) > 1 for iv in red):
        return None    # a reduction over channels: not depthwise
    taps = 1
    for iv in red:
        taps *= int(iv.dom.extent)
    ext = [int(iv.dom.extent) for iv in acc.iter_vars[:n_sp]]
    return ext[0] * ext[1], ext[2], ext[3], taps


def _uses(expr, var) -> bool:
    return any(v.same_as(var) for v in tirx.analysis.undefined_vars(expr))


def _schedule(func, target, mr, rows, staged):
    """The streaming schedule (see the module doc), reading the source clamped or, if
    ``staged``, from a zero-haloed copy of its rows; None where a primitive refuses."""
    func = (staged_source if staged else clamped_source)(unpredicated(func, ACC))
    func, _ = whole_tiles(func, ACC, mr, 1)
    lanes = vector_lanes(target, "float32")
    sch = s_tir.Schedule(func)
    try:
        acc, dst = sch.get_sblock(ACC), sch.get_sblock(DST)
        stage = next((b for b in root_blocks(sch) if sch.get(b).name_hint == STAGE), None)
        others = [b for b in root_blocks(sch)
                  if sch.get(b).name_hint not in (ACC, DST, STAGE)]
        n, cb, oh, ow, c = sch.get_loops(dst)
        oh_o, oh_i = sch.split(oh, [None, rows])
        ow_o, ow_i = sch.split(ow, [None, mr])
        c_ext = int(sch.get(c).extent)
        c_o, c_i = sch.split(c, [None, lanes]) if c_ext > lanes and c_ext % lanes == 0 \
            else (None, c)
        order = [n, cb, oh_o, oh_i, *([c_o] if c_o is not None else []), ow_o, ow_i, c_i]
        sch.reorder(*order)
        task = sch.fuse(n, cb, oh_o)
        sch.parallel(task)
        sch.compute_at(acc, ow_o, preserve_unit_loops=True)
        sch.set_scope(acc, 0, tile_scope(target))
        loops = sch.get_loops(acc)
        n_red = count_iters(sch.get(acc), REDUCE)
        *_, at, av = loops[:len(loops) - n_red]
        reduce = loops[len(loops) - n_red:]
        sch.reorder(*reduce, at, av)
        for loop in (*reduce[1:], at):
            sch.unroll(loop)
        sch.vectorize(av)
        init = sch.decompose_reduction(acc, reduce[0])
        sch.unroll(sch.get_loops(init)[-2])
        sch.vectorize(sch.get_loops(init)[-1])
        sch.unroll(ow_i)
        sch.vectorize(c_i)
        if stage is not None:
            sch.compute_at(stage, task, preserve_unit_loops=True)
            sch.vectorize(sch.get_loops(stage)[-1])
        for block in others:    # the bias gathered into whole blocks, if any
            spatial_parallel_vectorize(sch, block, target)
    except s_tir.ScheduleError:
        return None
    return sch if _vector_extents_constant(sch) else None


def _vector_extents_constant(sch) -> bool:
    """Whether every vectorized loop has a constant extent. Where the source's channels do
    not follow the destination's blocks one to one (a channel multiplier: 14 outputs of 2
    groups, ``nhwC16c`` into ``nChw4c``), the staged source's rows at a task span a varying
    number of channels, and LLVM cannot vectorize that loop (blockpad check seed 20261130
    case 37 failed to build); the next rule takes such a nest."""
    extents = []

    def visit(loop):
        if loop.kind == tirx.ForKind.VECTORIZED:
            extents.append(loop.extent)
        return loop
    tvm_ffi.structural_map(sch.mod["main"].body, (tirx.For, visit))
    return all(isinstance(e, tirx.IntImm) for e in extents)


RULES = [Depthwise()]
