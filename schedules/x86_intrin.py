"""Tensor intrinsics blockpad needs on x86 and TVM 0.27 lacks or gets wrong (docs/tvm-0.27-notes.md 5):

* ``vnni_16x4``: ``C[16] i32 += A[4] u8 . B[16, 4] i8`` with ``vpdpbusd`` (TVM's own fails LLVM
  22 verification: the intrinsic's operand types changed), and ``vnni_s8s8_16x4``, the same
  for s8 sources (blockpad's int8 ops take s8 x s8), exact through a shift and a compensation;
* ``maddubs_8x4`` / ``maddubs_16x4`` (and ``_s8s8_``): the same dot product on CPUs without
  VNNI, ``vpmaddubsw`` + ``vpmaddwd`` on ymm (AVX2) or zmm (AVX-512BW), exact for every input
  (the source byte split so that no int16 pair sum saturates); ``maddubs7_*``: one
  ``vpmaddubsw`` a step for weights promised to fit 7 bits (``weight_bits = 7``);
* ``vdpbf16ps_16x2`` / ``_8x2``: ``C[16] f32 += A[2] bf16 . B[16, 2] bf16`` with ``vdpbf16ps``
  on zmm / ymm (AVX-512 BF16), through a function in LLVM IR that TVM links and LLVM inlines (TVM cannot hand LLVM
  a bfloat vector);
* every buffer aligned to its element only: blockpad's kernel parameters promise no more;
* ``amx_u8s8s32_16x16x64`` / ``amx_s8s8s32_16x16x64`` / ``amx_bf16f32_16x16x32``: one AMX
  tile multiply (``tdpbusd``, ``tdpbssd``, ``tdpbf16ps``), or ``n`` of them along the reduction
  with the accumulator kept in its tile (``amx_multiply``), and ``amx_cfg_zero_*``, which loads
  the tile configuration and zeroes the accumulator tile. Tile configuration is per thread,
  so it lives in the tensorized init block, which runs on the same pool thread as the updates
  that follow it.

Each intrinsic also has a ``*_ref`` twin: plain loops that compute what the instruction
computes, written from Intel's pseudo-code rather than from the description or the
implementation (``vdpbf16ps``: two bf16 products added to each float32 lane, the odd one
first; ``vpdpbusd``: four u8 x s8 byte products widened to int32 and summed into each lane; an
s8 source shifted by +128 to u8 and compensated by ``128 * sum(b)``; AMX: loops over the rows
and row bytes of the tile configuration the implementation loads, B's rows being A's dwords).
A schedule tensorized with the twin runs the same packing, blocking, shift and accumulation on
any CPU, so an AVX2-only machine checks the arithmetic the instructions do.

Defined here, in TVMScript, rather than imported from ``tvm.s_tir.tensor_intrin``: importing
that package parses every intrinsic TVM has and takes ~30 s.
"""

from __future__ import annotations

import functools

from tvm.s_tir import TensorIntrin
from tvm.script import tirx as T

from .dot_intrin import BF16_BITS, bf16, dot_desc, widen

# a byte in each of the 4 bytes of an int32 (a broadcast dword of source bytes)
_BYTE_0X80 = -2139062144   # 0x80808080: + 128 in each byte (u8 from s8)
_BYTE_0X7F = 0x7F7F7F7F
_BYTE_0X40 = 0x40404040
_BYTE_0X01 = 0x01010101

# ---- VNNI ----------------------------------------------------------------------------------


