"""MobileNetV2's inverted residual as one kernel: a 1x1 expansion, a depthwise convolution and a
1x1 projection, with the expanded tensor never written to memory:

    e   = expand_post_ops(conv1x1(src, expand_weights) + expand_bias)        (N, E, H, W)
    d   = depthwise_post_ops(depthwise(e, depthwise_weights, stride, pad = kernel // 2)
                             + depthwise_bias)                               (N, E, OH, OW)
    dst = post_ops(conv1x1(d, weights))                                      (N, K, OH, OW)

``post_ops`` is conv2d's whole chain (bias, the residual as a ``sum``, eltwise, binary);
``expand_post_ops`` and ``depthwise_post_ops`` hold eltwise entries only (relu6 is ``clip``
with alpha 0, beta 6). Weights keep the logical shapes of the three convolutions they stand
for: ``(E, C, 1, 1)``, ``(E, 1, 1, KH, KW)`` (``goihw``, depthwise: groups = E) and ``(K, E,
1, 1)``, in any layout (the Graph gives ``OIhw<b>i<b>o`` and ``Goihw<b>g``).

Why one kernel: the expanded tensor is the largest of the block (6x the block's input
channels) and each of the three convolutions alone is bound by memory, not arithmetic, at
MobileNet's channel counts. ``schedules/inverted_residual.py`` computes the expansion for a
band of rows, the depthwise one output row at a time and the projection from that row, all
in cache. The inner stages are declared on channel blocks of ``cb``
(``channel_blocks.inner_block``: 16 for a destination in blocks of 8 or 16, so that a
projection into ``nChw8c`` keeps the expansion on whole zmm registers); ``expanded`` is the
expansion's epilogue (bias, activation) on the image, and the depthwise reads it as
``select(in_image, expanded[clamped], 0)``: every read in the tensor, no branch, and the
epilogue applied where the expansion's sums are, in registers.
Expanded channels past E (E not a block multiple) are computed as zeros that the projection's
zero weight padding cancels; they never reach the destination.

Floating point only (float32, float64); the padding policies act on the destination as for
conv2d (``materialize``).
"""

from __future__ import annotations

from tvm import te, tirx

from blockpad.channel_blocks import inner_block
from blockpad.errors import SpecError
from blockpad.layout import window_out_size
from blockpad.vocabulary import DEPTHWISE, DEPTHWISE_OUT, EXPAND, EXPANDED

from . import eltwise, postops
from .common import OpDef, Source, int_pair, materialize, plan_for, reduced_channels

INNER = ("src", "expand_weights", "expand_bias", "depthwise_weights", "depthwise_bias", "weights")
TENSORS = (*INNER, *postops.TENSORS, "dst")
PARAMS = {"expanded": None, "channels": None, "kernel": [3, 3], "stride": [1, 1],
          "expand_post_ops": [], "depthwise_post_ops": [], "post_ops": []}
DEFAULT_TAGS = {**postops.DEFAULT_TAGS, "expand_bias": "a", "depthwise_bias": "a"}
DTYPES = ("float32", "float64")


