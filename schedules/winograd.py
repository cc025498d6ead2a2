"""CPU schedule of the Winograd convolution (codegen/ops/winograd.py): the register-tiled GEMM
of schedules/register_tiled.py for the transformed domain, vectorised transforms along the channels.

The kernel's stages and what each gets:

* ``wino_dt`` / ``wino_v`` (input transform): one task per tile (the threads split the
  tiles); per vector of ``lanes`` channels, the (m + 2)^2 rows-then-columns products, unrolled
  so that the transform matrices' zeros and ones fold away (``winograd._pick`` selects on the
  unrolled index), ``wino_dt`` computed per vector of channels at the tile, in registers;
* ``wino_acc`` / ``wino_m`` (batched GEMM, one per transformed position): register_tiled's
  ``RegisterTiled`` micro-kernel, tiles of ``mr`` tiles x ``nr`` output channels (x ``mu``
  panels) over the input channels, ranked by its tile model (``register_tiled.tile_configs``): the
  tuning space is its variants;
* ``wino_t`` / ``dst`` (output transform, bias, post-ops, padding store): per output tile and
  vector of output channels, ``wino_t`` in registers, the m x m outputs unrolled and
  vectorised, the destination's predicate (``dst_stage``'s valid elements) put back on the
  tiled loops.

Where the weights fit in L2 beside them, the three stages run a band of tile rows at a time
(``_band_rows``): the band's transformed source and products stay in L2 from stage to stage
instead of passing through memory (the early, wide layers: their scratch is megabytes, their
weights a few hundred KB). A GEMM cut in two (``tile_edges.panel_parts``) runs unbanded.

Where the weights are too large for bands (``PREFETCH_BYTES`` or more), each GEMM task
prefetches its share of the next panel's weights (``prefetch.prefetch_next_panel``; x86).

Rows past the last tile are computed whole (``tile_edges.whole_tiles``: clamped rows), so the
GEMM's hot loop has no predicate. The rule reads the nest's facts from the func's
``blockpad.winograd`` attribute (the tile, the destination's h, w and channel-block dims);
a func without it is not this rule's.
"""

from __future__ import annotations

import math

from tvm import s_tir, tirx

from . import register_tiled, tile_edges
from .common import REDUCE, buffer_bytes, op_of, vector_lanes
from .dot_rewrites import set_predicate, take_predicate
from .dot_tiled import _realize
from .generic import root_blocks, spatial_parallel_vectorize
from .nest import substitute, uses
from .prefetch import PREFETCH_BYTES, prefetch_next_panel
from .rule import ScheduleRule, distinct
from .vector_math import vector_math

ATTR = "blockpad.winograd"
STAGES = ("wino_dt", "wino_v", "wino_acc", "wino_m", "wino_t", "dst")
PANEL = 3   # the GEMM's panel dim, counted from the last (eps, nu, panel, tile, column)


class Winograd(ScheduleRule):
    ops = ("conv2d",)

    def schedule(self, func, target):
        space = self.space(func, target, first=True)
        return space[0] if space else None

    def space(self, func, target, first=False) -> list:
        """Complete schedules, the default first: the GEMM's register tiles (register_tiled's
        ranked Configs), each once."""
        func = vector_math(func)   # transcendental post-ops: polynomials, not libm per lane
        facts = _facts(func)
        if facts is None:
            return []
        return distinct((_schedule(func, target, cfg, facts) for cfg in configs(func, target)),
                        first)


def _facts(func):
    if op_of(func) != "conv2d" or func.attrs is None or ATTR not in func.attrs:
        return None
    return {k: int(v) for k, v in func.attrs[ATTR].items()}


def configs(func, target) -> list:
    """register_tiled's micro-kernel Configs for the GEMM: rows = tiles, columns = the weights'
    panel of output channels, column blocks = the panels."""
    sch = s_tir.Schedule(func)
    block = sch.get(sch.get_sblock("wino_acc"))
    _, _, panels, tiles, cols = (int(iv.dom.extent) for iv in block.iter_vars[:5])
    lanes = vector_lanes(target, str(block.writes[0].source.dtype))
    return register_tiled.tile_configs(tiles, cols, panels, lanes, target.tile_registers)