def _vnni_impl(src):
    """``vpdpbusd`` is u8 x s8. An s8 source goes through ``a . b = (a + 128) . b - 128 *
    sum(b)``: ``a ^ 0x80`` is ``a + 128`` as u8, and the compensation ``128 * sum(b)`` is a
    second ``vpdpbusd`` of a broadcast 128 by the same weights. It depends on the weights only,
    so LLVM computes it once for all the rows of a register tile that share them. Exact in
    int32: each 4-product sum fits, and the sums wrap modulo 2**32 as numpy's int32 sums do."""
    signed = src == "int8"
    flip = _BYTE_0X80

    @T.prim_func(s_tir=True)
    def impl(a: T.handle, b: T.handle, c: T.handle) -> None:
        A = T.match_buffer(a, (4,), src, offset_factor=1, align=1)
        B = T.match_buffer(b, (16, 4), "int8", offset_factor=1, align=1)
        C = T.match_buffer(c, (16,), "int32", offset_factor=1, align=1)
        with T.sblock("root"):
            T.reads(C[0:16], A[0:4], B[0:16, 0:4])
            T.writes(C[0:16])
            # no named temporaries: TVM 0.27 gives each one a memory slot of its own
            if signed:
                C[T.ramp(T.int32(0), 1, 16)] = T.call_llvm_pure_intrin(
                    T.llvm_lookup_intrinsic_id("llvm.x86.avx512.vpdpbusd.512"),
                    C.vload([0], dtype="int32x16"),
                    T.reinterpret(T.broadcast(T.bitwise_xor(
                        T.reinterpret(A.vload([0], "int8x4"), dtype="int32"), T.int32(flip)), 16),
                        dtype="uint8x64"),
                    B.vload([0, 0], dtype="int8x64"), dtype="int32x16") - T.call_llvm_pure_intrin(
                    T.llvm_lookup_intrinsic_id("llvm.x86.avx512.vpdpbusd.512"),
                    T.broadcast(T.int32(0), 16),
                    T.reinterpret(T.broadcast(T.int32(flip), 16), dtype="uint8x64"),
                    B.vload([0, 0], dtype="int8x64"), dtype="int32x16")
            else:
                C[T.ramp(T.int32(0), 1, 16)] = T.call_llvm_pure_intrin(
                    T.llvm_lookup_intrinsic_id("llvm.x86.avx512.vpdpbusd.512"),
                    C.vload([0], dtype="int32x16"),
                    T.reinterpret(T.broadcast(T.reinterpret(A.vload([0], "uint8x4"),
                                                            dtype="int32"), 16), dtype="uint8x64"),
                    B.vload([0, 0], dtype="int8x64"), dtype="int32x16")
    return impl


# ---- AVX2 / AVX-512BW without VNNI: vpmaddubsw + vpmaddwd ----------------------------------
# ``vpmaddubsw`` multiplies u8 x s8 byte pairs and adds each pair into a SATURATED s16; one
# ``vpmaddwd`` by ones then adds the two words of each dword into int32 (oneDNN's AVX2 int8
# kernels). 2 * 255 * -128 = -65280 does not fit an s16, so the pair sum saturates on large
# sources and weights. oneDNN shifts an s8 source to u8 (+128, compensated) and halves the s8
# weights in its reorder (``wei_adj_scale = 0.5``, the output scale doubled): the weights lose
# their lowest bit, and a u8 source by full-range weights can still saturate. blockpad stays
# exact instead, for every u8/s8 source and s8 weight: the source byte u (s8 shifted to u8) is
# split u = 2 h + l, h = u >> 1 in [0, 127], l = u & 1. A pair of h x w is at most 2 * 127 *
# 128 = 32512 and a pair of l x w at most 256 in magnitude, so neither ``vpmaddubsw`` can
# saturate, and ``vpmaddwd`` by 2 and by 1 joins them in int32: 2 (h . w) + l . w = u . w.
# The split costs a second vpmaddubsw + vpmaddwd per row and column vector; the halves of the
# broadcast source are computed once per row (the two scalar ops on its dword).

_MADD = {8: ("llvm.x86.avx2.pmadd.ub.sw", "llvm.x86.avx2.pmadd.wd"),
         16: ("llvm.x86.avx512.pmaddubs.w.512", "llvm.x86.avx512.pmaddw.d.512")}


