"""x86 convolution and matmul on the dot-product units: ``vpdpbusd`` (AVX-512 VNNI) and AMX tiles.

Both ops come from ``codegen.ops.common.materialize`` as ``acc`` (the reduction) and ``dst``
(post-ops, cast, padding store) over the destination's physical index space. The rules read
that nest, not the op or the layout tags:

* ``j``: the destination's innermost dim (the ``16o`` of ``nChw16c``, matmul columns), which
  must also be the weights' second-innermost: weights packed ``...16o4i`` (``OIhw4i16o4i``,
  ``BA16b4a``), so that 16 outputs x 4 reduction steps are 64 contiguous bytes, one zmm;
* ``r``: the reduction loop that walks both the source's and the weights' innermost dim;
* ``t``: the innermost destination dim that the source walks and the weights do not (``ow``,
  matmul rows): the rows of a tile.

``Vnni`` (targets with ``avx512_vnni``): the micro-kernel of ``x86_conv.RegisterTiled`` with
its FMAs replaced by dot products: ``dst`` tiled ``mr`` rows x 1-3 vectors of 16 columns (along
``u``, a dim the weights and the destination walk and the source does not: nChw16c's channel
blocks; else along ``j``), ``acc`` per tile, the reduction outside the tile, each step one
``vpdpbusd`` per row and column vector: 4 broadcast source bytes times the weight vectors
every row shares (oneDNN's ``ur_w x nb_oc_blocking``). The tile is a ``global`` buffer of under 1 KiB (``VNNI_TILE``):
TVM 0.27 puts those on the stack, where LLVM keeps them in registers, and every ``local`` one
on the heap, where it cannot. blockpad's int8 ops are s8 (or u8) x s8; ``vpdpbusd`` is u8 x s8,
so s8 sources go through ``x86_intrin.VNNI_S8`` (shift by 128, compensated: exact). Spatial
padding read through a guard (``if_then_else`` around the source) and the rows of a last,
partial tile become the predicate of a step (see ``_lift_conditions``).

``Amx`` (targets with ``amx_tile``): 16 x 16 output tiles, 64 int8 (``tdpbusd`` / ``tdpbssd``)
or 32 bf16 (``tdpbf16ps``) reduction steps per tile multiply. All of loop ``r`` is one
intrinsic (``x86_intrin.amx_multiply``): the accumulator tile is loaded from its per-tile
scratch once, multiplied along the whole of ``r``, stored once (per filter tap for a
convolution), and the epilogue reads the scratch. The tensorized init loads the tile
configuration on the thread that runs the tile (it is per thread). Rows are source rows 64
bytes apart or more with a constant stride: matmul rows, or convolution output pixels of a
channels-last source (``nhwc``) with 64 channels per row. Guarded (spatially padded) reads,
and dims that are not multiples of 16, are left to ``Vnni``.

A rule returns None for what it does not take (another dtype, dims that are not multiples of
the tile, a predicated or guarded nest it cannot tensorize), and the next rule in the table
tries: ``Amx`` falls back to ``Vnni``, which falls back to ``x86_conv.RegisterTiled``.

``reference=True`` builds the same schedule with the plain-loop twins of the intrinsics, so
that the algorithm runs, and is checked against numpy, on a CPU without the instructions.
"""

from __future__ import annotations

import functools
from typing import ClassVar

import tvm
import tvm_ffi
from tvm import s_tir, tirx

from . import x86_intrin as xi
from .common import op_of
from .generic import root_blocks, spatial_parallel_vectorize

_realize = tvm.get_global_func("s_tir.schedule.GetSBlockRealize")
SPATIAL, REDUCE = 0, 2   # IterVar types
VNNI_TILE = 15   # vectors in a register tile; 16 x 16 int32 would be 1 KiB, which TVM puts on
                 # the heap


