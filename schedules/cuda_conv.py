"""CUDA convolution: fp16 on tensor cores as an implicit GEMM where the GEMM is large enough
(``TensorCoreConv``), otherwise (fp32, other types, small GEMMs) a direct convolution with
shared-memory tiling (``DirectConv``), described here.

``codegen.ops.conv`` gives two stages over the destination's physical index space: ``acc``
(the reduction over input channels ``rc`` and the window ``rh``, ``rw``) and ``dst`` (post-ops,
cast, padding store). The schedule is the classic GPU direct convolution (TVM topi's
``conv2d_direct``, cuDNN's implicit-precomp kernels without the GEMM view):

* a thread block computes an output tile of ``TK`` output channels x ``TH`` rows x ``TW``
  columns of one image; each thread ``kr x wr`` outputs of it in registers (``acc`` in local
  scope), strided by the thread count so that neighbouring threads own neighbouring channels
  (or columns): their weight reads from shared memory hit distinct banks and their stores
  coalesce;
* the reduction over input channels runs in steps of ``rci``; per step the block stages the
  source window its tile needs (``TH`` rows grown by the kernel's reach, likewise columns) and
  the ``TK x rci x KH x KW`` weights into shared memory, all threads loading cooperatively
  (``compute_at`` of the copies at the step loop; TVM puts the barriers around them); then every
  thread runs its ``rci x KH x KW`` FMA steps from shared memory, register loops unrolled;
* spatial padding: with ``spatial_pad = "stage"`` the zero-haloed copy of the source
  (``src_padded``, whose loads carry the image-bounds guard) *is* the shared tile, so the FMA
  loop has no guard; fused padding keeps its ``if_then_else`` on the shared reads, and so do the
  channel-tail guards of the ``src`` policy: every predicate the plan produced survives;
* ``dst`` (post-ops, the ``dst_stage`` valid-region predicate, the ``select`` zero store) runs
  per thread on its registers, right after its reduction.

Roles come from the index expressions, not from layout tags: an output loop is a *channel* loop
when the weights are indexed by it, a *pixel* loop otherwise (batch, rows, columns: the last
two pixel loops that the source index combines with the window are tiled, others go whole to
the grid); a reduction loop is the *channel step* loop when no pixel loop shares a source
index with it.
"""

from __future__ import annotations

import math

import tvm
import tvm_ffi
from tvm import s_tir, tirx

from blockpad.vocabulary import ACC, DST

from .common import SPATIAL
from .cuda import TENSOR_CORE_MIN, bind_spatial, dlight_style, loop_depth, pow2_above, predicated_schedule
from .generic import root_blocks
from .halo import staged_source
from .nest import uses
from .rule import ScheduleRule

_IF_THEN_ELSE = tvm.ir.Op.get("prim.if_then_else")
THREADS = 256             # most threads in a block
SHARED_BYTES = 40 << 10   # shared memory a step may stage (48 KiB static, some slack)
STEPS = (16, 8, 4, 2, 1)  # channel steps tried, the largest that fits first

TENSOR_CORE_SOURCES = ("float16", "uint16")   # uint16: bf16 bits (cuda_bf16 declines others)


class TensorCoreConv(ScheduleRule):
    """fp16 and bf16 convolution (fp32 accumulation) on tensor cores, as an implicit GEMM: output pixels
    (batch, rows, columns) x output channels = M x N, input channels x window = K. The
    reduction is dlight's matmul after all (``C[S, I, J] += A[S, I, K] * B[S, J, K]``, with
    ``oh + rh`` an I and a K index of A), so dlight's ``MatmulTensorization`` schedules it:
    ``reindex`` of the source read *is* the im2col matrix, never materialised, its 128 x 64
    tiles gathered straight from the (blocked or plain) source into ``shared.dyn`` by all
    threads, the weights' 128 x 64 tiles likewise; 16x16x16 ``wmma`` fragments, M, N and K
    padded to its tiles (the padding gathers zeros). Spatial padding is ``halo.staged_source``'s
    zero-haloed copy, which the rule inlines into the gather: the image-bounds guard sits on the
    shared tile's load, not in the MMA. The epilogue (post-ops, cast, padding store) is inlined
    into the store from the accumulator; block predicates are kept (``dlight_style``). bf16
    (uint16 bits in the arguments, the staged copy included) goes through ``cuda_bf16``, which
    runs the same rule with bf16 fragments.

    Only where M, N and K each exceed ``TENSOR_CORE_MIN`` (smaller GEMMs leave most of a 128 x 128
    tile idle). Grouped convolutions (an output channel indexes the source too: no GEMM) and
    whatever the rule cannot tensorize return None: ``DirectConv`` takes them."""

    ops = ("conv2d",)

    def takes(self, func, target):
        return super().takes(func, target) and _tensor_core_gemm(func)

    def schedule(self, func, target):
        from tvm.s_tir.dlight.gpu.matmul import MatmulTensorization

        from .cuda_bf16 import tensorized

        return dlight_style(staged_source(func), target, lambda f, t: (
            tensorized(f, t) or MatmulTensorization().apply(f, t, False)))


