"""Softmax and log-softmax over one axis (the blocked channel axis by default), fp32:

    max[j]  = max_c x[j, c]                     j: every index but the axis ("a row")
    sum[j]  = sum_c exp(x[j, c] - max[j])
    norm[j] = 1 / sum[j]          (log: max[j] + log(sum[j]))
    dst[j, c] = exp(x[j, c] - max[j]) * norm[j]      (log: x[j, c] - norm[j])

The row statistics are stages of the kernel over the logical shape with the axis of extent 1;
``materialize`` stores the last line under the padding plan. The reductions run over the logical
extent of the axis only, walked as the source's blocks (``c = rb * B + ri``, so that schedules
can vectorise along a block) with the channels past ``C`` read as ``-inf``: padding adds nothing
to the max nor to the sum (exp(0) = 1 would), and source padding is never read. The value at a
padded destination channel is exp(0 - max) / sum, not zero: ``propagates_zero`` derives that,
so ``dst_fused`` stores zeros there explicitly.
"""

from __future__ import annotations

import math

from tvm import te, tirx

from blockpad.errors import SpecError
from blockpad.layout import Layout

from ..policy import plan
from .common import OpDef, Source, materialize, propagates_zero

PARAMS = {"axis": 1, "log": False}


def make(layouts, name, policy, axis=1, log=False):
    src, dst = layouts["src"], layouts["dst"]
    if not isinstance(axis, int) or not -src.rank <= axis < src.rank:
        raise SpecError(f"softmax: axis must be an integer in [{-src.rank}, {src.rank}); "
                        f"got {axis!r}")
    if src.dtype != "float32":
        raise SpecError(f"softmax: dtype must be float32; got {src.dtype}")
    axis %= src.rank

    def opdef(mode):
        x = Source("src", src, mode)
        mx = Rows(x, axis, "max", lambda read, j, red: te.max(read(), axis=red))
        sm = Rows(x, axis, "sum", lambda read, j, red: te.sum(exp(read() - mx(*j)), axis=red))
        norm = Rows(x, axis, "norm", lambda read, j, red:
                    mx(*j) + tirx.log(sm(*j)) if log else tirx.const(1, "float32") / sm(*j))
        if log:
            def value(*i):
                return x(*i) - norm(*i)
        else:
            def value(*i):
                return exp(x(*i) - mx(*i)) * norm(*i)
        return OpDef("softmax", [x], value, params={"axis": axis, "log": bool(log)})

    p = plan(policy, propagates_zero(opdef("trusted"), dst), reduces_over_padding=False)
    return materialize(opdef(p.reads), dst, p, name)


class Rows(Source):
    """A per-row statistic: a stage of the kernel over the source's logical shape with ``axis``
    of extent 1, read like a source (any index along ``axis`` reads the row's value; a read
    outside the rows, from destination padding along another dim, is guarded).

    ``body(read, j, axes)`` gives the value at row ``j``; ``read()`` is the row's element at the
    reduction variables ``axes`` (the source's blocks along ``axis``), ``-inf`` past the
    logical extent."""

    def __init__(self, x: Source, axis: int, name: str, body):
        lay = x.layout
        shape = tuple(1 if d == axis else n for d, n in enumerate(lay.shape))
        super().__init__(name, Layout.plain(shape, lay.dtype))
        self.x, self.axis = x, axis
        block = lay.block_of(axis)
        axes = [te.reduce_axis((0, -(-lay.shape[axis] // block)), f"{name}_rb")]
        if block > 1:
            axes.append(te.reduce_axis((0, block), f"{name}_ri"))
        c = axes[0] * block + axes[1] if block > 1 else axes[0]
        ranges = {ax.var: (0, int(ax.dom.extent) - 1) for ax in axes}

        def at(*j):
            x.bounds = {**ranges, **{v: (0, n - 1) for v, n in zip(j, shape)}}
            idx = [c if d == axis else v for d, v in enumerate(j)]
            return body(lambda: x(*idx, pad=-math.inf), j, axes)

        self.tensor = te.compute(shape, at, name=name)

    def __call__(self, *idx, pad=0):
        self.bounds = self.x.bounds   # the ranges materialize gives the kernel's sources
        return super().__call__(*(0 if d == self.axis else i for d, i in enumerate(idx)), pad=pad)


def exp(value):
    """exp of a float32, as Cephes' expf computes it: 2^n * p(r), n = round(x / ln 2), with a
    degree-6 polynomial p (relative error ~2e-7). A dozen vector instructions per register,
    where ``tirx.exp`` becomes one libm call per lane (about 4.5 ns an element here, several
    times the memory time of a softmax). Below the smallest normal result it is exactly 0, so
    channels read as ``-inf`` add exactly nothing to a sum."""
    def f(v):
        return tirx.const(v, "float32")

    lo, hi = -87.3365447505531, 88.3762626647949   # exp(lo) = smallest normal float
    x, xc, n, r = (tirx.Var(v, "float32") for v in ("x", "xc", "n", "r"))
    steps = [(x, value),
             (xc, tirx.min(tirx.max(x, f(lo)), f(hi))),
             (n, tirx.floor(xc * f(1.44269504088896341) + f(0.5))),   # xc = n ln2 + r
             (r, xc - n * f(0.693359375) + n * f(2.12194440e-4))]      # ln 2 in two parts
    out = tirx.Select(x < f(lo), f(0), _poly(r) * _pow2(n))
    for var, val in reversed(steps):
        out = tirx.Let(var, val, out)
    return out


def _poly(r):
    """Cephes' minimax polynomial: exp(r) on |r| <= ln(2) / 2."""
    p = tirx.const(1.9875691500e-4, "float32")
    for coef in (1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1,
                 5.0000001201e-1):
        p = p * r + tirx.const(coef, "float32")
    return p * r * r + r + tirx.const(1, "float32")


def _pow2(n):
    """2^n for an integral float n in the normal range: n + 127 in the exponent bits."""
    return tirx.reinterpret("float32", tirx.shift_left(n.astype("int32") + 127, 23))
