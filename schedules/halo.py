"""The source a convolution window reads, restaged out of the hot loop on any target.

Spatial padding: the window's guarded reads (``if_then_else(in_image, src[...], 0)``, padding
fused into the loads, a branch per read) become either reads of a zero-haloed copy of the
source, made by a stage of the kernel (``staged_source``: the CPU rules ``register_tiled`` and
the tensorized ones through it, whose every source element feeds many FMAs, and CUDA's
``cuda_conv``, which stages the copy in shared memory), or branch-free selects of clamped reads
(``clamped_source``: the depthwise rule, where a copy of the source costs as much as the
convolution). Strides: a window that reads every ``s``-th row or column and nothing between
them (a ResNet downsample's strided 1x1) reads a dense copy of those instead
(``subsampled_source``)."""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import s_tir, te, tirx
from tvm.sym.analyzer import Analyzer

from blockpad.vocabulary import ACC

from .common import SPATIAL
from .nest import realizes, with_root

_IF_THEN_ELSE = tvm.ir.Op.get("prim.if_then_else")


def staged_source(func):
    """``func`` with the guarded reads of its convolution window (``if_then_else(in_image,
    src[...], 0)``, spatial padding fused) taken from a copy of the source with a zero halo,
    made by a stage of the kernel: the guards cost a branch per broadcast element in the hot
    loop; the copy costs one pass over the source. Only guards that are exactly the buffer's
    bounds are staged (a ``masked`` read of channel padding stays a guard), so the numbers do
    not change. ``func`` itself if it has no such reads."""
    found = _window_guard(func)
    if found is None:
        return func
    guarded, lo, hi, shape = found
    load = guarded.args[1]
    buf, idx = load.source, list(load.indices)
    padded = [s + a + b for s, a, b in zip(shape, lo, hi)]
    dtype = str(buf.ty.dtype)
    ph = te.placeholder(shape, dtype, "src")

    def value(*p):
        inside = [tirx.all(p[d] >= lo[d], p[d] < lo[d] + shape[d])
                  for d in range(len(shape)) if lo[d] or hi[d]]
        return tirx.if_then_else(tirx.all(*inside), ph(*[x - a for x, a in zip(p, lo)]),
                                 tirx.const(0, dtype))

    return _with_stage(func, buf, ph, te.compute(padded, value, name="src_pad"), guarded,
                       lambda staged: tirx.BufferLoad(staged, [x + a for x, a in zip(idx, lo)]),
                       lambda reg: [tvm.ir.Range.from_min_extent(r.min + a, r.extent)
                                    for r, a in zip(reg.region, lo)])


def _with_stage(func, buf, src, copy, old, new_read, new_region):
    """``func`` with the TE stage ``copy`` (of the placeholder ``src``, standing for the
    source buffer ``buf``) run first into a buffer of its name, shape and dtype, and the ``acc``
    block's ``old`` read (a load, or the call guarding one) replaced by ``new_read(copy's
    buffer)``; its read regions of ``buf`` become ``new_region(region)`` of the copy."""
    stage_func = te.create_prim_func([src, copy])
    staged = tirx.decl_buffer(copy.shape, copy.dtype, copy.op.name)
    rename = {stage_func.params[0]: buf, stage_func.params[1]: staged}
    stage = tvm_ffi.structural_map(
        stage_func.body.block.body,
        (tirx.Var, lambda v: next((n for o, n in rename.items() if o.same_as(v)), v)))
    body = _replace_guard(func.body.block.body, old, new_read(staged), lambda reads: [
        tirx.BufferRegion(staged, new_region(reg)) if reg.source.same_as(buf) else reg
        for reg in reads])
    stmts = list(body) if isinstance(body, tirx.SeqStmt) else [body]
    return with_root(func, [stage, *stmts], [*func.body.block.alloc_buffers, staged])