def _tensor_core_gemm(func) -> bool:
    """Whether ``func``'s ``acc`` block is a GEMM (dlight's iter traits) with fp16 sources
    (or uint16: bf16 bits) and M, N and K each above ``TENSOR_CORE_MIN``."""
    from tvm.s_tir.dlight.gpu.matmul import IterKind, detect_iter_traits

    blocks = []
    tvm_ffi.structural_walk(func, (s_tir.SBlock, lambda b: blocks.append(b)
                                   if b.name_hint == ACC else None))
    if len(blocks) != 1 or any(str(r.source.dtype) not in TENSOR_CORE_SOURCES
                               for r in blocks[0].reads):
        return False
    traits = detect_iter_traits(blocks[0])
    if traits is None:
        return False
    dims = {kind: math.prod(int(t.extent) for t in traits[3] if t.kind == kind)
            for kind in (IterKind.kIter_I, IterKind.kIter_J, IterKind.kIter_K)}
    return all(d > TENSOR_CORE_MIN for d in dims.values())


class DirectConv(ScheduleRule):
    ops = ("conv2d",)

    def schedule(self, func, target):
        # scheduled over compact parameters (the shared tiles copy a parameter's declaration,
        # symbolic element offset included); the layouts' own ones are put back afterwards
        return predicated_schedule(staged_source(func), _conv, align=16)


class _Roles:
    """The ``acc`` nest's loops by role: channel (weights indexed by it), pixel, the channel
    step reduction loop and the window reduction loops; ``rows``/``cols``: the two tiled pixel
    loops (None where the nest has fewer)."""

    def __init__(self, sch, acc):
        block = sch.get(acc)
        loops = sch.get_loops(acc)
        iv_of = {l: iv for l, iv in zip(loops, block.iter_vars)}
        wei = _read(block, "weights")
        src = _read(block, "src")
        src_index = _indices(block, src.source)
        self.extent = {l: int(sch.get(l).extent) for l in loops}
        spatial = [l for l in loops if iv_of[l].iter_type == SPATIAL]
        reduce = [l for l in loops if iv_of[l].iter_type != SPATIAL]
        self.channel = [l for l in spatial if _uses_region(wei, iv_of[l].var)]
        self.pixel = [l for l in spatial if l not in self.channel]
        pixel_vars = [iv_of[l].var for l in self.pixel]
        window = [l for l in self.pixel if any(
            uses(e, iv_of[l].var) and any(uses(e, iv_of[r].var) for r in reduce)
            for e in src_index)]
        self.rows, self.cols = ([None, *window][-2:] if window else (None, None))
        self.step = [r for r in reduce if not any(
            uses(e, iv_of[r].var) and any(uses(e, v) for v in pixel_vars) for e in src_index)]
        self.window = [r for r in reduce if r not in self.step]
        self.src_name = src.source.name
        # grouped: a source element meets one group's channels (depthwise: one channel)
        self.grouped = any(uses(e, iv_of[l].var) for l in self.channel for e in src_index)


