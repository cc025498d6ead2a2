"""2-D max and average pooling (oneDNN semantics), fp32, declared once over logical indices:

    dst[n, c, oh, ow] = max / avg over (kh, kw) of src[n, c, oh*sh - ph + kh*dh, ow*sw - pw + kw*dw]

A window cell outside the image reads the value the reduction needs: -inf for the max, 0 for
the sum. The average divides by the whole window (``exclude_pad = false``, oneDNN's
``pooling_avg_include_padding``) or by the cells inside the image (``exclude_pad = true``,
``pooling_avg_exclude_padding``). ``stride`` defaults to the kernel, ``dilation`` 1 is a dense
window (PyTorch's convention).

Channels are not reduced over, so source padding is read only to compute destination padding
under the ``full`` plan. There the max reads -inf (the guard's value) and the average reads the
clean padding, 0: ``propagates_zero`` derives a zero store for the max only.
"""

from __future__ import annotations

import math

from tvm import te, tirx

from blockpad.errors import SpecError

from .common import OpDef, Source, int_pair, materialize, plan_for

PARAMS = {"algorithm": "max", "kernel": [2, 2], "stride": None, "pad": [0, 0],
          "dilation": [1, 1], "exclude_pad": True}


def geometry(shape, kernel, stride, pad, dilation):
    """``(kernel, stride, pad, dilation, out)`` pairs, checked: every window holds a cell of
    the image (else its average has no cells to divide by)."""
    if len(shape) != 4:
        raise SpecError(f"pool: shape is the source's (N, C, H, W); got {list(shape)}")
    kernel, pad = int_pair("pool", kernel, "kernel", 1), int_pair("pool", pad, "pad", 0)
    dilation = int_pair("pool", dilation, "dilation", 1)
    stride = kernel if stride is None else int_pair("pool", stride, "stride", 1)
    out = tuple((n + 2 * p - d * (k - 1) - 1) // s + 1
                for n, k, s, p, d in zip(shape[2:], kernel, stride, pad, dilation))
    for n, k, s, p, d, o in zip(shape[2:], kernel, stride, pad, dilation, out):
        if o < 1 or any(_cells(i * s - p, k, d, n) == 0 for i in range(o)):
            raise SpecError(f"pool: kernel {list(kernel)} (dilation {list(dilation)}) with pad "
                            f"{list(pad)} has windows outside the {shape[2]}x{shape[3]} image")
    return kernel, stride, pad, dilation, out


def signature(shape, dtype, params):
    *_, out = geometry(shape, *(params[p] for p in ("kernel", "stride", "pad", "dilation")))
    return {"src": (tuple(shape), dtype), "dst": ((*shape[:2], *out), dtype)}


def make(layouts, name, policy, algorithm="max", kernel=(2, 2), stride=None, pad=(0, 0),
         dilation=(1, 1), exclude_pad=True):
    if algorithm not in ("max", "avg"):
        raise SpecError(f"pool algorithm: expected 'max' or 'avg'; got {algorithm!r}")
    src, dst = layouts["src"], layouts["dst"]
    if src.dtype != "float32":
        raise SpecError(f"pool: dtype must be float32; got {src.dtype}")
    (kh, kw), (sh, sw), (ph, pw), (dh, dw), _ = geometry(src.shape, kernel, stride, pad, dilation)
    h, w = src.shape[2:]

    def opdef(mode):
        x = Source("src", src, mode)
        rh, rw = te.reduce_axis((0, kh), "rh"), te.reduce_axis((0, kw), "rw")

        def value(n, c, oh, ow):
            ih, iw = oh * sh - ph + rh * dh, ow * sw - pw + rw * dw
            if algorithm == "max":
                return te.max(x(n, c, ih, iw, pad=-math.inf), axis=[rh, rw])
            return te.sum(x(n, c, ih, iw), axis=[rh, rw])

        def average(total, idx):
            _, _, oh, ow = idx
            if not exclude_pad:
                return total * tirx.const(1 / (kh * kw), "float32")
            cells = _cells(oh * sh - ph, kh, dh, h) * _cells(ow * sw - pw, kw, dw, w)
            # at least 1: a destination halo's window lies outside the image (its sum is 0)
            return total / tirx.max(cells, 1).astype("float32")

        params = {"algorithm": algorithm, "kernel": [kh, kw], "stride": [sh, sw],
                  "pad": [ph, pw], "dilation": [dh, dw], "exclude_pad": bool(exclude_pad)}
        return OpDef("pool", [x], value, reduce=True,
                     epilogue=average if algorithm == "avg" else None,
                     params=params, axes=[rh, rw])

    p = plan_for(policy, opdef("trusted"), dst)
    return materialize(opdef(p.reads), dst, p, name)


def _cells(start, k, d, n):
    """How many of the ``k`` taps ``start + i*d`` fall in ``[0, n)``: Python ints or TVM
    expressions (``//`` is floor division on both)."""
    if isinstance(start, int):
        return sum(0 <= start + i * d < n for i in range(k))
    first = tirx.max(0, -(start // d))             # ceil(-start / d)
    last = tirx.min(k - 1, (n - 1 - start) // d)
    return last - first + 1
