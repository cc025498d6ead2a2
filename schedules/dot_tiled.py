"""Convolution and matmul on a CPU's dot-product instruction, register-tiled: the part of x86's
``vpdpbusd`` and ``vdpbf16ps`` rules (schedules/x86_tensorized.py) and Arm's ``sdot`` rule
(schedules/arm.py) that does not depend on the instruction, so that all take the same awkward
nests. An instruction sums ``steps`` products into each lane: 4 for int8 (bytes into int32),
2 for bf16 (pairs into float32); below, "4" is int8's and bf16 reads 2.

Both ops come from ``codegen.ops.common.materialize`` as ``acc`` (the reduction) and ``dst``
(post-ops, cast, padding store) over the destination's physical index space. The rules read
that nest, not the op or the layout tags:

* ``j``: the destination's innermost dim (the ``16o`` of ``nChw16c``, the ``4c`` of
  ``nChw4c``, matmul columns), which must also be the weights' second-innermost: weights packed
  ``...<lanes>o4i`` (``OIhw4i16o4i``, ``OIhw4o4i``, ``BA16b4a``, ``BA4b4a``), so that ``lanes``
  outputs x 4 reduction steps are one vector register of weights;
* ``r``: the reduction loop that walks both the source's and the weights' innermost dim;
* ``t``: the innermost destination dim that the source walks and the weights do not (``ow``,
  matmul rows): the rows of a tile;
* ``u``: a dim the weights and the destination walk and the source does not (channel blocks,
  matmul column blocks), for tiles of several column vectors.

``DotTiled``: ``dst`` tiled ``rows`` x 1-3 column vectors of ``lanes`` int32 (oneDNN's
``ur_w x nb_oc_blocking``), ``acc`` computed per tile in a scratch buffer small enough for the
stack (LLVM keeps it in registers; TVM 0.27 puts small ``global`` buffers on the stack and
every ``local`` one on the heap), the reduction outside the tile, each step one dot product per
row and column vector: 4 broadcast source bytes times the weight vectors every row shares.

What makes a nest awkward, and how it is still tensorized:

* spatial padding read through a guard (``if_then_else`` around the source) is read from a
  zero-haloed copy of the source, a stage of the kernel (``halo.staged_source``); a guard it
  does not take (not exactly the buffer's bounds), and the rows of a last, partial tile,
  become the predicate of a whole dot-product step (``lift_conditions``);
* guarded weights (output channels past what the weights hold: ``nChw8c`` with ``K = 12``
  against ``OIhw4o4i``) where the guard holds or fails for whole vectors of lanes: the guard
  too becomes the predicate of a step (``lift_conditions``);
* masked weights (the ``src`` policy's guard on output channels past the logical ones, which
  splits a vector) are read unguarded inside the padded buffer, and the guard moves to where
  ``dst`` reads the accumulator (``lift_weight_guard``): zero there, as the guarded sum was;
* ``j`` not a multiple of ``lanes``, or ``r`` not a multiple of 4 (plain ``ab`` matmul
  sources and destinations: M, N, K of any size), pad the dot product (``pad_dot``): the
  accumulator gains the missing lanes (scratch nobody reads), the source is copied with its
  innermost dim zero-padded to a multiple of 4, so the extra reduction steps add zero;
* a destination whose padding is left alone (``dst_stage``: ``dst`` predicated on the valid
  elements) is tiled unpredicated and predicated again over its new loops (``tile_dst``).

Weights of ``PREFETCH_BYTES`` or more (``prefetch`` rules: ``vpdpbusd``'s) come from memory
on every inference: the panels of column blocks go outermost and each tile prefetches into L2
its share of the next panel's weights, spread over its reduction (``prefetch.py``).

A heavy epilogue (``interleave`` rules: ``vpdpbusd``'s) runs beside the next tile's dot
products instead of after its own (``interleave.py``).

Anything else returns None and the next rule in the target's table tries.
The rewrites themselves, and ``DotShape`` (the nest read as ``j``, ``r``, ``t``, ``u``), are in
``dot_rewrites``.
"""

from __future__ import annotations

import functools

import tvm
from tvm import s_tir

from blockpad.vocabulary import ACC, DST, WEIGHT_SUMS, ZP_COMP

from .common import REDUCE, SPATIAL, buffer_bytes, divisor_at_most, element_strides, vector_lanes
from .dot_rewrites import DotShape, lift_conditions, lift_weight_guard, pad_dot, set_predicate, take_predicate
from .generic import root_blocks, spatial_parallel_vectorize
from .halo import staged_source, subsampled_source
from .interleave import interleave_epilogue
from .nest import substitute, uses
from .prefetch import PREFETCH_BYTES, panels_lead, prefetch_next_panel
from .rule import ScheduleRule