def _maddubs_impl(lanes, src, seven_bit=False):
    """``C[lanes] i32 += A[4] . B[lanes, 4] i8`` with the source split in halves (above). An s8
    source is shifted to u8 (``a ^ 0x80``) and compensated: a . b = 2 (h . b - 64 sum(b)) +
    l . b, the 64 sum(b) pairs one more ``vpmaddubsw`` of a broadcast 64, subtracted in s16
    (``vpsubw``) before the ``vpmaddwd`` by 2: the difference is (h - 64) . b with h - 64 in
    [-64, 63], at most 2 * 64 * 128 = 16384 a pair, so the wrapping s16 subtraction is exact.
    The broadcast 64's product depends on the weights only: LLVM computes it once for the rows
    of a tile that no predicate separates. ``seven_bit``: weights in [-64, 64], the whole byte
    in one ``vpmaddubsw`` (below)."""
    ub_sw, wd = _MADD[lanes]
    signed = src == "int8"
    bytes_, words, dwords = f"int8x{4 * lanes}", f"int16x{2 * lanes}", f"int32x{lanes}"
    quad = f"{src}x4"

    def ubsw(word, weights):   # vpmaddubsw(broadcast word, weights)
        return T.call_llvm_pure_intrin(T.llvm_lookup_intrinsic_id(ub_sw),
                                       T.reinterpret(T.broadcast(word, lanes), dtype=bytes_),
                                       weights, dtype=words)

    def madd(pairs, by):   # vpmaddwd(pairs, broadcast by)
        return T.call_llvm_pure_intrin(T.llvm_lookup_intrinsic_id(wd), pairs,
                                       T.broadcast(T.int16(by), 2 * lanes), dtype=dwords)

    def dot(word, weights):   # word: the 4 source bytes as an int32
        if seven_bit:
            if not signed:
                return madd(ubsw(word, weights), 1)
            return madd(ubsw(T.bitwise_xor(word, T.int32(_BYTE_0X80)), weights)
                        - ubsw(T.int32(_BYTE_0X80), weights), 1)
        if not signed:
            return madd(ubsw(T.bitwise_and(T.shift_right(word, 1), T.int32(_BYTE_0X7F)), weights), 2) \
                + madd(ubsw(T.bitwise_and(word, T.int32(_BYTE_0X01)), weights), 1)
        u = T.bitwise_xor(word, T.int32(_BYTE_0X80))
        return madd(ubsw(T.bitwise_and(T.shift_right(u, 1), T.int32(_BYTE_0X7F)), weights)
                    - ubsw(T.int32(_BYTE_0X40), weights), 2) \
            + madd(ubsw(T.bitwise_and(u, T.int32(_BYTE_0X01)), weights), 1)

    @T.prim_func(s_tir=True)
    def impl(a: T.handle, b: T.handle, c: T.handle) -> None:
        A = T.match_buffer(a, (4,), src, offset_factor=1, align=1)
        B = T.match_buffer(b, (lanes, 4), "int8", offset_factor=1, align=1)
        C = T.match_buffer(c, (lanes,), "int32", offset_factor=1, align=1)
        with T.sblock("root"):
            T.reads(C[0:lanes], A[0:4], B[0:lanes, 0:4])
            T.writes(C[0:lanes])
            # no named temporaries: TVM 0.27 gives each one a memory slot of its own
            C[T.ramp(T.int32(0), 1, lanes)] = C.vload([0], dtype=dwords) + dot(
                T.reinterpret(A.vload([0], quad), dtype="int32"), B.vload([0, 0], dtype=bytes_))
    return impl


# 7-bit weights (``weight_bits = 7``: every weight in [-64, 64], as ONNX Runtime's
# ``reduce_range`` writes them): a pair of u8 x w is at most 2 * 255 * 64 = 32640 in
# magnitude, so one ``vpmaddubsw`` of the whole source byte cannot saturate, and ``vpmaddwd``
# by 1 widens it: half the multiplies of the split above (oneDNN's and ONNX Runtime's AVX2
# sequence, whose weights are 7-bit for that reason). An s8 source is shifted to u8 and
# compensated as above, in s16: (a + 128) . b - 128 . b pairs are a . b pairs, at most 2 * 128 *
# 64 = 16384, so the wrapping ``vpsubw`` is exact. The promise is the caller's; the runtime
# checks it (runtime/library.py, runtime/graph).


# ---- AVX-512 BF16: vdpbf16ps -----------------------------------------------------------------
# ``vdpbf16ps zmm_c, zmm_a, zmm_b`` (or ymm, AVX-512VL): each of 16 (8) float32 lanes adds two
# bf16 x bf16 products, pair i of A by pair i of B. LLVM 22's intrinsic takes ``<32 x bfloat>``
# operands, and TVM cannot pass it any: its lowering (``BF16ComputeLegalize``) turns every
# bfloat16 vector into float32 before LLVM sees it. So the instruction is reached through a
# small function in LLVM IR that takes the pairs as ``<16 x i32>`` and bitcasts them: TVM
# links it into the module where the intrinsic's body names it (``pragma_import_llvm``) and
# LLVM inlines it (TVM marks imported functions ``alwaysinline``), leaving one ``vdpbf16ps`` a
# step. The source pair is broadcast as a dword, as ``vpdpbusd``'s 4 bytes are.


