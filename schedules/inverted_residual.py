"""CPU schedule of the fused inverted residual (``codegen/ops/inverted_residual.py``): the
expanded tensor lives in cache, one band of rows at a time.

The destination (``nChw<b>c``) is split into bands of ``rows`` output rows, the parallel tasks.
Per band:

1. ``expand`` + ``expanded``: the 1x1 expansion for the band's input rows and the depthwise
   window's halo rows above and below (recomputed by the neighbouring band: the price of
   independent tasks), register-tiled as a GEMM (``mu`` channel blocks x ``mr`` pixels of
   vector accumulators, the reduction unrolled in steps within a source channel block), bias
   and activation applied on the registers, into a band buffer of ``rows * stride + kernel -
   stride`` rows (fewer at the image's top and bottom). The expansion's sums once went to a
   row buffer that a second pass read back for the bias, the activation and a zero border
   (AVX-512 Zen 4, 1 thread: 16 -> 96 -> 24 at 112x112 stride 2 0.79 -> 0.65 ms, 24 -> 144
   -> 32 at 56x56 stride 2 0.37 -> 0.30, the other MobileNetV2 blocks 1.0-1.09x);
2. per output row: ``depthwise`` + ``depthwise_out`` for every expanded channel of the row,
   ``mr`` pixels x one channel block of accumulators with the kernel taps unrolled, the
   band's cells read clamped into the image, the padding selected as 0;
3. the projection of that row (``acc``), tiles of a few output-channel blocks x ``mr``
   pixels, the expanded channel block unrolled, and its epilogue (``dst``: bias, residual,
   padding store) on the registers.

The band's height keeps its buffer under ``BAND_BYTES``, with at least ``MIN_BANDS`` bands
and as many on each of ``MIN_BANDS`` cores (``_band_rows``); for a pool of one thread
(``for_threads``, compiled beside the default) as few as that allows.
Measured on MobileNetV2's blocks (AVX2 EPYC, 512 KiB L2, 1 thread, fused against the three
kernels, ``nChw16c``): bands of 128 KiB 1.07x (112x112 block), 0.88x (56x56), 0.96x (28x28);
256 KiB 1.22x, 1.02x, 1.00x; 1 MiB 1.32x, 1.09x, 1.07x; 4 MiB 1.21x, 1.11x, 1.05x. Taller
bands recompute fewer halo rows and lose little to L2 misses; two bands keep two cores busy
(each recomputes the other's halo rows; on more cores a small image leaves some idle).
Anything it cannot schedule (a plain destination, a primitive that refuses) returns None and
the generic rule computes the stages whole, slower and equal.
"""

from __future__ import annotations

import math

import tvm
import tvm_ffi
from tvm import s_tir

from blockpad.vocabulary import ACC, DEPTHWISE, DEPTHWISE_OUT, DST, EXPAND, EXPANDED

from .common import REDUCE, SPATIAL, count_iters, divisor_at_most, tile_scope, vector_lanes
from .generic import root_blocks, spatial_parallel_vectorize
from .nest import uses
from .register_tiled import accumulators
from .rule import ScheduleRule, distinct
from .vector_math import vector_math

BAND_BYTES = 1 << 20   # the expanded band buffer's target size
MIN_BANDS = 2          # tasks for two cores, even where one band would hold the image
BAND_CHOICES = (256 * 1024, 1 << 20, 4 << 20)   # the tuning space's band buffer sizes
STAGES = (EXPAND, EXPANDED, DEPTHWISE, DEPTHWISE_OUT, ACC, DST)


class InvertedResidual(ScheduleRule):
    ops = ("inverted_residual",)

    def schedule(self, func, target):
        return _attempt(func, target, BAND_BYTES, MIN_BANDS)

    def for_threads(self, func, target, threads):
        """On fewer cores than ``MIN_BANDS``, bands only recompute each other's halo rows:
        the image in as few bands as ``BAND_BYTES`` allows (MobileNetV2's 14x14 blocks in one,
        16 expanded rows for 14 no longer; the whole network 6.83 -> 6.65 ms at 1 thread on a
        Zen 4, AVX-512)."""
        if threads >= MIN_BANDS or not self.takes(func, target):
            return None
        return _attempt(func, target, BAND_BYTES, threads)

    def space(self, func, target) -> list:
        """The default, then other band heights for tuning on the device: the band buffer's
        size against the halo rows recomputed, and one band (no recomputation: a small image
        on one core) or four (more cores)."""
        if not self.takes(func, target):
            return []
        bands = [(BAND_BYTES, MIN_BANDS), *((b, MIN_BANDS) for b in BAND_CHOICES
                                            if b != BAND_BYTES), (BAND_BYTES, 1), (BAND_BYTES, 4)]
        return distinct(_attempt(func, target, b, n) for b, n in bands)


