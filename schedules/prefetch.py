"""Weights a panel ahead: large weights come from memory on every inference, so a
register-tiled kernel whose tasks walk its weights panel after panel prefetches, from each
task, its share of the next panel (``prefetch_next_panel``). The x86 rules that do:
``vpdpbusd``'s (``dot_tiled``), the float32 direct kernel (``register_tiled``) and the
Winograd GEMMs too large for bands (``winograd``). Figures are in the functions' docstrings
and docs/performance.md."""

from __future__ import annotations

import math

import tvm_ffi
from tvm import s_tir, tirx

from .common import buffer_bytes, element_strides
from .nest import substitute, uses

#: Weights of at least this many bytes (half an L2) are read panel by panel, each task
#: prefetching its share of the next panel (``prefetch_next_panel``): in the dot rules whose
#: ``prefetch`` is set, the float32 direct kernel and the unbanded Winograd GEMMs.
PREFETCH_BYTES = 512 << 10
LINE = 64            # bytes a prefetch brings
L2_LOCALITY = 2      # llvm.prefetch's locality for L2 (x86 prefetcht1); 3 (L1) measured slower


def panels_lead(weights, indices, var) -> bool:
    """Whether the weights (``weights`` read at ``indices``) have the destination's panel dim
    (``var``: ``OIhw4i16o4i``'s and ``OIhw16i16o``'s ``O``, ``BA16b4a``'s ``B``) outermost and
    nowhere else, in a compact buffer: then a panel of output-channel blocks is one contiguous
    run of the weights (a dim of 1 may keep a symbolic stride)."""
    shape = [int(n) for n in weights.shape]
    compact = [math.prod(shape[i + 1:]) for i in range(len(shape))]
    if any(n > 1 and not (isinstance(x, (int, tirx.IntImm)) and int(x) == c)
           for n, x, c in zip(shape, element_strides(weights), compact)):
        return False
    walks = [uses(x, var) for x in indices]
    return walks[0] and not any(walks[1:])


def prefetch_next_panel(sch, task, weights, panel, steps, panels=None, runs=None):
    """``sch`` with each task (one register tile: the ``For`` ``task``, whose tasks walk the
    weights a panel of ``panel`` contiguous bytes after another from their start, as many
    tasks a panel; ``panels`` of them where not all of the weights: a kernel's part whose
    last blocks a part of its own computes; ``runs``, ``(panels, bytes)``: the panels lie in
    runs of that many, that many bytes apart, as a Winograd GEMM's first part walks the
    leading panels of each position)
    prefetching into L2 its share of the next panel's weights, spread over its reduction
    (``steps``: the reduction loops' vars and extents, outermost first): at the deepest of
    those loops that runs no more often than there are lines to fetch, a few lines an
    iteration. Weights this large come from memory on every inference, and a
    panel's tiles all read them at once at its first: the hardware prefetcher, which starts
    on misses, follows too late. Spread over the tiles and their steps, the next panel
    arrives while this one computes; all at a tile's start (a loop of 330 prefetches before
    a layer4 3x3's tile), the prefetches held the tile up: those 3x3s went 0.61 -> 0.74 ms.
    int8 ResNet-50 on Zen 4 (zen4, whole inferences alternating with the same build without
    it, logits identical): 0.974-0.984x at 1 thread, 0.971-0.978x at 2 (with a branch that
    stopped at the share instead: 0.966-0.980x, and layer4's steps 4.62 -> 4.22 ms in the
    network's order). Panels outermost alone changed nothing.
    Unchanged where the tiles of one panel are fewer than 2."""
    var, tasks = task.loop_var, int(task.extent)
    item = tvm_ffi.dtype(str(weights.dtype)).itemsize
    total = buffer_bytes(weights)
    if panels is None:
        panels = total // panel if total % panel == 0 else 0
    if not steps or not panels or panels * panel > total or tasks % panels \
            or tasks // panels < 2:
        return sch
    per_panel = tasks // panels
    lines = -(-panel // LINE // per_panel)                  # a task's share of the next panel
    depth = max(d for d in range(1, len(steps) + 1)
                if d == 1 or math.prod(n for _, n in steps[:d]) <= lines)
    steps = steps[:depth]
    per_step = -(-lines // math.prod(n for _, n in steps))
    p, t = tirx.floordiv(var, per_panel), tirx.floormod(var, per_panel)
    step = 0
    for v, n in steps:
        step = step * n + v
    k = tirx.Var("k", "int32")
    # no branch: one on the reduction loops makes TVM's loop partitioning copy their bodies
    # (a Winograd GEMM's build took 7x as long). The last iterations run past the share (less
    # than an iteration's worth a step, into the next task's), the last panel's tasks fetch the
    # weights' last line
    nxt = p + 1
    start = nxt * panel if runs is None else \
        tirx.floordiv(nxt, runs[0]) * runs[1] + tirx.floormod(nxt, runs[0]) * panel
    at = tirx.min(start + (t * lines + step * per_step + k) * LINE, total - LINE)
    fetch = tirx.Evaluate(tirx.call_llvm_intrin(
        "void", "llvm.prefetch.p0", weights.access_ptr("r", offset=tirx.floordiv(at, item)),
        tirx.const(0, "int32"), tirx.const(L2_LOCALITY, "int32"), tirx.const(1, "int32")))
    pre = tirx.For(k, 0, per_step, tirx.ForKind.UNROLLED, fetch) if per_step > 1 else \
        substitute(fetch, {k: tirx.const(0, "int32")})
    innermost = steps[-1][0]

    def visit(f):
        if not f.loop_var.same_as(innermost):
            return f
        return tirx.For(f.loop_var, f.min, f.extent, f.kind, tirx.SeqStmt([pre, f.body]),
                        f.thread_binding, f.annotations)
    func = sch.mod["main"]
    return s_tir.Schedule(func.with_body(tvm_ffi.structural_map(func.body, (tirx.For, visit))))