def vdpbf16ps_fn(lanes: int) -> tuple:
    """(name, LLVM IR) of the function ``C[lanes] f32 += A . B`` (pairs as ``lanes`` i32)."""
    name, bits = f"blockpad_vdpbf16ps_{32 * lanes}", 32 * lanes
    ir = f"""
declare <{lanes} x float> @llvm.x86.avx512bf16.dpbf16ps.{bits}(<{lanes} x float>, <{2 * lanes} x bfloat>, <{2 * lanes} x bfloat>)
define <{lanes} x float> @{name}(<{lanes} x float> %c, <{lanes} x i32> %a, <{lanes} x i32> %b) #0 {{
  %x = bitcast <{lanes} x i32> %a to <{2 * lanes} x bfloat>
  %y = bitcast <{lanes} x i32> %b to <{2 * lanes} x bfloat>
  %r = call <{lanes} x float> @llvm.x86.avx512bf16.dpbf16ps.{bits}(<{lanes} x float> %c, <{2 * lanes} x bfloat> %x, <{2 * lanes} x bfloat> %y)
  ret <{lanes} x float> %r
}}
attributes #0 = {{ "target-features"="+avx512f,+avx512bw,+avx512vl,+avx512bf16" }}
"""
    return name, ir


def _vdpbf16_impl(lanes, src):
    fn, ir = vdpbf16ps_fn(lanes)
    acc, pairs = f"float32x{lanes}", f"int32x{lanes}"

    @T.prim_func(s_tir=True)
    def impl(a: T.handle, b: T.handle, c: T.handle) -> None:
        A = T.match_buffer(a, (2,), src, offset_factor=1, align=1)
        B = T.match_buffer(b, (lanes, 2), src, offset_factor=1, align=1)
        C = T.match_buffer(c, (lanes,), "float32", offset_factor=1, align=1)
        with T.sblock("root"):
            T.reads(C[0:lanes], A[0:2], B[0:lanes, 0:2])
            T.writes(C[0:lanes])
            with T.attr(0, "pragma_import_llvm", ir):
                C[T.ramp(T.int32(0), 1, lanes)] = T.call_extern(
                    acc, fn, C.vload([0], dtype=acc),
                    T.broadcast(T.reinterpret(A.vload([0], "uint16x2"), dtype="int32"), lanes),
                    T.reinterpret(B.vload([0, 0], dtype=f"uint16x{2 * lanes}"), dtype=pairs))
    return impl


# ---- AMX -----------------------------------------------------------------------------------
# One tile multiply: C[16, 16] += A[16, K] . B packed [K/s][16][s] (s = 4 int8, 2 bf16: the
# "VNNI" layout AMX wants, each tile row 64 bytes). bf16 is stored as uint16 (as blockpad keeps
# it in every kernel argument: DLPack and numpy have no bfloat16), reinterpreted per element.


# The tile configuration the kernels load (palette 1): tiles 0 (C), 1 (A) and 2 (B), each 16
# rows of 64 bytes. The implementation writes it into the ldtilecfg block; the twins take
# their loop extents from it, as the instructions do.
TILE_ROWS = (16, 16, 16)
TILE_COLSB = (64, 64, 64)


def _amx_shape(src, tiles):
    """(accumulator, weight dtype, elements per 4 bytes, reduction length, element bytes) of
    ``tiles`` tile multiplies of ``src`` (uint16: bf16 bits)."""
    if src == "uint16":
        return "float32", "uint16", 2, 32 * tiles, 2
    return "int32", "int8", 4, 64 * tiles, 1