def subsampled_source(func):
    """``func`` with the source read at ``s * o`` along some dims (a strided window of extent
    one there: a ResNet downsample's 1x1, stride 2) taken from a dense copy of the rows and
    columns it reads, made by a stage of the kernel. Read strided, each panel of output
    channels pulls the whole source through the cache (a pixel of ``nChw16c`` float32 is one
    64-byte line, and the lines between are fetched with it), and a source larger than L2
    comes from L3 once per panel; the copy is a quarter of it. ``func`` itself where no read
    is so strided."""
    found = _strided_read(func)
    if found is None:
        return func
    load, strided = found
    buf, idx = load.source, list(load.indices)
    shape = [int(n) for n in buf.ty.shape]
    dense = [strided[d][1] if d in strided else n for d, n in enumerate(shape)]
    dtype = str(buf.ty.dtype)
    ph = te.placeholder(shape, dtype, "src")
    stage = te.compute(dense, lambda *p: ph(*[p[d] * strided[d][0] if d in strided else p[d]
                                              for d in range(len(p))]), name="src_sub")
    new_idx = [strided[d][2] if d in strided else x for d, x in enumerate(idx)]
    return _with_stage(func, buf, ph, stage, load, lambda staged: tirx.BufferLoad(staged, new_idx),
                       lambda reg: [tvm.ir.Range.from_min_extent(strided[d][2], 1)
                                    if d in strided else r for d, r in enumerate(reg.region)])


def clamped_source(func):
    """``func`` with the guarded read of its window (``if_then_else(in_image, src[...], fill)``,
    ``fill`` a constant: 0 for a convolution's sum, the lowest value for a max pool's) turned
    into ``select(in_image, src[clamped], fill)``: the read is clamped into the source, so it
    is always safe, and the fill is a select of whole vectors, with no branch and no copy of
    the source (``staged_source``'s pass over memory, which took as long as a depthwise
    convolution's FMAs). Only guards that are exactly the buffer's bounds are rewritten;
    ``func`` itself if it has no such read."""
    found = _window_guard(func)
    if found is None:
        return func
    guarded, lo, hi, shape = found
    cond, load, fill = guarded.args
    idx = [x if not (a or b) else tirx.max(tirx.min(x, n - 1), 0)
           for x, a, b, n in zip(load.indices, lo, hi, shape)]
    picked = tirx.Select(cond, tirx.BufferLoad(load.source, idx), fill)
    return func.with_body(_replace_guard(func.body, guarded, picked))


def _replace_guard(stmt, guarded, new, reads=None):
    """``stmt`` with the ``acc`` block's call or load ``guarded`` replaced by ``new``, and the block's
    read regions mapped by ``reads`` (a function of the list), if given."""
    def swap(c):   # the read itself, or one alike (a NaN-aware max reads its cell twice)
        return new if tvm_ffi.structural_equal(c, guarded) else c

    def swap_block(realize):
        blk = realize.block
        if blk.name_hint != ACC:
            return realize
        body = tvm_ffi.structural_map(blk.body, (type(guarded), swap))
        blk = s_tir.SBlock(blk.iter_vars, reads(blk.reads) if reads else blk.reads, blk.writes,
                           blk.name_hint, body, blk.init, blk.alloc_buffers, blk.match_buffers,
                           blk.annotations)
        return s_tir.SBlockRealize(realize.iter_values, realize.predicate, blk)

    return tvm_ffi.structural_map(stmt, (s_tir.SBlockRealize, swap_block))


def _acc_block(func):
    return next((r.block for r in realizes(func) if r.block.name_hint == ACC), None)


