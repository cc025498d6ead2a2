"""bf16 x bf16 -> fp32 matmul on CUDA tensor cores (``wmma`` 16x16x16), through dlight's fp16
tensor-core rule.

Why the detour: TVM 0.27's dlight tensorizes fp16 and int8 only (``get_wmma_intrin_group``
asserts ``in_dtype`` is one of them) and ``tensor_intrin.cuda`` registers no bf16 wmma
intrinsics, although its builders (``get_wmma_load_intrin``, ``get_wmma_sync_intrin``) take any
element type and the CUDA codegen declares ``nv_bfloat16`` fragments (``mma.sync...bf16`` in the
PTX, ``HMMA.16816.F32.BF16`` in the SASS). And blockpad keeps bf16 as its uint16 bits in kernel
arguments (DLPack and numpy have no bfloat16), so the reduction reads uint16, which no rule
would take for bf16. Hence:

1. the bf16 load and mma intrinsics are registered here (once per process);
2. the uint16 buffers the reduction reinterprets are retyped to bfloat16 and their
   ``reinterpret`` s dropped, so the reduction reads bf16 as dlight's rule expects
   (``C += f32(A) * f32(B)``): parameters, and a convolution's zero-haloed source copy
   (``halo.staged_source``'s ``src_pad``, a uint16 stage) together with the parameter it copies
   and the zero it pads with;
3. dlight's ``MatmulTensorization`` runs while ``get_wmma_intrin_group`` answers with the bf16
   names (the rule looks that function up on each call; it has no other hook);
4. the parameters become uint16 again, each load of them reinterpreted to bfloat16 (they are
   read only by the copies into shared memory).
"""

from __future__ import annotations

import contextlib
import functools

import tvm_ffi
from tvm import s_tir, tirx
from tvm.ir import expr as ir_expr

from .common import SPATIAL
from .cuda import TENSOR_CORE_MIN

BF16 = "bfloat16"


def tensor_core_matmul(func, target):
    """``func`` (bf16 bits in uint16 parameters, compact ones) scheduled on tensor cores, or
    None: not bf16, too small for dlight's tiles, or the rule did not take it."""
    return tensorized(func, target) if _large_enough(func) else None


def tensorized(func, target):
    """``func`` scheduled by dlight's tensor-core rule with the bf16 intrinsics, whatever its
    sizes (the rule pads them to its tiles), or None: it reads no bf16 bits in uint16
    parameters, or the rule did not take it."""
    bits = _bit_buffers(func)
    if not any(any(b.same_as(p) for p in func.params) for b in bits):
        return None
    pairs = [(p, tirx.decl_buffer(p.shape, BF16, p.name, strides=p.strides,
                                  elem_offset=p.elem_offset, data_alignment=p.data_alignment,
                                  offset_factor=p.offset_factor)) for p in bits]
    from tvm.s_tir.dlight.gpu.matmul import MatmulTensorization

    with _bf16_intrinsics():
        sch = MatmulTensorization().apply(_as_bf16(func, pairs), target, False)
    if sch is None:
        return None
    params = [(b, a) for a, b in pairs if any(a.same_as(p) for p in func.params)]
    return s_tir.Schedule(_as_bits(sch.mod["main"], params))


def _bit_buffers(func) -> list:
    """The uint16 buffers ``func`` reads as bf16: those it reinterprets, and the uint16 ones
    copied into those (the parameter behind a staged source copy, whose stage reads it as
    bits). Retyping one of a copy's ends alone would leave the copy mistyped."""
    bits = []

    def add(buffer):
        if str(buffer.dtype) == "uint16" and not any(buffer.same_as(b) for b in bits):
            bits.append(buffer)

    def reinterpreted(call):
        load = _bits_load(call)
        if load is not None:
            add(load.source)

    tvm_ffi.structural_walk(func, (ir_expr.Call, reinterpreted))
    copies = []
    tvm_ffi.structural_walk(func, (s_tir.SBlock, copies.append))
    for block in copies:
        if any(w.source.same_as(b) for w in block.writes for b in bits):
            for r in block.reads:
                add(r.source)
    return bits