def _amx_desc(src, tiles=1):
    acc, wei, step, kt, _ = _amx_shape(src, tiles)
    elem = widen(src)

    @T.prim_func(s_tir=True)
    def desc(a: T.handle, b: T.handle, c: T.handle) -> None:
        A = T.match_buffer(a, (16, kt), src, offset_factor=1, align=1)
        B = T.match_buffer(b, (kt // step, 16, step), wei, offset_factor=1, align=1)
        C = T.match_buffer(c, (16, 16), acc, offset_factor=1, align=1)
        with T.sblock("root"):
            T.reads(C[0:16, 0:16], A[0:16, 0:kt], B[0:kt // step, 0:16, 0:step])
            T.writes(C[0:16, 0:16])
            for i, j, k in T.grid(16, 16, kt):
                with T.sblock("update"):
                    vi, vj, vk = T.axis.remap("SSR", [i, j, k])
                    C[vi, vj] = C[vi, vj] + elem(A[vi, vk]) * elem(B[vk // step, vj, vk % step])
    return desc


_AMX_INSTR = {"uint8": "llvm.x86.tdpbusd", "int8": "llvm.x86.tdpbssd", "uint16": "llvm.x86.tdpbf16ps"}


def _amx_impl(src, tiles=1):
    """The accumulator tile is loaded once, multiplied by ``tiles`` consecutive (A, B) tile
    pairs along the reduction, and stored once: the round trip through memory is paid per
    ``tiles`` multiplies, not per multiply."""
    acc, wei, step, kt, size = _amx_shape(src, tiles)
    instr = _AMX_INSTR[src]

    @T.prim_func(s_tir=True)
    def impl(a: T.handle, b: T.handle, c: T.handle) -> None:
        sa = T.int32()
        sb = T.int32()
        sc = T.int32()
        A = T.match_buffer(a, (16, kt), src, offset_factor=1, align=1, strides=[sa, 1])
        B = T.match_buffer(b, (kt // step, 16, step), wei, offset_factor=1, align=1, strides=[sb, step, 1])
        C = T.match_buffer(c, (16, 16), acc, offset_factor=1, align=1, strides=[sc, 1])
        with T.sblock("root"):
            T.reads(C[0:16, 0:16], A[0:16, 0:kt], B[0:kt // step, 0:16, 0:step])
            T.writes(C[0:16, 0:16])
            T.evaluate(T.call_llvm_intrin("void", "llvm.x86.tileloadd64", T.int8(0), C.access_ptr("r"), T.int64(sc * 4)))
            for t in range(tiles):
                T.evaluate(T.call_llvm_intrin("void", "llvm.x86.tileloadd64", T.int8(1), A.access_ptr("r", offset=t * (kt // tiles)), T.int64(sa * size)))
                T.evaluate(T.call_llvm_intrin("void", "llvm.x86.tileloadd64", T.int8(2), B.access_ptr("r", offset=t * 16 * sb), T.int64(sb * size)))
                T.evaluate(T.call_llvm_intrin("void", instr, T.int8(0), T.int8(1), T.int8(2)))
            T.evaluate(T.call_llvm_intrin("void", "llvm.x86.tilestored64", T.int8(0), C.access_ptr("w"), T.int64(sc * 4)))
    return impl


def _zero_desc(dtype):
    @T.prim_func(s_tir=True)
    def desc(c: T.handle) -> None:
        C = T.match_buffer(c, (16, 16), dtype, offset_factor=1, align=1)
        with T.sblock("root"):
            T.reads()
            T.writes(C[0:16, 0:16])
            for i, j in T.grid(16, 16):
                with T.sblock("init"):
                    vi, vj = T.axis.remap("SS", [i, j])
                    C[vi, vj] = T.cast(0, dtype)
    return desc


def _amx_cfg_zero_impl(dtype):
    """Load the tile configuration (palette 1, three 16 x 64-byte tiles) and zero tile 0 into C."""
    @T.prim_func(s_tir=True)
    def impl(c: T.handle) -> None:
        sc = T.int32()
        C = T.match_buffer(c, (16, 16), dtype, offset_factor=1, align=1, strides=[sc, 1])
        with T.sblock("root"):
            T.reads()
            T.writes(C[0:16, 0:16])
            # not sblock_alloc: tensorize drops it; "global": TVM puts small global buffers on
            # the stack, every "local" one on the heap (TVMBackendAllocWorkspace)
            cfg = T.alloc_buffer((64,), "uint8")
            for b in range(64):
                cfg[b] = T.uint8(0)
            cfg[0] = T.uint8(1)                                    # palette 1
            cfg[16] = T.uint8(TILE_COLSB[0])                       # colsb[t]: bytes a row
            cfg[18] = T.uint8(TILE_COLSB[1])
            cfg[20] = T.uint8(TILE_COLSB[2])
            cfg[48] = T.uint8(TILE_ROWS[0])                        # rows[t]
            cfg[49] = T.uint8(TILE_ROWS[1])
            cfg[50] = T.uint8(TILE_ROWS[2])
            T.evaluate(T.call_llvm_intrin("void", "llvm.x86.ldtilecfg", cfg.access_ptr("r")))
            T.evaluate(T.call_llvm_intrin("void", "llvm.x86.tilezero", T.int8(0)))
            T.evaluate(T.call_llvm_intrin("void", "llvm.x86.tilestored64", T.int8(0), C.access_ptr("w"), T.int64(sc * 4)))
    return impl


# ---- the twins: what the instructions compute, in plain loops ---------------------------------


def _vnni_twin(src):
    """``vpdpbusd zmm_c, zmm_a, zmm_b`` with the 4 bytes of A broadcast to every lane: each
    int32 lane i adds the four products zero-extended u8 A[k] x sign-extended s8 B[i, k].
    An s8 source enters as u8 A[k] + 128, and ``128 * sum_k B[i, k]`` (the same instruction on
    a broadcast 128) is subtracted."""
    shift = 128 if src == "int8" else 0

    def u8(x):   # the byte vpdpbusd reads as unsigned
        return T.Cast("int32", x) + shift

    @T.prim_func(s_tir=True)
    def twin(a: T.handle, b: T.handle, c: T.handle) -> None:
        A = T.match_buffer(a, (4,), src, offset_factor=1, align=1)
        B = T.match_buffer(b, (16, 4), "int8", offset_factor=1, align=1)
        C = T.match_buffer(c, (16,), "int32", offset_factor=1, align=1)
        with T.sblock("root"):
            T.reads(C[0:16], A[0:4], B[0:16, 0:4])
            T.writes(C[0:16])
            for i in range(16):
                C[i] = C[i] + (u8(A[0]) * T.Cast("int32", B[i, 0])
                               + u8(A[1]) * T.Cast("int32", B[i, 1])
                               + u8(A[2]) * T.Cast("int32", B[i, 2])
                               + u8(A[3]) * T.Cast("int32", B[i, 3])) \
                    - shift * (T.Cast("int32", B[i, 0]) + T.Cast("int32", B[i, 1])
                               + T.Cast("int32", B[i, 2]) + T.Cast("int32", B[i, 3]))
    return twin


def _vdpbf16_twin(lanes, src):
    """``vdpbf16ps zmm_c, zmm_a, zmm_b`` (ymm: 8 lanes) with A's pair broadcast to every lane, from Intel's
    pseudo-code: each float32 lane i adds A[1] x B[i, 1], then A[0] x B[i, 0], each product of
    two bf16 widened to float32 (exact: 8-bit significands) and added with one rounding to
    nearest even. The odd element first: measured so on a Zen 4 (1 - 1 + 2**-30 is 2**-30;
    the even one first would give 0). The instruction also treats denormal inputs, and
    flushes denormal results, as zero; the twin does not, so it agrees on normal numbers."""
    @T.prim_func(s_tir=True)
    def twin(a: T.handle, b: T.handle, c: T.handle) -> None:
        A = T.match_buffer(a, (2,), src, offset_factor=1, align=1)
        B = T.match_buffer(b, (lanes, 2), src, offset_factor=1, align=1)
        C = T.match_buffer(c, (lanes,), "float32", offset_factor=1, align=1)
        with T.sblock("root"):
            T.reads(C[0:lanes], A[0:2], B[0:lanes, 0:2])
            T.writes(C[0:lanes])
            for i in range(lanes):
                C[i] = C[i] + bf16(A[1]) * bf16(B[i, 1])
                C[i] = C[i] + bf16(A[0]) * bf16(B[i, 0])
    return twin


def _maddubs_twin(lanes, src, seven_bit=False):
    """What ``_maddubs_impl``'s instructions compute, from Intel's pseudo-code: ``vpmaddubsw``
    word k of lane i is SaturateToSignedWord(u8 x[2k] * s8 y[i, 2k] + u8 x[2k + 1] * s8
    y[i, 2k + 1]); ``vpsubw`` subtracts words modulo 2**16; ``vpmaddwd`` by m adds m * word 0 +
    m * word 1 into int32. x is the high half h of the source byte u (by 2) and its low bit l
    (by 1), u = a, or a + 128 for an s8 source, whose high words lose the broadcast 64's;
    ``seven_bit``: x is u itself (by 1), less the broadcast 128's for an s8 source. The
    saturation and the wrap-around are written out: neither binds on these inputs; both would
    on u itself by full-range weights."""
    signed = src == "int8"

    def u(x):
        return T.Cast("int32", x) + (128 if signed else 0)

    def sat16(x):
        return T.max(T.min(x, 32767), -32768)

    def wrap16(x):
        return T.bitwise_and(x + 32768, 0xFFFF) - 32768

    def word(half, B, i, k):   # vpmaddubsw's word k of lane i
        return sat16(half(2 * k) * T.Cast("int32", B[i, 2 * k])
                     + half(2 * k + 1) * T.Cast("int32", B[i, 2 * k + 1]))

    def high(A, B, i, k):
        h = word(lambda e: T.shift_right(u(A[e]), 1), B, i, k)
        return wrap16(h - word(lambda e: 64, B, i, k)) if signed else h

    def whole(A, B, i, k):
        w = word(lambda e: u(A[e]), B, i, k)
        return wrap16(w - word(lambda e: 128, B, i, k)) if signed else w

    def dot(A, B, i):
        if seven_bit:
            return whole(A, B, i, 0) + whole(A, B, i, 1)
        return 2 * (high(A, B, i, 0) + high(A, B, i, 1)) \
            + word(lambda e: T.bitwise_and(u(A[e]), 1), B, i, 0) \
            + word(lambda e: T.bitwise_and(u(A[e]), 1), B, i, 1)

    @T.prim_func(s_tir=True)
    def twin(a: T.handle, b: T.handle, c: T.handle) -> None:
        A = T.match_buffer(a, (4,), src, offset_factor=1, align=1)
        B = T.match_buffer(b, (lanes, 4), "int8", offset_factor=1, align=1)
        C = T.match_buffer(c, (lanes,), "int32", offset_factor=1, align=1)
        with T.sblock("root"):
            T.reads(C[0:lanes], A[0:4], B[0:lanes, 0:4])
            T.writes(C[0:lanes])
            for i in range(lanes):
                C[i] = C[i] + dot(A, B, i)
    return twin


def _amx_twin(src, tiles=1):
    """``tiles`` x ``tdpbusd`` / ``tdpbssd`` / ``tdpbf16ps tmm0, tmm1, tmm2`` under the tile
    configuration: for each of C's rows m and dwords n and each dword k of A's row (B's row k),
    C[m, n] += the products of A[m]'s k-th dword elements with B[k][n]'s, in element order
    (u8 or s8 A by s8 B, widened to int32; bf16 pairs as fp32, accumulated one product at a
    time). Tile t multiplies A's t-th and B's t-th column block of the reduction."""
    acc, wei, step, kt, size = _amx_shape(src, tiles)
    rows, n_dwords = TILE_ROWS[0], TILE_COLSB[0] // 4
    k_dwords = TILE_COLSB[1] // 4
    if (TILE_ROWS[1], TILE_ROWS[2], TILE_COLSB[2]) != (rows, k_dwords, TILE_COLSB[0]) \
            or k_dwords * tiles * step != kt:
        raise ValueError("tile configuration does not describe this multiply")

    def elem(x):
        return bf16(x) if src == BF16_BITS else T.Cast("int32", x)

    @T.prim_func(s_tir=True)
    def twin(a: T.handle, b: T.handle, c: T.handle) -> None:
        sa = T.int32()
        sb = T.int32()
        sc = T.int32()
        A = T.match_buffer(a, (16, kt), src, offset_factor=1, align=1, strides=[sa, 1])
        B = T.match_buffer(b, (kt // step, 16, step), wei, offset_factor=1, align=1, strides=[sb, step, 1])
        C = T.match_buffer(c, (16, 16), acc, offset_factor=1, align=1, strides=[sc, 1])
        with T.sblock("root"):
            T.reads(C[0:16, 0:16], A[0:16, 0:kt], B[0:kt // step, 0:16, 0:step])
            T.writes(C[0:16, 0:16])
            for t, m, n, k, e in T.grid(tiles, rows, n_dwords, k_dwords, step):
                C[m, n] = C[m, n] + elem(A[m, (t * k_dwords + k) * step + e]) * \
                    elem(B[t * k_dwords + k, n, e])
    return twin


def _zero_twin(dtype):
    """``tilezero`` then ``tilestored``: C's configured rows and row bytes set to zero."""
    @T.prim_func(s_tir=True)
    def twin(c: T.handle) -> None:
        sc = T.int32()
        C = T.match_buffer(c, (16, 16), dtype, offset_factor=1, align=1, strides=[sc, 1])
        with T.sblock("root"):
            T.reads()
            T.writes(C[0:16, 0:16])
            for m, n in T.grid(TILE_ROWS[0], TILE_COLSB[0] // 4):
                C[m, n] = T.Cast(dtype, 0)
    return twin


VNNI = "blockpad_vnni_16x4"                # u8 x s8
VNNI_S8 = "blockpad_vnni_s8s8_16x4"        # s8 x s8, shifted to u8 and compensated
VDPBF16 = "blockpad_vdpbf16ps_16x2"      # bf16 pairs (uint16 bits) -> fp32, zmm
VDPBF16_8 = "blockpad_vdpbf16ps_8x2"     # ymm (AVX-512VL)
AMX_INT8 = "blockpad_amx_u8s8s32_16x16x64"
AMX_S8 = "blockpad_amx_s8s8s32_16x16x64"
AMX_BF16 = "blockpad_amx_bf16f32_16x16x32"  # bf16 as uint16 storage
AMX_ZERO_I32 = "blockpad_amx_cfg_zero_i32"
AMX_ZERO_F32 = "blockpad_amx_cfg_zero_f32"
MADDUBS = "blockpad_maddubs_8x4"            # u8 x s8, ymm (AVX2)
MADDUBS_S8 = "blockpad_maddubs_s8s8_8x4"    # s8 x s8, shifted to u8 and compensated
MADDUBS_16 = "blockpad_maddubs_16x4"        # zmm (AVX-512BW)
MADDUBS_S8_16 = "blockpad_maddubs_s8s8_16x4"
MADDUBS7 = "blockpad_maddubs7_8x4"          # u8 x s7 (weight_bits = 7): one vpmaddubsw
MADDUBS7_S8 = "blockpad_maddubs7_s8s8_8x4"
MADDUBS7_16 = "blockpad_maddubs7_16x4"
MADDUBS7_S8_16 = "blockpad_maddubs7_s8s8_16x4"
_vnni_desc = functools.partial(dot_desc, 16)   # vpdpbusd: 16 int32 lanes
_MAKERS = {VNNI: (_vnni_desc, _vnni_impl, _vnni_twin, "uint8"),
           VNNI_S8: (_vnni_desc, _vnni_impl, _vnni_twin, "int8"),
           **{name_: (functools.partial(dot_desc, lanes), functools.partial(_vdpbf16_impl, lanes),
                      functools.partial(_vdpbf16_twin, lanes), BF16_BITS)
              for name_, lanes in ((VDPBF16, 16), (VDPBF16_8, 8))},
           **{name_: (functools.partial(dot_desc, lanes), functools.partial(_maddubs_impl, lanes),
                      functools.partial(_maddubs_twin, lanes), src)
              for name_, lanes, src in ((MADDUBS, 8, "uint8"), (MADDUBS_S8, 8, "int8"),
                                        (MADDUBS_16, 16, "uint8"), (MADDUBS_S8_16, 16, "int8"))},
           **{name_: (functools.partial(dot_desc, lanes),
                      functools.partial(_maddubs_impl, lanes, seven_bit=True),
                      functools.partial(_maddubs_twin, lanes, seven_bit=True), src)
              for name_, lanes, src in ((MADDUBS7, 8, "uint8"), (MADDUBS7_S8, 8, "int8"),
                                        (MADDUBS7_16, 16, "uint8"), (MADDUBS7_S8_16, 16, "int8"))},
           AMX_INT8: (_amx_desc, _amx_impl, _amx_twin, "uint8"),
           AMX_S8: (_amx_desc, _amx_impl, _amx_twin, "int8"),
           AMX_BF16: (_amx_desc, _amx_impl, _amx_twin, "uint16"),
           AMX_ZERO_I32: (_zero_desc, _amx_cfg_zero_impl, _zero_twin, "int32"),
           AMX_ZERO_F32: (_zero_desc, _amx_cfg_zero_impl, _zero_twin, "float32")}


@functools.lru_cache(maxsize=1)
def register() -> None:
    """Register every intrinsic and its ``_ref`` twin."""
    for base, (desc, impl, twin, dtype) in _MAKERS.items():
        d = desc(dtype)
        TensorIntrin.register(base, d, impl(dtype))
        TensorIntrin.register(base + "_ref", d, twin(dtype))


def name(intrin: str, reference: bool) -> str:
    """``intrin``, or its plain-loop twin for running the same schedule on any CPU."""
    register()
    return intrin + "_ref" if reference else intrin


def amx_multiply(base: str, tiles: int, reference: bool) -> str:
    """``base`` (``AMX_INT8``, ``AMX_S8``, ``AMX_BF16``) over ``tiles`` tile multiplies along
    the reduction at once, registered on first use (the reduction length is a kernel's)."""
    if tiles == 1:
        return name(base, reference)
    return _register_tiles(base, tiles) + ("_ref" if reference else "")


@functools.cache
def _register_tiles(base: str, tiles: int) -> str:
    desc, impl, twin, dtype = _MAKERS[base]
    full = f"{base}_x{tiles}"
    d = desc(dtype, tiles)
    TensorIntrin.register(full, d, impl(dtype, tiles))
    TensorIntrin.register(full + "_ref", d, twin(dtype, tiles))
    return full
