"""Arm AArch64 schedules (NEON, 128-bit vectors: 4 lanes of fp32, 16 of int8).

* Data movement (reorders, zero fills): the CPU rule ``data_movement.DataMovement``, written
  against ``target.vector_bytes`` and the block's index expressions only (tiled transpose,
  loops partitioned where padding begins, vector stores of the register width); nothing in it
  is x86-specific. On AArch64 it gives ``q``-register stores fed by lane inserts
  (``ld1 {v.s}[i]``).
* Elementwise ops (eltwise, binary): the CPU-generic ``elementwise.Elementwise`` (loops
  partitioned where a padding condition changes, exp/erf/tanh/sigmoid as NEON polynomials:
  LLVM would call libm per lane).
* int8 convolution and matmul on ``neon-dotprod``: ``Sdot``, register tiles of ``sdot`` when
  the weights come in 4 x 4 blocks (``BA4b4a``, ``OIhw4o4i``), with padding, strides and odd
  sizes (schedules/dot_tiled.py, shared with x86's ``vpdpbusd``).
* fp32 convolution and matmul, and int8 where there is no ``sdot``: the CPU ``RegisterTiled``
  (schedules/register_tiled.py), which reads loops and index expressions only: register tiles of
  4-lane accumulators fed by by-element ``fmla`` (``target.tile_registers``: 20 of the 32 q
  registers), the halo staged out of the hot loop.
* Softmax and pooling: the CPU reduction rules (schedules/cpu_reduction.py), likewise written
  against loops, index expressions and the vector width: rows tiled so that the source stays
  in cache between the statistics and the store, statistics vectorised along the 4-lane
  channel block.
* Anything else: ``generic.Fallback`` (schedules/__init__.py), after ``vector_math`` where the
  kernel calls exp/erf/tanh/sigmoid (``vector_math.VectorMath``).
"""

from __future__ import annotations

from . import cpu_reduction, data_movement, register_tiled
from .dot_tiled import DotTiled
from .elementwise import Elementwise
from .vector_math import VectorMath, vector_math

ARM_TILE = 20   # accumulator vectors in a register tile: 32 q registers, less the weight
                # vectors of a step, a broadcast source and the addresses LLVM keeps in them


class Sdot(DotTiled):
    """int8 (s8 x s8 -> s32) convolution and matmul tensorized to ``sdot`` (targets with
    ``asimddp``): each instruction adds, to 4 int32 lanes, the dot products of 4 consecutive
    source bytes with a 4 x 4 weight block stored lane-major (``w[j][r]``, 16 contiguous bytes:
    ``BA4b4a`` matmul weights, ``OIhw4o4i`` convolution weights). The register tiling, and the
    awkward nests it takes (spatial padding, partial tiles, masked weights, M, N, K and channel
    counts of any size, a destination whose padding is left alone), are x86 VNNI's: the shared
    ``dot_tiled.DotTiled``. u8 sources (``udot`` is u8 x u8) go to the next rule."""

    feature, lanes, tile = "asimddp", 4, ARM_TILE

    def schedule(self, func, target):
        # exp/erf/tanh/sigmoid post-ops as NEON polynomials, not a libm call per lane
        return super().schedule(vector_math(func), target)

    def intrin(self, nest):
        if (nest.src_dtype, nest.wei_dtype, nest.acc_dtype) != ("int8", "int8", "int32"):
            return None
        from .arm_intrin import register

        return register()


RULES = [data_movement.DataMovement(), Elementwise(), Sdot(), register_tiled.RegisterTiled(),
         *cpu_reduction.RULES, VectorMath()]
