"""Rewrites that make an awkward dot-product nest tensorizable (the TIR half of ``dot_tiled``,
whose module doc lists the cases; that module tiles and tensorizes): the dot product padded
to whole intrinsics (``pad_dot``), a masked weights guard moved to where ``dst`` reads the
accumulator (``lift_weight_guard``), guards lifted into the predicate of a whole dot-product
step (``lift_conditions``), and a block's predicate taken off and put back (``take_predicate``,
``set_predicate``) around primitives that refuse it. ``DotShape`` reads the nest both halves
work on.
"""

from __future__ import annotations

import functools

import tvm
import tvm_ffi
from tvm import s_tir, tirx
from tvm.sym.analyzer import Analyzer

from blockpad.vocabulary import ACC, DST, MASKED_READS_ATTR

from .common import REDUCE, SPATIAL, is_true
from .dot_intrin import KINDS as DOT_KINDS
from .nest import substitute, uses

_realize = tvm.get_global_func("s_tir.schedule.GetSBlockRealize")


class DotShape:
    """The dot-product shape of a fresh ``acc`` block, or ``ok = False``: which iter var is
    ``t``, ``u`` and ``r`` (``j`` is the last spatial one; see the module doc), the source and
    weight element types, the accumulator's, the reduction steps an instruction sums per lane
    (``steps``: 4 int8, 2 bf16; None for sources no dot product takes), the guard around the
    source read and the one around the weights read (None if none)."""

    def __init__(self, sch, acc):
        self.ok = False
        block, realize = sch.get(acc), _realize(sch, acc)
        store = block.body
        if not isinstance(store, tirx.BufferStore) or not is_true(realize.predicate):
            return
        kinds = [int(iv.iter_type) for iv in block.iter_vars]
        self.n_sp = kinds.count(SPATIAL)
        if self.n_sp < 2 or kinds != [SPATIAL] * self.n_sp + [REDUCE] * (len(kinds) - self.n_sp):
            return
        self.vars = [iv.var for iv in block.iter_vars]
        loops = sch.get_loops(acc)
        self.loop_vars = [sch.get(l).loop_var for l in loops]
        if len(loops) != len(self.vars) or any(
                not v.same_as(l) for v, l in zip(realize.iter_values, self.loop_vars)):
            return   # not a fresh TE nest (one loop per iter var, in order)
        self.extents = [int(sch.get(l).extent) for l in loops]
        self.acc, self.store_indices = store.buffer, list(store.indices)
        self.acc_dtype = str(store.buffer.dtype)
        loads = []
        tvm_ffi.structural_walk(store.value, (tvm.ir.expr.TensorLoad, loads.append))
        guards = guards_of(store.value)
        sources = [l for l in loads if not l.source.same_as(store.buffer)]
        if len(sources) != 2 or len(loads) != 3 or len(guards) > 2:
            return
        j_var = self.vars[self.n_sp - 1]
        if not (isinstance(store.indices[-1], tirx.Var) and store.indices[-1].same_as(j_var)):
            return
        wei = next((l for l in sources if len(l.indices) >= 2 and uses(l.indices[-2], j_var)
                    and not uses(l.indices[-1], j_var)), None)
        if wei is None:
            return
        src = next(l for l in sources if l is not wei)
        self.src, self.wei = src, wei
        # t: the innermost spatial dim the source walks and the weights do not (ow; rows)
        self.t = next((i for i in reversed(range(self.n_sp - 1))
                       if self._walks(src, i) and not self._walks(wei, i)), None)
        self.r = next((i for i in range(self.n_sp, len(self.vars))
                       if uses(wei.indices[-1], self.vars[i])
                       and uses(src.indices[-1], self.vars[i])), None)
        if self.t is None or self.r is None:
            return
        self.u = next((i for i in range(self.n_sp - 1) if i != self.t
                       and self._walks(wei, i) and not self._walks(src, i)), None)
        self.guard = next((g for g in guards if g.args[1].same_as(src)), None)
        self.wei_guard = next((g for g in guards if g.args[1].same_as(wei)), None)
        if len(guards) != (self.guard is not None) + (self.wei_guard is not None):
            return   # a guard around anything else
        if self.guard is not None and (uses(self.guard.args[0], j_var)       # one that tests a
                                       or uses(self.guard.args[0], self.vars[self.r])):  # channel
            return
        if self.wei_guard is not None and any(    # weights masked along the reduction
                uses(self.wei_guard.args[0], v) for v in self.vars[self.n_sp:]):
            return
        self.src_dtype, self.wei_dtype = str(src.source.dtype), str(wei.source.dtype)
        self.steps = DOT_KINDS[self.src_dtype][0] if self.src_dtype in DOT_KINDS else None
        self.ok = True

    def _walks(self, load, i) -> bool:
        return any(uses(x, self.vars[i]) for x in load.indices)

    def column_blocks(self, lanes) -> int:
        """``lanes``-wide column vectors of the destination: along ``u``, else along ``j``."""
        return self.extents[self.u] if self.u is not None else self.extents[self.n_sp - 1] // lanes


