"""CUDA schedules (sm_80, sm_90).

On a GPU every loop nest must be bound to blocks and threads: TVM refuses a kernel with a
serial loop nest at the top level ("did you forget to bind?"), so there is no CPU-style
fallback here. Each stage of a function becomes one kernel launch; launches on one stream run in
order, so a stage sees its predecessor's stores.

* ``Elementwise`` (reorder, zero_pad, eltwise, binary): the stage's loops are fused into one and
  split into blocks of ``THREADS`` threads, one element per thread. Reorders and eltwise ops
  are declared over the destination's physical index space, so consecutive threads store
  consecutive addresses (coalesced). Predicates survive: a zero-pad block's
  ``T.where(is_padding)``, the ``valid``-region predicate of ``dst_stage`` and the tail of the
  split all end up in the one ``if`` that guards the thread's store.
* ``Matmul`` (op ``matmul``): TVM's dlight GPU matmul, shared-memory tiling for fp32 and
  tensor cores (``wmma`` 16x16x16, fp32 accumulation) for fp16 and bf16 sources (bf16 through
  ``cuda_bf16``: dlight's rule is fp16-only).
* ``Fallback``: any other stage gets its spatial loops fused and bound the same way, its
  reduction loops running serially inside the thread. Correct for every op; slow for
  reductions without a rule of their own (convolution has ``cuda_conv``, softmax and pooling
  ``cuda_reduction``).
"""

from __future__ import annotations

import threading

import tvm_ffi
from tvm import s_tir, tirx

from .common import SPATIAL, is_true
from .rule import ScheduleRule

THREADS = 256   # threads per block: 8 warps, enough to hide latency at full occupancy
TENSOR_CORE_MIN = 64   # dlight's minimal_tensorize_threshold: M, N and K must each exceed it


class Elementwise(ScheduleRule):
    ops = ("reorder", "zero_pad", "eltwise", "binary")

    def schedule(self, func, target):
        return _bind_all(s_tir.Schedule(func))


class Fallback(ScheduleRule):
    """Valid for any kernel: spatial loops to blocks x threads, reductions serial per thread."""

    def schedule(self, func, target):
        return _bind_all(s_tir.Schedule(func))


def _bind_all(sch):
    for block in _root_blocks(sch):
        bind_spatial(sch, block)
    return sch


def bind_spatial(sch, block, threads: int = THREADS):
    """Fuse the spatial loops of ``block`` (moved outside its reduction loops) and bind them to
    ``blockIdx.x`` x ``threadIdx.x``."""
    loops = sch.get_loops(block)
    if any(sch.get(l).thread_binding is not None for l in loops):
        return   # already bound (a rule that scheduled it itself)
    reduce_vars = _reduction_loop_vars(sch, block)
    is_reduction = [any(sch.get(l).loop_var.same_as(v) for v in reduce_vars) for l in loops]
    spatial = [l for l, r in zip(loops, is_reduction) if not r]
    reduction = [l for l, r in zip(loops, is_reduction) if r]
    if not spatial:
        spatial = [sch.add_unit_loop(block)]
    elif reduction:
        sch.reorder(*spatial, *reduction)
    fused = sch.fuse(*spatial) if len(spatial) > 1 else spatial[0]
    extent = int(sch.get(fused).extent)
    bx, tx = sch.split(fused, [None, min(threads, max(extent, 1))])
    sch.bind(bx, "blockIdx.x")
    sch.bind(tx, "threadIdx.x")


def aligned_params(func, align):
    """``func`` with compact, ``align``-byte aligned parameter buffers, and the function that
    puts the original parameters (strided, any offset) back into a func derived from it.
    Schedule primitives copy a buffer's declaration into the stages they derive from it:
    shared-memory copies of a parameter would inherit its symbolic element offset and its
    element alignment, which the tensor-core fragment loads reject (they need 64 bytes and
    offsets in multiples of 16)."""
    pairs = [(p, tirx.decl_buffer(p.shape, p.dtype, p.name, data_alignment=align))
             for p in func.params]

    def swap(f, table):
        return tvm_ffi.structural_map(
            f, (tirx.Var, lambda v: next((b for a, b in table if v.same_as(a)), v)))

    return swap(func, pairs), lambda f: swap(f, [(b, a) for a, b in pairs])