def _attempt(func, target, band_bytes, min_bands):
    try:   # transcendental activations: polynomials, not libm per lane (vector_math)
        return _schedule(vector_math(func), target, band_bytes, min_bands)
    except s_tir.ScheduleError:
        return None


def _channels_innermost(sch, acc) -> bool:
    """Whether the destination's innermost dim holds output channels (``nChw<b>c``), as the
    tiles assume: the projection weights' read in ``acc`` depends on the block's last spatial
    iterator. A destination blocked along another dim has five dims too (``nchW16w``): taken
    for channel blocks, its last channel came out wrong."""
    block = sch.get(acc)
    last = [iv.var for iv in block.iter_vars if int(iv.iter_type) == SPATIAL][-1]
    loads = []
    tvm_ffi.structural_walk(block.body, (tvm.ir.expr.TensorLoad, loads.append))
    return any(uses(i, last) for load in loads if load.source.name == "weights"
               for i in load.indices)


def _extents(sch, block) -> list:
    return [int(sch.get(l).extent) for l in sch.get_loops(block)]


def _tile(width: int, blocks: int, per_block: int, regs: int) -> tuple:
    """``(pixels, channel blocks, vectors of a block)`` of a register tile over a row of
    ``width`` pixels and ``blocks`` channel blocks of ``per_block`` vectors: a part of one block
    (``nChw16c`` on AVX2: 8 of its 16 channels) or whole blocks. The accumulators, the weight
    vectors and a broadcast source fit ``regs``, and no more accumulators than
    ``register_tiled`` allows (with AVX-512's 32 registers the fit alone allowed 24-28, which
    LLVM spills: MobileNetV2's fused blocks ran 1.2-1.7x slower on avx512 than on host, AVX2,
    on the same AMD EPYC); a tile that divides the row and the blocks
    first (a predicated last tile costs more than a smaller tile), then the fewest loads (a
    broadcast a pixel, a weight vector a column of accumulators) per FMA."""
    parts = [(1, v) for v in range(1, per_block + 1) if per_block % v == 0]
    parts += [(u, per_block) for u in range(2, blocks + 1)]

    def score(t):
        m, (u, v) = t
        vectors = u * v
        return (width % m == 0 and blocks % u == 0, -(m + vectors) / (m * vectors), vectors)
    options = [(m, p) for m in range(1, width + 1) for p in parts
               if (m + 1) * p[0] * p[1] + 1 <= regs
               and m * p[0] * p[1] <= accumulators(regs, p[0] * p[1])[0]]
    m, (u, v) = max(options, key=score)
    return m, u, v