def pad_dot(func, lanes):
    """``func`` with its dot product padded to whole intrinsics, where the padding is
    scratch or reads zero: ``acc``'s last dim (``j``) rounded up to ``lanes`` when the weights'
    padded lane blocks hold the extra columns (an intermediate buffer: its extra lanes are
    computed and never read), and the reduction ``r`` rounded up to whole steps (4 int8, 2
    bf16) by reading the source through a copy whose innermost dim is zero-padded (``src_pad``,
    a stage of the kernel): each extra step adds zero, whatever an int8 kernel's weights padding
    holds; a floating one (bf16, whose zero bits are +0.0) only where the padding is trusted to
    be zero (not ``MASKED_READS_ATTR``: 0 x NaN is NaN). Unchanged where neither is
    needed or the nest is not such a dot product (the rule then declines it)."""
    sch = s_tir.Schedule(func)
    try:
        nest = DotShape(sch, sch.get_sblock(ACC))
    except s_tir.ScheduleError:
        return func
    if not nest.ok or nest.steps is None:
        return func
    j = nest.n_sp - 1
    grow = {j: -nest.extents[j] % lanes, nest.r: -nest.extents[nest.r] % nest.steps}
    grow = {i: n for i, n in grow.items() if n}
    if not grow or not _weights_hold(nest, grow):
        return func
    attrs = func.attrs if func.attrs is not None else {}
    if nest.r in grow and "float" in nest.acc_dtype and MASKED_READS_ATTR in attrs:
        return func   # the extra steps read weights padding that may be NaN: 0 x NaN is NaN
    src = nest.src
    if nest.r in grow and not (src.indices[-1].same_as(nest.vars[nest.r])
                               and int(src.source.shape[-1]) == nest.extents[nest.r]):
        return func   # a source not read along r by its innermost index alone
    body = func.body
    if nest.r in grow:
        body = _read_padded(body, src.source, grow[nest.r])
    return func.with_body(_grow_acc(body, nest, grow))


def _weights_hold(nest, grow) -> bool:
    """The weights' reads stay in their buffer with the iter vars of ``grow`` extended."""
    ana = Analyzer()
    for i, v in enumerate(nest.vars):
        ana.bind(v, tvm.ir.Range(0, nest.extents[i] + grow.get(i, 0)))
    shape = nest.wei.source.shape
    return all(ana.const_int_bound(x).max_value < int(n) for x, n in zip(nest.wei.indices, shape))


def _read_padded(body, src, extra):
    """``body`` (the root block's) reading ``src`` in ``acc`` from ``src_pad``, a copy with
    ``extra`` zeros after each innermost row, computed by a new first stage."""
    shape = [*src.shape[:-1], int(src.shape[-1]) + extra]
    pad = tirx.decl_buffer(shape, src.dtype, "src_pad")

    def reread(block):
        if block.name_hint != ACC:
            return block
        swap = (tirx.Var, lambda b: pad if b.same_as(src) else b)   # buffers are Vars
        return tvm_ffi.structural_map(block, swap)

    root = body.block
    stmts = list(root.body.seq) if isinstance(root.body, tirx.SeqStmt) else [root.body]
    root = s_tir.SBlock(root.iter_vars, root.reads, root.writes, root.name_hint,
                        tirx.SeqStmt([_copy_stage(src, pad), *stmts]), root.init,
                        [*root.alloc_buffers, pad], root.match_buffers, root.annotations)
    return s_tir.SBlockRealize(body.iter_values, body.predicate,
                               tvm_ffi.structural_map(root, (s_tir.SBlock, reread)))


def _copy_stage(src, pad):
    """``pad[..., k] = src[..., k]`` where ``k`` is inside ``src``, else 0: one loop per dim."""
    loops = [tirx.Var(f"p{d}", "int32") for d in range(len(pad.shape))]
    ivs = [tirx.IterVar(tvm.ir.Range(0, n), tirx.Var(f"v{d}", "int32"), SPATIAL)
           for d, n in enumerate(pad.shape)]
    idx = [iv.var for iv in ivs]
    inside = idx[-1] < src.shape[-1]
    value = tirx.if_then_else(inside, tirx.BufferLoad(src, idx), tirx.const(0, src.dtype))
    point = [tvm.ir.Range.from_min_extent(x, 1) for x in idx]
    block = s_tir.SBlock(ivs, [tirx.BufferRegion(src, point)], [tirx.BufferRegion(pad, point)],
                         "src_pad", tirx.BufferStore(pad, value, idx))
    stmt = s_tir.SBlockRealize(loops, tirx.const(True, "bool"), block)
    for v, n in reversed(list(zip(loops, pad.shape))):
        stmt = tirx.For(v, 0, n, tirx.ForKind.SERIAL, stmt)
    return stmt


