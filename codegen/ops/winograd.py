"""Winograd convolution F(m x m, 3 x 3) (Lavin & Gray 2015): a 3x3, stride-1, dense, ungrouped
fp32 convolution computed on m x m output tiles as

    Y = A^T [ (G g G^T) (.) (B^T d B) ] A        per tile, summed over input channels

with d the (m + 2) x (m + 2) input tile, g a 3x3 filter and (.) the elementwise product. The
products of all input channels meet in a batched GEMM, one per transformed position (eps, nu):

    M[eps, nu, p, k] = sum_c V[eps, nu, p, c] * U[eps, nu, c, k]

which needs (m + 2)^2 / m^2 multiplications per output and channel pair where the direct
convolution needs 9: 4x fewer for F(2x2), 2.25/9 -> 4x for F(4x4), 1.78/9 -> 5x for F(6x6).

Stages of the kernel (all declared here, over logical indices of the source and destination):

* ``wino_dt``, ``wino_v``: the input transform V = B^T d B, in two passes (rows, then columns:
  2 (m + 2) products of a (m + 2)-vector instead of (m + 2)^2 of length (m + 2)^2), reading the
  source through ``Source``: the spatial padding is fused (a guard on tile reads that can fall
  outside the image), no padded copy is made; over whole channel blocks of a blocked source
  (its padding read as the zeros the policy keeps there), so that no vector of channels is
  partial: TVM scalarises a predicated vector loop (a pruned network's 40 -> 41 at 56x56 took
  1.44 ms with partial vectors, 0.54 with whole blocks; 48 -> 48 takes 0.59);
* ``wino_acc`` / ``wino_m``: the batched GEMM over input channels, the pair of stages (a
  reduction and its store) the register-tiled CPU rule schedules (``schedules/winograd.py``);
* ``wino_t`` and ``dst``: the output transform Y = A^T M A, also in two passes, whose second is
  the destination stage of ``common.materialize``: bias, post-ops, the destination padding of
  the policy (select, predicate, a separate zero-pad kernel) exactly as the direct kernel does,
  so all six policies give the same numbers; the channel padding is stored as a select (an
  ``if_then_else`` on a vector of channels scalarises the loop: 48 -> 41 0.82 -> 0.55 ms).

Weights: the kernel takes them already transformed, U = G g G^T, in the Winograd-domain layout
``hwOi<b>o`` over the logical ``(K, C, m + 2, m + 2)`` tensor (``weights_layout``): per
transformed position and block of ``b`` output channels, a C x b panel, the columns the GEMM's
register tile loads as vectors. The library holds the transform as a kernel of its own,
``<name>__winograd_weights`` (logical ``oihw`` weights in, the Winograd layout out, computed in
float64 and rounded once), named in the conv kernel's manifest entry (``params.winograd``);
``bp.Graph`` runs it once per constant.

Transform matrices, the weights layout, the accuracy bound and ``auto``'s cost model live in
``blockpad.winograd`` (pure Python: the runtime's ``bp.Graph`` uses them too).
"""

from __future__ import annotations

from tvm import te, tirx

from blockpad.errors import SpecError
from blockpad.layout import Layout, pad_sides_param
from blockpad.winograd import (
    DEFAULT_TILE,
    applicable,
    matrices,
    transform_name,
    weights_shape,
)

from ..policy import plan
from . import postops
from .common import OpDef, Source, dtype_of, materialize, plan_for

ATTR = "blockpad.winograd"  # func attribute: the schedule rule's facts about the nest


def block_of(dst: Layout) -> int:
    """Output channels per column panel of Winograd weights in a plain layout: the
    destination's channel block (8 of ``nChw8c``, 16 of ``nChw16c``), else 16 (two AVX2
    vectors, one AVX-512 vector, four NEON ones)."""
    return dst.block_of(1) if dst.block_of(1) > 1 else 16