class _Nest:
    """The dot-product shape of a fresh ``acc`` block, or ``ok = False``: which iter var is
    ``t`` and ``r`` (``j`` is the last spatial one; see the module doc), the source and weight
    element types, the accumulator's, and the guard around the source read (None if none)."""

    def __init__(self, sch, acc):
        self.ok = False
        block, realize = sch.get(acc), _realize(sch, acc)
        store = block.body
        if not isinstance(store, tirx.BufferStore) or not _is_true(realize.predicate):
            return
        kinds = [int(iv.iter_type) for iv in block.iter_vars]
        self.n_sp = kinds.count(SPATIAL)
        if self.n_sp < 2 or kinds != [SPATIAL] * self.n_sp + [REDUCE] * (len(kinds) - self.n_sp):
            return
        self.vars = [iv.var for iv in block.iter_vars]
        loops = sch.get_loops(acc)
        if len(loops) != len(self.vars) or any(
                not v.same_as(sch.get(l).loop_var) for v, l in zip(realize.iter_values, loops)):
            return   # not a fresh TE nest (one loop per iter var, in order)
        self.extents = [int(sch.get(l).extent) for l in loops]
        self.acc_dtype = str(store.buffer.dtype)
        loads, guards = [], []
        tvm_ffi.structural_walk(store.value, (tvm.ir.expr.TensorLoad, loads.append))

        def guard(call):
            if getattr(call.op, "name", "").endswith("if_then_else"):
                guards.append(call)
        tvm_ffi.structural_walk(store.value, (tvm.ir.expr.Call, guard))
        sources = [l for l in loads if not l.source.same_as(store.buffer)]
        if len(sources) != 2 or len(loads) != 3 or len(guards) > 1:
            return
        j_var = self.vars[self.n_sp - 1]
        if not (isinstance(store.indices[-1], tirx.Var) and store.indices[-1].same_as(j_var)):
            return
        wei = next((l for l in sources if len(l.indices) >= 2 and _uses(l.indices[-2], j_var)
                    and not _uses(l.indices[-1], j_var)), None)
        if wei is None:
            return
        src = next(l for l in sources if l is not wei)
        # t: the innermost spatial dim the source walks and the weights do not (ow; rows)
        self.t = next((i for i in reversed(range(self.n_sp - 1))
                       if any(_uses(x, self.vars[i]) for x in src.indices)
                       and not any(_uses(x, self.vars[i]) for x in wei.indices)), None)
        self.r = next((i for i in range(self.n_sp, len(self.vars))
                       if _uses(wei.indices[-1], self.vars[i])
                       and _uses(src.indices[-1], self.vars[i])), None)
        if self.t is None or self.r is None:
            return
        # u: a dim the weights and the destination walk and the source does not (the output
        # channel blocks of nChw16c, matmul column blocks), for tiles of several columns
        self.u = next((i for i in range(self.n_sp - 1) if i != self.t
                       and any(_uses(x, self.vars[i]) for x in wei.indices)
                       and not any(_uses(x, self.vars[i]) for x in src.indices)), None)
        self.guard = guards[0] if guards else None
        if self.guard is not None and (
                not self.guard.args[1].same_as(src)       # a guard around anything else
                or _uses(self.guard.args[0], j_var)       # or one that tests a channel
                or _uses(self.guard.args[0], self.vars[self.r])):   # (masked padding)
            return
        self.src_dtype, self.wei_dtype = str(src.source.dtype), str(wei.source.dtype)
        self.ok = True

    @property
    def column_blocks(self) -> int:
        """16-wide column vectors of the destination: along ``u``, else along ``j``."""
        return self.extents[self.u] if self.u is not None else self.extents[self.n_sp - 1] // 16