def _grow_acc(body, nest, grow):
    """``body`` with ``acc``'s loops and iter vars of ``grow`` extended, and its buffer too
    where ``j`` grows."""
    j = nest.n_sp - 1
    old = nest.acc
    new = old
    if j in grow:
        new = tirx.decl_buffer([*old.shape[:-1], int(old.shape[-1]) + grow[j]], old.dtype, ACC)

    def block(b):
        if b.name_hint != ACC:
            return b
        ivs = [tirx.IterVar(tvm.ir.Range(0, nest.extents[i] + grow.get(i, 0)), iv.var,
                            iv.iter_type) for i, iv in enumerate(b.iter_vars)]
        return s_tir.SBlock(ivs, b.reads, b.writes, b.name_hint, b.body, b.init,
                            b.alloc_buffers, b.match_buffers, b.annotations)

    def loop(f):
        i = next((i for i, v in enumerate(nest.loop_vars) if v.same_as(f.loop_var)), None)
        if i not in grow:
            return f
        return tirx.For(f.loop_var, f.min, nest.extents[i] + grow[i], f.kind, f.body,
                        f.thread_binding, f.annotations)

    return tvm_ffi.structural_map(body, [(tirx.Var, lambda v: new if v.same_as(old) else v),
                                         (s_tir.SBlock, block), (tirx.For, loop)])


def lift_weight_guard(func, lanes):
    """``func`` with the guard around ``acc``'s weights read (masked padding: output channels
    past the logical ones read as zero) moved to where ``dst`` reads the accumulator: the
    weights are read as they are inside their padded buffer (garbage in channels nobody
    reads), and ``dst`` sees 0 where the guard fails, as the guarded sum gave. Unchanged where
    there is no such guard, where it holds or fails for whole vectors of ``lanes`` (the tile
    skips those steps, ``lift_conditions``), or where the weights' reads would leave their
    buffer."""
    sch = s_tir.Schedule(func)
    try:
        nest = DotShape(sch, sch.get_sblock(ACC))
    except s_tir.ScheduleError:
        return func
    if not nest.ok or nest.wei_guard is None or _lane_uniform(nest, lanes) \
            or not _weights_hold(nest, {}) or not all(
            x.same_as(v) for x, v in zip(nest.store_indices, nest.vars[:nest.n_sp])):
        return func
    guard = nest.wei_guard

    def unguard(call):
        return call.args[1] if call.same_as(guard) else call

    def block(b):
        if b.name_hint == ACC:
            return _with_body(b, tvm_ffi.structural_map(b.body, (tvm.ir.expr.Call, unguard)))
        if b.name_hint != DST:
            return b

        def guarded(load):
            if not load.source.same_as(nest.acc):
                return load
            cond = substitute(guard.args[0], dict(zip(nest.vars, load.indices)))
            return tirx.if_then_else(cond, load, tirx.const(0, nest.acc_dtype))
        return _with_body(b, tvm_ffi.structural_map(b.body, (tvm.ir.expr.TensorLoad, guarded)))

    return func.with_body(tvm_ffi.structural_map(func.body, (s_tir.SBlock, block)))


