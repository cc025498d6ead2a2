"""Softmax and log-softmax over one axis (the blocked channel axis by default), fp32:

    max[j]    = max_c x[j, c]                      j: every index but the axis (a "row")
    exp[j, c] = exp(x[j, c] - max[j])              0 where x has padding
    sum[j]    = sum_c exp[j, c]
    norm[j]   = 1 / sum[j]                         log: max[j] + log(sum[j])
    dst[j, c] = exp[j, c] * norm[j]                log: x[j, c] - norm[j]

Padding never enters the max nor the sum (exp(0) = 1 would): the source is read as -inf past
its logical extent, so ``exp``, a stage of the kernel laid out like the source, is exactly 0 in
its padding and the sum runs over whole blocks without a tail. Source padding is never read:
any policy may leave it dirty. ``exp`` is kept rather than recomputed for the store (one exp
per element, the kernel's main cost), and since its padding is zero, softmax keeps destination
padding zero by its own arithmetic (``propagates_zero`` derives it; log-softmax, -inf - norm
there, gets the zero store).

The statistics and ``exp`` are stages over logical indices (``Stage``), read like sources;
``materialize`` stores the last line under the padding plan."""

from __future__ import annotations

import math
import struct

import tvm
from tvm import te, tirx
from tvm.sym.analyzer import Analyzer

from blockpad.errors import SpecError
from blockpad.layout import Layout
from blockpad.vocabulary import EXP, MAX, NORM, SUM

from .common import OpDef, Source, materialize, plan_for

PARAMS = {"axis": 1, "log": False}


def check(layouts, params) -> None:
    """The axis and dtype, refused when the spec is parsed, not when the kernel is made."""
    src, axis = layouts["src"], params["axis"]
    if isinstance(axis, bool) or not isinstance(axis, int) or not -src.rank <= axis < src.rank:
        raise SpecError(f"softmax: axis must be an integer in [{-src.rank}, {src.rank}) for "
                        f"a rank-{src.rank} source; got {axis!r}")
    if src.dtype != "float32":
        raise SpecError(f"softmax: dtype must be float32; got {src.dtype}")