class KeptPredicates:
    """The block predicates of an unscheduled function (the ``valid`` plan's ``not
    is_padding`` on ``dst``), put back after scheduling: ``compute_at`` and
    ``reverse_compute_at`` give the moved block the predicate of its new loops only, and a
    ``dst_stage`` kernel would then store into padding it promised to leave alone. A predicated
    block that was inlined into its producer (dlight's matmul inlines the ``dst`` epilogue into
    its store from the accumulator) lends its predicate to the block that now stores its
    buffer, through the store's indices: the predicated block stored at its own iter vars."""

    def __init__(self, func):
        self.by_block = {}
        self.stores = {}   # block name -> (buffer it stores, its iter vars = the store indices)

        def record(realize):
            if is_true(realize.predicate):
                return
            block = realize.block
            ivs = [iv.var for iv in block.iter_vars]
            self.by_block[block.name_hint] = _substitute(
                realize.predicate, dict(zip(realize.iter_values, ivs)))
            if isinstance(block.body, tirx.BufferStore) and len(block.body.indices) == len(ivs) \
                    and all(i.same_as(v) for i, v in zip(block.body.indices, ivs)):
                self.stores[block.name_hint] = (block.body.buffer, ivs)

        tvm_ffi.structural_walk(func, (s_tir.SBlockRealize, record))

    def strip(self, func):
        """``func`` without them: TVM's loop transformations refuse a predicated block."""
        def drop(realize):
            if realize.block.name_hint not in self.by_block:
                return realize
            return s_tir.SBlockRealize(realize.iter_values, tirx.const(True, "bool"),
                                       realize.block)

        return tvm_ffi.structural_map(func, (s_tir.SBlockRealize, drop))

    def restore(self, func):
        """``func`` whose blocks each carry their original predicate (again), or the one of
        the block inlined into them."""
        names = set()
        tvm_ffi.structural_walk(func, (s_tir.SBlock, lambda b: names.add(b.name_hint)))
        inlined = [(buf, ivs, self.by_block[name]) for name, (buf, ivs) in self.stores.items()
                   if name not in names]

        def pred_of(block):
            pred = self.by_block.get(block.name_hint)
            if pred is not None or not isinstance(block.body, tirx.BufferStore):
                return pred
            for buf, ivs, inlined_pred in inlined:
                if block.body.buffer.same_as(buf):
                    return _substitute(inlined_pred, dict(zip(ivs, block.body.indices)))
            return None

        def put(realize):
            pred = pred_of(realize.block)
            if pred is None:
                return realize
            pred = _substitute(pred, {iv.var: v for iv, v in zip(realize.block.iter_vars,
                                                                 realize.iter_values)})
            if not is_true(realize.predicate):
                pred = tirx.And(realize.predicate, pred)
            return s_tir.SBlockRealize(realize.iter_values, pred, realize.block)

        return tvm_ffi.structural_map(func, (s_tir.SBlockRealize, put))


def predicated_schedule(func, steps, align=None):
    """``steps(sch)`` applied to ``func`` without its block predicates, which are put back
    afterwards (``KeptPredicates``), and with ``align``-byte compact parameters if asked
    (``aligned_params``: put back likewise); None where ``steps`` returns False or a schedule
    primitive refuses the nest."""
    kept = KeptPredicates(func)
    func = kept.strip(func)
    func, restore = aligned_params(func, align) if align else (func, lambda f: f)
    sch = s_tir.Schedule(func)
    try:
        if steps(sch) is False:
            return None
    except s_tir.ScheduleError:
        return None
    return s_tir.Schedule(kept.restore(restore(sch.mod["main"])))


def reduction_predicates_kept(func):
    """``func`` with each predicated reduction block's predicate written as a conjunction.

    TVM's cross-thread reduction (``LowerCrossThreadReduction``) gives the block that stores
    the result (``<name>_write_back``) the clauses of the original predicate that use no
    reduction loop, but it collects them from ``And`` nodes only: a predicate of one clause
    (``threadIdx.y < 5``, a row split that leaves threads without a row) is dropped, and every
    thread stores. On an H100 the rows of threads past a softmax's last row of statistics
    stored the reduction's identity (-FLT_MAX, 0: inf and NaN, seed 12 case 98), or wrote
    past the end of the statistics' shared buffer. ``p && p`` is the same predicate, and the
    pass keeps it; it runs before any simplifier."""
    def keep(realize):
        pred = realize.predicate
        reduces = any(iv.iter_type != SPATIAL for iv in realize.block.iter_vars)
        if not reduces or is_true(pred) or isinstance(pred, tirx.And):
            return realize
        return s_tir.SBlockRealize(realize.iter_values, tirx.And(pred, pred), realize.block)

    return tvm_ffi.structural_map(func, (s_tir.SBlockRealize, keep))