def _lane_uniform(nest, lanes) -> bool:
    """The weights' guard takes one value across each vector of ``lanes`` columns."""
    j = nest.n_sp - 1
    jo, ji = tirx.Var("jo", "int32"), tirx.Var("ji", "int32")
    ana = Analyzer()
    for i, v in enumerate(nest.vars):
        if i != j:
            ana.bind(v, tvm.ir.Range(0, nest.extents[i]))
    ana.bind(jo, tvm.ir.Range(0, -(-nest.extents[j] // lanes)))
    ana.bind(ji, tvm.ir.Range(0, lanes))
    cond = ana.simplify(substitute(nest.wei_guard.args[0], {nest.vars[j]: jo * lanes + ji}))
    return not uses(cond, ji)


def lift_conditions(sch, step):
    """Take the conditions off the blockized step ``step`` (one intrinsic's worth of the
    update) so that tensorize, which refuses them, sees a plain dot product, and return them
    over the loop vars (None if it had none) for ``set_predicate`` to put back on the tensorized
    step. Three kinds: the predicate of the rows of a last, partial register tile; spatial
    padding: ``acc += cast(if_then_else(g, src, 0)) * w`` becomes ``acc += cast(src) * w``
    under ``g``, so that a step that would read outside the image is skipped, which is adding
    the zero it would have read; and weights guarded along whole vectors of lanes (output
    channel blocks past what the weights' buffer holds), skipped the same way. None may vary
    inside the step (a guard on some lanes of a vector, or on channels, raises ValueError: the
    rule declines the nest). The init, decomposed before, still zeroes every accumulator."""
    outer, outer_realize = sch.get(step), _realize(sch, step)
    inner_realize = []
    tvm_ffi.structural_walk(outer.body, (s_tir.SBlockRealize, inner_realize.append))
    inner_realize = inner_realize[0]
    inner = inner_realize.block
    guards = guards_of(inner.body)
    conds = [] if is_true(outer_realize.predicate) else [outer_realize.predicate]
    if not guards and not conds:
        return None
    conds += [_step_condition(g.args[0], outer, outer_realize, inner_realize) for g in guards]
    new_inner = _with_body(inner, tvm_ffi.structural_map(inner.body, (
        tvm.ir.expr.Call, lambda c: c.args[1] if any(c.same_as(g) for g in guards) else c)))
    new_outer = _with_body(outer, tvm_ffi.structural_map(outer.body, (
        s_tir.SBlockRealize, lambda r: s_tir.SBlockRealize(r.iter_values, r.predicate, new_inner)
        if r.same_as(inner_realize) else r)))
    _replace_realize(sch, step, s_tir.SBlockRealize(outer_realize.iter_values,
                                                    tirx.const(True, "bool"), new_outer),
                     {outer: new_outer, inner: new_inner})
    return functools.reduce(tirx.And, conds)


def _step_condition(cond, outer, outer_realize, inner_realize):
    """A guard of the step's inner block (over its iter vars) over the loop vars outside the
    step; ValueError where it depends on a loop inside the step."""
    inner = inner_realize.block
    cond = substitute(cond, {iv.var: v for iv, v in zip(inner.iter_vars, inner_realize.iter_values)})
    ana, inside = Analyzer(), []

    def bind(f):
        inside.append(f.loop_var)
        ana.bind(f.loop_var, tvm.ir.Range.from_min_extent(f.min, f.extent))
    tvm_ffi.structural_walk(outer.body, (tirx.For, bind))
    for iv in outer.iter_vars:
        ana.bind(iv.var, iv.dom)
    cond = ana.simplify(cond)
    if any(uses(cond, v) for v in inside):
        raise ValueError(f"a guard that varies inside one dot product: {cond}")
    return substitute(cond, {iv.var: v for iv, v in zip(outer.iter_vars, outer_realize.iter_values)})


def take_predicate(sch, block):
    """Remove ``block``'s predicate and return it over the block's iter vars (None if it had
    none); the block must have one loop per iter var, in order (a fresh TE nest)."""
    realize = _realize(sch, block)
    if is_true(realize.predicate):
        return None
    _replace_realize(sch, block, s_tir.SBlockRealize(
        realize.iter_values, tirx.const(True, "bool"), realize.block), {})
    return substitute(realize.predicate, {x: iv.var for iv, x in zip(
        realize.block.iter_vars, realize.iter_values)})


def set_predicate(sch, block, cond):
    """``block`` runs only where ``cond`` (over the loop vars) holds."""
    realize = _realize(sch, block)
    _replace_realize(sch, block, s_tir.SBlockRealize(
        realize.iter_values, tirx.And(realize.predicate, tirx.likely(cond)), realize.block), {})


def _replace_realize(sch, block, new_realize, reuse):
    """Put ``new_realize`` where ``block``'s realize is, through its parent loop (the
    schedule state replaces loops and blocks, not realizes)."""
    realize = _realize(sch, block)
    loop = sch.get_loops(block)[-1]
    new_loop = tvm_ffi.structural_map(sch.get(loop), (
        s_tir.SBlockRealize, lambda r: new_realize if r.same_as(realize) else r))
    sch.state.replace(sch.get_sref(loop), new_loop, reuse)


def guards_of(expr) -> list:
    """The ``if_then_else`` calls in ``expr``."""
    out = []
    tvm_ffi.structural_walk(expr, (tvm.ir.expr.Call, lambda c: out.append(c) if getattr(
        c.op, "name", "").endswith("if_then_else") else None))
    return out


def _with_body(block, body):
    return s_tir.SBlock(block.iter_vars, block.reads, block.writes, block.name_hint, body,
                        block.init, block.alloc_buffers, block.match_buffers, block.annotations)