_realize = tvm.get_global_func("s_tir.schedule.GetSBlockRealize")


class DotTiled(ScheduleRule):
    """int8 and bf16 convolution and matmul, register-tiled around a dot-product intrinsic
    ``C[lanes] += A[steps] . B[lanes, steps]`` (``dot_intrin.dot_desc``). A target rule says
    which CPU feature it needs (``feature``), how many lanes the instruction fills (``lanes``),
    how many accumulator vectors a tile may hold (``tile``) and which intrinsic takes a
    (source, weights, accumulator) type triple (``intrin``, None: not this rule's)."""

    ops = ("conv2d", "matmul")
    feature: str
    lanes: int
    tile: int
    prefetch = False   # large weights read panel by panel, the next one prefetched
    interleave = False   # a heavy epilogue interleaved with the next tile's reduction

    def intrin(self, nest) -> str | None:
        raise NotImplementedError

    def takes(self, func, target):
        return super().takes(func, target) and self.feature in target.features

    def schedule(self, func, target):
        """Spatial padding is read from a zero-haloed copy of the source (``staged_source``,
        as the fp32 rule does), not predicated per dot-product step: on an Intel Xeon
        (Cascade Lake, ``vpdpbusd``, 1 thread, u8 3x3, bit-identical results) 64 channels
        at 56x56 0.75 -> 0.43 ms, 128 at 28x28 0.60 -> 0.49, 256 at 14x14 0.58 -> 0.54, 512 at
        7x7 equal: a predicated step per row and tap kept the tile's rows from sharing it.
        A strided 1x1 reads a dense copy of its rows and columns (``subsampled_source``):
        ResNet-50's u8 downsamples 1.01-1.08x at 1 thread, 1.00-1.05x at 2."""
        func = pad_dot(lift_weight_guard(staged_source(subsampled_source(func)), self.lanes),
                       self.lanes)
        # two or three column vectors per row where the column blocks divide so, else one
        for blocks in (2, 3, 1):
            ahead = []   # what _tile found to prefetch, inserted once the schedule is done
            sch = schedule(func, target, functools.partial(self._tile, blocks=blocks,
                                                           ahead=ahead))
            if sch is not None:
                sch = prefetch_next_panel(sch, *ahead[0]) if ahead else sch
                return interleave_epilogue(sch) if self.interleave else sch
        return None

    def _tile(self, sch, acc, dst, nest, blocks, ahead):
        """A register tile of rows x ``blocks`` column vectors: each row's broadcast source
        bytes feed ``blocks`` dot products, each weight vector every row. Weights of
        ``PREFETCH_BYTES`` or more (``prefetch`` rules): the panels outermost, and what
        ``prefetch_next_panel`` needs appended to ``ahead``."""
        intrin = self.intrin(nest)
        if intrin is None or nest.extents[nest.n_sp - 1] % self.lanes \
                or nest.extents[nest.r] % nest.steps or not _packed(nest, self.lanes):
            return False
        if blocks > 1 and nest.column_blocks(self.lanes) % blocks:
            return False
        rows = _rows(nest.extents[nest.t], self.tile // blocks)
        streamed = self.prefetch and blocks > 1 and nest.u is not None \
            and panels_lead(nest.wei.source, nest.wei.indices, nest.vars[nest.u]) \
            and buffer_bytes(nest.wei.source) >= PREFETCH_BYTES
        outer = tile_dst(sch, dst, nest, rows, blocks, self.lanes, panels_first=streamed)
        update, init = tile_acc(sch, acc, nest, outer, nest.steps, blocks, self.lanes)
        if streamed:
            loops = sch.get_loops(update)   # the task's loop, the reduction's, the tile's 3-4
            steps = [sch.get(l) for l in loops[1:len(loops) - 3 - (blocks > 1)]]
            weights = nest.wei.source
            ahead.append((sch.get(outer), weights,
                          buffer_bytes(weights) // (int(weights.shape[0]) // blocks),
                          [(f.loop_var, int(f.extent)) for f in steps]))
        for loop in sch.get_loops(update)[-2 - (blocks > 1) - 1:-2]:   # rows, column vectors
            sch.unroll(loop)
        *tile, vec = sch.get_loops(init)[-2 - (blocks > 1):]
        sch.vectorize(vec)
        for loop in tile:
            sch.unroll(loop)
        step = sch.blockize(sch.get_loops(update)[-2])
        cond = lift_conditions(sch, step)
        name = sch.get(step).name_hint
        sch.tensorize(step, intrin)
        if cond is not None:
            set_predicate(sch, sch.get_sblock(name), cond)
        return True


def _packed(nest, lanes) -> bool:
    """The memory the intrinsic assumes: its ``B[lanes, steps]`` one contiguous run of the
    weights (their last dims ``[a multiple of lanes outputs, steps]``, compact: ``...16o4i``
    int8, ``...16o2i`` bf16) and its ``A[steps]`` contiguous source elements (a source block of
    channels a multiple of ``steps``).
    Weights blocked otherwise (``Ab8a``: 8 steps a row) match the nest's shape, and tensorize
    took them, reading the wrong bytes (blockpad check seed 20261126 case 36)."""
    def const(strides):
        return [int(x) if isinstance(x, (int, tvm.tirx.IntImm)) else None for x in strides]

    wei, src, n = nest.wei.source, nest.src.source, nest.steps
    outs, steps = (int(d) for d in wei.shape[-2:])
    return steps == n and outs % lanes == 0 and int(src.shape[-1]) % n == 0 \
        and const(element_strides(wei)[-2:]) == [n, 1] and const(element_strides(src)[-1:]) == [1]


def schedule(func, target, tile):
    """The schedule of ``func`` with ``tile(sch, acc, dst, nest)`` shaping the reduction, or
    None where the nest is not a dot product it takes (or a primitive refuses it)."""
    sch = s_tir.Schedule(func)
    try:
        acc, dst = sch.get_sblock(ACC), sch.get_sblock(DST)
    except s_tir.ScheduleError:
        return None
    nest = DotShape(sch, acc)
    if not nest.ok or len(sch.get_loops(dst)) != nest.n_sp:
        return None
    stages = [b for b in root_blocks(sch) if sch.get(b).name_hint not in (ACC, DST)]
    try:
        if not tile(sch, acc, dst, nest):
            return None
        for block in stages:   # per-channel copies, a spatial padding stage, a padded source
            if not weight_sums(sch, block, target):
                spatial_parallel_vectorize(sch, block, target)
    except (s_tir.ScheduleError, RuntimeError, ValueError):
        return None   # tensorize refused the nest: the next rule schedules it
    return sch


def weight_sums(sch, block, target) -> bool:
    """Schedule ``block`` if it is the zero-point compensation's sum of the weights over the
    reduction (``zp_wsum``, a matmul's ``zp_comp``: ``codegen/ops/quant.py``), in the order
    the packed weights lie (``...<lanes>o4i``: ``lanes`` outputs x 4 reduction steps in a row):
    split by the step (``rfactor``), ``lanes`` x 4 int32 partial sums are one contiguous
    vector, added over the reduction, and the 4 added at the end. As a plain nest it summed
    one output's weights at a time, a byte per step, on every call: at 7x7 that took longer
    than the convolution's dot products (int8 MobileNetV2's 320 -> 1280 1x1 on VNNI: 0.25 ms
    against ONNX Runtime's 0.14). False (untouched) where it is not such a sum or does not
    split so."""
    loops = sch.get_loops(block)
    kinds = [int(iv.iter_type) for iv in sch.get(block).iter_vars]
    if sch.get(block).name_hint not in (WEIGHT_SUMS, ZP_COMP) or \
            kinds != [SPATIAL] * (len(loops) - 1) + [REDUCE]:
        return False   # conv's zp_comp (the border classes' table, reduced over taps): small
    lanes = vector_lanes(target, "int32")
    k, *mid, c = loops
    if int(sch.get(k).extent) % lanes or int(sch.get(c).extent) % 4:
        return False
    k_out, k_in = sch.split(k, [None, lanes])
    c_out, c_in = sch.split(c, [None, 4])
    sch.reorder(k_out, *mid, c_out, k_in, c_in)
    partial = sch.rfactor(c_in, factor_axis=len(loops) - 1)
    *_, k_in, c_in = sch.get_loops(partial)
    sch.vectorize(sch.fuse(k_in, c_in))
    init = sch.decompose_reduction(partial, sch.get_loops(partial)[len(loops) - 1])
    sch.vectorize(sch.get_loops(init)[-1])
    return True   # on one thread: TVM refuses to parallelise the rfactor block's outer loop


def tile_dst(sch, dst, nest, rows, blocks, lanes, panels_first=False):
    """Tile ``dst`` in ``rows`` of loop ``t`` x ``blocks`` vectors of ``lanes`` columns (along
    ``u``, or along ``j`` when there is no ``u``); column panels outside row tiles, so that
    their weights stay in cache while rows stream past; the loops outside the tile fused in
    parallel, the tile's unrolled around a vector of ``lanes`` columns (``panels_first``: the
    panel of column blocks outermost, so that a task's panel is ``task // tiles per panel``).
    Returns the parallel loop. A predicated ``dst`` (padding left alone) is tiled
    unpredicated, then predicated again over its new loops: ``reorder`` refuses a block whose
    predicate is not a loop bound."""
    valid = take_predicate(sch, dst)
    loops = sch.get_loops(dst)
    t_loop, v = loops[nest.t], loops[-1]
    u = nest.u if blocks > 1 else None   # one vector: u stays where it is (no reorder)
    u_loop = loops[u] if u is not None else None
    outer = [l for i, l in enumerate(loops[:-1]) if i not in (nest.t, u)]
    panels, cols = [], []
    u_panel = None
    if int(sch.get(v).extent) != lanes:   # fewer columns too: acc's tile covers whole vectors
        v_outer, v = sch.split(v, [None, lanes])
        if u_loop is None and nest.u is None and blocks > 1:
            u_loop = v_outer
        else:
            panels.append(v_outer)
    if u_loop is not None:
        if blocks < int(sch.get(u_loop).extent):
            u_outer, u_loop = sch.split(u_loop, [None, blocks])
            panels.append(u_outer)
            u_panel = u_outer
        cols.append(u_loop)
    if rows < int(sch.get(t_loop).extent):
        t_outer, t_loop = sch.split(t_loop, [None, rows])
        panels.append(t_outer)
    outer += panels
    if panels_first and u_panel is not None:
        outer = [u_panel] + [l for l in outer if not l.same_as(u_panel)]
    sch.reorder(*outer, t_loop, *cols, v)
    if outer:
        fused = sch.fuse(*outer) if len(outer) > 1 else outer[0]
        sch.parallel(fused)
    else:   # one tile is the whole destination: a unit loop to compute the tile at
        fused = sch.add_unit_loop(t_loop)
    for loop in (t_loop, *cols):
        sch.unroll(loop)
    sch.vectorize(v)
    if valid is not None:
        realize = _realize(sch, dst)
        set_predicate(sch, dst, substitute(valid, {iv.var: x for iv, x in zip(
            realize.block.iter_vars, realize.iter_values)}))
    return fused


def tile_acc(sch, acc, nest, at_loop, steps, blocks, lanes):
    """Compute ``acc`` per tile of ``dst`` (at ``at_loop``) in a tile-sized scratch: the
    reduction loops outside the tile, loop ``r`` split so that ``steps`` of it sit innermost
    (the intrinsic's reduction). Returns (update, init), whose last loops are the tile's rows,
    its column vectors (``blocks > 1``), ``lanes`` columns and, for the update, those steps."""
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
            col, av = sch.split(av, [None, lanes])
            cols = [col]
    reduce = list(loops[-n_red:])
    r = nest.r - nest.n_sp
    r_outer, r_inner = sch.split(reduce[r], [None, steps])
    taps = [*reduce[:r], *reduce[r + 1:]]
    block = _steps_per_block(nest)
    if taps and block and int(sch.get(r_outer).extent) % block == 0:
        # the weights' order: a block of channels outside the taps, its steps inside
        r_block, r_outer = sch.split(r_outer, [None, block])
        taps = [r_block, *taps]
    reduce = [*taps, r_outer]   # r's outer part walks the source innermost
    sch.reorder(*reduce, at, *cols, av, r_inner)
    init = sch.decompose_reduction(acc, reduce[0])
    return acc, init


def _steps_per_block(nest) -> int | None:
    """Dot-product steps in one block of the weights' reduction dim (``OIhw4i16o4i``: the
    ``4i`` between ``hw`` and ``16o``, 4 steps of 4 channels), or None where the weights do not
    block it (matmul's ``BA16b4a``). The reduction walks a block's steps inside the taps, in
    the order the weights lie: walking every channel of a tap first jumped ``kh x kw`` rows of
    weights per block, across pages the hardware prefetcher does not follow, and a network's
    weights, which come from memory on each inference, arrived one miss at a time."""
    r = nest.vars[nest.r]
    dims = [i for i, x in enumerate(nest.wei.indices) if uses(x, r)]
    return int(nest.wei.source.shape[dims[-2]]) if len(dims) >= 3 else None


def _rows(n: int, limit: int) -> int:
    """Rows of a register tile over ``n``: a divisor of ``n`` up to ``limit``, unless that is
    less than half of the most even split (19 rows, limit 15: 10 + 9, one row predicated off
    in the last tile, rather than 19 tiles of 1). Where the split would be uneven, a divisor up
    to a quarter past ``limit`` is taken instead: a few spilled registers cost less than a
    predicated tile (uint8 3x3, 512 channels at 7x7, AVX2 ``vpmaddubsw`` with 7-bit weights,
    1 thread: 7 rows x 2 column vectors, 14 accumulators against a limit of 12, 2.07 -> 1.74
    ms against 4 + 3 rows; 256 channels at 14x14 1.54 -> 1.51 ms)."""
    even = -(-n // -(-n // limit))
    div = divisor_at_most(n, limit)
    if 2 * div > even:
        return div
    stretched = divisor_at_most(n, limit + limit // 4)
    return stretched if stretched > limit else even
