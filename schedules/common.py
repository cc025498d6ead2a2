"""Small facts every schedule module needs."""

import tvm_ffi


def op_of(func) -> str | None:
    """The blockpad op a PrimFunc implements (set by codegen.kernel.finish)."""
    return func.attrs.get("blockpad.op") if func.attrs is not None else None


def vector_lanes(target, dtype: str) -> int:
    """Elements of ``dtype`` in the target's widest vector register."""
    return max(1, target.vector_bytes // tvm_ffi.dtype(dtype).itemsize)