class Vnni:
    """int8 (s8 or u8 x s8 -> s32) convolution and matmul tensorized to ``vpdpbusd``."""

    ops = ("conv2d", "matmul")

    def __init__(self, reference: bool = False):
        self.reference = reference

    def apply(self, func, target):
        if op_of(func) not in self.ops or "avx512_vnni" not in target.features:
            return None
        # two or three column vectors per row where the column blocks divide so, else one (a
        # destination whose padding is left alone cannot have its loops reordered for them)
        for blocks in (2, 3, 1):
            sch = _schedule(func, target, functools.partial(self._tile, blocks=blocks))
            if sch is not None:
                return sch
        return None

    def _tile(self, sch, acc, dst, nest, blocks):
        """A register tile of rows x ``blocks`` column vectors: each row's broadcast source
        bytes feed ``blocks`` dot products, each weight vector every row."""
        if (nest.src_dtype, nest.wei_dtype, nest.acc_dtype) not in \
                (("uint8", "int8", "int32"), ("int8", "int8", "int32")):
            return False
        if nest.extents[nest.n_sp - 1] % 16 or nest.extents[nest.r] % 4:
            return False
        if blocks > 1 and nest.column_blocks % blocks:
            return False
        rows = _rows(nest.extents[nest.t], VNNI_TILE // blocks)
        outer = _tile_dst(sch, dst, nest, rows, blocks)
        update, init = _tile_acc(sch, acc, nest, outer, 4, blocks)
        for loop in sch.get_loops(update)[-2 - (blocks > 1) - 1:-2]:   # rows, column vectors
            sch.unroll(loop)
        *tile, vec = sch.get_loops(init)[-2 - (blocks > 1):]
        sch.vectorize(vec)
        for loop in tile:
            sch.unroll(loop)
        step = sch.blockize(sch.get_loops(update)[-2])
        cond = _lift_conditions(sch, step)
        intrin = xi.VNNI if nest.src_dtype == "uint8" else xi.VNNI_S8
        name = sch.get(step).name_hint
        sch.tensorize(step, xi.name(intrin, self.reference))
        if cond is not None:
            _predicate(sch, sch.get_sblock(name), cond)
        return True


class Amx:
    """int8 and bf16 convolution and matmul on AMX tiles."""

    ops = ("conv2d", "matmul")
    # (source, weights, accumulator) -> (tile multiply, init, reduction steps per multiply)
    KINDS: ClassVar[dict] = {
        ("uint8", "int8", "int32"): (xi.AMX_INT8, xi.AMX_ZERO_I32, 64),
        ("int8", "int8", "int32"): (xi.AMX_S8, xi.AMX_ZERO_I32, 64),
        # bf16 arrives as its uint16 bits, reinterpreted per element (codegen/ops/matmul.py)
        ("uint16", "uint16", "float32"): (xi.AMX_BF16, xi.AMX_ZERO_F32, 32),
    }

    def __init__(self, reference: bool = False):
        self.reference = reference

    def apply(self, func, target):
        if op_of(func) not in self.ops or "amx_tile" not in target.features:
            return None
        return _schedule(func, target, self._tile)

    def _tile(self, sch, acc, dst, nest):
        kind = self.KINDS.get((nest.src_dtype, nest.wei_dtype, nest.acc_dtype))
        if kind is None or nest.guard is not None:
            return False
        multiply, zero, per_tile = kind
        steps = nest.extents[nest.r]   # the whole of r: one accumulator round trip per tile
        if nest.extents[nest.n_sp - 1] % 16 or nest.extents[nest.t] % 16 or steps % per_tile:
            return False
        outer = _tile_dst(sch, dst, nest, 16, 1)
        update, init = _tile_acc(sch, acc, nest, outer, steps, 1)
        sch.tensorize(sch.get_loops(init)[-2], xi.name(zero, self.reference))
        sch.tensorize(sch.get_loops(update)[-3], xi.amx_multiply(
            multiply, steps // per_tile, self.reference))
        return True


def _schedule(func, target, tile):
    """The schedule of ``func`` with ``tile(sch, acc, dst, nest)`` shaping the reduction, or
    None where the nest is not a dot product it takes (or a primitive refuses it)."""
    sch = s_tir.Schedule(func)
    try:
        acc, dst = sch.get_sblock("acc"), sch.get_sblock("dst")
    except s_tir.ScheduleError:
        return None
    nest = _Nest(sch, acc)
    if not nest.ok or len(sch.get_loops(dst)) != nest.n_sp:
        return None
    stages = [b for b in root_blocks(sch) if sch.get(b).name_hint not in ("acc", "dst")]
    try:
        if not tile(sch, acc, dst, nest):
            return None
        for block in stages:   # per-channel copies, a spatial padding stage
            spatial_parallel_vectorize(sch, block, target)
    except (s_tir.ScheduleError, RuntimeError, ValueError):
        return None   # tensorize refused the nest: the next rule schedules it
    return sch


def _tile_dst(sch, dst, nest, rows, blocks):
    """Tile ``dst`` in ``rows`` of loop ``t`` x ``blocks`` vectors of 16 columns (along ``u``,
    or along ``j`` when there is no ``u``); column panels outside row tiles, so that their
    weights stay in cache while rows stream past; the loops outside the tile fused in
    parallel, the tile's unrolled around a vector of 16 columns. Returns the parallel loop."""
    loops = sch.get_loops(dst)
    t_loop, v = loops[nest.t], loops[-1]
    u = nest.u if blocks > 1 else None   # one vector: u stays where it is (no reorder)
    u_loop = loops[u] if u is not None else None
    outer = [l for i, l in enumerate(loops[:-1]) if i not in (nest.t, u)]
    panels, cols = [], []
    if int(sch.get(v).extent) > 16:
        v_outer, v = sch.split(v, [None, 16])
        if u_loop is None and nest.u is None and blocks > 1:
            u_loop = v_outer
        else:
            panels.append(v_outer)
    if u_loop is not None:
        if blocks < int(sch.get(u_loop).extent):
            u_outer, u_loop = sch.split(u_loop, [None, blocks])
            panels.append(u_outer)
        cols.append(u_loop)
    if rows < int(sch.get(t_loop).extent):
        t_outer, t_loop = sch.split(t_loop, [None, rows])
        panels.append(t_outer)
    outer += panels
    order = (*outer, t_loop, *cols, v)
    if not all(sch.get(a).same_as(sch.get(b)) for a, b in zip(sch.get_loops(dst), order)):
        sch.reorder(*order)   # only if needed: a predicated dst (padding left alone) refuses it
    if outer:
        fused = sch.fuse(*outer) if len(outer) > 1 else outer[0]
        sch.parallel(fused)
    else:   # one tile is the whole destination: a unit loop to compute the tile at
        fused = sch.add_unit_loop(t_loop)
    for loop in (t_loop, *cols):
        sch.unroll(loop)
    sch.vectorize(v)
    return fused


def _tile_acc(sch, acc, nest, at_loop, steps, blocks):
    """Compute ``acc`` per tile of ``dst`` (at ``at_loop``) in a tile-sized scratch: the
    reduction loops outside the tile, loop ``r`` split so that ``steps`` of it sit innermost
    (the intrinsic's reduction). Returns (update, init), whose last loops are the tile's rows,
    its column vectors (``blocks > 1``), 16 columns and, for the update, those steps."""
    sch.compute_at(acc, at_loop, preserve_unit_loops=True)
    loops = sch.get_loops(acc)
    n_red = len(nest.vars) - nest.n_sp
    spatial = loops[-n_red - nest.n_sp:-n_red]
    at, av = spatial[nest.t], spatial[-1]   # rows, columns
    cols = []
    if blocks > 1:
        if nest.u is not None:
            cols = [spatial[nest.u]]
        else:
            col, av = sch.split(av, [None, 16])
            cols = [col]
    reduce = list(loops[-n_red:])
    r = nest.r - nest.n_sp
    r_outer, r_inner = sch.split(reduce[r], [None, steps])
    reduce = [*reduce[:r], *reduce[r + 1:], r_outer]   # r's outer part walks the source innermost
    sch.reorder(*reduce, at, *cols, av, r_inner)
    init = sch.decompose_reduction(acc, reduce[0])
    return acc, init


def _lift_conditions(sch, step):
    """Take the conditions off the blockized step ``step`` (one intrinsic's worth of the
    update) so that tensorize, which refuses them, sees a plain dot product, and return them
    over the loop vars (None if it had none) for ``_predicate`` to put back on the tensorized
    step. Two kinds: the predicate of the rows of a last, partial register tile, and spatial
    padding: ``acc += cast(if_then_else(g, src, 0)) * w`` becomes ``acc += cast(src) * w``
    under ``g``, so that a step that would read outside the image is skipped, which is adding
    the zero it would have read. Neither depends on a loop inside the step (they test rows and
    pixels, not channels). The init, decomposed before, still zeroes every accumulator."""
    outer, outer_realize = sch.get(step), _realize(sch, step)
    inner_realize = []
    tvm_ffi.structural_walk(outer.body, (s_tir.SBlockRealize, inner_realize.append))
    inner_realize = inner_realize[0]
    inner = inner_realize.block
    guards = []
    tvm_ffi.structural_walk(inner.body, (tvm.ir.expr.Call, lambda c: guards.append(c) if getattr(
        c.op, "name", "").endswith("if_then_else") else None))
    conds = [] if _is_true(outer_realize.predicate) else [outer_realize.predicate]
    if not guards and not conds:
        return None
    new_inner = inner
    if guards:
        call = guards[0]
        new_inner = _with_body(inner, tvm_ffi.structural_map(
            inner.body, (tvm.ir.expr.Call, lambda c: call.args[1] if c.same_as(call) else c)))
        cond = _substitute(call.args[0], {iv.var: v for iv, v in
                                          zip(inner.iter_vars, inner_realize.iter_values)})
        conds.append(_substitute(cond, {iv.var: v for iv, v in
                                        zip(outer.iter_vars, outer_realize.iter_values)}))
    new_outer = _with_body(outer, tvm_ffi.structural_map(outer.body, (
        s_tir.SBlockRealize, lambda r: s_tir.SBlockRealize(r.iter_values, r.predicate, new_inner)
        if r.same_as(inner_realize) else r)))
    _replace_realize(sch, step, s_tir.SBlockRealize(outer_realize.iter_values,
                                                    tirx.const(True, "bool"), new_outer),
                     {outer: new_outer, inner: new_inner})
    return functools.reduce(tirx.And, conds)


def _predicate(sch, block, cond):
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


def _with_body(block, body):
    return s_tir.SBlock(block.iter_vars, block.reads, block.writes, block.name_hint, body,
                        block.init, block.alloc_buffers, block.match_buffers, block.annotations)


def _substitute(expr, mapping: dict):
    return tvm_ffi.structural_map(
        expr, (tirx.Var, lambda v: next((new for old, new in mapping.items() if v.same_as(old)),
                                        v)))


def _uses(expr, var) -> bool:
    return any(v.same_as(var) for v in tirx.analysis.undefined_vars(expr))


def _is_true(e) -> bool:
    return isinstance(e, tirx.IntImm) and e.value == 1


def _divisor_at_most(n: int, limit: int) -> int:
    return max(k for k in range(1, min(n, limit) + 1) if n % k == 0)


def _rows(n: int, limit: int) -> int:
    """Rows of a register tile over ``n``: a divisor of ``n`` up to ``limit``, unless that is
    less than half of the most even split (19 rows, limit 15: 10 + 9, one row predicated off
    in the last tile, rather than 19 tiles of 1)."""
    even = -(-n // -(-n // limit))
    div = _divisor_at_most(n, limit)
    return div if 2 * div > even else even


RULES = [Amx(), Vnni()]