def _conv(sch) -> bool:
    acc, dst = sch.get_sblock(ACC), sch.get_sblock(DST)
    for block in root_blocks(sch):
        if sch.get(block).name_hint.endswith("_extended"):
            sch.compute_inline(block)       # per-channel scale / bias: read in the epilogue
    if _read(sch.get(acc), "src") is None or _read(sch.get(acc), "weights") is None:
        return False    # a window wholly in the spatial padding: its reads folded to 0
    roles = _Roles(sch, acc)
    if not roles.channel or len(roles.step) != 1:
        return False
    tile = _Tile.of(roles)
    _flatten_channels(sch, acc, roles)
    threads, step, step_in = _tile_loops(sch, acc, roles, tile)
    sch.set_scope(acc, 0, "local")
    shared = _stage(sch, acc, roles, step, tile.threads)
    if shared is None:
        return False
    _registers(sch, acc, shared[1:] if roles.grouped else shared, step_in)
    sch.reverse_compute_at(dst, threads, preserve_unit_loops=True)
    init = sch.decompose_reduction(acc, step)
    depth = loop_depth(sch, dst, threads)
    for block in (init, dst):
        for loop in sch.get_loops(block)[depth:]:
            sch.unroll(loop)
    for block in root_blocks(sch):          # stages left at the root (none for a plain conv)
        bind_spatial(sch, block)
    return True


