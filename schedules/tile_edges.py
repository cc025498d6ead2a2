"""Rewriting the TIR of a register-tiled convolution or matmul at its edges (the second half
of ``register_tiled``'s job; that module chooses and applies the tiles): a stage computed over
whole tiles (``whole_tiles``: clamped rows, columns into the blocked layout's padding), the
predicate of a scratch stage dropped (``unpredicated``), the last rows and columns cut off
into stage pairs of their own (``edge_parts``, through ``_cut``, ``_range`` and ``_shift``)
where tiling them with the rest would cost, and a last channel block that is half padding
computed in half vectors (``half_block``).
"""

from __future__ import annotations

import dataclasses

import tvm
import tvm_ffi
from tvm import s_tir, tirx
from tvm.sym.analyzer import Analyzer

from blockpad.vocabulary import ACC, DST

from .common import count_iters
from .nest import definitions, realizes, root_stmts, substitute, with_root

_realize = tvm.get_global_func("s_tir.schedule.GetSBlockRealize")
CLAMPED_ROWS = 6   # the most rows of a tile that may read a clamped row (``edge_parts``)


def edge_parts(func, cfg, panel=None, half=False):
    """(``func``, its ``[(acc, dst, Config)]`` stage pairs to tile): ``acc`` and ``dst``, and
    where whole tiles leave some over, the rest cut off (``_cut``) as pairs of their own:

    * the last output-channel blocks that ``cfg.mu`` blocks per tile leave over (13 = 6 x 2 + 1,
      a channel-pruned network's 206 channels in blocks of 16), along the spatial dim
      ``panel`` (counted from the last, as ``extent``'s ``back``), as a part with fewer blocks
      per tile: 1x1 860 -> 206 at 14x14 0.74 -> 0.59 ms against one-block tiles over all 13,
      377 -> 166 at 28x28 1.20 -> 0.92, 860 -> 450 at 14x14 1.83 -> 1.30 (Cascade Lake,
      avx512, 1 thread, the kernels alternating);
    * the last rows (257 = 32 x 8 + 1) of a tile taller than ``CLAMPED_ROWS``: tiled with the
      others, each row of a tile reads ``src[min(row, last)]``, an address of its own (not
      base + constant), and past 6 of them LLVM spills the unrolled loop (AVX-512, 8 x 32
      tiles: 0.92x numpy at 257 rows, 1.15x at 264; 6 x 32 tiles: as fast at 257 as at 258);
    * the last, partial panel of columns (1000 = 31 x 32 + 8), tiled in whole vectors, where
      it ends inside a vector or the sources do not extend to a whole panel: tiled with the
      others, its store is predicated per lane, and TVM scalarises a predicated vector store,
      in every tile of the nest (AVX-512: 7% of the time at 257 x 511 x 1023), or the tiles
      fall back to one vector (25% at 1000^3). A panel that overhangs by whole vectors
      (1000 = 62 x 16 + 8 on AVX2) keeps them: their predicate is the same for every lane, the
      stores stay vector stores."""
    func, parts = panel_parts(func, cfg, panel, half=half)
    rows = extent(func, DST, 2)
    if cfg.mr > CLAMPED_ROWS and rows > cfg.mr and rows % cfg.mr:
        for acc, dst, c in list(parts):
            func = _cut(func, acc, dst, 2, rows // cfg.mr * cfg.mr, "_rows")
            parts.append((acc + "_rows", dst + "_rows", dataclasses.replace(c, mr=rows % cfg.mr)))
    cols = extent(func, DST, 1)
    if cfg.nr < cols and cols % cfg.nr and (
            cols % cfg.lanes or not whole_tiles(func, ACC, cfg.mr, cfg.nr)[1]):
        for acc, dst, c in list(parts):
            func = _cut(func, acc, dst, 1, cols // cfg.nr * cfg.nr, "_cols")
            nr = -(-(cols % cfg.nr) // cfg.lanes) * cfg.lanes
            parts.append((acc + "_cols", dst + "_cols", dataclasses.replace(c, nr=nr)))
    return func, parts


def panel_parts(func, cfg, panel, acc=ACC, dst=DST, half=False):
    """(``func``, ``[(acc, dst, cfg)]`` and, where ``cfg.mu`` blocks a tile leave some of the
    ``panel`` dim's blocks over, the part that takes them): ``edge_parts``'s first cut, also
    the Winograd GEMM's (schedules/winograd.py). ``half``: the last block computed in half
    vectors where its second half is padding (``half_block``)."""
    halved = half_block(func, cfg, panel, acc, dst) if half else None
    if halved is not None:
        func, half_part = halved
        func, parts = panel_parts(func, cfg, panel, acc, dst)
        return func, [*parts, half_part]
    blocks = extent(func, dst, panel) if panel is not None else 1
    if blocks < cfg.mu:   # what ``half_block`` left of two blocks
        return func, [(acc, dst, dataclasses.replace(cfg, mu=blocks))]
    parts = [(acc, dst, cfg)]
    if cfg.mu > 1 and blocks % cfg.mu:
        func = _cut(func, acc, dst, panel, blocks // cfg.mu * cfg.mu, "_panels")
        parts.append((acc + "_panels", dst + "_panels",
                      dataclasses.replace(cfg, mu=blocks % cfg.mu)))
    return func, parts


def half_block(func, cfg, panel, acc=ACC, dst=DST):
    """(``func`` with the last block of the ``panel`` dim cut off into a pair of its own
    computed in vectors of half the lanes, ``(acc, dst, cfg)`` of that pair), or None. Taken
    where a vector is one whole channel block and the block's second half is all padding
    whose value ``dst`` does not read from ``acc`` (a ``select`` plan stores zeros there, a
    ``valid`` one nothing): 213 channels are 13 blocks of 16 and 5 channels, which 8 lanes
    hold. The padding half becomes a store of its value (``_drop_dead_acc``); the reduction
    runs over the first half only. On cores that run a 512-bit FMA as two 256-bit halves
    (Zen 4) a ymm FMA costs half a zmm one (``blockpad.channel_blocks``)."""
    lanes = cfg.lanes
    if panel is None or cfg.nr != lanes or lanes % 2 or extent(func, dst, 1) != lanes:
        return None
    blocks = extent(func, dst, panel)
    if blocks < 2:
        return None
    cut = _cut(func, acc, dst, panel, blocks - 1, "_half")
    a, d = acc + "_half", dst + "_half"
    cut = _drop_dead_acc(_cut(cut, a, d, 1, lanes // 2, "_pad"), a + "_pad", d + "_pad")
    if cut is None:
        return None
    return cut, (a, d, dataclasses.replace(cfg, nr=lanes // 2, mu=1))


def _drop_dead_acc(func, acc, dst):
    """``func`` without stage ``acc`` where ``dst`` never reads it over its ranges (its value
    there a constant, or its predicate false: then without ``dst`` too), else None."""
    realize = realize_of(func, dst)
    blk = realize.block
    acc_buf = realize_of(func, acc).block.writes[0].source
    ana = Analyzer()
    loops = []
    tvm_ffi.structural_map(func.body, (tirx.For, lambda f: loops.append(f) or f))
    for f in loops:
        ana.bind(f.loop_var, tvm.ir.Range.from_min_extent(f.min, f.extent))
    for iv in blk.iter_vars:
        ana.bind(iv.var, iv.dom)
    store = blk.body
    if not isinstance(store, tirx.BufferStore):
        return None
    value = ana.simplify(store.value)
    reads = []
    tvm_ffi.structural_map(value, (tvm.ir.expr.TensorLoad, lambda l: reads.append(l) or l))
    dead = ana.can_prove(tirx.Not(realize.predicate))
    if not dead and any(r.source.same_as(acc_buf) for r in reads):
        return None
    blk = s_tir.SBlock(blk.iter_vars, [r for r in blk.reads
                                       if any(r.source.same_as(x.source) for x in reads)],
                       blk.writes, blk.name_hint,
                       tirx.BufferStore(store.buffer, value, store.indices), blk.init,
                       blk.alloc_buffers, blk.match_buffers, blk.annotations)
    body = []
    for stmt in root_stmts(func):
        names = [r.block.name_hint for r in realizes(stmt)]
        if acc in names or dead and dst in names:
            continue
        body.append(tvm_ffi.structural_map(stmt, (s_tir.SBlockRealize, lambda r: r if
                    r.block.name_hint != dst else s_tir.SBlockRealize(r.iter_values,
                                                                      r.predicate, blk))))
    return with_root(func, body, [b for b in func.body.block.alloc_buffers
                                  if not b.same_as(acc_buf)])


def extent(func, name, back) -> int:
    """The extent of block ``name``'s ``back``-th spatial dim from the last (1: the vector
    dim, 2: the register-tile dim)."""
    block = realize_of(func, name).block
    n_sp = count_iters(block)
    return int(block.iter_vars[n_sp - back].dom.extent)


def whole_tiles(func, name, mr, nr):
    """(``func`` with its stage ``name`` (an ``acc``) computed over whole ``mr x nr`` tiles,
    whether its columns are whole too). The register-tile dim is rounded up to ``mr`` (the
    extra rows read the last real row: clamped, in bounds) and the vector dim to ``nr`` where
    every source read stays inside its buffer (a blocked layout's padding), so the hot loop
    has no predicated tail; only the destination stage, outside the reduction, keeps the
    predicate. The stage's buffer is the kernel's own scratch: what the extra rows and columns
    hold is never stored."""
    realize = realize_of(func, name)
    blk = realize.block
    n_sp = count_iters(blk)
    acc_buf = blk.writes[0].source
    ext = [int(iv.dom.extent) for iv in blk.iter_vars]
    new = list(ext)
    t, v = n_sp - 2, n_sp - 1
    new[t] = -(-ext[t] // mr) * mr
    new[v] = -(-ext[v] // nr) * nr
    t_var = blk.iter_vars[t].var
    clamp = tirx.min(t_var, ext[t] - 1)

    def clamped(load):
        if load.source.same_as(acc_buf):
            return load
        return tirx.BufferLoad(load.source, [tvm_ffi.structural_map(
            i, (tirx.Var, lambda x: clamp if x.same_as(t_var) else x)) for i in load.indices])

    body = tvm_ffi.structural_map(blk.body, (tvm.ir.expr.TensorLoad, clamped))
    if new[v] != ext[v] and not _in_bounds(blk, body, acc_buf, new):
        new[v] = ext[v]
    whole = new[v] % nr == 0 or nr >= ext[v]
    if new == ext:
        return func, whole
    loop_ext = {realize.iter_values[d]: (ext[d], new[d]) for d in range(n_sp)
                if new[d] != ext[d]}
    reads = [tirx.BufferRegion(r.source, [
        tvm.ir.Range.from_min_extent(tvm_ffi.structural_map(
            x.min, (tirx.Var, lambda y: clamp if y.same_as(t_var) else y)), x.extent)
        for x in r.region]) if not r.source.same_as(acc_buf) else r for r in blk.reads]
    iter_vars = [tirx.IterVar(tvm.ir.Range(0, n), iv.var, iv.iter_type)
                 for iv, n in zip(blk.iter_vars, new)]
    blk = s_tir.SBlock(iter_vars, reads, blk.writes, blk.name_hint, body, blk.init,
                       blk.alloc_buffers, blk.match_buffers, blk.annotations)
    grown = tirx.decl_buffer([*new[:n_sp]], str(acc_buf.ty.dtype), acc_buf.name)

    def swap_realize(r):
        if r.block.name_hint == name:
            return s_tir.SBlockRealize(r.iter_values, r.predicate, blk)
        return r

    def swap_loop(loop):
        for var, (old, n) in loop_ext.items():
            if loop.loop_var.same_as(var) and int(loop.extent) == old:
                return tirx.For(loop.loop_var, loop.min, n, loop.kind, loop.body,
                                loop.thread_binding, loop.annotations)
        return loop

    func = tvm_ffi.structural_map(func, [(s_tir.SBlockRealize, swap_realize), (tirx.For, swap_loop)])
    return tvm_ffi.structural_map(func, (tirx.Var, lambda x: grown if x.same_as(acc_buf) else x)), \
        whole


def realize_of(func, name):
    """The ``SBlockRealize`` of block ``name`` in ``func``."""
    return next(r for r in realizes(func) if r.block.name_hint == name)


def _cut(func, acc, dst, back, width, suffix):
    """``func`` with stages ``acc`` and ``dst`` cut at ``width`` along their ``back``-th
    spatial dim from the last: they keep the first ``width``; copies named with ``suffix``
    take the rest, counting it from ``width``, into a scratch buffer of their own, so that
    they are tiled apart (``edge_parts`` says why)."""
    acc_buf = realize_of(func, acc).block.writes[0].source
    shape = [int(x) for x in acc_buf.ty.shape]
    d = len(shape) - back
    edge_buf = tirx.decl_buffer([*shape[:d], shape[d] - width, *shape[d + 1:]],
                                str(acc_buf.ty.dtype), acc_buf.name + suffix)
    main, edge, last = [], [], 0
    for stmt in root_stmts(func):
        if any(r.block.name_hint in (acc, dst) for r in realizes(stmt)):
            main.append(_range(stmt, back, width))
            edge.append(_range(stmt, back, width, suffix, {acc_buf: edge_buf}))
            last = len(main)
        else:
            main.append(stmt)
    # the copies right after the pair: a later stage may read what ``dst`` writes
    return with_root(func, main[:last] + edge + main[last:],
                     [*func.body.block.alloc_buffers, edge_buf])


def _range(nest, back, start, suffix=None, scratch=None):
    """The loop nest ``nest`` (loops around one block) with its block's ``back``-th spatial dim
    from the last cut: below ``start`` if ``suffix`` is None, else from ``start`` on, as a
    copy (fresh variables, the block's name + ``suffix``) that counts that dim from ``start``
    (every index and the block's predicate shifted by ``start``, but the indices of the
    ``scratch`` buffers, which it swaps: ``{old: new}``)."""
    realize = realizes(nest)
    ivs = realize[0].block.iter_vars
    d = count_iters(realize[0].block) - back
    loop_var, var, extent = realize[0].iter_values[d], ivs[d].var, int(ivs[d].dom.extent)
    if suffix is not None:
        fresh = {x: tirx.Var(x.name, x.ty) for x in definitions(nest)}
        fresh.update(scratch)
        nest = tvm_ffi.structural_map(
            nest, (tirx.Var, lambda x: next((n for o, n in fresh.items() if o.same_as(x)), x)))
        loop_var, var = fresh[loop_var], fresh[var]
        nest = _shift(nest, var, start, list(scratch.values()))
    n = start if suffix is None else extent - start

    def loop(f):
        if not f.loop_var.same_as(loop_var):
            return f
        return tirx.For(f.loop_var, f.min, n, f.kind, f.body, f.thread_binding, f.annotations)

    def block(r):
        b = r.block
        iter_vars = [tirx.IterVar(tvm.ir.Range(0, n), iv.var, iv.iter_type)
                     if iv.var.same_as(var) else iv for iv in b.iter_vars]
        b = s_tir.SBlock(iter_vars, b.reads, b.writes, b.name_hint + (suffix or ""), b.body,
                         b.init, b.alloc_buffers, b.match_buffers, b.annotations)
        predicate = r.predicate if suffix is None else tvm_ffi.structural_map(
            r.predicate, (tirx.Var, lambda x: x + start if x.same_as(loop_var) else x))
        return s_tir.SBlockRealize(r.iter_values, predicate, b)

    return tvm_ffi.structural_map(nest, [(tirx.For, loop), (s_tir.SBlockRealize, block)])


def _shift(nest, var, offset, keep):
    """``nest`` with its blocks reading ``var`` as ``var + offset`` everywhere (indices, regions
    and the guards of fused spatial padding or channel tails alike) but in the indices and
    regions of the buffers of ``keep``."""
    held = tirx.Var(var.name + "_kept", var.ty)   # ``var`` where ``keep``'s indices use it

    def kept(buf):
        return any(buf.same_as(k) for k in keep)

    def hold_load(l):
        return tirx.BufferLoad(l.source, [substitute(i, {var: held}) for i in l.indices]) \
            if kept(l.source) else l

    def hold_store(st):
        return tirx.BufferStore(st.buffer, st.value,
                                [substitute(i, {var: held}) for i in st.indices]) \
            if kept(st.buffer) else st

    def shifted(stmt):
        stmt = tvm_ffi.structural_map(stmt, [(tvm.ir.expr.TensorLoad, hold_load),
                                             (tirx.BufferStore, hold_store)])
        return substitute(substitute(stmt, {var: var + offset}), {held: var})

    def region(r):
        return r if kept(r.source) else tirx.BufferRegion(r.source, [
            tvm.ir.Range.from_min_extent(substitute(x.min, {var: var + offset}), x.extent)
            for x in r.region])

    def block(b):
        return s_tir.SBlock(b.iter_vars, [region(r) for r in b.reads],
                            [region(r) for r in b.writes], b.name_hint, shifted(b.body),
                            shifted(b.init) if b.init is not None else None, b.alloc_buffers,
                            b.match_buffers, b.annotations)

    return tvm_ffi.structural_map(nest, (s_tir.SBlock, block))


def _in_bounds(blk, body, acc_buf, extents) -> bool:
    """Whether every source read of ``body`` stays inside its buffer over ``extents``."""
    ana = Analyzer()
    for iv, n in zip(blk.iter_vars, extents):
        ana.bind(iv.var, tvm.ir.Range(0, n))
    loads = []
    tvm_ffi.structural_map(body, (tvm.ir.expr.TensorLoad, lambda l: loads.append(l) or l))
    for load in loads:
        if load.source.same_as(acc_buf):
            continue
        for i, n in zip(load.indices, load.source.ty.shape):
            b = ana.const_int_bound(i)
            if b.min_value < 0 or b.max_value >= int(n):
                return False
    return True


def unpredicated(func, name):
    """``func`` with block ``name`` computed everywhere (the ``valid`` plan predicates both
    stages to the logical elements, which no tiling primitive accepts): ``acc`` is the kernel's
    own scratch, its values at padding are never stored, and its reads are guarded for the whole
    padded index space anyway (``Source`` derives guards from index ranges, not predicates)."""
    def drop(realize):
        if realize.block.name_hint != name:
            return realize
        return s_tir.SBlockRealize(realize.iter_values, tirx.const(True, "bool"), realize.block)

    return tvm_ffi.structural_map(func, (s_tir.SBlockRealize, drop))