def _strided_read(func):
    """``(load, {dim: (stride, extent, var)})``: the ``acc`` block's one load of its first
    source whose index is ``stride * var`` (stride > 1, ``var`` a spatial iterator of the
    block, plus a window iterator of extent one) along some dims, unguarded; None if there is
    none."""
    acc = _acc_block(func)
    if acc is None or not acc.reads or \
            not any(acc.reads[0].source.same_as(p) for p in func.params):
        return None
    src = acc.reads[0].source
    loads = []
    tvm_ffi.structural_map(acc.body, (tvm.ir.expr.TensorLoad, lambda c: loads.append(c) or c))
    loads = [x for x in loads if x.source.same_as(src)]
    if len(loads) != 1 or _is_guarded(acc.body, loads[0]):
        return None
    spatial = {iv.var: int(iv.dom.extent) for iv in acc.iter_vars if int(iv.iter_type) == SPATIAL}
    # a window of extent one: ``s * o + r`` with ``r`` a reduction iterator over [0, 1)
    zero = [iv.var for iv in acc.iter_vars if int(iv.iter_type) != SPATIAL
            and int(iv.dom.min) == 0 and int(iv.dom.extent) == 1]
    strided = {}
    for d, x in enumerate(loads[0].indices):
        if isinstance(x, tirx.Add) and any(x.b.same_as(v) for v in zero):
            x = x.a
        if isinstance(x, tirx.Mul) and isinstance(x.b, tirx.IntImm) and x.b.value > 1:
            var = next((v for v in spatial if v.same_as(x.a)), None)
            if var is not None:
                strided[d] = (int(x.b.value), spatial[var], var)
    return (loads[0], strided) if strided else None


def _is_guarded(body, load) -> bool:
    calls = []
    tvm_ffi.structural_map(body, (tvm.ir.expr.Call, lambda c: calls.append(c) or c))
    return any(c.op.same_as(_IF_THEN_ELSE) and any(a.same_as(load) for a in c.args)
               for c in calls)


def _window_guard(func):
    """``(guard, lo, hi, shape)``: the one guarded read of a parameter in ``func``'s ``acc``
    block (``if_then_else(cond, src[idx], fill)``, ``fill`` a constant; it may occur more than
    once) whose condition is exactly bounds of the source, with how far its indices reach
    below 0 (``lo``) and past the end (``hi``) per dim and the source's shape; None if there
    is no such read."""
    acc = _acc_block(func)
    if acc is None:
        return None
    calls = []
    tvm_ffi.structural_map(acc.body, (tvm.ir.expr.Call, lambda c: calls.append(c) or c))
    guarded = [c for c in calls if c.op.same_as(_IF_THEN_ELSE) and _is_load(c.args[1])
               and isinstance(c.args[2], (tirx.IntImm, tirx.FloatImm))]
    if not guarded or any(not tvm_ffi.structural_equal(g, guarded[0]) for g in guarded) \
            or not any(guarded[0].args[1].source.same_as(p) for p in func.params):
        return None
    cond, load = guarded[0].args[0], guarded[0].args[1]
    idx = list(load.indices)
    shape = [int(s) for s in load.source.ty.shape]
    ana = Analyzer()
    for iv in acc.iter_vars:
        ana.bind(iv.var, iv.dom)
    lo, hi = [0] * len(shape), [0] * len(shape)
    for term in _conjuncts(cond):
        side = _bound_side(ana, term, idx, shape)
        if side is None:
            return None
        d, upper = side
        b = ana.const_int_bound(idx[d])
        if upper:
            hi[d] = max(hi[d], b.max_value - shape[d] + 1)
        else:
            lo[d] = max(lo[d], -b.min_value)
    return guarded[0], lo, hi, shape


def _conjuncts(cond):
    if isinstance(cond, tirx.And):
        return _conjuncts(cond.a) + _conjuncts(cond.b)
    return [cond]


def _bound_side(ana, term, idx, shape):
    """``(d, upper)`` if ``term`` is ``idx[d] < shape[d]`` (upper) or ``idx[d] >= 0``."""
    t = ana.simplify(term)
    for d, x in enumerate(idx):
        for upper, bound in ((False, x >= 0), (True, x < shape[d])):
            if tvm_ffi.structural_equal(t, ana.simplify(bound)):
                return d, upper
    return None


def _is_load(e):
    return isinstance(e, tvm.ir.expr.TensorLoad)
