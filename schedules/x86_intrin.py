"""Tensor intrinsics blockpad needs on x86 and TVM 0.27 lacks or gets wrong (tvm027.md §2-3):

* ``vnni_16x4``: ``C[16] i32 += A[4] u8 . B[16, 4] i8`` with ``vpdpbusd`` (TVM's own fails LLVM
  22 verification: the intrinsic's operand types changed);
* ``amx_u8s8s32_16x16x64`` / ``amx_bf16_16x16x32``: one AMX tile multiply (``tdpbusd``,
  ``tdpbf16ps``) and ``amx_cfg_zero_16x16*``, which loads the tile configuration and zeroes the
  accumulator tile. Tile configuration is per thread, so it lives in the tensorized init block,
  which runs on the same pool thread as the updates that follow it.

Each intrinsic also has a ``*_ref`` implementation: plain loops with the same description,
so a schedule tensorized with it runs the same algorithm (packing, blocking, accumulation order)
on any CPU, which is how the tests check the numerics where the instructions are missing.

Defined here, in TVMScript, rather than imported from ``tvm.s_tir.tensor_intrin``: importing
that package parses every intrinsic TVM has and takes ~30 s.
"""

from __future__ import annotations

import functools

from tvm.s_tir import TensorIntrin
from tvm.script import tirx as T

# ---- VNNI ----------------------------------------------------------------------------------


@T.prim_func(s_tir=True)
def _vnni_desc(A: T.Buffer((4,), "uint8", offset_factor=1),
               B: T.Buffer((16, 4), "int8", offset_factor=1),
               C: T.Buffer((16,), "int32", offset_factor=1)) -> None:
    with T.sblock("root"):
        T.reads(C[0:16], A[0:4], B[0:16, 0:4])
        T.writes(C[0:16])
        for i in T.serial(0, 16):
            for k in T.serial(0, 4):
                with T.sblock("update"):
                    vi, vk = T.axis.remap("SR", [i, k])
                    C[vi] = C[vi] + T.cast(A[vk], "int32") * T.cast(B[vi, vk], "int32")


@T.prim_func(s_tir=True)
def _vnni_impl(A: T.Buffer((4,), "uint8", offset_factor=1),
               B: T.Buffer((16, 4), "int8", offset_factor=1),
               C: T.Buffer((16,), "int32", offset_factor=1)) -> None:
    with T.sblock("root"):
        T.reads(C[0:16], A[0:4], B[0:16, 0:4])
        T.writes(C[0:16])
        a_i32 = T.reinterpret(A.vload([0], "uint8x4"), dtype="int32")
        a_u8x64 = T.reinterpret(T.broadcast(a_i32, 16), dtype="uint8x64")
        C[T.ramp(T.int32(0), 1, 16)] = T.call_llvm_pure_intrin(
            T.llvm_lookup_intrinsic_id("llvm.x86.avx512.vpdpbusd.512"),
            C.vload([0], dtype="int32x16"), a_u8x64, B.vload([0, 0], dtype="int8x64"),
            dtype="int32x16")


# ---- AMX -----------------------------------------------------------------------------------