def _schedule(func, target, cfg, facts):
    # panels that tiles of cfg.mu leave over: a GEMM of their own (tile_edges.panel_parts)
    func, parts = tile_edges.panel_parts(func, cfg, PANEL, "wino_acc", "wino_m")
    for acc, _, c in parts:
        func, _ = tile_edges.whole_tiles(func, acc, c.mr, c.nr)
    sch = s_tir.Schedule(func)
    lanes = cfg.lanes
    names = {*STAGES, *(name for part in parts for name in part[:2])}
    try:
        others = [b for b in root_blocks(sch) if sch.get(b).name_hint not in names]
        # in bands of tile rows where the GEMM is one stage (compute_at needs its only writer)
        rows = _band_rows(func, facts) if len(parts) == 1 else 0
        band = _output_transform(sch, lanes, facts, rows)
        for acc, m, c in parts:
            if band is not None:
                sch.compute_at(sch.get_sblock(m), band, preserve_unit_loops=True)
            register_tiled._tile(sch, sch.get_sblock(acc), sch.get_sblock(m), c, target,
                                 parallel=band is None)
        if band is not None:
            sch.compute_at(sch.get_sblock("wino_v"), band, preserve_unit_loops=True)
        _input_transform(sch, lanes, parallel=band is None)
        for block in others:   # per-channel copies (bias)
            spatial_parallel_vectorize(sch, block, target)
    except s_tir.ScheduleError:
        return None
    if band is None and target.arch == "x86_64":   # measured there only
        return _prefetch_weights(sch, cfg, len(parts) > 1)
    return sch


def _prefetch_weights(sch, cfg, cut):
    """An unbanded GEMM whose transformed weights (``hwOi16o``: positions, then panels of
    ``cfg.mu`` output-channel blocks over every input channel) reach ``PREFETCH_BYTES``: each
    task prefetches its share of the next panel (``prefetch.prefetch_next_panel``). Its tasks
    walk the positions, their panels, then the tiles; where the last blocks are a part of
    their own (``cut``), the first part walks the leading panels of each position, runs of
    them a position apart. ResNet-50 (fp32, zen4, whole inferences alternating with the build
    without it, logits identical): 0.979x / 0.985x at 1 thread, 0.982x at 2; the
    channel-pruned ResNet-50 0.984x / 0.986x at 1 thread, 0.972x / 0.988x at 2."""
    weights = sch.mod["main"].params[1]
    if len(weights.shape) != 5 or buffer_bytes(weights) < PREFETCH_BYTES:   # not hwOi16o's
        return sch
    update = sch.get_sblock("wino_acc_update")
    block = sch.get(update)
    reduced = [x for iv, x in zip(block.iter_vars, _realize(sch, update).iter_values)
               if int(iv.iter_type) == REDUCE]
    fors = [sch.get(l) for l in sch.get_loops(update)]
    steps = [(f.loop_var, int(f.extent)) for f in fors[1:]
             if f.kind == tirx.ForKind.SERIAL and any(uses(x, f.loop_var) for x in reduced)]
    # the rolled reduction loop, not its unrolled steps; a panel: cfg.mu blocks of (eps, nu, kb)
    positions, blocks = math.prod(int(n) for n in weights.shape[:2]), int(weights.shape[2])
    block_bytes = buffer_bytes(weights) // (positions * blocks)
    panels = runs = None   # uncut: the panels one after another through the weights
    if cut:                # the first part: the leading panels of each position
        leading = blocks // cfg.mu
        panels, runs = positions * leading, (leading, blocks * block_bytes)
    return prefetch_next_panel(sch, fors[0], weights, cfg.mu * block_bytes, steps, panels, runs)


