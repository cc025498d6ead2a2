"""How to compute on each target: one module per target family, dispatched by a plain table.

A rule is a ``rule.ScheduleRule``: ``apply(func, target) -> Schedule | None`` (TVM dlight's
contract), None meaning "not mine"; ``rule.first_match`` walks a family's list.
"""

from __future__ import annotations

import tvm

from . import (
    arm,
    cpu_reduction,
    cuda,
    cuda_conv,
    cuda_reduction,
    data_movement,
    depthwise,
    generic,
    inverted_residual,
    register_tiled,
    winograd,
    x86_tensorized,
)
from .elementwise import Elementwise
from .rule import distinct, first_match
from .vector_math import VectorMath

RULES = {
    "x86": [*data_movement.RULES, Elementwise(), *x86_tensorized.RULES, *winograd.RULES,
            *depthwise.RULES, *inverted_residual.RULES,
            *register_tiled.RULES, *cpu_reduction.RULES, VectorMath(),
            generic.Fallback()],
    "arm": [*winograd.RULES, *inverted_residual.RULES, *arm.RULES, generic.Fallback()],
    # never generic.Fallback: GPU kernels must bind threads
    "cuda": [*cuda.RULES, *cuda_conv.RULES, *cuda_reduction.RULES, cuda.Fallback()],
}


def schedule(func: tvm.tirx.PrimFunc, target) -> tvm.tirx.PrimFunc:
    """Apply the first rule of ``target.family`` that takes ``func``; return the scheduled func."""
    return finish(first_match(RULES[target.family], func, target)[1].mod["main"], target)


#: the pool sizes a rule may schedule a kernel apart for (``ScheduleRule.for_threads``): one
#: core, where work split into tasks for several (the inverted residual's bands) only adds
#: recomputation
THREAD_VARIANTS = (1,)


def schedule_for_pools(func: tvm.tirx.PrimFunc, target) -> tuple:
    """``(schedule(func, target), {threads: scheduled func})``: the default and the variants
    its rule makes for pools of ``THREAD_VARIANTS`` threads (``ScheduleRule.for_threads``),
    those that differ from the default only. What a build compiles."""
    rule, default = first_match(RULES[target.family], func, target)
    variants = {}
    for n in THREAD_VARIANTS:
        picked = distinct([default, rule.for_threads(func, target, n)])
        if len(picked) == 2:
            variants[n] = finish(picked[1].mod["main"], target)
    return finish(default.mod["main"], target), variants


def finish(func: tvm.tirx.PrimFunc, target) -> tvm.tirx.PrimFunc:
    """What every scheduled function of ``target.family`` gets before TVM lowers it, whichever
    rule (or tuning variant) scheduled it: on CUDA, reduction predicates TVM would drop and
    vector selects its code generator cannot print."""
    if target.family != "cuda":
        return func
    return cuda.selects_unvectorized(cuda.reduction_predicates_kept(func))