@T.prim_func(s_tir=True)
def _amx_u8s8_desc(a: T.handle, b: T.handle, c: T.handle) -> None:
    A = T.match_buffer(a, (16, 64), "uint8", offset_factor=1)
    B = T.match_buffer(b, (16, 16, 4), "int8", offset_factor=1)
    C = T.match_buffer(c, (16, 16), "int32", offset_factor=1)
    with T.sblock("root"):
        T.reads(C[0:16, 0:16], A[0:16, 0:64], B[0:16, 0:16, 0:4])
        T.writes(C[0:16, 0:16])
        for i, j, k in T.grid(16, 16, 64):
            with T.sblock("update"):
                vi, vj, vk = T.axis.remap("SSR", [i, j, k])
                C[vi, vj] = C[vi, vj] + T.cast(A[vi, vk], "int32") * T.cast(B[vk // 4, vj, vk % 4], "int32")


@T.prim_func(s_tir=True)
def _amx_u8s8_impl(a: T.handle, b: T.handle, c: T.handle) -> None:
    sa = T.int32()
    sb = T.int32()
    sc = T.int32()
    A = T.match_buffer(a, (16, 64), "uint8", offset_factor=1, strides=[sa, 1])
    B = T.match_buffer(b, (16, 16, 4), "int8", offset_factor=1, strides=[sb, 4, 1])
    C = T.match_buffer(c, (16, 16), "int32", offset_factor=1, strides=[sc, 1])
    with T.sblock("root"):
        T.reads(C[0:16, 0:16], A[0:16, 0:64], B[0:16, 0:16, 0:4])
        T.writes(C[0:16, 0:16])
        T.evaluate(T.call_llvm_intrin("void", "llvm.x86.tileloadd64", T.int8(0), C.access_ptr("r"), T.int64(sc * 4)))
        T.evaluate(T.call_llvm_intrin("void", "llvm.x86.tileloadd64", T.int8(1), A.access_ptr("r"), T.int64(sa)))
        T.evaluate(T.call_llvm_intrin("void", "llvm.x86.tileloadd64", T.int8(2), B.access_ptr("r"), T.int64(sb)))
        T.evaluate(T.call_llvm_intrin("void", "llvm.x86.tdpbusd", T.int8(0), T.int8(1), T.int8(2)))
        T.evaluate(T.call_llvm_intrin("void", "llvm.x86.tilestored64", T.int8(0), C.access_ptr("w"), T.int64(sc * 4)))


@T.prim_func(s_tir=True)
def _amx_bf16_desc(a: T.handle, b: T.handle, c: T.handle) -> None:
    A = T.match_buffer(a, (16, 32), "bfloat16", offset_factor=1)
    B = T.match_buffer(b, (16, 16, 2), "bfloat16", offset_factor=1)
    C = T.match_buffer(c, (16, 16), "float32", offset_factor=1)
    with T.sblock("root"):
        T.reads(C[0:16, 0:16], A[0:16, 0:32], B[0:16, 0:16, 0:2])
        T.writes(C[0:16, 0:16])
        for i, j, k in T.grid(16, 16, 32):
            with T.sblock("update"):
                vi, vj, vk = T.axis.remap("SSR", [i, j, k])
                C[vi, vj] = C[vi, vj] + T.cast(A[vi, vk], "float32") * T.cast(B[vk // 2, vj, vk % 2], "float32")


@T.prim_func(s_tir=True)
def _amx_bf16_impl(a: T.handle, b: T.handle, c: T.handle) -> None:
    sa = T.int32()
    sb = T.int32()
    sc = T.int32()
    A = T.match_buffer(a, (16, 32), "bfloat16", offset_factor=1, strides=[sa, 1])
    B = T.match_buffer(b, (16, 16, 2), "bfloat16", offset_factor=1, strides=[sb, 2, 1])
    C = T.match_buffer(c, (16, 16), "float32", offset_factor=1, strides=[sc, 1])
    with T.sblock("root"):
        T.reads(C[0:16, 0:16], A[0:16, 0:32], B[0:16, 0:16, 0:2])
        T.writes(C[0:16, 0:16])
        # access_ptr on bf16 buffers trips LowerAccessPtr (tvm027.md §3): take addresses instead
        T.evaluate(T.call_llvm_intrin("void", "llvm.x86.tileloadd64", T.int8(0), T.address_of(C[0, 0]), T.int64(sc * 4)))
        T.evaluate(T.call_llvm_intrin("void", "llvm.x86.tileloadd64", T.int8(1), T.address_of(A[0, 0]), T.int64(sa * 2)))
        T.evaluate(T.call_llvm_intrin("void", "llvm.x86.tileloadd64", T.int8(2), T.address_of(B[0, 0, 0]), T.int64(sb * 2)))
        T.evaluate(T.call_llvm_intrin("void", "llvm.x86.tdpbf16ps", T.int8(0), T.int8(1), T.int8(2)))
        T.evaluate(T.call_llvm_intrin("void", "llvm.x86.tilestored64", T.int8(0), T.address_of(C[0, 0]), T.int64(sc * 4)))


def _zero_desc(dtype):
    @T.prim_func(s_tir=True)
    def desc(c: T.handle) -> None:
        C = T.match_buffer(c, (16, 16), dtype, offset_factor=1)
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
        C = T.match_buffer(c, (16, 16), dtype, offset_factor=1, strides=[sc, 1])
        with T.sblock("root"):
            T.reads()
            T.writes(C[0:16, 0:16])
            cfg = T.alloc_buffer((64,), "uint8", scope="local")   # not sblock_alloc: tensorize drops it
            for b in range(64):
                cfg[b] = T.uint8(0)
            cfg[0] = T.uint8(1)                                    # palette 1
            for t in range(3):
                cfg[16 + 2 * t] = T.uint8(64)                      # colsb[t] = 64 bytes
                cfg[48 + t] = T.uint8(16)                          # rows[t] = 16
            T.evaluate(T.call_llvm_intrin("void", "llvm.x86.ldtilecfg", cfg.access_ptr("r")))
            T.evaluate(T.call_llvm_intrin("void", "llvm.x86.tilezero", T.int8(0)))
            T.evaluate(T.call_llvm_intrin("void", "llvm.x86.tilestored64", T.int8(0), C.access_ptr("w"), T.int64(sc * 4)))
    return impl


VNNI = "blockpad_vnni_16x4"
AMX_INT8 = "blockpad_amx_u8s8s32_16x16x64"
AMX_BF16 = "blockpad_amx_bf16f32_16x16x32"
AMX_ZERO_I32 = "blockpad_amx_cfg_zero_i32"
AMX_ZERO_F32 = "blockpad_amx_cfg_zero_f32"


@functools.lru_cache(maxsize=1)
def register() -> None:
    """Register every intrinsic and its ``_ref`` twin (the description as implementation)."""
    pairs = {VNNI: (_vnni_desc, _vnni_impl), AMX_INT8: (_amx_u8s8_desc, _amx_u8s8_impl),
             AMX_BF16: (_amx_bf16_desc, _amx_bf16_impl),
             AMX_ZERO_I32: (_zero_desc("int32"), _amx_cfg_zero_impl("int32")),
             AMX_ZERO_F32: (_zero_desc("float32"), _amx_cfg_zero_impl("float32"))}
    for name, (desc, impl) in pairs.items():
        TensorIntrin.register(name, desc, impl)
        TensorIntrin.register(name + "_ref", desc, desc)


def name(intrin: str, reference: bool) -> str:
    """``intrin``, or its plain-loop twin for running the same schedule on any CPU."""
    register()
    return intrin + "_ref" if reference else intrin