def _bits_load(call, buffers=None):
    """The load inside ``reinterpret(bfloat16, buffer[...])`` for one of ``buffers`` (any
    buffer if None), else None."""
    if call.op.name != "tirx.reinterpret" or not isinstance(call.args[0], ir_expr.TensorLoad):
        return None
    load = call.args[0]
    if buffers is None or any(load.source.same_as(b) for b in buffers):
        return load
    return None


def _large_enough(func) -> bool:
    """dlight's own condition for tensor cores, on the reduction block's M, N, K."""
    extents = []

    def visit(block):
        if any(iv.iter_type != SPATIAL for iv in block.iter_vars):
            extents.extend(iv.dom.extent for iv in block.iter_vars)

    tvm_ffi.structural_walk(func, (s_tir.SBlock, visit))
    return bool(extents) and all(isinstance(e, tirx.IntImm) and e.value > TENSOR_CORE_MIN
                                 for e in extents)


def _swap(func, pairs):
    return tvm_ffi.structural_map(
        func, (tirx.Var, lambda v: next((b for a, b in pairs if v.same_as(a)), v)))


def _as_bf16(func, pairs):
    """Each reinterpreted load of a bits buffer a load of its bf16 twin; in a copy between
    bits buffers (``if_then_else(in_image, src[...], 0)``, nested when the source is masked
    too) the loads and the zero they pad with bf16 as well."""
    def twin(load):
        return tirx.BufferLoad(next(b for a, b in pairs if load.source.same_as(a)), load.indices)

    def retype(call):
        load = _bits_load(call, [a for a, _ in pairs])
        if load is not None:
            return twin(load)
        if call.op.name != "prim.if_then_else" or str(call.args[2].ty.dtype) != "uint16":
            return call
        value = call.args[1]
        if isinstance(value, ir_expr.TensorLoad) and any(value.source.same_as(a)
                                                         for a, _ in pairs):
            value = twin(value)
        if str(value.ty.dtype) != BF16:
            return call
        return tirx.if_then_else(call.args[0], value, tirx.reinterpret(BF16, call.args[2]))

    return _swap(tvm_ffi.structural_map(func, (ir_expr.Call, retype)), pairs)


def _as_bits(func, pairs):
    def wrap(load):
        bits = next((b for a, b in pairs if load.source.same_as(a)), None)
        return load if bits is None else tirx.reinterpret(BF16, tirx.BufferLoad(bits, load.indices))

    return _swap(tvm_ffi.structural_map(func, (ir_expr.TensorLoad, wrap)), pairs)


@contextlib.contextmanager
def _bf16_intrinsics():
    """While active, the wmma intrinsic group dlight asks for names the bf16 loads and mma
    (fill and store are the fp32 accumulator's, shared with fp16). Entered only inside
    ``cuda.dlight_style``, whose lock keeps other threads' dlight rules out meanwhile."""
    from tvm.s_tir.tensor_intrin import cuda as intrin  # the ~30-60 s import

    _register(intrin)
    fp16_group = intrin.get_wmma_intrin_group
    intrin.get_wmma_intrin_group = lambda **kw: {
        k: v.replace("f16", "bf16") for k, v in fp16_group(**kw).items()}
    try:
        yield
    finally:
        intrin.get_wmma_intrin_group = fp16_group


@functools.cache
def _register(intrin):
    """bf16 twins of the fp16 shared.dyn fragment loads and of the fp32-accumulating mma, named
    as ``get_wmma_intrin_group`` names the fp16 ones with ``f16`` -> ``bf16``."""
    for is_b in (False, True):
        for trans in (False, True):
            name = f"wmma_load_16x16x16_bf16_{'b' if is_b else 'a'}{'_trans' if trans else ''}"
            s_tir.TensorIntrin.register(f"{name}_shared_dyn", *intrin.get_wmma_load_intrin(
                16, 16, 16, BF16, "shared.dyn", is_b, trans))
    for trans in (False, True):
        s_tir.TensorIntrin.register(
            f"wmma_sync_16x16x16_bf16bf16f32{'_trans' if trans else ''}",
            *intrin.get_wmma_sync_intrin(16, 16, 16, BF16, "float32", trans))
