"""The rule of last resort, valid for any kernel on any CPU target: each stage runs its outer
loops in parallel and, when it has no reduction, vectorises its innermost loop. Correct, never
fast for reductions: ops with real schedules never reach it."""

from __future__ import annotations

import math

from tvm import s_tir

from .common import SPATIAL, vector_lanes
from .rule import ScheduleRule


class Fallback(ScheduleRule):
    def schedule(self, func, target):
        sch = s_tir.Schedule(func)
        for block in root_blocks(sch):
            spatial_parallel_vectorize(sch, block, target)
        return sch


def root_blocks(sch):
    """The top-level stages of a function (none for an empty body)."""
    try:
        root = sch.get_sblock("root")
    except Exception:  # noqa: BLE001 - s_tir raises a generic error for a missing block
        return []
    return sch.get_child_blocks(root)


def spatial_parallel_vectorize(sch, block, target, min_task=4096):
    """Parallel over the outer spatial loops (fused until a task holds at most ``min_task``
    elements), vectorised innermost loop when the stage is purely spatial."""
    loops = sch.get_loops(block)
    kinds = [iv.iter_type for iv in sch.get(block).iter_vars]
    spatial = all(k == SPATIAL for k in kinds)
    extents = [int(sch.get(l).extent) for l in loops]
    # an unscheduled TE stage has one loop per iter var, spatial ones first
    n_spatial = sum(1 for k in kinds if k == SPATIAL)
    inner = None
    if spatial and loops:
        dtype = str(sch.get(block).writes[0].source.dtype)
        lanes = vector_lanes(target, dtype)
        inner = loops[-1]
        if extents[-1] > lanes and extents[-1] % lanes == 0:
            _, inner = sch.split(inner, [None, lanes])
            extents[-1] = lanes
        loops = loops[:-1]
        n_spatial -= 1
    outer, work = [], math.prod(extents)
    for loop, n in zip(loops[:n_spatial], extents[:n_spatial]):
        outer.append(loop)
        work //= n
        if work <= min_task:
            break
    if outer and math.prod(extents[: len(outer)]) > 1:
        sch.parallel(sch.fuse(*outer) if len(outer) > 1 else outer[0])
    if inner is not None and extents[-1] > 1:
        sch.vectorize(inner)
