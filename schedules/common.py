"""Small facts every schedule module needs."""

import math

import tvm_ffi
from tvm import tirx

from blockpad.vocabulary import OP_ATTR

SPATIAL, REDUCE = 0, 2   # IterVar.iter_type: data parallel, commutative reduction


def count_iters(block, kind: int = SPATIAL) -> int:
    """How many of ``block``'s iter vars are of ``kind`` (``SPATIAL`` or ``REDUCE``): a TE
    stage's block lists its spatial iters first, so this is also where its reductions start."""
    return sum(1 for iv in block.iter_vars if int(iv.iter_type) == kind)


def op_of(func) -> str | None:
    """The blockpad op a PrimFunc implements (set by codegen.kernel.finish)."""
    return func.attrs.get(OP_ATTR) if func.attrs is not None else None


def vector_lanes(target, dtype: str) -> int:
    """Elements of ``dtype`` in the target's widest vector register."""
    return max(1, target.vector_bytes // tvm_ffi.dtype(dtype).itemsize)


def buffer_bytes(buf) -> int:
    """Bytes of ``buf`` (the register-tiled rules' cache budgets, the weight prefetch's sizes)."""
    return math.prod(int(n) for n in buf.shape) * tvm_ffi.dtype(str(buf.dtype)).bits // 8


def is_true(expr) -> bool:
    """``expr`` is the constant true (a block without a predicate)."""
    return isinstance(expr, tirx.IntImm) and expr.value == 1


def divisor_at_most(n: int, limit: int) -> int:
    """The largest divisor of ``n`` not above ``limit``."""
    return max(k for k in range(1, min(n, limit) + 1) if n % k == 0)


def element_strides(buf) -> list:
    """Elements between two steps of each dim of ``buf``: its declared strides (a strided
    layout's, a Var where TIR keeps one symbolic), else those of the compact row-major shape."""
    return list(buf.strides) or [math.prod(int(n) for n in buf.shape[i + 1:])
                                 for i in range(len(buf.shape))]


def tile_scope(target) -> str:
    """The storage scope of a CPU register tile's accumulator scratch. On x86, ``global``: TVM
    0.27 puts a constant-size ``global`` buffer under 1 KiB on the stack, which LLVM promotes to
    registers, and a ``local`` one in a workspace from ``TVMBackendAllocWorkspace``, which LLVM
    must keep in memory: zero stores before the reduction, stores after it, reloads in the
    epilogue (AVX2, 1 thread, fp32 1x1 convs C16 -> K96 112x112: 43 -> 55 GFLOP/s; C64 -> K256
    56x56: 71 -> 87). Elsewhere ``local``: on aarch64 the stack tile spilled more of a 7-row
    3x3 tile (14 spills in the hot loop against 9), and qemu cannot time which is faster."""
    return "global" if target.family == "x86" else "local"
