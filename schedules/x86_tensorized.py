"""x86 convolution and matmul on the dot-product units: ``vpdpbusd`` (AVX-512 VNNI), AMX tiles,
and ``vpmaddubsw`` + ``vpmaddwd`` where there is no VNNI (AVX2, AVX-512BW).

The rules read the ``acc`` / ``dst`` nest that ``codegen.ops.common.materialize`` gives both
ops, through ``dot_rewrites.DotShape`` (schedules/dot_rewrites.py, shared with Arm's ``sdot``): ``j``
the destination's innermost dim, also the weights' second-innermost (weights packed
``...16o4i``: ``OIhw4i16o4i``, ``BA16b4a``, so that 16 outputs x 4 reduction steps are 64
contiguous bytes, one zmm); ``r`` the reduction loop walking both the source's and the
weights' innermost dim; ``t`` the rows of a tile (``ow``, matmul rows).

``Vnni`` (targets with ``avx512_vnni``): the micro-kernel of ``register_tiled.RegisterTiled`` with
its FMAs replaced by dot products: ``dot_tiled.DotTiled`` with 16 lanes, ``dst`` tiled ``mr``
rows x 1-3 vectors of 16 columns, ``acc`` per tile, each step one ``vpdpbusd`` per row and
column vector. The tile is a ``global`` buffer of under 1 KiB (``VNNI_TILE``): TVM 0.27 puts
those on the stack, where LLVM keeps them in registers, and every ``local`` one on the heap,
where it cannot. blockpad's int8 ops are s8 (or u8) x s8; ``vpdpbusd`` is u8 x s8, so s8
sources go through ``x86_intrin.VNNI_S8`` (shift by 128, compensated: exact). Spatial padding,
partial tiles, masked weights and sizes that are not multiples of 16 (or of 4 along the
reduction) are handled as ``dot_tiled`` says.

``Vdpbf16`` (targets with ``avx512_bf16``): the same tiling for bf16, each step one
``vdpbf16ps`` (two bf16 products into each float32 lane) per row and column vector, weights
``...16o2i`` on zmm or ``...8o2i`` on ymm.

``Maddubs`` (x86 without VNNI: ``avx2``, 8 ymm lanes; ``avx512bw``, 16 zmm lanes): the same
``DotTiled`` tiling, each step ``vpmaddubsw`` + ``vpmaddwd`` per row and column vector with the
source byte split in halves so that no int16 pair sum saturates (``x86_intrin``): exact, at
twice the multiplies of oneDNN's single ``vpmaddubsw`` (which is exact only for 7-bit weights).

``Maddubs7``: ``Maddubs`` for weights promised to fit 7 bits (``weight_bits = 7``), one
``vpmaddubsw`` + ``vpmaddwd`` a step, as oneDNN's and ONNX Runtime's AVX2 int8 kernels.

``Amx`` (targets with ``amx_tile``): 16 x 16 output tiles, 64 int8 (``tdpbusd`` / ``tdpbssd``)
or 32 bf16 (``tdpbf16ps``) reduction steps per tile multiply. All of loop ``r`` is one
intrinsic (``x86_intrin.amx_multiply``): the accumulator tile is loaded from its per-tile
scratch once, multiplied along the whole of ``r``, stored once (per filter tap for a
convolution), and the epilogue reads the scratch. Where the weights' blocks hold less of
``r`` than all of it (a convolution's ``OIhw16i16o2i`` bf16 weights: 32 input channels a block,
against 64 or more channels a source row), the intrinsic's weight tiles would not be
contiguous: ``r`` is split at the block and each block is one intrinsic (one accumulator round
trip per block and tap). The tensorized init loads the tile configuration on the thread that
runs the tile (it is per thread). Rows are source rows 64 bytes apart or more with a constant
stride: matmul rows, or convolution output pixels of a channels-last source (``nhwc``) with 64
channels (int8) or 32 (bf16) per row. Guarded (spatially padded) reads, and dims that are not
multiples of 16, are left to the next rule.

A rule returns None for what it does not take (another dtype, dims that are not multiples of
the tile, a predicated or guarded nest it cannot tensorize), and the next rule in the table
tries: ``Amx`` falls back to ``Vnni`` (int8) or ``Vdpbf16`` (bf16), then ``Maddubs7`` and
``Maddubs`` (zmm, then ymm), then ``register_tiled.RegisterTiled``.

``reference=True`` builds the same schedule with the plain-loop twins of the intrinsics, so
that the algorithm runs, and is checked against numpy, on a CPU without the instructions.
"""

