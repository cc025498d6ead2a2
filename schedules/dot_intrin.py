"""What every CPU's dot-product instruction computes, as a tensor intrinsic description:
``C[rows] += A[steps] . B[rows, steps]``, ``steps`` products summed into each lane. int8
(Arm's ``sdot``: 4 rows; x86's ``vpdpbusd``: 16): 4 byte products into an int32 lane; bf16
(x86's ``vdpbf16ps``: 16 rows): 2 products into a float32 lane, bf16 arriving as its uint16
bits (blockpad keeps it so in every kernel argument: DLPack and numpy have no bfloat16) and
reinterpreted per element, as the ops declare it. Buffers are aligned to their element only:
blockpad's kernel parameters promise no more."""

from __future__ import annotations

from tvm.script import tirx as T

BF16_BITS = "uint16"

# source dtype -> (reduction steps per lane, weight dtype, accumulator dtype)
KINDS = {"uint8": (4, "int8", "int32"), "int8": (4, "int8", "int32"),
         BF16_BITS: (2, BF16_BITS, "float32")}


def bf16(x):
    """A bf16 element held as uint16 bits, as float32 (exact: bf16 is fp32's upper half)."""
    return T.cast(T.reinterpret(x, dtype="bfloat16"), "float32")


def widen(src: str):
    """How an element of a ``src`` dot product enters its accumulator."""
    return bf16 if src == BF16_BITS else (lambda x: T.cast(x, "int32"))


def dot_desc(rows: int, src: str):
    steps, wei, acc = KINDS[src]
    elem = widen(src)

    @T.prim_func(s_tir=True)
    def desc(a: T.handle, b: T.handle, c: T.handle) -> None:
        A = T.match_buffer(a, (steps,), src, offset_factor=1, align=1)
        B = T.match_buffer(b, (rows, steps), wei, offset_factor=1, align=1)
        C = T.match_buffer(c, (rows,), acc, offset_factor=1, align=1)
        with T.sblock("root"):
            T.reads(C[0:rows], A[0:steps], B[0:rows, 0:steps])
            T.writes(C[0:rows])
            for i in T.serial(0, rows):
                for k in T.serial(0, steps):
                    with T.sblock("update"):
                        vi, vk = T.axis.remap("SR", [i, k])
                        C[vi] = C[vi] + elem(A[vk]) * elem(B[vi, vk])
    return desc
