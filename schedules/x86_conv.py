"""x86 schedules (AVX2, AVX-512) for convolution and matmul: a register-tiled direct kernel.

Both ops come from ``codegen.ops.common.materialize`` as two stages over the destination's
physical index space: ``acc`` (the reduction) and ``dst`` (post-ops, cast, padding store). The
micro-kernel is the classic one (oneDNN's jit convolutions, BLIS):

* the destination's innermost physical dim (the channel block of ``nChw16c``, a panel of
  matmul columns) is the vector dim, ``nr`` lanes: at most two registers;
* the dim outside it (``ow``, matmul rows) is the register tile, ``mr`` rows: ``mr x nr``
  accumulators fill the register file but for the weight vectors and the broadcast source
  element (measured: 6 x 16 with a predicated last tile beats 4 x 16 without one on OW = 56);
* ``dst`` is tiled so, and ``acc`` is computed per tile (``compute_at``) into a tile-sized
  local buffer that LLVM keeps in registers: zeroed, then the reduction, whose loops sit between
  the tile's outer and inner loops, the one that walks the source's channel block innermost, so
  that each step is ``mr`` FMAs of a broadcast source element by the same weight vector(s);
  then the epilogue (post-ops, cast, padding store) on the registers;
* the loops outside the tile run in parallel, fused into one (TVM's pool gives each thread a
  contiguous chunk); a panel of columns outside the rows, so its weights stay in cache while the
  rows stream past.

The rule reads loops and index expressions, never layout tags, and takes every conv and matmul:
a vector dim that is not a multiple of the lanes gets a partial vector (nchw with OW = 7) or a
predicated tail, as does a tile that does not divide its dim, so odd shapes are slower, never
wrong. It returns None (generic fallback) only if a schedule primitive refuses the nest.
"""

from __future__ import annotations

import math

import tvm
import tvm_ffi
from tvm import s_tir, tirx

from .common import op_of, vector_lanes
from .generic import root_blocks, spatial_parallel_vectorize

_realize = tvm.get_global_func("s_tir.schedule.GetSBlockRealize")
LOAD_REGS = 4      # vector registers kept for weight vectors and the broadcast source element
SPATIAL, REDUCE = 0, 2   # IterVar types


class RegisterTiled:
    ops = ("conv2d", "matmul")

    def apply(self, func, target):
        if op_of(func) not in self.ops:
            return None
        sch = s_tir.Schedule(_unpredicated(func, "acc"))
        try:
            acc, dst = sch.get_sblock("acc"), sch.get_sblock("dst")
            stages = [b for b in root_blocks(sch) if sch.get(b).name_hint not in ("acc", "dst")]
            if not _tile(sch, acc, dst, target):
                return None
            for block in stages:   # a spatial padding stage, if the kernel has one
                spatial_parallel_vectorize(sch, block, target)
        except s_tir.ScheduleError:
            return None
        return sch


def _tile(sch, acc, dst, target) -> bool:
    """Tile ``dst`` and compute ``acc`` per tile as the register-tiled micro-kernel. False if
    the nest does not fit the kernel's shape (nothing changed then)."""
    block = sch.get(acc)
    kinds = [int(iv.iter_type) for iv in block.iter_vars]
    n_sp, n_red = kinds.count(SPATIAL), kinds.count(REDUCE)
    loops = sch.get_loops(dst)
    extents = [int(sch.get(l).extent) for l in loops]
    if n_sp < 2 or kinds != [SPATIAL] * n_sp + [REDUCE] * n_red or len(loops) != n_sp:
        return False
    lanes = vector_lanes(target, str(block.writes[0].source.dtype))
    # a predicated block (the valid plan's) can be split but not reordered: its columns stay whole
    pred = _realize(sch, dst).predicate
    predicated = not (isinstance(pred, tirx.IntImm) and pred.value == 1)
    nr = extents[-1] if predicated else _tile_width(extents[-1], lanes)
    regs = 32 if "avx512f" in target.features else 16
    mr = max(1, min(extents[-2], (regs - LOAD_REGS) // -(-nr // lanes)))

    *outer, t, v = loops                   # dst in tiles of mr x nr, column panels outermost
    t_outer, t = sch.split(t, [None, mr])
    if nr < extents[-1]:
        v_outer, v = sch.split(v, [None, nr])
        outer.append(v_outer)
        sch.reorder(*outer, t_outer, t, v)
    outer.append(t_outer)
    sch.compute_at(acc, outer[-1], preserve_unit_loops=True)
    *_, at, av = sch.get_loops(acc)[:-n_red]
    reduce = sch.get_loops(acc)[-n_red:]
    split = _innermost_reduction(block, [int(sch.get(l).extent) for l in reduce])
    if split is not None:
        i, b = split
        parts = sch.split(reduce[i], [None, b]) if b < int(sch.get(reduce[i]).extent) \
            else [reduce[i]]
        reduce = [*reduce[:i], *parts[:-1], *reduce[i + 1:], parts[-1]]
    sch.reorder(*reduce, at, av)
    sch.set_scope(acc, 0, "local")
    sch.parallel(sch.fuse(*outer))
    sch.unroll(at)
    sch.vectorize(av)                      # before decompose_reduction (tvm027.md 1a)
    init = sch.decompose_reduction(acc, reduce[0])
    for b, (bt, bv) in ((init, sch.get_loops(init)[-2:]), (dst, (t, v))):
        sch.unroll(bt)
        sch.vectorize(bv)
    return True


def _unpredicated(func, name):
    """``func`` with block ``name`` computed everywhere (the ``valid`` plan predicates both
    stages to the logical elements, which no tiling primitive accepts): ``acc`` is the kernel's
    own scratch, its values at padding are never stored, and its reads are guarded for the whole
    padded index space anyway (``Source`` derives guards from index ranges, not predicates)."""
    def drop(realize):
        if realize.block.name_hint != name:
            return realize
        return s_tir.SBlockRealize(realize.iter_values, tirx.const(True, "bool"), realize.block)

    return tvm_ffi.structural_map(func, (s_tir.SBlockRealize, drop))


def _tile_width(width: int, lanes: int) -> int:
    """Columns of the register tile: all of ``width`` up to two vectors; else two vectors or
    one where they divide it; else a divisor between one and two vectors (the second one
    partial, no tail); else one vector and a predicated tail."""
    if width <= 2 * lanes:
        return width
    fits = [d for d in (2 * lanes, lanes, *range(2 * lanes, lanes, -1)) if width % d == 0]
    return fits[0] if fits else lanes


def _innermost_reduction(block, extents):
    """``(i, b)``: the innermost reduction loop should be ``b`` steps of reduction loop ``i``,
    the one that walks the first source's innermost dim (``r % b`` of a channel block, or ``r``
    itself for a contiguous dim such as nhwc's c), so that source and weights stream
    contiguously. None when no reduction loop walks that dim."""
    idx = block.reads[0].region[-1].min
    block_size = None
    if isinstance(idx, tirx.FloorMod) and isinstance(idx.b, tirx.IntImm):
        idx, block_size = idx.a, int(idx.b.value)
    used = tirx.analysis.undefined_vars(idx)
    reduce_vars = [iv.var for iv in block.iter_vars if int(iv.iter_type) == REDUCE]
    for i, (var, n) in enumerate(zip(reduce_vars, extents)):
        b = math.gcd(block_size, n) if block_size else n
        if b > 1 and any(u.same_as(var) for u in used):
            return i, b
    return None


RULES = [RegisterTiled()]
