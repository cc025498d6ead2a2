"""CPU schedules (x86 AVX2 and AVX-512, Arm NEON) for convolution and matmul: a register-tiled
direct kernel.

Both ops come from ``codegen.ops.common.materialize`` as two stages over the destination's
physical index space: ``acc`` (the reduction) and ``dst`` (post-ops, cast, padding store). The
micro-kernel is the classic one (oneDNN's jit convolutions, BLIS):

* the destination's innermost physical dim (the channel block of ``nChw16c``, a panel of
  matmul columns) is the vector dim, ``nr`` elements in one or two registers; the dim outside
  it (``ow``, matmul rows) gives ``mr`` rows; for convolutions the output-channel block dim
  may add ``mu = 2`` blocks, so each broadcast source element meets ``mu x nr / lanes``
  weight vectors: ``mu x mr x nr`` accumulators (AVX2: 6 x 16 = 12 ymm; AVX-512: 2 x 8 x 16 =
  16 zmm, past which LLVM spills the unrolled loop);
* ``dst`` is tiled so, and ``acc`` is computed per tile (``compute_at``) into a tile-sized
  local buffer that LLVM keeps in registers: zeroed, then the reduction, whose loops sit
  between the tile's outer and inner loops with the one that walks the source's channel block
  innermost and unrolled (kh, kw outside it), so that each step is broadcast, weight loads and
  FMAs (``vbroadcastss`` + ``vfmadd231ps``); then the epilogue (post-ops, cast, padding store)
  on the registers;
* no guard or predicate in the hot loop: spatial padding fused into the reads (``if_then_else``
  per broadcast) is staged into a zero-haloed copy of the source, a stage of the kernel
  (``halo.staged_source``: one pass over the source against a branch per FMA pair), and a tile that
  overhangs its dim is computed whole (``_whole_tiles``: rows past the end read the last row,
  columns past the end read the blocked layout's padding); only the destination store is
  predicated. Where that costs (a partial last panel of columns: TVM scalarises its predicated
  vector store; tall tiles over clamped rows: LLVM spills), the last rows and columns are cut off
  into kernels of their own (``_edge_parts``); the innermost reduction loop is unrolled by 16
  with its tail peeled off where no divisor of its extent is near 16 (``_unrolled``: k = 511);
* the loops outside the tile run in parallel, fused into one (TVM's pool gives each thread a
  contiguous chunk); a panel of columns outside the rows, so its weights stay in cache while the
  rows stream past.

Tile shapes are ranked by a small model (``_tile_score``: enough accumulators to hide the FMA
latency, loads per FMA, work past the end), calibrated by measurement on the benchmark shapes
of ``examples/bench_host.toml``; ``RegisterTiled.space`` hands the ranked variants (tile shapes,
vectors per tile, rolled channel loop, what the threads split) to MetaSchedule.

The rule reads loops and index expressions, never layout tags, and takes every conv and matmul;
shapes no variant tiles whole (plain weights with a ragged column count) get a predicated tail,
slower, never wrong. It returns None (generic fallback) only if a schedule primitive refuses
the nest.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import tvm
import tvm_ffi
from tvm import s_tir, tirx
from tvm.sym.analyzer import Analyzer

from blockpad.vocabulary import ACC, DST

from .common import is_true, vector_lanes
from .generic import root_blocks, spatial_parallel_vectorize
from .halo import staged_source
from .nest import substitute
from .rule import ScheduleRule, distinct

_realize = tvm.get_global_func("s_tir.schedule.GetSBlockRealize")
SPATIAL, REDUCE = 0, 2   # IterVar types
UNROLL = 16        # the innermost reduction loop is unrolled up to this many steps
CLAMPED_ROWS = 6   # the most rows of a tile that may read a clamped row (``_edge_parts``)


@dataclass(frozen=True)
class Config:
    """One variant of the micro-kernel: ``mu`` x ``mr`` x ``nr`` accumulators (``nr`` elements
    of the vector dim in vectors of ``lanes``, ``mr`` steps of the dim outside it, ``mu`` blocks
    of output channels: each broadcast source element meets ``mu`` weight blocks), whether the
    innermost reduction loop (the source's channel block) is unrolled, and whether the threads
    split the tiles of a row (more, smaller tasks) or only the rows and column panels (each
    thread keeps a row's source lines in its own cache)."""

    mr: int
    nr: int
    lanes: int
    unroll: bool = True
    parallel_tiles: bool = True
    mu: int = 1


class RegisterTiled(ScheduleRule):
    ops = ("conv2d", "matmul")

    def schedule(self, func, target):
        space = self.space(func, target, first=True)
        return space[0] if space else None

    def space(self, func, target, first=False) -> list:
        """Complete, valid schedules of ``func``, the first one ``schedule``'s: the design spaces
        ``schedules/space.py`` hands MetaSchedule (register tile shapes, one or two vectors of
        columns, unrolled or rolled channel loop, what the threads split), each once: two
        Configs can schedule alike (what the threads split, where the whole panels are one).
        ``first``: stop at the first that schedules."""
        configs = self.configs(func, target)
        for tails in (False, True):     # a predicated column tail only where nothing else fits
            out = distinct((_schedule(func, target, cfg, tails) for cfg in configs), first)
            if out:
                return out
        return []

    def configs(self, func, target) -> list:
        """The default Config first, then its neighbours; [] if ``func`` is not this rule's."""
        if not self.takes(func, target):
            return []
        shape = _nest_shape(func)
        if shape is None:
            return []
        t_extent, v_extent, dtype, predicated, u_extent = shape
        return tile_configs(t_extent, v_extent, u_extent, vector_lanes(target, dtype),
                            target.tile_registers, predicated)


def tile_configs(t_extent, v_extent, u_extent, lanes, regs, predicated=False) -> list:
    """The ranked micro-kernel Configs of a nest: ``t_extent`` rows, ``v_extent`` columns,
    ``u_extent`` column blocks outside the tile (1: none), ``regs`` vector registers; the best
    first, then its neighbours (also the GEMM of schedules/winograd.py)."""
    widths = [v_extent] if predicated else _tile_widths(v_extent, lanes)
    out = []
    for nr in widths:
        for mu in (1, 2) if u_extent % 2 == 0 and not predicated else (1,):
            vecs = mu * -(-nr // lanes)
            most = max(1, _accumulators(regs, vecs)[0] // vecs)
            busy = -(-_accumulators(regs, vecs)[1] // vecs)
            out += [Config(mr, nr, lanes, mu=mu) for mr in _tile_heights(t_extent, most, busy)]
    out.sort(key=lambda c: (-round(_tile_score(c, t_extent, v_extent, lanes, regs), 3),
                            -c.nr, c.mu))
    best = out[0]
    out += [Config(best.mr, best.nr, lanes, unroll=False, mu=best.mu),
            Config(best.mr, best.nr, lanes, parallel_tiles=False, mu=best.mu)]
    return out


def _schedule(func, target, cfg: Config, tails=False):
    """The schedule of ``cfg``, or None where it would leave a predicated vector tail in the
    hot loop (columns past the end that no source pads, which TVM scalarises) unless
    ``tails``, or where a primitive refuses the nest. Rows and columns that whole tiles do not
    cover are, where that pays, kernels of their own (``_edge_parts``)."""
    func, parts = _edge_parts(staged_source(_unpredicated(func, ACC)), cfg)
    whole = True
    for i, (acc, dst, c) in enumerate(parts):
        func, part_whole = _whole_tiles(func, acc, c.mr, c.nr)
        whole = whole and part_whole
        parts[i] = (acc, dst, dataclasses.replace(c, nr=min(c.nr, _extent(func, acc, 1))))
    if not whole and not tails:
        return None
    sch = s_tir.Schedule(func)
    names = {name for part in parts for name in part[:2]}
    try:
        stages = [b for b in root_blocks(sch) if sch.get(b).name_hint not in names]
        for acc, dst, c in parts:
            _tile(sch, sch.get_sblock(acc), sch.get_sblock(dst), c)
        for block in stages:   # a spatial padding stage, if the kernel has one
            spatial_parallel_vectorize(sch, block, target)
    except s_tir.ScheduleError:
        return None
    return sch


def _edge_parts(func, cfg: Config):
    """(``func``, its ``[(acc, dst, Config)]`` stage pairs to tile): ``acc`` and ``dst``, and
    where whole tiles leave some over, the rest cut off (``_cut``) as pairs of their own:

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
    parts = [(ACC, DST, cfg)]
    rows = _extent(func, DST, 2)
    if cfg.mr > CLAMPED_ROWS and rows > cfg.mr and rows % cfg.mr:
        func = _cut(func, ACC, DST, 2, rows // cfg.mr * cfg.mr, "_rows")
        parts.append(("acc_rows", "dst_rows", dataclasses.replace(cfg, mr=rows % cfg.mr)))
    cols = _extent(func, DST, 1)
    if cfg.nr < cols and cols % cfg.nr and (
            cols % cfg.lanes or not _whole_tiles(func, ACC, cfg.mr, cfg.nr)[1]):
        for acc, dst, c in list(parts):
            func = _cut(func, acc, dst, 1, cols // cfg.nr * cfg.nr, "_cols")
            nr = -(-(cols % cfg.nr) // cfg.lanes) * cfg.lanes
            parts.append((acc + "_cols", dst + "_cols", dataclasses.replace(c, nr=nr)))
    return func, parts


def _extent(func, name, back) -> int:
    """The extent of block ``name``'s ``back``-th spatial dim from the last (1: the vector
    dim, 2: the register-tile dim)."""
    block = _realize_of(func, name).block
    n_sp = sum(1 for iv in block.iter_vars if int(iv.iter_type) == SPATIAL)
    return int(block.iter_vars[n_sp - back].dom.extent)


def _nest_shape(func):
    """(extent of the register-tile dim, of the vector dim, accumulator dtype, whether the
    destination stage is predicated) or None if the nest is not the kernel's shape."""
    sch = s_tir.Schedule(func)
    try:
        acc, dst = sch.get_sblock(ACC), sch.get_sblock(DST)
    except s_tir.ScheduleError:
        return None
    block = sch.get(acc)
    kinds = [int(iv.iter_type) for iv in block.iter_vars]
    n_sp, n_red = kinds.count(SPATIAL), kinds.count(REDUCE)
    loops = sch.get_loops(dst)
    if n_sp < 2 or kinds != [SPATIAL] * n_sp + [REDUCE] * n_red or len(loops) != n_sp:
        return None
    extents = [int(sch.get(l).extent) for l in loops]
    # a predicated block (the valid plan's) can be split but not reordered: its columns stay whole
    pred = _realize(sch, dst).predicate
    predicated = not is_true(pred)
    u = _weights_block_dim(block, n_sp)
    return (extents[-2], extents[-1], str(block.writes[0].source.dtype), predicated,
            extents[u] if u is not None else 1)


def _weights_block_dim(block, n_sp):
    """The destination dim outside the tile that only the weights depend on (the output
    channel block of ``nChw16c``), or None."""
    def uses(region, var):
        return any(any(u.same_as(var) for u in tirx.analysis.undefined_vars(r.min))
                   for r in region.region)
    if len(block.reads) < 2:
        return None
    for d, iv in enumerate(block.iter_vars[:n_sp - 2]):
        if int(iv.dom.extent) > 1 and not uses(block.reads[0], iv.var) \
                and uses(block.reads[1], iv.var):
            return d
    return None


def _tile(sch, acc, dst, cfg: Config):
    """Tile ``dst`` in ``mr x nr`` tiles and compute ``acc`` per tile as the register-tiled
    micro-kernel."""
    n_dims = len(sch.get_loops(dst))
    u = _weights_block_dim(sch.get(acc), n_dims) if cfg.mu > 1 else None
    outer = _tile_loops(sch, dst, cfg, u)
    sch.compute_at(acc, outer[-1], preserve_unit_loops=True)
    sch.set_scope(acc, 0, "local")
    threads = outer if cfg.parallel_tiles or len(outer) < 2 else outer[:-1]
    _micro_kernel(sch, acc, dst, threads, u, n_dims, cfg)


def _tile_loops(sch, dst, cfg: Config, u) -> list:
    """Split ``dst``'s loops into ``mr x nr`` (x ``mu``) tiles; return the loops outside the
    tile: column panels outermost, the tile's rows last."""
    loops = sch.get_loops(dst)
    v_extent = int(sch.get(loops[-1]).extent)
    *outer, t, v = loops
    tile = []
    if u is not None:
        outer[u], u_inner = sch.split(outer[u], [None, cfg.mu])
        tile.append(u_inner)
    t_outer, t = sch.split(t, [None, cfg.mr])
    if cfg.nr != v_extent:   # nr > v_extent: a cut-off partial panel, in whole vectors
        v_outer, v = sch.split(v, [None, cfg.nr])
        outer.append(v_outer)
    if tile or cfg.nr != v_extent:   # a predicated block refuses even a no-op reorder
        sch.reorder(*outer, t_outer, *tile, t, v)
    return [*outer, t_outer]


def _micro_kernel(sch, acc, dst, threads, u, n_dims, cfg: Config):
    """Schedule one tile of ``dst`` (``acc`` computed at it) as the micro-kernel: the
    reduction loops between the tile's outer and inner loops, the source's channel block
    innermost and unrolled, the tile's rows unrolled, its columns in vectors; ``threads``
    fused and parallel."""
    block = sch.get(acc)
    n_red = sum(1 for iv in block.iter_vars if int(iv.iter_type) == REDUCE)
    n_tile = 3 if u is not None else 2
    tile = sch.get_loops(dst)[-n_tile:]
    acc_loops = sch.get_loops(acc)[:-n_red]
    at, av = acc_loops[-2:]
    a_tile = [acc_loops[len(acc_loops) - n_dims + u]] if u is not None else []
    reduce = sch.get_loops(acc)[-n_red:]
    split = _innermost_reduction(block, [int(sch.get(l).extent) for l in reduce])
    if split is not None:
        i, b = split
        parts = sch.split(reduce[i], [None, b]) if b < int(sch.get(reduce[i]).extent) \
            else [reduce[i]]
        reduce = [*reduce[:i], *parts[:-1], *reduce[i + 1:], parts[-1]]
    sch.reorder(*reduce, *a_tile, at, av)
    sch.parallel(sch.fuse(*threads) if len(threads) > 1 else threads[0])
    if cfg.unroll:
        reduce[-1:] = _unrolled(sch, reduce[-1])
        sch.reorder(*reduce, *a_tile, at, av)
    for loop in (*a_tile, at):
        sch.unroll(loop)
    _vectors(sch, av, cfg.lanes)           # before decompose_reduction (docs/tvm-0.27-notes.md 4)
    init = sch.decompose_reduction(acc, reduce[0])
    init_loops = sch.get_loops(init)
    init_tile = [init_loops[len(init_loops) - n_dims + u]] if u is not None else []
    for rows, bv in ((init_tile + init_loops[-2:-1], init_loops[-1]), (tile[:-1], tile[-1])):
        for loop in rows:
            sch.unroll(loop)
        _vectors(sch, bv, cfg.lanes)


def _unrolled(sch, loop) -> list:
    """``loop`` (the innermost reduction loop) unrolled: whole if short, else by ``UNROLL``
    steps, or by a divisor of its extent of at least half that (matmul's k = 1000: by 8). An
    extent with no such divisor (k = 511) is split by ``UNROLL`` with a tail, which TVM's loop
    partitioning peels off (``pragma_loop_partition_hint``): a loop rolled step by step
    recomputes the clamped row addresses at every step (47% of the AVX-512 peak)."""
    n = int(sch.get(loop).extent)
    loops = [loop]
    if n > UNROLL:
        b = math.gcd(UNROLL, n)
        b = b if 2 * b >= UNROLL else UNROLL
        loops = list(sch.split(loop, [None, b]))
        if n % b:
            sch.annotate(loops[0], "pragma_loop_partition_hint", 1)
    sch.unroll(loops[-1])
    return loops


def _vectors(sch, loop, lanes):
    """Vectorise ``loop`` one register at a time: a single vector over two blocks of a
    blocked dim (32 columns of ``Ba16b`` weights) would be a gather."""
    if int(sch.get(loop).extent) > lanes:
        outer, loop = sch.split(loop, [None, lanes])
        sch.unroll(outer)
    sch.vectorize(loop)


def _whole_tiles(func, name, mr, nr):
    """(``func`` with its stage ``name`` (an ``acc``) computed over whole ``mr x nr`` tiles,
    whether its columns are whole too). The register-tile dim is rounded up to ``mr`` (the
    extra rows read the last real row: clamped, in bounds) and the vector dim to ``nr`` where
    every source read stays inside its buffer (a blocked layout's padding), so the hot loop
    has no predicated tail; only the destination stage, outside the reduction, keeps the
    predicate. The stage's buffer is the kernel's own scratch: what the extra rows and columns
    hold is never stored."""
    realize = _realize_of(func, name)
    blk = realize.block
    n_sp = sum(1 for iv in blk.iter_vars if int(iv.iter_type) == SPATIAL)
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


def _realize_of(func, name):
    """The ``SBlockRealize`` of block ``name`` in ``func``."""
    realizes = []
    tvm_ffi.structural_map(func, (s_tir.SBlockRealize, lambda r: realizes.append(r) or r))
    return next(r for r in realizes if r.block.name_hint == name)


def _cut(func, acc, dst, back, width, suffix):
    """``func`` with stages ``acc`` and ``dst`` cut at ``width`` along their ``back``-th
    spatial dim from the last: they keep the first ``width``; copies named with ``suffix``
    take the rest, counting it from ``width``, into a scratch buffer of their own, so that
    they are tiled apart (``_edge_parts`` says why)."""
    root = func.body.block
    stmts = list(root.body) if isinstance(root.body, tirx.SeqStmt) else [root.body]
    acc_buf = _realize_of(func, acc).block.writes[0].source
    shape = [int(x) for x in acc_buf.ty.shape]
    d = len(shape) - back
    edge_buf = tirx.decl_buffer([*shape[:d], shape[d] - width, *shape[d + 1:]],
                                str(acc_buf.ty.dtype), acc_buf.name + suffix)
    main, edge = [], []
    for stmt in stmts:
        realizes = []
        tvm_ffi.structural_map(stmt, (s_tir.SBlockRealize,
                                      lambda r: realizes.append(r) or r))  # noqa: B023 (run now)
        if any(r.block.name_hint in (acc, dst) for r in realizes):
            main.append(_range(stmt, back, width))
            edge.append(_range(stmt, back, width, suffix, {acc_buf: edge_buf}))
        else:
            main.append(stmt)
    root = s_tir.SBlock(root.iter_vars, root.reads, root.writes, root.name_hint,
                        tirx.SeqStmt(main + edge), root.init, [*root.alloc_buffers, edge_buf],
                        root.match_buffers, root.annotations)
    return func.with_body(s_tir.SBlockRealize(func.body.iter_values, func.body.predicate, root))


def _range(nest, back, start, suffix=None, scratch=None):
    """The loop nest ``nest`` (loops around one block) with its block's ``back``-th spatial dim
    from the last cut: below ``start`` if ``suffix`` is None, else from ``start`` on, as a
    copy (fresh variables, the block's name + ``suffix``) that counts that dim from ``start``
    (every index and the block's predicate shifted by ``start``, but the indices of the
    ``scratch`` buffers, which it swaps: ``{old: new}``)."""
    realize = []
    tvm_ffi.structural_map(nest, (s_tir.SBlockRealize, lambda r: realize.append(r) or r))
    ivs = realize[0].block.iter_vars
    d = sum(1 for iv in ivs if int(iv.iter_type) == SPATIAL) - back
    loop_var, var, extent = realize[0].iter_values[d], ivs[d].var, int(ivs[d].dom.extent)
    if suffix is not None:
        loops = []
        tvm_ffi.structural_map(nest, (tirx.For, lambda f: loops.append(f.loop_var) or f))
        fresh = {x: tirx.Var(x.name, x.ty) for x in [*loops, *(iv.var for iv in ivs)]}
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


def _unpredicated(func, name):
    """``func`` with block ``name`` computed everywhere (the ``valid`` plan predicates both
    stages to the logical elements, which no tiling primitive accepts): ``acc`` is the kernel's
    own scratch, its values at padding are never stored, and its reads are guarded for the whole
    padded index space anyway (``Source`` derives guards from index ranges, not predicates)."""
    def drop(realize):
        if realize.block.name_hint != name:
            return realize
        return s_tir.SBlockRealize(realize.iter_values, tirx.const(True, "bool"), realize.block)

    return tvm_ffi.structural_map(func, (s_tir.SBlockRealize, drop))


def _accumulators(regs: int, vecs: int) -> tuple:
    """(most, enough) accumulator registers for a tile ``vecs`` vectors wide. AVX2: all but
    the weight vectors and a broadcast, 12 enough (two FMA ports x 4 cycles, and slack). With
    32 registers LLVM spills the unrolled channel loop past 16 accumulators (measured on
    C=64 56x56: 8 x 2 x 16 runs at ~90% of the AVX-512 peak, 12 x 2 x 16 and 28 x 16 at 55%)."""
    if regs > 16:
        return regs // 2, regs // 2
    return regs - 1 - vecs, 3 * regs // 4


def _tile_score(cfg: Config, t_extent: int, v_extent: int, lanes: int, regs: int) -> float:
    """Expected fraction of peak of a tile shape, for ranking: accumulators enough to hide the
    FMA latency (``_accumulators``); broadcasts that each feed more than one FMA (one-vector
    tiles measured at ~2/3 the rate: 14 x 8 against 5 x 16 on 14-wide rows, against 6 x 16 on
    56-wide ones); and no work on rows or columns past the end, which costs more than its
    share (on 7x7: 4 x 16 ~ 7 x 8 > 6 x 16 with 12 rows computed)."""
    vecs = cfg.mu * -(-cfg.nr // lanes)
    busy = _accumulators(regs, vecs)[1]
    waste = (-(-t_extent // cfg.mr) * cfg.mr / t_extent) * (-(-v_extent // cfg.nr) * cfg.nr
                                                             / v_extent)
    return min(cfg.mr * vecs, busy) / busy * (1.0 if vecs > 1 else 0.65) / waste ** 1.5


def _tile_widths(width: int, lanes: int) -> list:
    """Candidate columns of the register tile: all of ``width`` up to two vectors (and one
    vector where it divides it), else two vectors or one; columns past the end are computed
    where the sources are padded there (``_whole_tiles``), else predicated."""
    if width <= 2 * lanes:
        return [width] + ([lanes] if width > lanes and width % lanes == 0 else [])
    return [2 * lanes, lanes]


def _tile_heights(extent: int, most: int, busy: int) -> list:
    """Candidate rows of the register tile, best first. A tile that does not divide ``extent``
    costs the rows computed past its end (``_whole_tiles``); a short one leaves FMA latency
    exposed: fewer than ``busy`` accumulators (two FMA ports x 4 cycles, plus slack for the
    loads) idle a port. Ranked by the product of both; 56 -> 6 (60 computed), 7 -> 7 or 4."""
    def score(m):
        return min(m, busy) / busy * extent / (-(-extent // m) * m)

    ranked = sorted(range(1, min(extent, most) + 1), key=lambda m: (-score(m), -m))
    return ranked[:3]


def _innermost_reduction(block, extents):
    """``(i, b)``: the innermost reduction loop should be ``b`` steps of reduction loop ``i``,
    the one that walks the first source's innermost dim (``r % b`` of a channel block, or ``r``
    itself for a contiguous dim such as nhwc's c), so that source and weights stream
    contiguously. None when no reduction loop walks that dim, or the block reads no source (a
    window that lies wholly in the spatial padding: the simplifier folds its reads to 0)."""
    if not block.reads:
        return None
    idx = block.reads[0].region[-1].min
    block_size = None
    if isinstance(idx, tirx.FloorMod) and isinstance(idx.b, tirx.IntImm):
        idx, block_size = idx.a, int(idx.b.value)
    used = tirx.analysis.undefined_vars(idx)
    reduce_vars = [iv.var for iv in block.iter_vars if int(iv.iter_type) == REDUCE]
    for i, (var, n) in enumerate(zip(reduce_vars, extents)):
        b = math.gcd(block_size, n) if block_size else n
        if b > 1 and any(u.same_as(var) for u in used):
            return i, b
    return None


RULES = [RegisterTiled()]
