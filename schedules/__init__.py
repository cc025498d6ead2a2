"""How to compute on each target: one module per target family, dispatched by a plain table.

A rule is an object with ``apply(func, target) -> Schedule | None`` (TVM dlight's contract):
None means "not mine", and the next rule in the family's list is tried.
"""

from __future__ import annotations

import tvm

from . import (arm, cpu_reduction, cuda, cuda_conv, cuda_reduction, data_movement, generic,
               register_tiled, winograd, x86_tensorized)
from .common import op_of
from .elementwise import Elementwise
from .vector_math import VectorMath

RULES = {
    "x86": [*data_movement.RULES, Elementwise(), *x86_tensorized.RULES, *winograd.RULES,
            *register_tiled.RULES, *cpu_reduction.RULES, VectorMath(), generic.Fallback()],
    "arm": [*winograd.RULES, *arm.RULES, generic.Fallback()],
    # never generic.Fallback: GPU kernels must bind threads
    "cuda": [*cuda.RULES, *cuda_conv.RULES, *cuda_reduction.RULES, cuda.Fallback()],
}


def schedule(func: tvm.tirx.PrimFunc, target) -> tvm.tirx.PrimFunc:
    """Apply the first rule of ``target.family`` that takes ``func``; return the scheduled func."""
    for rule in RULES[target.family]:
        sch = rule.apply(func, target)
        if sch is not None:
            return sch.mod["main"]
    raise NotImplementedError(f"no {target.family} schedule rule takes op "
                              f"{op_of(func)!r}")