from __future__ import annotations

from typing import ClassVar

from blockpad.vocabulary import WEIGHT_BITS_ATTR

from . import x86_intrin as xi
from .dot_intrin import BF16_BITS
from .dot_tiled import DotTiled, schedule, tile_acc, tile_dst
from .nest import uses
from .rule import ScheduleRule

VNNI_TILE = 15   # vectors in a register tile; 16 x 16 int32 would be 1 KiB, which TVM puts on
                 # the heap
MADDUBS_TILE = 8  # ymm accumulators: AVX2 has 16 ymm, and each step also holds the weight
                  # vectors, both halves of the broadcast source and the constants 1 and 2
MADDUBS7_TILE = 12  # 7-bit weights: one broadcast and the constant 1 (and for s8 the 128's
                    # product) beside the weight vectors


class Vnni(DotTiled):
    """int8 (s8 or u8 x s8 -> s32) convolution and matmul tensorized to ``vpdpbusd``."""

    feature, lanes, tile = "avx512_vnni", 16, VNNI_TILE
    prefetch = True   # measured on Zen 4 (prefetch.prefetch_next_panel); the others not
    interleave = True   # measured on Zen 4 (interleave.interleave_epilogue); the others not

    def __init__(self, reference: bool = False):
        self.reference = reference

    def intrin(self, nest):
        kinds = {("uint8", "int8", "int32"): xi.VNNI, ("int8", "int8", "int32"): xi.VNNI_S8}
        kind = kinds.get((nest.src_dtype, nest.wei_dtype, nest.acc_dtype))
        return None if kind is None else xi.name(kind, self.reference)


class Vdpbf16(DotTiled):
    """bf16 (x bf16 -> fp32) convolution and matmul tensorized to ``vdpbf16ps``: ``Vnni``'s
    tiling with 2 reduction steps a lane, twice the multiplies of an FMA; 16 lanes of zmm on
    weights ``...16o2i`` (``OIhw8i16o2i``, ``BA16b2a``), 8 of ymm on ``...8o2i`` (an
    ``nChw8c`` convolution's ``OIhw4i8o2i``), so that a register of weights is ``lanes``
    outputs x 2 input channels."""

    feature, tile = "avx512_bf16", VNNI_TILE
    INTRINS: ClassVar[dict] = {16: xi.VDPBF16, 8: xi.VDPBF16_8}

    def __init__(self, lanes: int = 16, reference: bool = False):
        self.lanes, self.reference = lanes, reference

    def intrin(self, nest):
        bf16 = (nest.src_dtype, nest.wei_dtype, nest.acc_dtype) == (BF16_BITS, BF16_BITS, "float32")
        return xi.name(self.INTRINS[self.lanes], self.reference) if bf16 else None


class Maddubs(DotTiled):
    """int8 (s8 or u8 x s8 -> s32) convolution and matmul on CPUs without VNNI:
    ``vpmaddubsw`` + ``vpmaddwd`` (oneDNN's AVX2 int8 sequence), exact for every input
    (``x86_intrin``: the source byte split in halves so that no s16 pair sum saturates). 8
    lanes of ymm on AVX2, 16 of zmm with AVX-512BW; weights ``...16o4i`` (or ``...8o4i`` for
    ymm), so that ``lanes`` outputs x 4 reduction steps are one register."""

    TILES: ClassVar[dict] = {8: MADDUBS_TILE, 16: VNNI_TILE}
    INTRINS: ClassVar[dict] = {
        8: {("uint8", "int8", "int32"): xi.MADDUBS, ("int8", "int8", "int32"): xi.MADDUBS_S8},
        16: {("uint8", "int8", "int32"): xi.MADDUBS_16,
             ("int8", "int8", "int32"): xi.MADDUBS_S8_16}}

    def __init__(self, lanes: int, reference: bool = False):
        self.lanes, self.tile, self.reference = lanes, self.TILES[lanes], reference
        self.feature = "avx512bw" if lanes == 16 else "avx2"

    def intrin(self, nest):
        kind = self.INTRINS[self.lanes].get((nest.src_dtype, nest.wei_dtype, nest.acc_dtype))
        return None if kind is None else xi.name(kind, self.reference)


