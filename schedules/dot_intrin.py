"""What every CPU's int8 dot-product instruction computes, as a tensor intrinsic description:
``C[rows] i32 += A[4] src . B[rows, 4] i8``, four products summed into each int32 lane
(Arm's ``sdot``: 4 rows; x86's ``vpdpbusd``: 16). Buffers are aligned to their element only:
blockpad's kernel parameters promise no more."""

from __future__ import annotations

from tvm.script import tirx as T


def dot_desc(rows: int, src: str):
    @T.prim_func(s_tir=True)
    def desc(a: T.handle, b: T.handle, c: T.handle) -> None:
        A = T.match_buffer(a, (4,), src, offset_factor=1, align=1)
        B = T.match_buffer(b, (rows, 4), "int8", offset_factor=1, align=1)
        C = T.match_buffer(c, (rows,), "int32", offset_factor=1, align=1)
        with T.sblock("root"):
            T.reads(C[0:rows], A[0:4], B[0:rows, 0:4])
            T.writes(C[0:rows])
            for i in T.serial(0, rows):
                for k in T.serial(0, 4):
                    with T.sblock("update"):
                        vi, vk = T.axis.remap("SR", [i, k])
                        C[vi] = C[vi] + T.cast(A[vk], "int32") * T.cast(B[vi, vk], "int32")
    return desc
