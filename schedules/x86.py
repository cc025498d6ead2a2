"""x86 schedules (AVX2 host and AVX-512): vectorise along the innermost physical dim, which for
blocked layouts is the block, and run the outer dims in parallel."""

from __future__ import annotations

import math

import tvm
from tvm import s_tir

from .common import op_of, vector_lanes


class DataMovement:
    """Reorders and zero fills: one pass over the destination, outer dims parallel, inner dim
    vectorised (split to the register width when it is longer)."""

    ops = ("reorder", "zero_pad")

    def apply(self, func, target):
        if op_of(func) not in self.ops:
            return None
        sch = s_tir.Schedule(func)
        for block in sch.get_child_blocks(sch.get_sblock("root")) if _has_root(sch) else []:
            self._block(sch, block, target)
        return sch

    @staticmethod
    def _block(sch, block, target):
        loops = sch.get_loops(block)
        extents = [int(sch.get(l).extent) for l in loops]
        dtype = str(sch.get(block).writes[0].source.dtype)
        lanes = vector_lanes(target, dtype)
        inner = loops[-1]
        if extents[-1] > lanes:
            _, inner = sch.split(inner, [None, lanes])
            extents[-1] = lanes
        # parallel over the outer loops, leaving enough work inside each task to amortise it
        outer, work = [], math.prod(extents)
        for loop, n in zip(loops[:-1], extents[:-1]):
            outer.append(loop)
            work //= n
            if work <= 4096:
                break
        if outer and math.prod(extents[: len(outer)]) > 1:
            sch.parallel(sch.fuse(*outer) if len(outer) > 1 else outer[0])
        sch.vectorize(inner)


def _has_root(sch):
    try:
        sch.get_sblock("root")
        return True
    except Exception:  # noqa: BLE001 - a func without a root block has nothing to schedule
        return False


RULES = [DataMovement()]