class Maddubs7(Maddubs):
    """``Maddubs`` for kernels whose weights are promised to fit 7 bits (``weight_bits = 7``,
    the ``blockpad.weight_bits`` function attribute): one ``vpmaddubsw`` + ``vpmaddwd`` a step
    (``x86_intrin``), so a tile holds more accumulators (AVX2: 16 ymm less the weight vectors,
    the broadcast and the constant 1)."""

    TILES: ClassVar[dict] = {8: MADDUBS7_TILE, 16: VNNI_TILE}
    INTRINS: ClassVar[dict] = {
        8: {("uint8", "int8", "int32"): xi.MADDUBS7, ("int8", "int8", "int32"): xi.MADDUBS7_S8},
        16: {("uint8", "int8", "int32"): xi.MADDUBS7_16,
             ("int8", "int8", "int32"): xi.MADDUBS7_S8_16}}

    def takes(self, func, target):
        attrs = func.attrs if func.attrs is not None else {}
        return super().takes(func, target) and int(attrs.get(WEIGHT_BITS_ATTR, 8)) == 7


class Amx(ScheduleRule):
    """int8 and bf16 convolution and matmul on AMX tiles."""

    ops = ("conv2d", "matmul")
    # (source, weights, accumulator) -> (tile multiply, init, reduction steps per multiply)
    KINDS: ClassVar[dict] = {
        ("uint8", "int8", "int32"): (xi.AMX_INT8, xi.AMX_ZERO_I32, 64),
        ("int8", "int8", "int32"): (xi.AMX_S8, xi.AMX_ZERO_I32, 64),
        # bf16 arrives as its uint16 bits, reinterpreted per element (codegen/ops/matmul.py)
        ("uint16", "uint16", "float32"): (xi.AMX_BF16, xi.AMX_ZERO_F32, 32),
    }

    def __init__(self, reference: bool = False):
        self.reference = reference

    def takes(self, func, target):
        return super().takes(func, target) and "amx_tile" in target.features

    def schedule(self, func, target):
        return schedule(func, target, self._tile)

    def _tile(self, sch, acc, dst, nest):
        kind = self.KINDS.get((nest.src_dtype, nest.wei_dtype, nest.acc_dtype))
        if kind is None or nest.guard is not None or nest.wei_guard is not None:
            return False
        multiply, zero, per_tile = kind
        steps = _contiguous_steps(nest)
        if not steps or steps % per_tile or nest.extents[nest.n_sp - 1] % 16 \
                or nest.extents[nest.t] % 16:
            return False
        outer = tile_dst(sch, dst, nest, 16, 1, 16)
        update, init = tile_acc(sch, acc, nest, outer, steps, 1, 16)
        sch.tensorize(sch.get_loops(init)[-2], xi.name(zero, self.reference))
        sch.tensorize(sch.get_loops(update)[-3], xi.amx_multiply(
            multiply, steps // per_tile, self.reference))
        return True


def _contiguous_steps(nest) -> int:
    """The steps of ``r`` whose weights are contiguous tile rows: all of ``r`` (one
    accumulator round trip per tile), unless an outer weights dim walks ``r`` too (blocks of
    input channels, ``OIhw16i16o2i``: ``[..16i, 16o, 2i]``) and the steps are one block."""
    r, wei = nest.vars[nest.r], nest.wei
    if not any(uses(i, r) for i in wei.indices[:-3]):
        return nest.extents[nest.r]
    block = int(wei.source.shape[-3]) * int(wei.source.shape[-1])
    return block if nest.extents[nest.r] % block == 0 else 0   # 0: no whole blocks, declined


RULES = [Amx(), Vnni(), Vdpbf16(16), Vdpbf16(8), Maddubs7(16), Maddubs7(8), Maddubs(16), Maddubs(8)]
