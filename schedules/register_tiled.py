"""CPU schedules (x86 AVX2 and AVX-512, Arm NEON) for convolution and matmul: a register-tiled
direct kernel.

Both ops come from ``codegen.ops.common.materialize`` as two stages over the destination's
physical index space: ``acc`` (the reduction) and ``dst`` (post-ops, cast, padding store). The
micro-kernel is the classic one (oneDNN's jit convolutions, BLIS):

* the destination's innermost physical dim (the channel block of ``nChw16c``, a panel of
  matmul columns) is the vector dim, ``nr`` elements in one or two registers; the dim outside
  it (``ow``, matmul rows) gives ``mr`` rows; for convolutions the output-channel block dim
  may add ``mu = 2`` blocks (3 on AVX-512 where the blocks come in threes, pairs and a
  one-block part cut off where they do neither: ``_panel_blocks``, ``tile_edges.panel_parts``),
  so each broadcast source element meets ``mu x nr / lanes``
  weight vectors: ``mu x mr x nr`` accumulators (AVX2: 6 x 16 = 12 ymm; AVX-512: 2 x 8 x 16 =
  16 zmm, past which LLVM spills the unrolled loop);
* ``dst`` is tiled so, and ``acc`` is computed per tile (``compute_at``) into a tile-sized
  stack buffer that LLVM keeps in registers (``common.tile_scope``): zeroed, then the
  reduction, whose loops sit
  between the tile's outer and inner loops with the one that walks the source's channel block
  innermost and unrolled (kh, kw outside it), so that each step is broadcast, weight loads and
  FMAs (``vbroadcastss`` + ``vfmadd231ps``); then the epilogue (post-ops, cast, padding store)
  on the registers;
* no guard or predicate in the hot loop: spatial padding fused into the reads (``if_then_else``
  per broadcast) is staged into a zero-haloed copy of the source, a stage of the kernel
  (``halo.staged_source``: one pass over the source against a branch per FMA pair), and a tile that
  overhangs its dim is computed whole (``tile_edges.whole_tiles``: rows past the end read the last row,
  columns past the end read the blocked layout's padding); only the destination store is
  predicated. Where that costs (a partial last panel of columns: TVM scalarises its predicated
  vector store; tall tiles over clamped rows: LLVM spills), the last rows and columns are cut off
  into kernels of their own (``tile_edges.edge_parts``); the innermost reduction loop is unrolled by 16
  with its tail peeled off where no divisor of its extent is near 16 (``_unrolled``: k = 511);
* on cores that run a 512-bit FMA as two 256-bit halves (Zen 4), a last output-channel block
  whose second half is padding (213 channels: 13 blocks and 5) is computed in ymm vectors
  (``tile_edges.half_block``): 1x1 41 -> 213 at 56x56 643 -> 583 us, 213 -> 101 1440 -> 1408
  (1 thread, one kernel alone), the channel-pruned ResNet-50 0.988x;
* a strided 1x1 (a ResNet downsample) reads a dense copy of the rows and columns it uses
  (``halo.subsampled_source``) where each panel reads the source (not with the panels inside
  the rows, which read each source row once): 512 -> 1024 from 28x28 1.13-1.20x, 1024 -> 2048
  from 14x14 1.02-1.12x on a Cascade Lake (avx512, 1 and 2 threads);
* the loops outside the tile run in parallel, fused into one (TVM's pool gives each thread a
  contiguous chunk); a panel of columns outside the rows, so its weights stay in cache while the
  rows stream past;
* weights of half an L2 or more come from memory on every inference: on x86 each task
  prefetches its share of the next panel's weights into L2 (``prefetch.py``);
* where a panel's weights outgrow L1 (1x1 1024 -> 256: 128 KiB), the reduction runs in passes
  of a few source channel blocks over a group of rows (``chunk_plan``, ``_chunked``): the
  partial sums go to a scratch between passes, and the pass's weights stay in L1.

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
from tvm import s_tir, tirx

from blockpad.channel_blocks import HALF_WIDTH_FMA
from blockpad.vocabulary import ACC, DST

from .common import REDUCE, SPATIAL, buffer_bytes, count_iters, is_true, tile_scope, vector_lanes
from .generic import root_blocks, spatial_parallel_vectorize
from .halo import staged_source, subsampled_source
from .prefetch import PREFETCH_BYTES, panels_lead, prefetch_next_panel
from .rule import ScheduleRule, distinct
from .tile_edges import edge_parts, extent, realize_of, unpredicated, whole_tiles
from .vector_math import vector_math

_realize = tvm.get_global_func("s_tir.schedule.GetSBlockRealize")
UNROLL = 16        # the innermost reduction loop is unrolled up to this many steps


@dataclass(frozen=True)
class Config:
    """One variant of the micro-kernel: ``mu`` x ``mr`` x ``nr`` accumulators (``nr`` elements
    of the vector dim in vectors of ``lanes``, ``mr`` steps of the dim outside it, ``mu`` blocks
    of output channels: each broadcast source element meets ``mu`` weight blocks), whether the
    innermost reduction loop (the source's channel block) is unrolled, whether the threads
    split the tiles of a row (more, smaller tasks) or only the rows and column panels (each
    thread keeps a row's source lines in its own cache), whether the column panels run
    inside the rows (``rows_outer_pays``) rather than outside them, and ``chunk``: source
    channel blocks per pass of a panel over a group of ``rows`` image rows (0: no passes, each
    tile reduces over every channel in registers; ``chunk_plan`` says when and why)."""

    mr: int
    nr: int
    lanes: int
    unroll: bool = True
    parallel_tiles: bool = True
    mu: int = 1
    rows_outer: bool = False
    chunk: int = 0
    rows: int = 0


class RegisterTiled(ScheduleRule):
    ops = ("conv2d", "matmul")

    def schedule(self, func, target):
        space = self.space(func, target, first=True)
        return space[0] if space else None

    def for_threads(self, func, target, threads):
        """On one core, a panel whose weights and source overflow L2 passes over all of its
        rows at once (``chunk_plan``'s ``once``): more rows a pass than the default's, which
        keeps ``MIN_TASKS`` tasks for many cores; the same sums in the same order."""
        if threads != 1 or self.configs(func, target, threads)[:1] == self.configs(func, target)[:1]:
            return None
        space = self.space(func, target, first=True, threads=threads)
        return space[0] if space else None

    def space(self, func, target, first=False, threads: int | None = None) -> list:
        """Complete, valid schedules of ``func``, the first one ``schedule``'s: the design spaces
        ``schedules/space.py`` hands MetaSchedule (register tile shapes, one or two vectors of
        columns, unrolled or rolled channel loop, what the threads split), each once: two
        Configs can schedule alike (what the threads split, where the whole panels are one).
        ``first``: stop at the first that schedules; ``threads``: for a pool of that many
        only (``configs``). exp/erf/tanh/sigmoid in the epilogue (a swish, a gelu post-op)
        become vector polynomials (``vector_math``): LLVM called libm once per lane, which
        made EfficientNet-B0's convolutions with their SiLU 2x slower than the convolution
        and the activation run apart."""
        func = vector_math(func)
        configs = self.configs(func, target, threads)
        for tails in (False, True):     # a predicated column tail only where nothing else fits
            out = distinct((_schedule(func, target, cfg, tails) for cfg in configs), first)
            if out:
                return out
        return []

    def configs(self, func, target, threads: int | None = None) -> list:
        """The default Config first, then its neighbours; [] if ``func`` is not this rule's.
        ``threads``: the pool's size where the schedule is for that many threads only."""
        if not self.takes(func, target):
            return []
        nest = _nest_shape(func)
        if nest is None:
            return []
        out = tile_configs(nest.t_extent, nest.v_extent, nest.u_extent,
                           vector_lanes(target, nest.dtype), target.tile_registers,
                           nest.predicated)
        if not nest.predicated and rows_outer_pays(nest.src_bytes, nest.w_bytes):
            out.insert(0, dataclasses.replace(out[0], rows_outer=True))
        overflows = nest.channels is not None and _panel_overflows_l2(nest, out[0])
        chunked = chunk_plan(nest.channels, out[0], overflows and threads == 1) \
            if not nest.predicated else None
        if chunked is not None:   # the default where the target's cores want passes or a
            # panel's weights and the source overflow L2, else the first neighbour (tuning on
            # the device still tries them)
            out.insert(0 if target.reduction_passes or overflows else 1,
                       dataclasses.replace(out[0], chunk=chunked[0], rows=chunked[1],
                                           rows_outer=False))
        return out


#: The L2 per core ``rows_outer_pays`` assumes: 1 MiB (Intel Xeon since Skylake-SP, AMD Zen 4)
L2_BYTES = 1 << 20


def rows_outer_pays(src_bytes: int, w_bytes: int) -> bool:
    """Whether the output-channel panels should run inside the image rows: where the source
    does not fit in L2 and the weights fit in half of it. Panels outside the rows (the
    default) read the weights once and the source once per panel, which is free while the
    source stays in L2; past that it streams from L3 once per panel. Measured on an Intel
    Xeon (Cascade Lake, 1 and 2 threads, avx512, same process alternating): 1x1 512 -> 128 at
    28x28 (1.6 MB of source, 256 KB of weights) 1.13-1.59x faster, 256 -> 64 at 56x56
    0.97-1.24x; where the source fits in L2 (64 -> 256 at 56x56, 96 -> 576 at 14x14) or the
    weights do not (2048 -> 512 at 7x7, the 3x3s of layer3) 0.76-0.99x."""
    return src_bytes > L2_BYTES and w_bytes <= L2_BYTES // 2


def _panel_overflows_l2(nest: Nest, cfg: Config) -> bool:
    """Whether one panel's weights (``cfg.mu`` blocks of output channels over every input
    channel and tap) fill more than half of L2 and overflow it with the source: then each row
    of tiles evicts what the next one reads again, and a panel streams its weights from L3
    once per row (small weights stay: ``rows_outer_pays`` is for a large source), which
    passes over the channels (``chunk_plan``), each over all of a panel's rows, read once.
    The channel-pruned ResNet-50's 3x3 450 -> 334 stride 2 at 14x14 (802 KB of weights a
    panel, 364 KB of source) on a Zen 4 (avx512, one kernel alone, 7 x 3 tiles): 1.58-1.63 ms
    in one pass, 1.39 in passes over all 7 rows, 1.61 over one row at a time; at 2 threads
    0.84 / 0.86 / 0.85 (7 tasks for 2 cores against 49). Passes otherwise cost on that core
    (``Target.reduction_passes``)."""
    c = nest.channels
    panel_bytes = c.blocks * c.block * c.taps * cfg.mu * cfg.nr * c.itemsize
    return panel_bytes > L2_BYTES // 2 and panel_bytes + nest.src_bytes > L2_BYTES


#: Bytes of weights a chunked pass keeps in L1 (``chunk_plan``): half of a 32 KiB L1D.
CHUNK_BYTES = 16 << 10
#: Tasks (panels x groups of rows) a chunked schedule leaves the threads at least, where the
#: rows allow (``chunk_plan``).
MIN_TASKS = 8
#: Bytes of a panel's partial sums over a group of rows (``chunk_plan``), kept in L1 too.
GROUP_BYTES = 32 << 10


def chunk_plan(shape: ChannelPasses | None, cfg: Config, once: bool = False):
    """``(chunk, rows)`` for ``cfg``'s tiles where a panel's weights outgrow L1, else None
    (also where the nest has no ``shape``: no channel blocks or row dim to pass over).
    ``once``: a panel's weights must be read once (with the source they overflow L2,
    ``_panel_overflows_l2``), so a group takes all the rows its scratch may hold, however few
    tasks that leaves.

    A tile reduces over all of its panel's weights: ``mu x nr`` output channels times every
    input channel and kernel tap (1x1 1024 -> 256 with 2 x 16 columns: 128 KiB), which L1 does
    not hold, so every tile streams them from L2 again (oneDNN and ONNX Runtime's NCHWc
    kernels reduce a few input-channel blocks at a time for that reason). Chunked, a panel
    walks the channels ``chunk`` blocks (about ``CHUNK_BYTES`` of weights) at a time over a
    group of ``rows`` image rows, its partial sums in a scratch of about ``GROUP_BYTES`` that
    each tile loads into registers before its chunk and stores after. Measured on an Intel
    Xeon (Cascade Lake, avx512, 1 thread), 1x1 1024 -> 256 at 14x14: 96-106 -> 117-128 GFLOP/s
    with 64 or 128 channels per chunk (256: 103-111). The groups are the threads' tasks with the
    panels: the most rows that still leave ``MIN_TASKS`` tasks (MobileNetV2's 576 -> 96 at
    14x14 ran 3 panels of whole images, 2 tasks against 1 on two cores: 0.127 -> 0.101 ms at 2
    threads in groups of 2 rows, 1 thread equal; Zen 4, avx512). None where there is no second
    chunk, no row dim apart from the panels, or the chunk would not divide the channel
    blocks."""
    if shape is None:
        return None
    per_block = shape.taps * shape.block * cfg.mu * cfg.nr * shape.itemsize
    if shape.blocks * per_block <= 2 * CHUNK_BYTES:
        return None
    chunk = max(d for d in range(1, shape.blocks + 1)
                if shape.blocks % d == 0 and (d == 1 or d * per_block <= CHUNK_BYTES))
    if chunk == shape.blocks:
        return None
    row_bytes = cfg.mu * -(-shape.width // cfg.mr) * cfg.mr * cfg.nr * shape.itemsize
    fits = [d for d in range(1, shape.height + 1)
            if shape.height % d == 0 and (d == 1 or d * row_bytes <= GROUP_BYTES)]
    panels = -(-shape.panels // cfg.mu)
    enough = [d for d in fits if once or panels * (shape.height // d) >= MIN_TASKS]
    return chunk, max(enough) if enough else min(fits)


def tile_configs(t_extent, v_extent, u_extent, lanes, regs, predicated=False) -> list:
    """The ranked micro-kernel Configs of a nest: ``t_extent`` rows, ``v_extent`` columns,
    ``u_extent`` column blocks outside the tile (1: none), ``regs`` vector registers; the best
    first, then its neighbours (also the GEMM of schedules/winograd.py). Callers cut off the
    column blocks that tiles of several leave over (``tile_edges.panel_parts``)."""
    widths = [v_extent] if predicated else _tile_widths(v_extent, lanes)
    out = []
    for nr in widths:
        for mu in (1,) if predicated else sorted({1, _panel_blocks(u_extent, regs)}):
            vecs = mu * -(-nr // lanes)
            most = max(1, accumulators(regs, vecs)[0] // vecs)
            if vecs >= 3:   # three weight vectors live: 12 accumulators (see _panel_blocks)
                most = min(most, max(1, 12 // vecs))
                most = _whole_row_height(t_extent, most, vecs, regs)
            busy = -(-accumulators(regs, vecs)[1] // vecs)
            out += [Config(mr, nr, lanes, mu=mu) for mr in _tile_heights(t_extent, most, busy)]
    out.sort(key=lambda c: (-round(_tile_score(c, t_extent, v_extent, lanes, regs), 3),
                            -c.nr, c.mu))
    best = out[0]
    out += [Config(best.mr, best.nr, lanes, unroll=False, mu=best.mu),
            Config(best.mr, best.nr, lanes, parallel_tiles=False, mu=best.mu)]
    return out


def _whole_row_height(t_extent: int, most: int, vecs: int, regs: int) -> int:
    """The most rows of a tile of ``vecs`` (3) weight vectors: ``most`` (4: 12 accumulators),
    or, where tiles of ``most`` rows would run past the end of the rows, the largest height
    up to 7 that divides them and fits the registers with the weights and a broadcast (7: 21
    + 3 + 1 of AVX-512's 32; 9 rows keep 4: 5 would cost 15 accumulators and a row past the
    end, unmeasured). A channel-pruned ResNet-50's layer4 (7x7, blocks in threes) computed 8
    columns for 7 in tiles of 4. Measured on a Zen 4 (avx512, 1 thread, one kernel alone):
    3x3 349 -> 330 at 7x7 1.20 -> 1.02 ms (4 x 3 against 7 x 3), 1x1 384 -> 336 at 14x14
    0.515 -> 0.468; rows that 4 divides keep 4 (28 wide: 2.32 against 2.35 ms with 7 x 3;
    56 wide, 1x1 213 -> 44: 0.72 against 0.71)."""
    if t_extent % most == 0:
        return most
    fits = [m for m in range(most + 1, 8) if t_extent % m == 0 and m * vecs + vecs + 1 <= regs]
    return max(fits, default=most)


def _panel_blocks(u_extent: int, regs: int) -> int:
    """Output-channel blocks a tile may take beside 1 (``Config.mu``): 2 where they pair up,
    else 3 where they come in threes, as a channel-pruned network's counts often do, with 32
    vector registers (AVX2's 16 would hold three weight vectors and few accumulators). Measured
    on a Cascade Lake (avx512, 1 thread, a cache flush before each call): the 7x7 stem to 48
    channels 2.44 -> 1.56 ms (tiles of one block ran it slower than 64 channels in tiles of
    two), 1x1 213 -> 44 at 56x56 0.96 -> 0.69, 860 -> 227 at 14x14 1.01 -> 0.93; with 5 x 3
    accumulators instead of 4 x 3 the 56-wide one ran 1.14 ms (``tile_configs`` keeps 12).
    Any other count past 2 takes pairs too, the last block cut off into a part of its own
    (``tile_edges.panel_parts``)."""
    if u_extent % 2 == 0 or u_extent > 2 and (u_extent % 3 or regs < 32):
        return 2
    return 3 if u_extent % 3 == 0 and regs >= 32 else 1


def _schedule(func, target, cfg: Config, tails=False):
    """The schedule of ``cfg``, or None where it would leave a predicated vector tail in the
    hot loop (columns past the end that no source pads, which TVM scalarises) unless
    ``tails``, or where a primitive refuses the nest. Rows and columns that whole tiles do not
    cover are, where that pays, kernels of their own (``edge_parts``)."""
    func = unpredicated(func, ACC)
    if not cfg.rows_outer:   # each panel reads the source: a strided one from a dense copy
        func = subsampled_source(func)
    func = staged_source(func)
    block = realize_of(func, ACC).block
    n_sp = count_iters(block)
    panel = _weights_block_dim(block, n_sp)
    func, parts = edge_parts(func, cfg, n_sp - panel if panel is not None else None,
                             half=target.name in HALF_WIDTH_FMA)
    whole = True
    for i, (acc, dst, c) in enumerate(parts):
        func, part_whole = whole_tiles(func, acc, c.mr, c.nr)
        whole = whole and part_whole
        parts[i] = (acc, dst, dataclasses.replace(c, nr=min(c.nr, extent(func, acc, 1))))
    if not whole and not tails:
        return None
    sch = s_tir.Schedule(func)
    names = {name for part in parts for name in part[:2]}
    try:
        stages = [b for b in root_blocks(sch) if sch.get(b).name_hint not in names]
        for acc, dst, c in parts:
            _tile(sch, sch.get_sblock(acc), sch.get_sblock(dst), c, target)
        for block in stages:   # a spatial padding stage, if the kernel has one
            spatial_parallel_vectorize(sch, block, target)
    except s_tir.ScheduleError:
        return None
    acc, _, first = parts[0]   # the leading blocks; the blocks past them, if any, their own part
    if target.arch == "x86_64" and not first.chunk and not first.rows_outer:
        return _prefetch_weights(sch, acc, first)
    return sch


def _prefetch_weights(sch, acc, cfg: Config):
    """Weights of ``PREFETCH_BYTES`` or more whose panels come one after another in memory
    (``OIhw16i16o``'s ``O`` outermost) and lead the parallel loop (a batch of one): each task
    prefetches its share of the next panel over its tiles and reduction
    (``prefetch_next_panel``). ``chunk_plan``'s passes and rows outside the panels walk the
    weights otherwise. Whole inferences alternating in one process with the build without
    it (zen4, logits identical): the channel-pruned ResNet-50 0.979-0.985x at 1 thread,
    0.981x at 2; ResNet-50 0.982x / 0.982x; MobileNetV2 0.982-0.989x / 0.973x."""
    update = sch.get_sblock(f"{acc}_update")   # decompose_reduction's name for it
    block = sch.get(update)
    u = _weights_block_dim(block, count_iters(block))
    if u is None:
        return sch
    read = _operands(block)[1]
    weights = read.source
    if buffer_bytes(weights) < PREFETCH_BYTES \
            or any(int(iv.dom.extent) > 1 for iv in block.iter_vars[:u]) \
            or not panels_lead(weights, [r.min for r in read.region], block.iter_vars[u].var):
        return sch
    fors = [sch.get(l) for l in sch.get_loops(update)]
    if fors[0].kind != tirx.ForKind.PARALLEL:
        return sch
    steps = [(f.loop_var, int(f.extent)) for f in fors[1:] if f.kind == tirx.ForKind.SERIAL]
    panel = buffer_bytes(weights) // int(weights.shape[0]) * cfg.mu
    return prefetch_next_panel(sch, fors[0], weights, panel, steps,
                               -(-int(block.iter_vars[u].dom.extent) // cfg.mu))


@dataclass(frozen=True)
class ChannelPasses:
    """What ``chunk_plan`` reads of a conv nest (``acc`` over ``n, panel, .., row, col,
    vector``): ``blocks`` source channel blocks of ``block`` channels (the innermost
    reduction), ``taps`` other reduction steps (kernel taps), ``panels`` (the panel dim's
    extent), the image's ``height`` rows and ``width`` columns, the accumulator's
    ``itemsize``."""

    blocks: int
    block: int
    taps: int
    panels: int
    height: int
    width: int
    itemsize: int


@dataclass(frozen=True)
class Nest:
    """What the rule reads of a nest: the extents of the register-tile dim (``t_extent``), of
    the vector dim (``v_extent``) and of the panel dim (``u_extent``, 1: none), the
    accumulator ``dtype``, whether the destination stage is ``predicated``, the bytes of the
    source and of the weights, and its ``channels`` for reduction passes (None: no such
    dims)."""

    t_extent: int
    v_extent: int
    dtype: str
    predicated: bool
    u_extent: int
    src_bytes: int
    w_bytes: int
    channels: ChannelPasses | None


def _nest_shape(func) -> Nest | None:
    """The ``Nest`` of ``func``, or None if the nest is not the kernel's shape."""
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
    u = _weights_block_dim(block, n_sp)
    # no reads at all where every window lies in the spatial padding
    src, weights = ([buffer_bytes(r.source) for r in block.reads[:2]] + [0, 0])[:2]
    return Nest(extents[-2], extents[-1], str(block.writes[0].source.dtype), not is_true(pred),
                extents[u] if u is not None else 1, src, weights, _channel_passes(block, n_sp, u))


def _channel_passes(block, n_sp: int, u) -> ChannelPasses | None:
    """The ``ChannelPasses`` of ``acc``'s ``block`` (``n_sp`` spatial iters, panel dim ``u``),
    or None where the nest has no panel dim outside the rows or no channel-blocked reduction."""
    extents = [int(iv.dom.extent) for iv in block.iter_vars]
    split = _innermost_reduction(block, extents[n_sp:])
    if u is None or split is None or u >= n_sp - 3:
        return None
    i, b = split
    if extents[n_sp + i] % b:   # a partial last block: no passes (a kernel of several taps
        return None             # reduces over whole blocks where they add little)
    return ChannelPasses(blocks=extents[n_sp + i] // b, block=b,
                         taps=math.prod(extents[n_sp:]) // extents[n_sp + i], panels=extents[u],
                         height=extents[n_sp - 3], width=extents[n_sp - 2],
                         itemsize=tvm.DataType(block.writes[0].source.dtype).bits // 8)


def _weights_block_dim(block, n_sp):
    """The destination dim outside the tile that only the weights depend on (the output
    channel block of ``nChw16c``), or None."""
    def uses(region, var):
        return any(any(u.same_as(var) for u in tirx.analysis.undefined_vars(r.min))
                   for r in region.region)
    reads = _operands(block)
    if len(reads) < 2:
        return None
    for d, iv in enumerate(block.iter_vars[:n_sp - 2]):
        if int(iv.dom.extent) > 1 and not uses(reads[0], iv.var) and uses(reads[1], iv.var):
            return d
    return None


def _operands(block) -> list:
    """The regions ``acc``'s ``block`` reads, source first, then the weights: not the sums it
    reads back once ``decompose_reduction`` has made it the update."""
    return [r for r in block.reads if not r.source.same_as(block.writes[0].source)]


def _tile(sch, acc, dst, cfg: Config, target, parallel: bool = True):
    """Tile ``dst`` in ``mr x nr`` tiles and compute ``acc`` per tile as the register-tiled
    micro-kernel; the loops outside the tile parallel unless ``dst`` is computed inside a
    parallel loop already (``parallel`` False: the Winograd rule's bands)."""
    n_dims = len(sch.get_loops(dst))
    panel = _weights_block_dim(sch.get(acc), n_dims)
    u = panel if cfg.mu > 1 else None
    if cfg.chunk:
        _chunked(sch, acc, dst, cfg, u, n_dims, parallel)
        return
    outer = _tile_loops(sch, dst, cfg, u, panel if cfg.rows_outer else None)
    sch.compute_at(acc, outer[-1], preserve_unit_loops=True)
    sch.set_scope(acc, 0, tile_scope(target))
    threads = outer if cfg.parallel_tiles or len(outer) < 2 else outer[:-1]
    _micro_kernel(sch, acc, dst, threads, u, n_dims, cfg, parallel)


def _tile_loops(sch, dst, cfg: Config, u, panel=None) -> list:
    """Split ``dst``'s loops into ``mr x nr`` (x ``mu``) tiles; return the loops outside the
    tile: column panels outermost, the tile's rows last; with ``panel`` (the index of the
    panel loop) the panels inside the image rows instead."""
    loops = sch.get_loops(dst)[-len(sch.get(dst).iter_vars):]   # not those it is computed at
    v_extent = int(sch.get(loops[-1]).extent)
    *outer, t, v = loops
    tile = []
    if u is not None:
        outer[u], u_inner = sch.split(outer[u], [None, cfg.mu])
        tile.append(u_inner)
    if panel is not None:
        outer.append(outer.pop(panel))
    t_outer, t = sch.split(t, [None, cfg.mr])
    if cfg.nr != v_extent:   # nr > v_extent: a cut-off partial panel, in whole vectors
        v_outer, v = sch.split(v, [None, cfg.nr])
        outer.append(v_outer)
    if tile or cfg.nr != v_extent or panel is not None:   # a predicated block refuses even a
        # no-op reorder
        sch.reorder(*outer, t_outer, *tile, t, v)
    return [*outer, t_outer]


def _micro_kernel(sch, acc, dst, threads, u, n_dims, cfg: Config, parallel=True):
    """Schedule one tile of ``dst`` (``acc`` computed at it) as the micro-kernel: the
    reduction loops between the tile's outer and inner loops, the source's channel block
    innermost and unrolled, the tile's rows unrolled, its columns in vectors; ``threads``
    fused, and parallel unless the caller's loop is (``parallel`` False)."""
    block = sch.get(acc)
    n_red = count_iters(block, REDUCE)
    n_tile = 3 if u is not None else 2
    tile = sch.get_loops(dst)[-n_tile:]
    acc_loops = sch.get_loops(acc)[:-n_red]
    at, av = acc_loops[-2:]
    a_tile = [acc_loops[len(acc_loops) - n_dims + u]] if u is not None else []
    reduce = sch.get_loops(acc)[-n_red:]
    split = _innermost_reduction(block, [int(sch.get(l).extent) for l in reduce])
    if split is not None:
        i, b = split
        parts = _split_peeled(sch, reduce[i], b)   # a partial last channel block peeled
        reduce = [*reduce[:i], *parts[:-1], *reduce[i + 1:], parts[-1]]
    sch.reorder(*reduce, *a_tile, at, av)
    fused = sch.fuse(*threads) if len(threads) > 1 else threads[0]
    if parallel:
        sch.parallel(fused)
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


def _chunked(sch, acc, dst, cfg: Config, u, n_dims, parallel=True):
    """``chunk_plan``'s schedule: ``dst`` in groups of ``cfg.rows`` image rows per panel (the
    threads split those), ``acc`` computed per group into a scratch, its reduction loops
    ordered chunk, tiles, rest of the chunk, so the chunk's weights stay in L1 while the
    group's tiles pass. Within a tile the loops are the micro-kernel's (``_micro_kernel``);
    LLVM keeps the tile's sums in registers across the chunk (the scratch is not an argument:
    nothing the loop stores to can alias it)."""
    *outer, t, v = sch.get_loops(dst)
    tile = []
    if u is not None:
        outer[u], u_inner = sch.split(outer[u], [None, cfg.mu])
        tile.append(u_inner)
    rows, rows_inner = sch.split(outer[-1], [None, cfg.rows])
    t_outer, t = sch.split(t, [None, cfg.mr])
    sch.reorder(*outer[:-1], rows, rows_inner, t_outer, *tile, t, v)
    sch.compute_at(acc, rows, preserve_unit_loops=True)
    block = sch.get(acc)
    n_red = count_iters(block, REDUCE)
    spatial = sch.get_loops(acc)[-n_dims - n_red:-n_red]
    reduce = sch.get_loops(acc)[-n_red:]
    i, b = _innermost_reduction(block, [int(sch.get(l).extent) for l in reduce])
    blocks, inner = sch.split(reduce[i], [None, b])
    passes, blocks = sch.split(blocks, [None, cfg.chunk])
    *others, at, av = spatial
    a_tile = [others.pop(u)] if u is not None else []
    at_outer, at = sch.split(at, [None, cfg.mr])
    rest = [*reduce[:i], *reduce[i + 1:]]
    sch.reorder(passes, *others, at_outer, blocks, *rest, inner, *a_tile, at, av)
    if parallel:
        sch.parallel(sch.fuse(*outer[:-1], rows))
    if cfg.unroll:
        _unrolled(sch, inner)
    for loop in (*a_tile, at):
        sch.unroll(loop)
    _vectors(sch, av, cfg.lanes)
    init = sch.decompose_reduction(acc, passes)
    _vectors(sch, sch.get_loops(init)[-1], cfg.lanes)
    for loop in (*tile, t):
        sch.unroll(loop)
    _vectors(sch, v, cfg.lanes)


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
        loops = _split_peeled(sch, loop, b if 2 * b >= UNROLL else UNROLL)
    sch.unroll(loops[-1])
    return loops


def _split_peeled(sch, loop, b) -> list:
    """``loop`` split into steps of ``b`` (itself where it has no more), the partial last
    step, if any, peeled off by TVM's loop partitioning (``pragma_loop_partition_hint``)."""
    n = int(sch.get(loop).extent)
    if b >= n:
        return [loop]
    loops = list(sch.split(loop, [None, b]))
    if n % b:
        sch.annotate(loops[0], "pragma_loop_partition_hint", 1)
    return loops


def _vectors(sch, loop, lanes):
    """Vectorise ``loop`` one register at a time: a single vector over two blocks of a
    blocked dim (32 columns of ``Ba16b`` weights) would be a gather."""
    if int(sch.get(loop).extent) > lanes:
        outer, loop = sch.split(loop, [None, lanes])
        sch.unroll(outer)
    sch.vectorize(loop)


def accumulators(regs: int, vecs: int) -> tuple:
    """(most, enough) accumulator registers for a tile ``vecs`` vectors wide (also the fused
    inverted residual's limit, schedules/inverted_residual.py). AVX2: all but
    the weight vectors and a broadcast, 12 enough (two FMA ports x 4 cycles, and slack). With
    32 registers LLVM spills the unrolled channel loop past 16 accumulators (measured on
    C=64 56x56: 8 x 2 x 16 runs at ~90% of the AVX-512 peak, 12 x 2 x 16 and 28 x 16 at 55%),
    and 16 already cost: on an AMD EPYC (Zen 4) 1x1 convolutions ran 6-21% slower with 8 x 2
    zmm accumulators than with 7 x 2 or 14 x 1 on 56-wide rows, 29% slower with 16 x 1 than
    15 x 1 on 112-wide ones, and 14 was never slower (all ResNet-50 and MobileNetV2 1x1
    layers, tuned). So 15 at most with AVX-512's 32. AArch64's 20 (``Target.tile_registers``)
    keep half, 10, as measured there before (the Zen 4 finding says nothing of NEON)."""
    if regs >= 32:
        return regs // 2 - 1, regs // 2 - 1
    if regs > 16:
        return regs // 2, regs // 2
    return regs - 1 - vecs, 3 * regs // 4


def _tile_score(cfg: Config, t_extent: int, v_extent: int, lanes: int, regs: int) -> float:
    """Expected fraction of peak of a tile shape, for ranking: accumulators enough to hide the
    FMA latency (``accumulators``); broadcasts that each feed more than one FMA (one-vector
    tiles measured at ~2/3 the rate: 14 x 8 against 5 x 16 on 14-wide rows, against 6 x 16 on
    56-wide ones); and no work on rows or columns past the end, which costs more than its
    share (on 7x7: 4 x 16 ~ 7 x 8 > 6 x 16 with 12 rows computed)."""
    vecs = cfg.mu * -(-cfg.nr // lanes)
    busy = accumulators(regs, vecs)[1]
    waste = (-(-t_extent // cfg.mr) * cfg.mr / t_extent) * (-(-v_extent // cfg.nr) * cfg.nr
                                                             / v_extent)
    return min(cfg.mr * vecs, busy) / busy * (1.0 if vecs > 1 else 0.65) / waste ** 1.5


def _tile_widths(width: int, lanes: int) -> list:
    """Candidate columns of the register tile: all of ``width`` up to two vectors (and one
    vector where it divides it), else two vectors or one; columns past the end are computed
    where the sources are padded there (``whole_tiles``), else predicated."""
    if width <= 2 * lanes:
        return [width] + ([lanes] if width > lanes and width % lanes == 0 else [])
    return [2 * lanes, lanes]


def _tile_heights(extent: int, most: int, busy: int) -> list:
    """Candidate rows of the register tile, best first. A tile that does not divide ``extent``
    costs the rows computed past its end (``whole_tiles``); a short one leaves FMA latency
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
        b = _block_steps(n, block_size)
        if b > 1 and any(u.same_as(var) for u in used):
            return i, b
    return None


def _block_steps(n: int, block: int | None) -> int:
    """Steps of the innermost reduction loop over ``n`` channels in blocks of ``block``: all
    of them if they fit in one block, else the largest divisor of the block that divides
    ``n`` where it is at least half the block and 8 (24 channels: 3 x 8), else the whole block
    with a partial last one (213 channels: 13 x 16 + 5, ``reduced_channels``'s logical
    channels; 30 on NEON's ``nChw4c``: 7 x 4 + 2, where 15 x 2 left the hot loop more loads
    than FMAs)."""
    if not block or n <= block:
        return n
    b = math.gcd(block, n)
    return b if 2 * b >= block and b >= 8 else block


RULES = [RegisterTiled()]
