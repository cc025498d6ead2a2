"""A register tile's epilogue interleaved with the next tile's dot products.

A dot-product rule (``dot_tiled``) computes each register tile's accumulators over the
reduction, then runs ``dst`` (requantization, post-ops, the narrowing store) over the tile. A
heavy epilogue (int8 ResNet-50's residual 1x1s: the conv's requantization, the quantized sum's
dequantization, two FMAs, rounding, saturation: 15 vector instructions an output vector
against 16 ``vpdpbusd`` of a 64-channel reduction) then runs after the dot products instead of
beside them: ~210 instructions for a 7 x 2 tile, more than the scheduler holds, so the next
tile's dot products wait for it to drain. LLVM does not interleave the two on its own.

``interleave_epilogue`` rewrites the scheduled loop nest so that each task runs ``tiles``
register tiles in sequence: tile ``t``'s accumulators are copied into a scratch
(``ACC_PREV``) when its reduction ends, and tile ``t + 1``'s first reduction steps each run one
output vector of tile ``t``'s epilogue from that scratch; the task's first tile runs as before,
its last one's epilogue after the loop. The same blocks, bindings and buffers as before, in
another order: the results are bit-identical. Measured in C first
(``docs/experiments/int8_epilogue.c``: 0.89x of the 64 -> 256 1x1 at 56x56 on Zen 4), then as
generated on Zen 4 only (int8 ResNet-50 0.982x at 1 thread; docs/performance.md); an Intel
core (``vpdpbusd`` and the FMAs on the same two ports) was not at hand.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import tvm_ffi
from tvm import s_tir, tirx
from tvm.ir import Range
from tvm.ir.expr import Call, TensorLoad

from blockpad.vocabulary import ACC, ACC_PREV, DST

from .common import is_true
from .nest import definitions, substitute

#: register tiles a task runs in sequence: the last one's epilogue runs alone
TILES = 8
#: interleave where ``dst`` computes at least this many operations an element per reduction
#: step (int8 ResNet-50 on Zen 4, each kernel alone, the rewrite against none: the residual
#: 1x1s with 18 operations over 16, 32 and 64 steps 0.91-0.93x, 0.90-0.97x, 0.95x; over 128
#: steps 0.97-1.03x; a plain 1x1's 9 over 16 steps 0.96x, over 64 1.02-1.07x)
HEAVY = 0.25
#: a task loop of fewer chunks than this (after grouping its tiles) is left as it is
MIN_CHUNKS = 8


def _loops(stmt):
    """The perfect nest of ``For`` at ``stmt`` and what it wraps."""
    loops = []
    while isinstance(stmt, tirx.For):
        loops.append(stmt)
        stmt = stmt.body
    return loops, stmt


def _wrap(loops, inner):
    """``loops`` (a perfect nest's) around ``inner``."""
    for f in reversed(loops):
        inner = tirx.For(f.loop_var, f.min, f.extent, f.kind, inner, f.thread_binding,
                         f.annotations)
    return inner


def _renew(stmt):
    """``stmt`` with new vars for what it defines (``nest.definitions``) and new match
    buffers: a copy may not share its definitions with the original."""
    fresh = {v: tirx.Var(v.name, v.ty) for v in definitions(stmt)}
    return _renew_match_buffers(substitute(stmt, fresh))


def _rebuffer(stmt, old, new):
    """``stmt`` with buffer ``old`` replaced by ``new``: in loads, stores, and blocks' regions."""
    def region(r):
        return tirx.BufferRegion(new, r.region) if r.source.same_as(old) else r

    def block(b):
        return s_tir.SBlock(b.iter_vars, [region(r) for r in b.reads],
                            [region(r) for r in b.writes], b.name_hint, b.body, b.init,
                            b.alloc_buffers, [s_tir.MatchBufferRegion(m.buffer, region(m.source))
                                              for m in b.match_buffers], b.annotations)
    stmt = tvm_ffi.structural_map(stmt, (TensorLoad, lambda x: tirx.BufferLoad(new, x.indices)
                                         if x.source.same_as(old) else x))
    stmt = tvm_ffi.structural_map(stmt, (tirx.BufferStore, lambda x: tirx.BufferStore(
        new, x.value, x.indices) if x.buffer.same_as(old) else x))
    return tvm_ffi.structural_map(stmt, (s_tir.SBlock, block))


def _renew_match_buffers(stmt):
    """``stmt`` with a new buffer for each block's match buffer (a tensorized step's views)."""
    def block(b):
        if not b.match_buffers:
            return b
        pairs = [(m.buffer, tirx.decl_buffer(
            m.buffer.shape, m.buffer.dtype, m.buffer.name, strides=list(m.buffer.strides),
            data_alignment=m.buffer.data_alignment, offset_factor=m.buffer.offset_factor))
            for m in b.match_buffers]
        body = b.body
        for old, new in pairs:
            body = _rebuffer(body, old, new)
        return s_tir.SBlock(b.iter_vars, b.reads, b.writes, b.name_hint, body, b.init,
                            b.alloc_buffers,
                            [s_tir.MatchBufferRegion(n, m.source)
                             for (_, n), m in zip(pairs, b.match_buffers)], b.annotations)
    return tvm_ffi.structural_map(stmt, (s_tir.SBlock, block))


def _names(stmt) -> set:
    out = set()
    tvm_ffi.structural_walk(stmt, (s_tir.SBlock, lambda b: out.add(b.name_hint)))
    return out


def _updates(names) -> bool:
    """Whether block ``names`` hold the accumulator's update (``acc_update``, blockized
    ``acc_update_o``)."""
    return any(n.startswith(ACC + "_update") for n in names)


def _chunks(n: int) -> int:
    """Tiles a task runs in sequence: the most up to ``TILES`` that divide ``n`` and leave at
    least ``MIN_CHUNKS`` tasks, else 1 (no rewrite)."""
    for t in range(TILES, 1, -1):
        if n % t == 0 and n // t >= MIN_CHUNKS:
            return t
    return 1


def interleave_epilogue(sch):
    """``sch`` with the epilogue of each register tile interleaved with the next tile's
    reduction (module docstring), or ``sch`` unchanged where its nest is not the shape this
    takes (``_read``), the epilogue is light beside the reduction (``HEAVY``) or the tasks are
    too few to run several tiles each (``_chunks``)."""
    func = sch.mod["main"]
    found = []
    tvm_ffi.structural_walk(func.body, (tirx.For, lambda f: found.append(f)
                                        if f.kind == tirx.ForKind.PARALLEL else None))
    nest = _read(found[0]) if len(found) == 1 else None
    if nest is None or nest.operations < HEAVY * nest.steps * _inner_steps(nest.chain[1]):
        return sch
    tiles = _chunks(int(nest.task.extent))
    if tiles < 2:
        return sch
    scratch, stmt = _rewrite(nest, tiles)
    body = tvm_ffi.structural_map(func.body, (tirx.For, lambda f: stmt
                                              if f.same_as(nest.task) else f))
    root = body.block   # the root block's realize: the new scratch joins its allocations
    body = s_tir.SBlockRealize(body.iter_values, body.predicate, s_tir.SBlock(
        root.iter_vars, root.reads, root.writes, root.name_hint, root.body, root.init,
        list(root.alloc_buffers) + scratch, root.match_buffers, root.annotations))
    return s_tir.Schedule(func.with_body(body))


@dataclass(frozen=True)
class _Nest:
    """A task loop as ``_read`` found it: its body the accumulators' nest (``acc_part``, with
    the reduction ``chain``: ``_reduction_chain``) then ``dst``'s (``loops`` around
    ``realize``), ``dst`` reading the accumulator at its own element only (``acc_load``)."""

    task: tirx.For
    acc_part: tirx.Stmt
    chain: tuple
    loops: list
    realize: s_tir.SBlockRealize
    acc_load: TensorLoad

    @property
    def extents(self) -> list:
        return [int(f.extent) for f in self.loops]

    @property
    def vectors(self) -> int:
        """Output vectors of a tile: ``dst``'s loops but the vectorized one."""
        return math.prod(self.extents[:-1])

    @property
    def steps(self) -> int:
        """Iterations of the reduction chain."""
        return math.prod(int(f.extent) for f in self.chain[0])

    @property
    def operations(self) -> int:
        return _operations(self.realize.block.body.value)


def _read(task) -> _Nest | None:
    """The nest ``interleave_epilogue`` rewrites, or None: a body of the accumulators' nest
    then ``dst``'s, ``dst`` unpredicated under unrolled loops and one vectorized loop, reading
    the accumulator at its own element only, over a reduction of at least as many steps as a
    tile has output vectors."""
    if not isinstance(task.body, tirx.SeqStmt) or len(task.body.seq) != 2:
        return None
    acc_part, dst_part = task.body.seq
    if DST in _names(acc_part) or _names(dst_part) != {DST}:
        return None
    loops, realize = _loops(dst_part)
    if not isinstance(realize, s_tir.SBlockRealize) or not loops \
            or not is_true(realize.predicate) \
            or loops[-1].kind != tirx.ForKind.VECTORIZED \
            or any(f.kind != tirx.ForKind.UNROLLED for f in loops[:-1]):
        return None
    loads = []
    tvm_ffi.structural_walk(realize.block.body, (TensorLoad, lambda x: loads.append(x)
                                                 if x.source.name == ACC else None))
    if not loads or any(not tvm_ffi.structural_equal(list(x.indices), list(loads[0].indices))
                        for x in loads):
        return None
    chain = _reduction_chain(acc_part)
    if chain is None:
        return None
    nest = _Nest(task, acc_part, chain, loops, realize, loads[0])
    return nest if nest.steps >= nest.vectors else None


def _rewrite(nest: _Nest, tiles: int):
    """``(new scratch buffers, the new task loop)``: ``tiles`` register tiles a task, each
    tile's epilogue spread over the next one's first reduction steps."""
    task, realize, extents = nest.task, nest.realize, nest.extents
    block, acc = realize.block, nest.acc_load.source
    prev = tirx.decl_buffer(extents, acc.dtype, ACC_PREV)
    w_vars = [tirx.Var(f"w{i}", "int32") for i in range(len(extents))]
    w_iters = [tirx.IterVar(Range(0, n), v, 0) for v, n in zip(w_vars, extents)]
    w_region = tirx.BufferRegion(prev, [Range.from_min_extent(v, 1) for v in w_vars])
    # dst reading the accumulator from prev (its element's place in the tile: new iterators
    # bound to dst's loops), and the copy of the accumulator into prev
    epi = s_tir.SBlock(
        list(block.iter_vars) + w_iters,
        [w_region if r.source.same_as(acc) else r for r in block.reads], block.writes,
        block.name_hint, tvm_ffi.structural_map(block.body, (TensorLoad, lambda x: tirx.BufferLoad(
            prev, w_vars) if x.source.same_as(acc) else x)))
    copy = s_tir.SBlock(list(block.iter_vars) + w_iters,
                        [next(r for r in block.reads if r.source.same_as(acc))], [w_region],
                        ACC_PREV, tirx.BufferStore(prev, nest.acc_load, w_vars))
    loop_vars = [f.loop_var for f in nest.loops]

    def around(blk, values=()):
        """``dst``'s nest around ``blk``, its outer loops set to ``values`` (constants)."""
        inner = s_tir.SBlockRealize(list(realize.iter_values) + loop_vars, realize.predicate,
                                    blk)
        fixed = {v: tirx.const(x, "int32") for v, x in zip(loop_vars, values)}
        return _renew(_wrap(nest.loops[len(values):], substitute(inner, fixed)))

    def vector(e):
        """Output vector ``e`` of a tile's epilogue (``dst``'s unrolled loops at ``e``)."""
        idx = []
        for n in reversed(extents[:-1]):
            idx.append(e % n)
            e //= n
        return around(epi, list(reversed(idx)))

    f = task.loop_var
    c, t = tirx.Var(f.name + "_c", f.ty), tirx.Var(f.name + "_t", f.ty)
    cur = c * tiles + t
    per_step = [[] for _ in range(nest.steps)]   # the previous tile's vectors, spread evenly
    for e in range(nest.vectors):
        per_step[e * nest.steps // nest.vectors].append(substitute(vector(e), {f: cur - 1}))
    copied = around(copy)
    # the first tile has no epilogue before it to interleave: its reduction as it was (a
    # branch on the tile instead kept LLVM from interleaving: it sank the dot products below
    # the guarded epilogue vectors), with its own accumulator buffer (one buffer accessed both
    # there and in the loop of tiles is allocated for every tile a task walks, in memory)
    acc0 = tirx.decl_buffer(acc.shape, acc.dtype, acc.name)
    first = _rebuffer(_renew(tirx.SeqStmt([substitute(nest.acc_part, {f: c * tiles}),
                                           substitute(copied, {f: c * tiles})])), acc, acc0)
    rest = tirx.For(t, 1, tiles - 1, tirx.ForKind.SERIAL, tirx.SeqStmt(
        [substitute(_interleave(nest.acc_part, nest.chain, per_step), {f: cur}),
         _renew(substitute(copied, {f: cur}))]))
    last = substitute(around(epi), {f: c * tiles + (tiles - 1)})   # from prev, after the loop
    return [prev, acc0], tirx.For(c, 0, int(task.extent) // tiles, tirx.ForKind.PARALLEL,
                                  tirx.SeqStmt([first, rest, last]), task.thread_binding,
                                  task.annotations)


_OPERATIONS = (tirx.Add, tirx.Sub, tirx.Mul, tirx.Div, tirx.Min, tirx.Max, tirx.Cast,
               tirx.Select, Call)


def _operations(value) -> int:
    """Arithmetic in ``value`` an element, the indices of its loads not counted."""
    value = tvm_ffi.structural_map(value, (TensorLoad, lambda x: tirx.Var("x", x.ty)))
    n = [0]
    for kind in _OPERATIONS:
        tvm_ffi.structural_walk(value, (kind, lambda _: n.__setitem__(0, n[0] + 1)))
    return n[0]


def _inner_steps(stmt) -> int:
    """Iterations of the serial loops around the accumulator's update inside ``stmt`` (a
    reduction chain's body: loops the chain stops at, e.g. behind a prefetch)."""
    if isinstance(stmt, tirx.SeqStmt):
        return next((_inner_steps(x) for x in stmt.seq if _updates(_names(x))), 1)
    if isinstance(stmt, tirx.For) and stmt.kind == tirx.ForKind.SERIAL:
        return int(stmt.extent) * _inner_steps(stmt.body)
    return 1


def _reduction_chain(acc_part):
    """``(loops, body)``: the serial loops of the reduction (the first serial ``For`` whose
    subtree holds the accumulator's update but not its init, and the serial loops directly
    inside it), and the body they wrap."""
    def outermost(stmt):
        if isinstance(stmt, tirx.SeqStmt):
            return next((x for x in map(outermost, stmt.seq) if x is not None), None)
        if not isinstance(stmt, tirx.For):
            return None
        names = _names(stmt)
        if stmt.kind == tirx.ForKind.SERIAL and _updates(names) \
                and not any(n.startswith(ACC + "_init") for n in names):
            return stmt
        return outermost(stmt.body)
    top = outermost(acc_part)
    if top is None:
        return None
    loops, stmt = [], top
    while isinstance(stmt, tirx.For) and stmt.kind == tirx.ForKind.SERIAL:
        loops.append(stmt)
        stmt = stmt.body
    return loops, stmt


def _interleave(acc_part, chain, per_step):
    """``acc_part`` with its reduction chain unrolled over the steps that run epilogue
    vectors (``per_step[s]`` after step ``s``), the rest left a loop."""
    loops, inner = chain
    ext = [int(f.extent) for f in loops]
    last = max(s for s, xs in enumerate(per_step) if xs) + 1
    block = math.prod(ext[1:])        # steps per iteration of the outermost loop
    peel = -(-last // block)          # outermost iterations unrolled
    stmts = []
    for s in range(peel * block):
        vals, r = [], s
        for n in reversed(ext):
            vals.append(r % n)
            r //= n
        vals.reverse()
        stmts.append(_renew(substitute(inner, {f.loop_var: tirx.const(v, f.loop_var.ty.dtype)
                                               for f, v in zip(loops, vals)})))
        stmts += per_step[s] if s < len(per_step) else []
    if peel < ext[0]:
        top = loops[0]
        stmts.append(_renew(tirx.For(top.loop_var, peel, ext[0] - peel, tirx.ForKind.SERIAL,
                                     top.body)))
    new = tirx.SeqStmt(stmts)
    head = loops[0]

    def visit(f):
        return new if f.same_as(head) else f
    return tvm_ffi.structural_map(acc_part, (tirx.For, visit))
