"""2-D max and average pooling (oneDNN semantics), declared once over logical indices:

    dst[n, c, oh, ow] = max / avg over (kh, kw) of src[n, c, oh*sh - ph + kh*dh, ow*sw - pw + kw*dw]

A window cell outside the image reads the value the reduction needs: -inf for the max, 0 for
the sum. A NaN in a window makes its max NaN, as in PyTorch (``common.NAN_MAX``). The
average divides by the window's cells inside the padded image (``exclude_pad =
false``, oneDNN's ``pooling_avg_include_padding``, ONNX's ``count_include_pad = 1``) or by those
inside the image (``exclude_pad = true``, ``pooling_avg_exclude_padding``). ``stride`` defaults
to the kernel, ``dilation`` 1 is a dense window (PyTorch's convention). ``pad`` is one integer,
``[h, w]`` or per side ``[[top, bottom], [left, right]]`` (as conv2d's).

``ceil_mode`` (PyTorch's and ONNX's) rounds the output size up, so a last window may hang over
the bottom/right padding (its cells there count for neither average), except that no window
starts past the padded image's top/left part: one that would is dropped, as PyTorch and ONNX
Runtime do.

The max also pools 8-bit integers (``uint8``, ``int8``: oneDNN's int8 max pooling, and what a
quantized model's ``DequantizeLinear -> MaxPool -> QuantizeLinear`` is, exactly, since
dequantization is monotonic): a cell outside the image reads the type's smallest value. The
average stays fp32 (an integer average needs a rounding rule of its own).

Channels are not reduced over, so source padding is read only to compute destination padding
under the ``full`` plan. There the max reads -inf (the guard's value) and the average reads the
clean padding, 0: ``propagates_zero`` derives a zero store for the max only.
"""

from __future__ import annotations

import math

import numpy as np
from tvm import te, tirx

from blockpad.errors import SpecError
from blockpad.layout import pad_sides, pad_sides_param, window_out_size
from blockpad.vocabulary import POOL_DTYPES

from .common import NAN_MAX, OpDef, Source, int_pair, materialize, plan_for

PARAMS = {"algorithm": "max", "kernel": [2, 2], "stride": None, "pad": [0, 0],
          "dilation": [1, 1], "exclude_pad": True, "ceil_mode": False}
GEOMETRY = ("kernel", "stride", "pad", "dilation", "ceil_mode")


def geometry(shape, kernel, stride, pad, dilation, ceil_mode=False):
    """``(kernel, stride, pad, dilation, out)``, checked: every window holds a cell of the
    image (else its average has no cells to divide by); ``pad`` as ``((top, bottom), (left,
    right))``."""
    if len(shape) != 4:
        raise SpecError(f"pool: shape is the source's (N, C, H, W); got {list(shape)}")
    if not isinstance(ceil_mode, bool):
        raise SpecError(f"pool: ceil_mode must be true or false; got {ceil_mode!r}")
    kernel, pad = int_pair("pool", kernel, "kernel", 1), pad_sides(pad)
    dilation = int_pair("pool", dilation, "dilation", 1)
    stride = kernel if stride is None else int_pair("pool", stride, "stride", 1)
    out = tuple(window_out_size(n, k, s, p, d, ceil_mode)
                for n, k, s, p, d in zip(shape[2:], kernel, stride, pad, dilation))
    for n, k, s, p, d, o in zip(shape[2:], kernel, stride, pad, dilation, out):
        if o < 1 or any(_cells(i * s - p[0], k, d, 0, n) == 0 for i in range(o)):
            raise SpecError(f"pool: kernel {list(kernel)} (dilation {list(dilation)}) with pad "
                            f"{pad_sides_param(pad)} has windows outside the "
                            f"{shape[2]}x{shape[3]} image")
    return kernel, stride, pad, dilation, out


def signature(shape, dtype, params):
    *_, out = geometry(shape, *(params[p] for p in GEOMETRY))
    return {"src": (tuple(shape), dtype), "dst": ((*shape[:2], *out), dtype)}


def make(layouts, name, policy, algorithm="max", kernel=(2, 2), stride=None, pad=(0, 0),
         dilation=(1, 1), exclude_pad=True, ceil_mode=False):
    if algorithm not in ("max", "avg"):
        raise SpecError(f"pool algorithm: expected 'max' or 'avg'; got {algorithm!r}")
    src, dst = layouts["src"], layouts["dst"]
    dtypes = POOL_DTYPES[algorithm]
    if src.dtype not in dtypes:
        raise SpecError(f"pool: {algorithm} pooling takes dtype {' or '.join(dtypes)}; got "
                        f"{src.dtype}")
    lowest = -math.inf if src.dtype == "float32" else int(np.iinfo(src.dtype).min)
    (kh, kw), (sh, sw), pad, (dh, dw), out = geometry(src.shape, kernel, stride, pad, dilation,
                                                      ceil_mode)
    (ph, pb), (pw, pr) = pad
    h, w = src.shape[2:]
    # the padded image's cells each window covers: the whole window unless ceil_mode lets the
    # last one hang over the bottom/right padding
    whole = all((o - 1) * s - p[0] + d * (k - 1) < n + p[1] for n, k, s, p, d, o in
                zip((h, w), (kh, kw), (sh, sw), pad, (dh, dw), out))

    def opdef(mode):
        x = Source("src", src, mode)
        rh, rw = te.reduce_axis((0, kh), "rh"), te.reduce_axis((0, kw), "rw")

        def value(n, c, oh, ow):
            ih, iw = oh * sh - ph + rh * dh, ow * sw - pw + rw * dw
            if algorithm == "max":
                return NAN_MAX(x(n, c, ih, iw, pad=lowest), axis=[rh, rw])
            return te.sum(x(n, c, ih, iw), axis=[rh, rw])

        def average(total, idx):
            _, _, oh, ow = idx
            if not exclude_pad and whole:
                return total * tirx.const(1 / (kh * kw), "float32")
            lo_h, hi_h, lo_w, hi_w = (-ph, h + pb, -pw, w + pr) if not exclude_pad else \
                (0, h, 0, w)
            cells = _cells(oh * sh - ph, kh, dh, lo_h, hi_h) * \
                _cells(ow * sw - pw, kw, dw, lo_w, hi_w)
            # at least 1: a destination halo's window lies outside the image (its sum is 0)
            return total / tirx.max(cells, 1).astype("float32")

        params = {"algorithm": algorithm, "kernel": [kh, kw], "stride": [sh, sw],
                  "pad": pad_sides_param(pad), "dilation": [dh, dw],
                  "exclude_pad": bool(exclude_pad), "ceil_mode": ceil_mode}
        return OpDef("pool", [x], value, reduce=True,
                     epilogue=average if algorithm == "avg" else None,
                     params=params, axes=[rh, rw])

    p = plan_for(policy, opdef("trusted"), dst)
    return materialize(opdef(p.reads), dst, p, name)


def _cells(start, k, d, lo, hi):
    """How many of the ``k`` taps ``start + i*d`` fall in ``[lo, hi)``: Python ints or TVM
    expressions (``//`` is floor division on both)."""
    if isinstance(start, int):
        return sum(lo <= start + i * d < hi for i in range(k))
    first = tirx.max(0, -((start - lo) // d))             # ceil((lo - start) / d)
    last = tirx.min(k - 1, (hi - 1 - start) // d)
    return last - first + 1