def _check(shape, dtype, expanded, channels, kernel, stride, expand_post_ops,
           depthwise_post_ops):
    if dtype not in DTYPES:
        raise SpecError(f"inverted_residual: dtype must be one of {', '.join(DTYPES)}; "
                        f"got {dtype!r}")
    if len(shape) != 4:
        raise SpecError(f"inverted_residual: shape is the source's (N, C, H, W); "
                        f"got {list(shape)}")
    for what, v in (("expanded", expanded), ("channels", channels)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise SpecError(f"inverted_residual: {what} must be a positive integer; got {v!r}")
    kh, kw = int_pair("inverted_residual", kernel, "kernel", 1)
    if kh % 2 == 0 or kw % 2 == 0:
        raise SpecError(f"inverted_residual: the depthwise kernel must have odd sides (its "
                        f"padding is kernel // 2 on each side); got {[kh, kw]}")
    for what, chain in (("expand_post_ops", expand_post_ops),
                        ("depthwise_post_ops", depthwise_post_ops)):
        bad = [p for p in postops.check(chain) if p["kind"] != "eltwise"]
        if bad:
            raise SpecError(f"inverted_residual: {what} takes eltwise post-ops only (the "
                            f"biases are the expand_bias and depthwise_bias tensors); got {bad}")
    return (kh, kw), int_pair("inverted_residual", stride, "stride", 1)


def out_hw(h, w, kernel, stride) -> tuple:
    """The depthwise stage's output size: its window padded by kernel // 2 on each side."""
    return tuple(window_out_size(n, k, s, (k // 2, k // 2))
                 for n, k, s in zip((h, w), kernel, stride))


def signature(shape, dtype, params):
    kernel, stride = _check(tuple(shape), dtype, *(params[p] for p in (
        "expanded", "channels", "kernel", "stride", "expand_post_ops", "depthwise_post_ops")))
    n, c, h, w = shape
    e, k = params["expanded"], params["channels"]
    dst = (n, k, *out_hw(h, w, kernel, stride))
    return {"src": (tuple(shape), dtype), "expand_weights": ((e, c, 1, 1), dtype),
            "expand_bias": ((e,), dtype), "depthwise_weights": ((e, 1, 1, *kernel), dtype),
            "depthwise_bias": ((e,), dtype), "weights": ((k, e, 1, 1), dtype),
            **postops.tensors(params["post_ops"], dst, k, dtype), "dst": (dst, dtype)}


def make(layouts, name, policy, expanded=None, channels=None, kernel=(3, 3), stride=(1, 1),
         expand_post_ops=(), depthwise_post_ops=(), post_ops=()):
    src, dst = layouts["src"], layouts["dst"]
    (kh, kw), (sh, sw) = _check(src.shape, src.dtype, expanded, channels, kernel, stride,
                                expand_post_ops, depthwise_post_ops)
    n, c, h, w = src.shape
    ph, pw = kh // 2, kw // 2
    cb = inner_block(dst.blocks[1])
    eb = -(-expanded // cb)
    # the expansion reduces over the source's channels rounded up to 8 (reduced_channels)
    c_red = reduced_channels(c, src, layouts["expand_weights"], 8)
    acc_type = postops.types(src.dtype)[1]
    zero = tirx.const(0, acc_type)

    def eltwise_chain(v, chain):
        for p in postops.check(chain):
            v = eltwise.apply(p["algorithm"], v, p["alpha"], p["beta"])
        return v

    def opdef(mode):
        x, we, be, wd, bd, wp = (Source(t, layouts[t], mode) for t in INNER)
        post = postops.Chain(post_ops, layouts, mode)

        def reading(ranges, *sources):
            """Sets the ranges of a stage's loop and reduce vars on the sources it reads, so
            that each read is guarded exactly where it can leave the tensor."""
            for s in sources:
                s.bounds = ranges

        rc = te.reduce_axis((0, c_red), "rc")

        def expand(b, e_b, y, z, e_i):
            reading({b: (0, n - 1), e_b: (0, eb - 1), y: (0, h - 1), z: (0, w - 1),
                     e_i: (0, cb - 1), rc.var: (0, c_red - 1)}, x, we)
            return te.sum(x(b, rc, y, z) * we(e_b * cb + e_i, rc, 0, 0), axis=[rc])

        ex = te.compute((n, eb, h, w, cb), expand, name=EXPAND)

        def expanded_value(b, e_b, y, z, e_i):
            reading({e_b: (0, eb - 1), e_i: (0, cb - 1)}, be)
            return eltwise_chain(ex[b, e_b, y, z, e_i] + be(e_b * cb + e_i), expand_post_ops)

        exd = te.compute((n, eb, h, w, cb), expanded_value, name=EXPANDED)
        oh, ow = out_hw(h, w, (kh, kw), (sh, sw))
        rh, rw = te.reduce_axis((0, kh), "rh"), te.reduce_axis((0, kw), "rw")

        def depthwise(b, e_b, y, z, e_i):
            reading({e_b: (0, eb - 1), e_i: (0, cb - 1), rh.var: (0, kh - 1), rw.var: (0, kw - 1)},
                    wd)
            iy, iz = y * sh + rh - ph, z * sw + rw - pw
            inside = tirx.all(iy >= 0, iy < h, iz >= 0, iz < w)
            cell = exd[b, e_b, tirx.max(0, tirx.min(iy, h - 1)), tirx.max(0, tirx.min(iz, w - 1)),
                       e_i]
            return te.sum(tirx.Select(inside, cell, zero) * wd(e_b * cb + e_i, 0, 0, rh, rw),
                          axis=[rh, rw])

        dw = te.compute((n, eb, oh, ow, cb), depthwise, name=DEPTHWISE)

        def depthwise_value(b, e_b, y, z, e_i):
            reading({e_b: (0, eb - 1), e_i: (0, cb - 1)}, bd)
            return eltwise_chain(dw[b, e_b, y, z, e_i] + bd(e_b * cb + e_i), depthwise_post_ops)

        dwo = te.compute((n, eb, oh, ow, cb), depthwise_value, name=DEPTHWISE_OUT)
        ro, ri = te.reduce_axis((0, eb), "ro"), te.reduce_axis((0, cb), "ri")

        def value(b, k, y, z):
            return te.sum(dwo[b, ro, y, z, ri] * wp(k, ro * cb + ri, 0, 0), axis=[ro, ri])

        params = {"expanded": expanded, "channels": channels, "kernel": [kh, kw],
                  "stride": [sh, sw], "expand_post_ops": list(expand_post_ops),
                  "depthwise_post_ops": list(depthwise_post_ops), "post_ops": list(post_ops)}
        return OpDef("inverted_residual", [x, we, be, wd, bd, wp, *post.sources.values()], value,
                     reduce=True, epilogue=post, params=params, axes=[ro, ri])

    p = plan_for(policy, opdef("trusted"), dst, reduces_over_padding=c_red > c)
    return materialize(opdef(p.reads), dst, p, name)

