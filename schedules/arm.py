"""Arm AArch64 schedules (NEON, 128-bit vectors: 4 lanes of fp32, 16 of int8).

* Data movement (reorders, zero fills): the x86 module's ``DataMovement`` rule, which is written
  against ``target.vector_bytes`` and the block's index expressions only (tiled transpose,
  loops partitioned where padding begins, vector stores of the register width); nothing in it
  is x86-specific. On AArch64 it gives ``q``-register stores fed by lane inserts
  (``ld1 {v.s}[i]``).
* Elementwise ops (eltwise, binary): the CPU-generic ``elementwise.Elementwise`` (loops
  partitioned where a padding condition changes, exp/erf/tanh/sigmoid as NEON polynomials:
  LLVM would call libm per lane).
* int8 reductions (matmul, convolution) on ``neon-dotprod``: ``Sdot``, tensorized to ``sdot``
  when the weights come in 4 x 4 blocks (``BA4b4a``, ``OIhw4o4i``).
* Anything else: ``generic.Fallback`` (schedules/__init__.py), after ``vector_math`` where the
  kernel calls exp/erf/tanh/sigmoid (``vector_math.VectorMath``).
"""

from __future__ import annotations

import functools

import tvm
import tvm_ffi
from tvm import s_tir, tirx

from . import generic, x86
from .elementwise import Elementwise
from .nest import uses
from .vector_math import VectorMath, vector_math

_realize = tvm.get_global_func("s_tir.schedule.GetSBlockRealize")
SPATIAL, REDUCE = 0, 2   # IterVar types


class Sdot:
    """``int32 acc[..., j] += int8 a[..., r] * int8 w[..., j4, r4]`` (matmul, convolution: any
    op whose reduction has this shape) tensorized to ``sdot``: each instruction adds, to 4 int32
    lanes of ``acc``, the dot products of 4 consecutive int8 source elements with a 4x4 int8
    weight block stored lane-major (``w[j][r]``, 16 contiguous bytes: ``BA4b4a`` matmul weights,
    ``OIhw4o4i`` convolution weights). Targets with ``asimddp`` only. The rule reads the
    reduction block's index expressions, not the op: the destination's innermost dim must be
    the lane dim of the weights' second-innermost, the source's innermost and the weights'
    innermost must be walked by one reduction loop, both 4-aligned. Anything else (and
    predicated or guarded nests) is left to the next rule."""

    def apply(self, func, target):
        if "asimddp" not in target.features:
            return None
        sch = s_tir.Schedule(vector_math(func))
        blocks = generic.root_blocks(sch)
        reductions = [b for b in blocks
                      if any(int(iv.iter_type) == REDUCE for iv in sch.get(b).iter_vars)]
        if len(reductions) != 1:
            return None
        acc = reductions[0]
        try:
            if not _sdot(sch, acc):
                return None
            for b in blocks:
                if not b.same_as(acc):
                    generic.spatial_parallel_vectorize(sch, b, target)
        except (s_tir.ScheduleError, RuntimeError, ValueError):   # tensorize refused the nest
            return None
        return sch


def _sdot(sch, acc) -> bool:
    block = sch.get(acc)
    realize = _realize(sch, acc)
    if not (isinstance(realize.predicate, tirx.IntImm) and realize.predicate.value == 1):
        return False
    store = block.body
    if not isinstance(store, tirx.BufferStore) or str(store.buffer.dtype) != "int32":
        return False
    loads = []
    tvm_ffi.structural_walk(store.value, (tvm.ir.expr.TensorLoad, loads.append))
    sources = [l for l in loads if not l.source.same_as(store.buffer)]
    if len(sources) != 2 or any(str(l.source.dtype) != "int8" for l in sources) or \
            len(loads) != 3:
        return False
    kinds = [int(iv.iter_type) for iv in block.iter_vars]
    n_sp = kinds.count(SPATIAL)
    if kinds != [SPATIAL] * n_sp + [REDUCE] * (len(kinds) - n_sp):
        return False
    ivars = [iv.var for iv in block.iter_vars]
    loops = sch.get_loops(acc)
    if len(loops) != len(ivars) or any(   # one loop per iter var, in order (a fresh TE nest)
            not value.same_as(sch.get(l).loop_var) for value, l in zip(realize.iter_values, loops)):
        return False
    # j: the destination's innermost index; r: the reduction var of the weights' innermost
    j_var = store.indices[-1]
    if not isinstance(j_var, tirx.Var):
        return False
    j = next((i for i, v in enumerate(ivars) if v.same_as(j_var)), None)
    weights = next((l for l in sources
                    if len(l.indices) >= 2 and uses(l.indices[-2], j_var)), None)
    if j is None or weights is None:
        return False
    src = next(l for l in sources if l is not weights)
    r = next((i for i in range(n_sp, len(ivars))
              if uses(weights.indices[-1], ivars[i])
              and uses(src.indices[-1], ivars[i])), None)
    extents = [int(sch.get(l).extent) for l in loops]
    if r is None or extents[j] % 4 or extents[r] % 4:
        return False
    jl, rl = loops[j], loops[r]
    jo, ji = sch.split(jl, [None, 4]) if extents[j] > 4 else (None, jl)
    ro, ri = sch.split(rl, [None, 4]) if extents[r] > 4 else (None, rl)
    outer = [l for i, l in enumerate(loops[:n_sp]) if i != j] + ([jo] if jo is not None else [])
    reduce = [l for i, l in enumerate(loops[n_sp:], n_sp) if i != r] + \
        ([ro] if ro is not None else [])
    sch.reorder(*outer, *reduce, ji, ri)
    if outer:
        sch.parallel(sch.fuse(*outer) if len(outer) > 1 else outer[0])
    if reduce:
        init = sch.decompose_reduction(acc, reduce[0])
        sch.vectorize(sch.get_loops(init)[-1])
    sch.tensorize(ji, _sdot_intrin())
    return True


@functools.cache
def _sdot_intrin() -> str:
    from .arm_intrin import register

    return register()


RULES = [x86.DataMovement(), Elementwise(), Sdot(), VectorMath()]