def _gemm_tile(sch, loops, shape, lanes, regs):
    """Tiles ``loops`` = (channel blocks, pixels, channel lanes) of a 1x1 convolution's
    epilogue for ``_tile``'s register tile (its accumulators are computed at the tile: the
    expansion's and the projection's); returns the outer loops and the tile's."""
    blocks, pixels, lane = loops
    n_blocks, width, block_size = shape
    m, u, v = _tile(width, n_blocks, max(1, block_size // lanes), regs)
    bo, bi = sch.split(blocks, [None, u])
    lo, li = sch.split(lane, [None, v * lanes]) if v * lanes < block_size else (None, lane)
    po, pi = sch.split(pixels, [None, m])
    outer = [bo, *([lo] if lo is not None else []), po]
    sch.reorder(*outer, bi, pi, li)
    return outer, (bi, pi, li)


def _accumulate(sch, acc, target, step=1):
    """The accumulator block ``acc``, computed at a register tile: its reduction loops outside
    its spatial ones, the innermost reduction (in ``step``s, unrolled, where given) and the
    spatial ones unrolled, the lanes vectorized, the zeroing split off."""
    sch.set_scope(acc, 0, tile_scope(target))
    loops = sch.get_loops(acc)
    n_red = count_iters(sch.get(acc), REDUCE)
    spatial, reduce = loops[len(loops) - n_red - 5:len(loops) - n_red], loops[len(loops) - n_red:]
    if step > 1:
        reduce = [*reduce[:-1], *sch.split(reduce[-1], [None, step])]
    sch.reorder(*reduce, *spatial)
    for loop in (*reduce[1:], *spatial[:-1]):
        sch.unroll(loop)
    sch.vectorize(spatial[-1])
    init = sch.decompose_reduction(acc, reduce[0])
    sch.vectorize(sch.get_loops(init)[-1])


def _widest(target, block: int) -> int:
    """The target's float32 vector, halved down to 4 lanes until it divides ``block``."""
    lanes = vector_lanes(target, "float32")
    while lanes > 4 and block % lanes:
        lanes //= 2
    return lanes


def _band_rows(height, stride, kernel, cores, most) -> int:
    """Output rows per band: at most ``most`` (the band buffer's size), bands spread evenly
    over ``cores`` (the parallel loop gives each core a run of whole bands), the fewest
    expanded rows on the busiest core, each band's halo rows counted. MobileNetV2's 16 -> 96
    -> 24 at 112x112, stride 2: 5 bands of 12 rows (3 on one core, 2 on the other) became 8
    of 7, 2 threads 0.445 -> 0.35 ms (AVX-512 Zen 4, alone, hot)."""
    def busiest(rows):
        bands = -(-height // rows)
        per_core = -(-bands // cores)
        return min(per_core * rows, height) * stride + per_core * (kernel - stride)
    first = max(1, min(most, -(-height // cores)))
    return min(range(1, first + 1), key=lambda r: (busiest(r), -r))


def _schedule(func, target, band_bytes, min_bands):
    sch = s_tir.Schedule(func)
    blocks = {name: sch.get_sblock(name) for name in STAGES}
    others = [b for b in root_blocks(sch) if sch.get(b).name_hint not in STAGES]
    dst = blocks[DST]
    if len(sch.get_loops(dst)) != 5 or not _channels_innermost(sch, blocks[ACC]):
        return None               # not nChw<b>c (plain, or blocked along w): the generic rule
    regs = target.tile_registers
    _, kb_n, oh_n, ow_n, kb_size = _extents(sch, dst)
    _, eb_n, h_n, w_n, cb = _extents(sch, blocks[EXPANDED])
    # the widest vectors that divide the destination's channel block (the projection's
    # ``lanes``: nChw8c on AVX-512 takes ymm; it fell to the generic rule once, 2.7 GFLOP/s
    # against 91 for host's kernel of the same block) and the inner stages' (``inner``)
    lanes, inner = (_widest(target, n) for n in (kb_size, cb))
    if kb_size % lanes or cb % inner:
        return None
    stride = max(1, round(h_n / oh_n))            # about: only the band's height depends on it
    kh = _extents(sch, blocks[DEPTHWISE])[-2]
    rows = _band_rows(oh_n, stride, kh, min_bands,
                      max(1, (band_bytes // (w_n * eb_n * cb * 4)) // stride))

    # 3. the projection, a row at a time
    n, kb, oh, ow, ki = sch.get_loops(dst)
    ohb, ohi = sch.split(oh, [None, rows])
    sch.reorder(n, ohb, ohi, kb, ow, ki)
    task = sch.fuse(n, ohb)
    sch.parallel(task)
    outer, (kbi, owi, ki) = _gemm_tile(sch, (kb, ow, ki), (kb_n, ow_n, kb_size), lanes, regs)
    sch.compute_at(blocks[ACC], outer[-1], preserve_unit_loops=True)
    _accumulate(sch, blocks[ACC], target)
    sch.unroll(kbi)
    sch.unroll(owi)
    sch.vectorize(ki)

    # 2. the depthwise convolution of the row: pixels x one vector, the taps unrolled
    out = blocks[DEPTHWISE_OUT]
    sch.compute_at(out, ohi, preserve_unit_loops=True)
    *_, d_n, d_eb, d_oh, d_ow, d_e = sch.get_loops(out)
    m = divisor_at_most(ow_n, 8)
    d_owo, d_owi = sch.split(d_ow, [None, m])
    d_eo, d_ei = sch.split(d_e, [None, inner])
    sch.reorder(d_eb, d_eo, d_owo, d_owi, d_ei)
    sch.compute_at(blocks[DEPTHWISE], d_owo, preserve_unit_loops=True)
    _accumulate(sch, blocks[DEPTHWISE], target)
    sch.unroll(d_owi)
    sch.vectorize(d_ei)

    # 1. the expansion of the band's rows (and the halo rows of the depthwise window), its
    # bias and activation applied on the register tile
    exd = blocks[EXPANDED]
    sch.compute_at(exd, task, preserve_unit_loops=True)
    *_, e_n, e_eb, e_h, e_w, e_e = sch.get_loops(exd)
    sch.reorder(e_n, e_h, e_eb, e_w, e_e)
    outer, (e_bi, e_wi, e_ei) = _gemm_tile(sch, (e_eb, e_w, e_e), (eb_n, w_n, cb), inner, regs)
    ex = blocks[EXPAND]
    sch.compute_at(ex, outer[-1], preserve_unit_loops=True)
    rc = sch.get_loops(ex)[-1]
    # the reduction unrolled in whole steps within a source channel block
    _accumulate(sch, ex, target, math.gcd(_source_block(sch.get(ex)), int(sch.get(rc).extent)))
    sch.unroll(e_bi)
    sch.unroll(e_wi)
    sch.vectorize(e_ei)
    for block in others:   # per-channel tensors extended over the padded channels
        spatial_parallel_vectorize(sch, block, target)
    return sch


def _source_block(block) -> int:
    """The extent of the source's innermost dim (its channel block) as ``expand`` reads it."""
    buf = block.reads[0].source
    return int(buf.shape[-1]) if len(buf.shape) == 5 else 1


RULES = [InvertedResidual()]