def make(layouts, name, policy, geo, post_ops, tile=DEFAULT_TILE):
    """The kernels of a Winograd convolution: the convolution (taking Winograd-domain
    weights), its ``dst_stage`` zero-pad kernel if the policy has one, and the weights
    transform."""
    src, dst, wl = layouts["src"], layouts["dst"], layouts["weights"]
    why = applicable(geo, src.dtype)
    if why is not None:
        raise SpecError(f"conv2d: algorithm 'winograd' needs {why}")
    m = tile
    at, _, bt = (_floats(x) for x in matrices(m))
    a = m + 2
    kb = wl.block_of(0) if wl.block_of(0) > 1 else block_of(dst)   # the GEMM's column panel
    logical_w = Layout("oihw", geo.weights, src.dtype)
    (ph, _), (pw, _) = geo.pad   # the before sides: tile t reads rows t m - ph ...
    oh, ow = geo.out
    th, tw = -(-oh // m), -(-ow // m)
    tiles = geo.n * th * tw
    kp = -(-geo.k // kb) * kb
    # the tiles [lo, hi) along h (w) whose input window lies inside the image
    inner_h = (-(-ph // m), (geo.h - a + ph) // m + 1)
    inner_w = (-(-pw // m), (geo.w - a + pw) // m + 1)
    # the input transform runs over whole channel blocks of a blocked source (its padding
    # read as the zeros it holds): a partial vector of channels is a predicated loop, which
    # TVM scalarises (40 -> 48 channels at 56x56: 2x the time of 48 -> 48)
    cv = src.padded_shape[1] if src.block_of(1) > 1 else geo.c
    # the GEMM runs over whole panels of the weights' padding; the transform over the source's
    over_padding = kp > geo.k or cv > geo.c

    def opdef(mode):
        x, u = Source("src", src, mode), Source("weights", wl, mode)
        post = postops.Chain(post_ops, layouts, mode)

        def rows(eps, j, p, c):
            x.bounds = {eps: (0, a - 1), j: (0, a - 1), p: (0, tiles - 1), c: (0, cv - 1)}
            n, ti, tj = p // (th * tw), p % (th * tw) // tw, p % tw
            ih, iw = ti * m - ph, tj * m + j - pw

            def dt(read):
                return _pick(eps, [_dot(bt[e], [read(n, c, ih + i, iw) for i in range(a)])
                                   for e in range(a)])

            # a tile wholly inside the image reads without a bounds check; a border tile
            # through Source's guards: one branch per tile, not one per read
            border = [cond for cond, needed in (
                (ti < inner_h[0], inner_h[0] > 0), (ti >= inner_h[1], inner_h[1] < th),
                (tj < inner_w[0], inner_w[0] > 0), (tj >= inner_w[1], inner_w[1] < tw)) if needed]
            if not border:
                return dt(x)
            if inner_h[0] >= inner_h[1] or inner_w[0] >= inner_w[1]:
                return dt(x)   # no tile is inside the image
            return tirx.if_then_else(tirx.any(*border), dt(x), dt(
                lambda *idx: x.tensor(*src.to_physical(idx))))

        dt = te.compute((a, a, tiles, cv), rows, name="wino_dt")
        v = te.compute((a, a, tiles, cv), lambda eps, nu, p, c: _pick(
            nu, [_dot(bt[e], [dt(eps, j, p, c) for j in range(a)]) for e in range(a)]),
            name="wino_v")
        rc = te.reduce_axis((0, geo.c), "rc")

        def gemm(eps, nu, kb_, p, kv):
            u.bounds = {eps: (0, a - 1), nu: (0, a - 1), kb_: (0, kp // kb - 1),
                        kv: (0, kb - 1), rc.var: (0, geo.c - 1)}
            return te.sum(v(eps, nu, p, rc) * u(kb_ * kb + kv, rc, eps, nu), axis=[rc])

        acc = te.compute((a, a, kp // kb, tiles, kb), gemm, name="wino_acc")
        mm = te.compute(acc.shape, lambda *i: acc(*i), name="wino_m")
        t = te.compute((a, m, tiles, kp), lambda eps, j, p, k: _pick(
            j, [_dot(at[i], [mm(eps, nu, k // kb, p, k % kb) for nu in range(a)])
                for i in range(m)]), name="wino_t")

        def value(n, k, h, w):
            # the destination's channel padding and halo read as 0 (clamped reads of T there,
            # which holds whole tiles of whole panels only); nothing to guard without them
            inside = []
            if dst.padded_shape[1] + dst.paddings[1][1] > geo.k:
                inside.append(k < geo.k)
                k = tirx.min(k, kp - 1)
            if any(dst.paddings[2]):
                inside += [h >= 0, h < oh]
                h = tirx.min(tirx.max(h, 0), oh - 1)
            if any(dst.paddings[3]):
                inside += [w >= 0, w < ow]
                w = tirx.min(tirx.max(w, 0), ow - 1)
            p = (n * th + h // m) * tw + w // m
            y = _pick(h % m, [_dot(at[i], [t(eps, w % m, p, k) for eps in range(a)])
                              for i in range(m)])
            if not inside:
                return y
            # a Select (both sides evaluated: the reads above are clamped in bounds) where
            # if_then_else would scalarise the vectorised channel loop
            return tirx.Select(tirx.all(*inside), y, tirx.const(0, src.dtype))

        params = {"channels": geo.k, "kernel": [3, 3], "stride": [1, 1],
                  "pad": pad_sides_param(geo.pad),
                  "dilation": [1, 1], "groups": 1, "post_ops": list(post_ops),
                  "algorithm": "winograd", "winograd_tile": m,
                  "winograd": {"tile": m, "weights_transform": transform_name(name),
                               "weights": wl.describe(), "logical_weights": logical_w.describe()}}
        return OpDef("conv2d", [x, u, *post.sources.values()], value, epilogue=post,
                     params=params)

    p = plan_for(policy, opdef("trusted"), dst, reduces_over_padding=over_padding)
    kernels = materialize(opdef(p.reads), dst, p, name)
    dims = [d.dim for d in dst.physical]
    inner_c = max(i for i, d in enumerate(dst.physical) if d.dim == 1)
    kernels[0].func = kernels[0].func.with_attr(ATTR, {
        "tile": m, "h": dims.index(2), "w": dims.index(3), "c": inner_c})
    return [*kernels, *transform(logical_w, wl, transform_name(name))]


PARAMS = {"winograd_tile": DEFAULT_TILE}


def transform_signature(shape, dtype, params):
    """op ``winograd_weights``: ``shape`` the logical (K, C, 3, 3) weights."""
    if len(shape) != 4 or tuple(shape[2:]) != (3, 3):
        raise SpecError(f"winograd_weights: shape is the 3x3 weights' (K, C, 3, 3); got "
                        f"{list(shape)}")
    return {"src": (tuple(shape), dtype),
            "dst": (weights_shape(*shape[:2], params["winograd_tile"]), dtype)}


def make_transform(layouts, name, policy, winograd_tile=DEFAULT_TILE):
    return transform(layouts["src"], layouts["dst"], name)


def transform(src: Layout, dst: Layout, name: str):
    """The weights transform U = G w G^T as a kernel: ``src`` logical (K, C, 3, 3) weights in,
    ``dst`` (any layout of the Winograd-domain (K, C, m + 2, m + 2)) out, computed in float64
    and rounded once, channel padding written zero. Data preparation: the same code under
    every policy, its destination always clean."""
    a = dst.shape[2]
    g = _floats(matrices(a - 2)[1])
    w = Source("src", src, "trusted")

    def value(k, c, eps, nu):
        rows = [[w(k, c, r, s).astype("float64") for s in range(3)] for r in range(3)]
        cols = [_pick(eps, [_dot(g[e], [rows[r][s] for r in range(3)]) for e in range(a)])
                for s in range(3)]
        return _pick(nu, [_dot(g[e], cols) for e in range(a)]).astype(dst.dtype)

    op = OpDef("winograd_weights", [w], value, params={"winograd_tile": a - 2})
    # the padding is stored as a select: -1.0 * 0.0 would leave -0.0 bits there
    return materialize(op, dst, plan("dst_fused", propagates_zero=False, reads_padding=False),
                       name)


# ---- expressions ----------------------------------------------------------------------------

def _floats(mat):
    return [[float(v) for v in row] for row in mat]


def _dot(coefs, terms):
    """sum_i coefs[i] * terms[i] over the non-zero coefficients, unit ones without a product:
    the transforms are mostly 0 and +-1."""
    out = None
    for c, t in zip(coefs, terms):
        if c == 0:
            continue
        term = t if c == 1 else tirx.const(c, dtype_of(t)) * t
        out = term if out is None else out - t if c == -1 else out + term
    return out


def _pick(index, exprs):
    """``exprs[index]`` for a symbolic index: a chain of selects that unrolling the loop over
    ``index`` folds to one expression per iteration."""
    out = exprs[-1]
    for i in range(len(exprs) - 2, -1, -1):
        out = tirx.Select(index == i, exprs[i], out)
    return out