def selects_unvectorized(func):
    """``func`` with each vectorized loop whose body selects (``T.Select``) unrolled instead.

    TVM's CUDA code generator declares a vector select's condition with the select's own
    type: ``float2 v = make_ushort2((bool)0, (bool)0)``, which nvcc refuses (seed 1 case 274:
    a uint8 matmul into ``Ab4a``, bias + tanh, whose epilogue dlight's rule vectorizes by 2;
    tanh's NaN check and the padding's zero are selects). Unrolled, each lane selects in
    scalar code; the loops concerned are epilogue stores of a few lanes."""
    def has_select(stmt) -> bool:
        found = []
        tvm_ffi.structural_walk(stmt, (tirx.Select, lambda e: found.append(e)))
        return bool(found)

    def unvectorize(loop):
        if loop.kind != tirx.ForKind.VECTORIZED or not has_select(loop.body):
            return loop
        return tirx.For(loop.loop_var, loop.min, loop.extent, tirx.ForKind.UNROLLED, loop.body,
                        loop.thread_binding, loop.annotations)

    return tvm_ffi.structural_map(func, (tirx.For, unvectorize))


def _substitute(expr, mapping: dict):
    return tvm_ffi.structural_map(expr, (tirx.Var, lambda v: next(
        (new for old, new in mapping.items() if v.same_as(old)), v)))


def loop_depth(sch, block, loop) -> int:
    """How many of ``block``'s loops enclose ``loop``'s body (``loop`` included)."""
    stmt = sch.get(loop)
    return 1 + next(i for i, l in enumerate(sch.get_loops(block)) if sch.get(l).same_as(stmt))


def pow2_above(n: int) -> int:
    return 1 << (max(n, 1) - 1).bit_length()


def _reduction_loop_vars(sch, block) -> list:
    """Loop vars that feed a reduction (or opaque) iter var of ``block``."""
    realize = _get_realize(sch, block)
    out = []
    for iv, value in zip(sch.get(block).iter_vars, realize.iter_values):
        if iv.iter_type != SPATIAL:
            out += list(tirx.analysis.undefined_vars(value))
    return out


def _get_realize(sch, block):
    import tvm

    return tvm.get_global_func("s_tir.schedule.GetSBlockRealize")(sch, block)


def _root_blocks(sch):
    try:
        root = sch.get_sblock("root")
    except Exception:  # noqa: BLE001 - a function without blocks (an empty zero-pad): nothing to bind
        return []
    return sch.get_child_blocks(root)


class Matmul(ScheduleRule):
    """Matmul-shaped reductions (``C[m, n] += A[m, k] * B[k, n]`` in any layouts, blocked ones
    included: each operand is re-indexed to a plain matrix on its way to shared memory) with TVM's
    dlight GPU matmul rule. fp16 and bf16 sources with fp32 accumulation run on tensor cores (``wmma``:
    16x16x16 fragments loaded from shared memory, ``mma.sync`` in the PTX, HMMA in the SASS),
    when each of M, N and K exceeds 64; otherwise, and for fp32, a shared-memory tiled kernel
    (8x16 threads, 4x4 outputs per thread, K in steps of 16). Non-multiples are padded. Returns
    None (so the next rule runs) for a reduction it cannot put in that form."""

    ops = ("matmul",)

    def schedule(self, func, target):
        from tvm.s_tir import dlight

        from .cuda_bf16 import tensor_core_matmul

        return dlight_style(func, target, lambda f, t: (
            tensor_core_matmul(f, t) or dlight.gpu.Matmul().apply(f, t, False)))


# One dlight rule at a time per process: ``cuda_bf16`` swaps the wmma intrinsic group dlight
# reads while it schedules a bf16 kernel, which an fp16 kernel scheduled by another thread (a
# JIT cache compiling for several) must not see.
_DLIGHT = threading.Lock()


def dlight_style(func, target, rule):
    """``rule(func, tvm_target)``, a dlight-style rule (a Schedule, or None where it does not
    apply; dlight asserts on shapes it does not handle: None too), applied over compact,
    64-byte aligned parameters and without block predicates, both put back afterwards (see
    ``aligned_params``, ``KeptPredicates``); stages the rule left alone are bound."""
    tvm_target = target.tvm_target()
    kept = KeptPredicates(func)
    aligned, restore = aligned_params(kept.strip(func), 64)
    try:   # (the first tensor-core kernel imports TVM's CUDA intrinsics: ~30-60 s)
        with _DLIGHT, tvm_target:
            sch = rule(aligned, tvm_target)
    except Exception:  # noqa: BLE001 - dlight asserts on shapes it does not handle
        return None
    if sch is None:
        return None
    _bind_all(sch)   # stages dlight left alone (an epilogue it could not inline)
    return s_tir.Schedule(kept.restore(restore(sch.mod["main"])))


RULES = [Elementwise(), Matmul()]
