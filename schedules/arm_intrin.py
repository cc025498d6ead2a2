"""Tensor intrinsics of the Arm schedules (schedules/arm.py), imported when a kernel needs one.

* ``blockpad_dot_4x4_i8i8s32_sdot``: ``C[4] i32 += A[4] i8 . B[4, 4] i8`` with one ``sdot``
  (Armv8.2-A dotprod). Description and implementation are those of TVM's own
  ``dot_4x4_i8i8s32_sdot`` (tvm.s_tir.tensor_intrin.arm_cpu), defined here because importing
  that package parses every intrinsic TVM has, CUDA's included: 30 s and more (docs/tvm-0.27-notes.md 2),
  and with ``align=1`` buffers: blockpad's kernel parameters promise only element alignment.
"""

from __future__ import annotations

import functools

from tvm.s_tir import TensorIntrin
from tvm.script import tirx as T

from .dot_intrin import dot_desc

SDOT = "blockpad_dot_4x4_i8i8s32_sdot"


@T.prim_func(s_tir=True)
def _sdot_impl(a: T.handle, b: T.handle, c: T.handle) -> None:
    A = T.match_buffer(a, (4,), "int8", offset_factor=1, align=1)
    B = T.match_buffer(b, (4, 4), "int8", offset_factor=1, align=1)
    C = T.match_buffer(c, (4,), "int32", offset_factor=1, align=1)
    with T.sblock("root"):
        T.reads(C[0:4], A[0:4], B[0:4, 0:4])
        T.writes(C[0:4])
        # no named temporary for the broadcast source: TVM 0.27 gives each one a workspace
        # allocation of its own, a call per dot product
        C[T.ramp(T.int32(0), 1, 4)] = T.call_llvm_pure_intrin(
            T.llvm_lookup_intrinsic_id("llvm.aarch64.neon.sdot.v4i32.v16i8"),
            C.vload([0], dtype="int32x4"),
            T.reinterpret(T.broadcast(T.reinterpret(A.vload([0], "int8x4"), dtype="int32"), 4),
                          dtype="int8x16"),
            B.vload([0, 0], dtype="int8x16"), dtype="int32x4")


@functools.lru_cache(maxsize=1)
def register() -> str:
    TensorIntrin.register(SDOT, dot_desc(4, "int8"), _sdot_impl)
    return SDOT