class _Tile:
    """Threads and registers per tiled loop: ``(threads, registers)`` for the fused channel
    loop, the rows and the columns."""

    def __init__(self, k, h, w, step):
        self.k, self.h, self.w, self.step = k, h, w, step

    @property
    def threads(self) -> int:
        return self.k[0] * self.h[0] * self.w[0]

    @classmethod
    def of(cls, roles):
        ext = roles.extent
        k = math.prod(ext[l] for l in roles.channel)
        oh = ext[roles.rows] if roles.rows is not None else 1
        ow = ext[roles.cols] if roles.cols is not None else 1
        kr = 4 if k >= 16 else 1
        kt = min(16, _pow2_below(-(-k // kr)))
        wr = 4 if ow >= 16 else 2 if ow >= 4 else 1
        wt = min(THREADS // kt, pow2_above(-(-ow // wr)))
        ht = min(THREADS // (kt * wt), pow2_above(oh))
        window = math.prod(ext[r] for r in roles.window)
        c = ext[roles.step[0]]
        for step in STEPS:
            if c % step == 0 and _shared_bytes(kt * kr, ht, wt * wr, step, window) <= \
                    SHARED_BYTES:
                break
        return cls((kt, kr), (ht, 1), (wt, wr), step)


def _shared_bytes(tk, th, tw, step, window) -> int:
    """A step's shared tiles, roughly: the source window (a 3x3 kernel grows a tile's rows and
    columns by 2 each) and the weights, 4-byte elements."""
    reach = int(math.isqrt(window)) - 1
    return 4 * step * ((th + reach) * (tw + reach) + tk * window)


def _flatten_channels(sch, acc, roles):
    """Lay the accumulator out as ``[pixel dims..., channel, rows, cols]``, the output
    channel one flat dim: a thread's ``kr`` channels are then one contiguous range of one dim,
    so the local buffer compacts to ``kr x wr`` registers indexed by unrolled loops only (a
    blocked ``(K/16, 16)`` pair would make the range's image a thread-dependent box: local
    memory, not registers)."""
    spatial = [l for l in roles.extent if l in roles.pixel or l in roles.channel]
    channel = [spatial.index(l) for l in roles.channel]
    tiled = [spatial.index(l) for l in (roles.rows, roles.cols) if l is not None]
    others = [d for d in range(len(spatial)) if d not in channel and d not in tiled]
    extents = [roles.extent[l] for l in spatial]

    def index(*p):
        flat = 0
        for d in channel:
            flat = flat * extents[d] + p[d]
        return [*(p[d] for d in others), flat, *(p[d] for d in tiled)]

    sch.transform_layout(acc, ("write", 0), index)


def _tile_loops(sch, acc, roles, tile):
    """Split and order ``acc``'s loops: grid, threads, channel steps, window and step, registers;
    bind grid and threads. Returns the fused thread loop and the channel-step loop."""
    others = [l for l in roles.pixel if l not in (roles.rows, roles.cols)]
    sch.reorder(*others, *roles.channel, *[l for l in (roles.rows, roles.cols) if l])
    k = sch.fuse(*roles.channel) if len(roles.channel) > 1 else roles.channel[0]
    kb, kt, kr = sch.split(k, [None, tile.k[0], tile.k[1]])
    grid, thread, regs = others + [kb], [], [kr]
    for loop, (t, r) in ((roles.rows, tile.h), (roles.cols, tile.w)):
        if loop is None:
            continue
        b, tt, rr = sch.split(loop, [None, t, r])
        grid.append(b)
        thread.append(tt)
        regs.append(rr)
    thread.append(kt)   # channels fastest: neighbouring threads read neighbouring weights
    step, step_in = sch.split(roles.step[0], [None, tile.step])
    sch.reorder(*grid, *thread, step, *roles.window, step_in, *regs)
    bx = sch.fuse(*grid) if len(grid) > 1 else grid[0]
    tx = sch.fuse(*thread) if len(thread) > 1 else thread[0]
    sch.bind(bx, "blockIdx.x")
    sch.bind(tx, "threadIdx.x")
    for loop in regs:
        sch.unroll(loop)
    sch.annotate(step, "pragma_auto_unroll_max_step", 256)
    sch.annotate(step, "pragma_unroll_explicit", 0)
    return tx, step, step_in


def _stage(sch, acc, roles, step, threads):
    """Source and weight tiles of one channel step into shared memory, loaded by all threads.
    The source's own padding stage (``src_padded``), if any, becomes the shared tile. Returns
    the shared buffers' names, the source's first; None where a tile's size varies."""
    copies = []
    reads = list(enumerate(sch.get(acc).reads))
    for name in (roles.src_name, "weights"):
        i, read = next((i, r) for i, r in reads if r.source.name == name)
        producer = [b for b in sch.get_producers(acc) if any(
            w.source.same_as(read.source) for w in sch.get(b).writes)]
        if producer:
            sch.set_scope(producer[0], 0, "shared")
            copies.append(producer[0])
        else:
            copies.append(sch.cache_read(acc, i, "shared"))
    depth = loop_depth(sch, acc, step)
    for copy in copies:
        sch.compute_at(copy, step)
        loops = sch.get_loops(copy)[depth:]
        if not all(isinstance(sch.get(l).extent, tirx.IntImm) for l in loops):
            # a tile that changes size from block to block (a channel tile across groups:
            # seed 1 case 416): TVM cannot prove the thread split of its copy divides it
            return None
        # a tile of one element (seed 1818 case 77: one channel, one tap a step) has no loop
        # left to bind: a unit loop, so that one thread copies it
        if not loops:
            loops = [sch.add_unit_loop(copy)]
        fused = sch.fuse(*loops) if len(loops) > 1 else loops[0]
        _, tx = sch.split(fused, [None, threads])
        sch.bind(tx, "threadIdx.x")
    return [sch.get(c).writes[0].source.name for c in copies]


def _registers(sch, acc, shared, loop):
    """The ``wr`` source and ``kr`` weight values of one reduction step copied from shared
    memory into registers, once, before the ``kr x wr`` FMAs: read in the FMA loop itself,
    each guarded source value was loaded ``kr`` times (nvcc does not merge loads under
    different branches). Not the source of a grouped convolution: no channel reuses its
    values, and their region over the thread's channels is not a box (local memory)."""
    block = sch.get(acc)
    for name in shared:
        index = next(i for i, r in enumerate(block.reads) if r.source.name == name)
        if not _guarded(block, block.reads[index].source):
            sch.compute_at(sch.cache_read(acc, index, "local"), loop)


def _guarded(block, buffer) -> bool:
    """Whether ``block`` reads ``buffer`` under an ``if_then_else`` (a masked channel tail).
    Such a read stays in the FMA loop: a register copy of it would be clipped to the buffer
    at the image border, and its index would then depend on the thread (local memory)."""
    calls = []
    tvm_ffi.structural_walk(block.body, (tvm.ir.expr.Call, calls.append))
    return any(c.op.same_as(_IF_THEN_ELSE) and isinstance(c.args[1], tvm.ir.expr.TensorLoad)
               and c.args[1].source.same_as(buffer) for c in calls)


def _read(block, prefix):
    """The read region of ``block`` whose buffer name starts with ``prefix`` (None if none)."""
    return next((r for r in block.reads if r.source.name.startswith(prefix)), None)


def _indices(block, buffer):
    """Every index expression ``block`` loads ``buffer`` at."""
    loads = []
    tvm_ffi.structural_walk(block.body, (tvm.ir.expr.TensorLoad, loads.append))
    return [i for load in loads if load.source.same_as(buffer) for i in load.indices]


def _uses_region(region, var) -> bool:
    return any(uses(r.min, var) or uses(r.extent, var) for r in region.region)


def _pow2_below(n: int) -> int:
    return 1 << (max(n, 1).bit_length() - 1)


RULES = [TensorCoreConv(), DirectConv()]