def make(layouts, name, policy, axis=1, log=False):
    src, dst = layouts["src"], layouts["dst"]
    check(layouts, {"axis": axis})
    axis %= src.rank
    rows = Layout.plain(tuple(1 if d == axis else n for d, n in enumerate(src.shape)))

    def opdef(mode):
        x = VectorSource("src", src, mode)

        def over_axis(name, reducer, element):
            """A row statistic: ``reducer`` of ``element(idx)`` along the axis, walked as the
            source's blocks (``c = rb * B + ri``: schedules vectorise along a block)."""
            block = src.block_of(axis)
            axes = [te.reduce_axis((0, src.padded_shape[axis] // block), f"{name}_rb")]
            if block > 1:
                axes.append(te.reduce_axis((0, block), f"{name}_ri"))
            c = axes[0] * block + axes[1] if block > 1 else axes[0]
            return Stage(name, x, rows, lambda *j: reducer(
                element([c if d == axis else v for d, v in enumerate(j)]), axis=axes),
                axes=axes, row_axis=axis)

        mx = over_axis(MAX, te.max, lambda i: x(*i, pad=-math.inf))
        e = Stage(EXP, x, src, lambda *i: exp(x(*i, pad=-math.inf) - mx(*i)))
        sm = over_axis(SUM, te.sum, lambda i: e(*i))
        norm = Stage(NORM, x, rows, (lambda *j: mx(*j) + tirx.log(sm(*j))) if log else
                     (lambda *j: tirx.const(1, "float32") / sm(*j)), row_axis=axis)
        value = (lambda *i: x(*i, pad=-math.inf) - norm(*i)) if log else \
            (lambda *i: e(*i) * norm(*i))
        return OpDef("softmax", [x], value, params={"axis": axis, "log": bool(log)})

    p = plan_for(policy, opdef("trusted"), dst)
    return materialize(opdef(p.reads), dst, p, name)


class VectorSource(Source):
    """A ``Source`` whose guarded reads that stay inside the buffer (padding that exists in
    memory, e.g. the last channel block) are ``Select(in_tensor, load, pad)``, not
    ``if_then_else``: the load is safe either way, and a Select vectorises as a blend where TVM
    scalarises a loop whose if_then_else condition differs between lanes. (A candidate for
    ``common.Source`` itself.)"""

    def __call__(self, *idx, pad=0):
        v = super().__call__(*idx, pad=pad)
        if isinstance(v, tvm.ir.expr.Call) and v.op.name == "prim.if_then_else" \
                and self._in_buffer(idx):
            return tirx.Select(*v.args)
        return v

    def _in_buffer(self, idx) -> bool:
        ana = Analyzer()
        for var, (lo, hi) in self.bounds.items():
            ana.bind(var, tvm.ir.Range(lo, hi + 1))
        lay = self.layout
        for x, n, (before, after) in zip(idx, lay.padded_shape, lay.paddings):
            b = ana.const_int_bound(tirx.const(x, "int32") if isinstance(x, int) else x)
            if b.min_value < -before or b.max_value >= n + after:
                return False
        return True


class Stage(Source):
    """A stage of the kernel: a tensor in ``layout``, ``fn`` of the logical index (reducing
    over ``axes``), read like a source (guarded outside its buffer; its padding is clean when
    ``fn`` is 0 there). With ``row_axis``, the layout holds one value per row (that axis of
    extent 1) and a read at any index along the axis reads its row's value."""

    def __init__(self, name, x: Source, layout: Layout, fn, axes=(), row_axis=None):
        super().__init__(name, layout)
        self.x, self.row_axis = x, row_axis
        ranges = {ax.var: (int(ax.dom.min), int(ax.dom.min + ax.dom.extent) - 1) for ax in axes}

        def at(*p):
            x.bounds = {**ranges, **{v: (0, n - 1) for v, n in zip(p, layout.physical_shape)}}
            return fn(*layout.to_logical(p))

        self.tensor = te.compute(layout.physical_shape, at, name=name)

    def __call__(self, *idx, pad=0):
        self.bounds = self.x.bounds   # the ranges of whichever stage is reading
        if self.row_axis is not None:
            idx = [0 if d == self.row_axis else i for d, i in enumerate(idx)]
        self.leaves_buffer = False
        v = super().__call__(*idx, pad=pad)
        self.x.leaves_buffer |= self.leaves_buffer   # counts as a read of the kernel's source
        return v


def exp(value):
    """exp of a float32 in 14 vector instructions, where ``tirx.exp`` becomes one libm call per
    lane (about 4.5 ns an element here, several times the memory time of a softmax).

    exp(x) = 2^n * p(r) with n = round(x / ln 2), r = x - n ln 2 (ln 2 in two parts, as in
    Cephes' expf) and p oneDNN's degree-5 polynomial (relative error 1.7e-7). n is rounded by
    adding 1.5 * 2^23 + 127, which leaves n + 127, the exponent bits of 2^n, in the low bits of
    the sum; n itself is read back from those bits, where TVM's simplifier, which treats float
    arithmetic as exact, cannot fold (t + magic) - magic into t. At x <= -127 ln 2 the exponent
    is 0 and so is the result, exactly: channels read as ``-inf`` add exactly nothing to a sum.
    Above 88.38 the result saturates at 2.4e38."""
    def f(v):
        return tirx.const(v, "float32")

    lo, hi = -127 * math.log(2), 88.3762626647949
    magic = 1.5 * 2 ** 23 + 127
    x = tirx.min(tirx.max(value, f(lo)), f(hi))
    bits = tirx.reinterpret("int32", x * f(1 / math.log(2)) + f(magic))   # 2^23 * 1.5 + 127 + n
    n = (bits - struct.unpack("<i", struct.pack("<f", magic))[0]).astype("float32")
    r = x - n * f(0.693359375) + n * f(2.12194440e-4)
    return _poly(r) * tirx.reinterpret("float32", tirx.shift_left(bits, 23))


def _poly(r):
    """oneDNN's minimax polynomial for exp(r) on |r| <= ln(2) / 2 (jit eltwise injector)."""
    p = tirx.const(0.00828929059, "float32")
    for coef in (0.0418978221, 0.166676521, 0.499991506, 0.999999701, 1.0):
        p = p * r + tirx.const(coef, "float32")
    return p