def _band_rows(func, facts) -> int:
    """Rows of output tiles the three stages run at a time (0: all at once), so that the
    transformed source and products of a band stay in L2 from one stage to the next: where
    the weights fit in L2 beside them (each band reads all of them again), the most rows
    whose scratch fits in ``min(L2 - weights, L2 / 2)`` and divide the rows. Measured with
    the caches flushed before each call, as inside a network (Cascade Lake, avx512, 1 thread,
    F(4x4)): 64 -> 64 at 56x56 1.80 -> 0.96 ms in bands of one row, 40 -> 41 0.97 -> 0.61 in
    bands of two (of four: 0.71); with 2.4 MB of weights (128 -> 128 at 28x28) bands of two
    ran 1.19 -> 1.25, with 6.6 MB (206 -> 224 at 14x14) bands of one 1.57 -> 2.52."""
    bufs = {b.name: b for b in func.body.block.alloc_buffers}
    weights = buffer_bytes(func.params[1])
    dst = func.params[-1].ty.shape
    rows = -(-int(dst[facts["h"]]) // facts["tile"])    # of tiles, per image
    scratch = buffer_bytes(bufs["wino_v"]) + \
        buffer_bytes(bufs["wino_m"])
    row_bytes = scratch / (int(dst[0]) * rows)
    budget = min(register_tiled.L2_BYTES - weights, register_tiled.L2_BYTES // 2)
    most = int(budget // row_bytes) if budget > 0 else 0
    band = max((d for d in range(1, min(most, rows - 1) + 1) if rows % d == 0), default=0)
    return band   # a divisor of the rows: a partial last band defeats compute_at


def _input_transform(sch, lanes, parallel=True):
    v, dt = sch.get_sblock("wino_v"), sch.get_sblock("wino_dt")
    eps, nu, p, c = sch.get_loops(v)[-4:]
    c_o, c_i = _vector_split(sch, c, lanes)
    sch.reorder(p, c_o, eps, nu, c_i)
    sch.compute_at(dt, c_o, preserve_unit_loops=True)
    for loop in (eps, nu):
        sch.unroll(loop)
    sch.vectorize(c_i)
    *_, d_eps, d_j, _, d_c = sch.get_loops(dt)
    sch.unroll(d_eps)
    sch.unroll(d_j)
    sch.vectorize(d_c)
    if parallel:
        sch.parallel(p)


def _output_transform(sch, lanes, facts, band_rows=0):
    dst, t = sch.get_sblock("dst"), sch.get_sblock("wino_t")
    valid = take_predicate(sch, dst)
    loops = sch.get_loops(dst)
    m = facts["tile"]
    h, w, c = loops[facts["h"]], loops[facts["w"]], loops[facts["c"]]
    outer = [l for i, l in enumerate(loops) if i not in (facts["h"], facts["w"], facts["c"])]
    ho, hi = sch.split(h, [None, m])
    wo, wi = sch.split(w, [None, m])
    c_o, c_i = _vector_split(sch, c, lanes)
    band = None
    if band_rows and int(sch.get(ho).extent) > band_rows:
        band, ho = sch.split(ho, [None, band_rows])
        n_loop = outer.pop(0)
        sch.reorder(n_loop, band, *outer, ho)
    tile = [ho, wo, c_o]
    sch.reorder(*outer, *tile, hi, wi, c_i)
    sch.compute_at(t, c_o, preserve_unit_loops=True)
    *_, t_eps, t_j, _, t_k = sch.get_loops(t)
    sch.unroll(t_eps)
    sch.unroll(t_j)
    sch.vectorize(t_k)
    sch.unroll(hi)
    sch.unroll(wi)
    sch.vectorize(c_i)
    par = [band] if band is not None else [*outer, ho]   # bands: one task each
    sch.parallel(sch.fuse(*par) if len(par) > 1 else par[0])
    if valid is not None:
        realize = _realize(sch, dst)
        set_predicate(sch, dst, substitute(valid, {iv.var: x for iv, x in zip(
            realize.block.iter_vars, realize.iter_values)}))
    return band


def _vector_split(sch, loop, lanes):
    """(outer, inner): ``loop`` in vectors of ``lanes`` (a unit outer loop where it is one
    vector or less)."""
    n = int(sch.get(loop).extent)
    return sch.split(loop, [None, min(n, lanes)])


RULES = [Winograd()]
