"""Quantization attributes of integer convolution and matmul: oneDNN v3's, onto which ONNX's
``QLinearConv`` / ``QLinearMatMul`` (and QDQ pairs) map. For a ``uint8``/``int8`` source and
``int8`` weights, a destination element is computed in this order:

    acc  = sum(src * wei)                      int32; padding (halo, padded channels) read as 0
    acc -= src_zero_point * comp               int32; comp: the weights' sum over the taps that
                                               read the image (below)
    acc += bias                                int32 bias only (ONNX QLinearConv's)
    v    = float32(acc) * scale                float32; scale[k] ("channel") or scale[0] ("tensor")
    v    = post_ops(v)                         float32 bias, eltwise, sum: the chain, in order
    dst  = v / dst_scale + dst_zero_point      a float32 destination
    dst  = saturate(nearbyint(v / dst_scale) + dst_zero_point)     int32, int8, uint8

oneDNN's per-tensor source scale has no attribute of its own: it folds into ``scale`` (a caller
passes ``src_scale * wei_scale[k]``, one float32 product, as oneDNN's reference forms it), and
ONNX's requantization multiplier ``x_scale * w_scale[k] / y_scale`` likewise (``dst_scale = 1``).
``nearbyint`` is round half to even (computed with integer bit arithmetic, not the intrinsic:
``common.round_clamped``); the zero point is added to the rounded value (an integer), then the
sum saturates to the destination's range; an int32 destination
saturates at the float32 values nearest inside its range (2**31 - 128 is the largest float32
below 2**31), as oneDNN's conversion does, the rounded value first (it is converted to int32
before the zero point is added: ``saturation_bounds``). The order is exact but for one liberty
LLVM takes where the target has FMA (checked: x86-64-v3 code has ``vfmadd`` there): a float
multiply and the add that follows it (the scale and a float32 bias, a sum's scale, ``linear``)
become one fused multiply-add, rounded once instead of twice.

``weight_bits = 7`` promises weights in [-64, 64] (ONNX Runtime's ``reduce_range``): the
result is the same, and x86 without VNNI takes one ``vpmaddubsw`` a step instead of two
(``schedules/x86_intrin.py``). The kernel function carries the promise as an attribute
(``WEIGHT_BITS_ATTR``) for the schedule rules; the runtime checks the weights on every call.

Zero points and padding, oneDNN's semantics (its ``zp_src_pad_comp``): the padding of a
zero-point-shifted source *is* the zero point, i.e. it contributes 0 to ``acc`` after the
shift. The dot product reads padding as 0 whatever the spatial padding (a fused guard, a
staged copy, a pre-padded halo: all unchanged, so the inner loop stays a plain u8 x s8 -> s32
dot product), and the compensation counts the weights of the taps that read the image only:

    wsum[k, kh, kw]  = sum_c wei[k, c, kh, kw]                          (stage ``zp_wsum``)
    comp[k, oh, ow]  = sum over (kh, kw) whose source row and column lie inside the image of
                       wsum[k, kh, kw]                                    (stage ``zp_comp``)

Padded channels need nothing: their weights are zero. The kernel computes both stages itself on
every call (no extra argument, nothing for a caller to get wrong): ``K C KH KW`` additions, and
``comp`` once per *border class* of rows and columns (``BorderClasses``: each border row its
own, all interior rows one), ``K KH KW`` per class: a small part of the convolution's
``N K OH OW C KH KW``, depthwise too. matmul's is ``comp[n] = sum_k wei[k, n]``. Small in
operations, not in time unless scheduled for it: a dot-product instruction does 64 of the
convolution's multiply-adds, so at 7x7 a byte-at-a-time weight sum outlasts the convolution;
the dot-product rules sum the packed weights a vector at a time (``dot_tiled.weight_sums``).
"""

from __future__ import annotations

import numpy as np
from tvm import te, tirx

from blockpad.errors import SpecError
from blockpad.vocabulary import (
    QUANT_DEFAULTS,
    QUANT_DST_DTYPES,
    QUANTIZED_DTYPES,
    SCALES,
    WEIGHT_BITS,
    WEIGHT_SUMS,
    ZP_COMP,
)

from .common import round_clamped, round_clamped_float

BF16 = "bfloat16"   # in kernel arguments as its uint16 bits: numpy and DLPack have no bf16
BF16_DST_DTYPES = ("float32", BF16)   # a bf16 kernel's destination types
PARAMS = dict(QUANT_DEFAULTS)
BIAS_DTYPES = ("float32", "int32")   # a bias post-op's ``dtype`` on an integer kernel
RANGE = {t: (int(np.iinfo(t).min), int(np.iinfo(t).max)) for t in ("int8", "uint8", "int32")}


def _int(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def check(src_dtype: str, params: dict, taps: int | None = None) -> dict:
    """The attributes of a kernel whose source is ``src_dtype``, defaults filled in; a
    SpecError names a bad value, or any attribute given to a floating-point kernel. ``taps``:
    the products summed per output (C/G x KH x KW, a matmul's K), which bound a source zero
    point outside the source's range (``zero_point_fits``)."""
    q = {k: params.get(k, v) for k, v in QUANT_DEFAULTS.items()}
    given = sorted(k for k, v in q.items() if v != QUANT_DEFAULTS[k])
    if src_dtype == BF16:   # its destination's type only: float32 or bfloat16
        dst_dtype(src_dtype, q)
        given = [k for k in given if k != "dst_dtype"]
    if src_dtype not in QUANTIZED_DTYPES:
        if given:
            raise SpecError(f"{', '.join(given)}: quantization attributes need a uint8 or int8 "
                            f"source; got {src_dtype}")
        return q
    zp = q["src_zero_point"]
    if not _int(zp) or not RANGE["int32"][0] <= zp <= RANGE["int32"][1]:
        raise SpecError(f"src_zero_point: expected an int32 integer; got {zp!r}")
    if taps is not None and not zero_point_fits(src_dtype, int(zp), taps):
        raise SpecError(f"src_zero_point {zp}: outside the {src_dtype} range, a zero point is "
                        f"taken where the int32 accumulator cannot overflow, (|largest "
                        f"product| + 128 |zp|) x {taps} products < 2**31")
    if q["weight_bits"] not in WEIGHT_BITS or isinstance(q["weight_bits"], bool):
        raise SpecError(f"weight_bits: expected 8 (int8 weights) or 7 (every weight in "
                        f"[-64, 64]); got {q['weight_bits']!r}")
    if q["scales"] not in SCALES:
        raise SpecError(f"scales: expected one of {', '.join(SCALES)}; got {q['scales']!r}")
    s = q["dst_scale"]
    if isinstance(s, bool) or not isinstance(s, (int, float)) or not 0 < s < float("inf"):
        raise SpecError(f"dst_scale: expected a positive finite number; got {s!r}")
    dst = dst_dtype(src_dtype, q)
    lo, hi = RANGE.get(dst, RANGE["int32"])
    if not _int(q["dst_zero_point"]) or not lo <= q["dst_zero_point"] <= hi:
        raise SpecError(f"dst_zero_point: expected an integer in [{lo}, {hi}] ({dst} "
                        f"destination); got {q['dst_zero_point']!r}")
    return q


def zero_point_fits(src_dtype: str, zp: int, taps: int) -> bool:
    """Whether source zero point ``zp`` keeps the int32 arithmetic exact: any value of the
    source's type does (ONNX's zero points, and the accumulation every int8 library does in
    int32 whatever the zero point); oneDNN also takes others (an int8 source shifted by 135),
    which are accepted where ``acc - zp * comp`` provably stays in int32: each of the ``taps``
    products is at most 255 x 128 (uint8) or 128 x 128, each compensation term 128 |zp|."""
    lo, hi = RANGE[src_dtype]
    if lo <= zp <= hi:
        return True
    return (max(abs(lo), hi) * 128 + 128 * abs(zp)) * taps < 2 ** 31


def dst_dtype(src_dtype: str, params: dict, natural: str = "float32") -> str:
    """The destination's type: ``dst_dtype`` for an integer kernel (float32 unless given) or a
    bf16 one (float32 or bfloat16, rounded to nearest even, as oneDNN's bf16 convolutions
    write either), else ``natural`` (the op's own, from ``postops.types``)."""
    want = params.get("dst_dtype")
    if src_dtype == BF16 and want is not None:
        if want not in BF16_DST_DTYPES:
            raise SpecError(f"dst_dtype: a bfloat16 kernel writes one of "
                            f"{', '.join(BF16_DST_DTYPES)}; got {want!r}")
        return want
    if src_dtype not in QUANTIZED_DTYPES:
        return natural
    if want is not None and want not in QUANT_DST_DTYPES:
        raise SpecError(f"dst_dtype: expected one of {', '.join(QUANT_DST_DTYPES)}; got "
                        f"{want!r}")
    return want or "float32"


def scale_shape(params: dict, channels: int) -> tuple:
    """``(K,)`` for per-channel weight scales, ``(1,)`` for one per tensor."""
    return (1,) if params.get("scales", "channel") == "tensor" else (channels,)


def bias_dtype(post_ops: list, src_dtype: str, natural: str) -> str:
    """The bias tensor's type: a bias post-op's ``dtype`` (``int32``: added to the integer
    accumulator before the scale, so it must come first in the chain; ``float32``: after the
    scale, where it stands), else ``natural``."""
    for i, p in enumerate(post_ops):
        if p["kind"] != "bias" or "dtype" not in p:
            continue
        want = p["dtype"]
        if src_dtype not in QUANTIZED_DTYPES or want not in BIAS_DTYPES:
            raise SpecError(f"post_ops[{i}] (bias): dtype {want!r} needs a uint8 or int8 "
                            f"source and one of {', '.join(BIAS_DTYPES)}; got a {src_dtype} "
                            f"source")
        if want == "int32" and i:
            raise SpecError(f"post_ops[{i}] (bias): an int32 bias is added to the int32 "
                            f"accumulator, before the scale and every other post-op, so it "
                            f"must be post_ops[0]")
        return want
    return natural


class Requant:
    """The two ends of an integer kernel's chain: ``start`` (int32: zero-point compensation,
    int32 bias) and ``finish`` (destination scale, zero point, rounding, saturation, type).
    ``comp(idx)`` reads the compensation at a destination index (``None``: no source zero
    point)."""

    def __init__(self, params: dict, dst: str, comp=None):
        self.zp, self.dst = int(params["src_zero_point"]), dst
        self.dst_scale, self.dst_zp = float(params["dst_scale"]), int(params["dst_zero_point"])
        self.comp = comp if self.zp else None

    def start(self, acc, idx, int_bias=None):
        if self.comp is not None:
            acc = acc - tirx.const(self.zp, "int32") * self.comp(idx)
        if int_bias is not None:
            acc = acc + int_bias
        return acc

    def finish(self, v, as_float: bool = False):
        """``v`` as the destination's value; ``as_float``: an 8-bit destination's value held
        exactly in a float32, for an epilogue that goes on in float32 (the quantized add):
        narrowing it to a byte, widening it back and converting cost four instructions a vector
        of the ~35 a 1x1 convolution with a quantized residual add spends per output vector
        (int8 ResNet-50's layer1 ``conv3``, 64 -> 256 channels at 56x56: 7% of its time)."""
        if self.dst_scale != 1.0:
            v = v / tirx.const(self.dst_scale, "float32")
        if self.dst == "float32":
            return v + tirx.const(float(self.dst_zp), "float32") if self.dst_zp else v
        lo, hi = saturation_bounds(self.dst, self.dst_zp)
        if as_float:
            return round_clamped_float(v, float(lo), float(hi), self.dst_zp)
        q = round_clamped(v, float(lo), float(hi))
        if self.dst_zp:
            q = q + tirx.const(self.dst_zp, "int32")
        return q.astype(self.dst)


INT32_FLOAT_MAX = np.float32(2 ** 31 - 128)   # the largest float32 below 2**31


def saturation_bounds(dst: str, zp: int) -> tuple:
    """The float32 range a rounded value is clamped to before ``zp`` is added: the float32
    values nearest inside ``[min - zp, max - zp]`` of ``dst`` (exact for int8 and uint8); for int32
    also inside the float32 range that converts to int32, ``[-2**31, 2**31 - 128]``, so that a
    negative ``zp`` cannot push the conversion past it (it overflowed: blockpad check seed
    20261128 case 2118). With a zero point, an int32 result beyond ``+-(2**31 - |zp|)`` therefore
    stops ``|zp|`` short of the range's end."""
    lo, hi = RANGE[dst]
    f_lo, f_hi = np.float32(lo - zp), np.float32(hi - zp)
    if int(f_lo) < lo - zp:
        f_lo = np.nextafter(f_lo, np.float32(np.inf))
    if int(f_hi) > hi - zp:
        f_hi = np.nextafter(f_hi, np.float32(-np.inf))
    if dst == "int32":   # the rounded value is converted to int32 before zp is added: keep it
        f_lo, f_hi = max(f_lo, np.float32(lo)), min(f_hi, INT32_FLOAT_MAX)   # convertible
    return float(f_lo), float(f_hi)


def conv_compensation(w, geo, dst, c_red: int):
    """``comp(idx)`` of a convolution reading weights ``w`` (a Source) over ``c_red`` channels
    per group, for destination layout ``dst``: the stages of the module doc. ``zp_comp`` holds
    one row (column) per *border class* of output rows (columns): each row whose taps leave
    the image at the top or bottom has its own, and every row whose taps all read the image
    shares one (``BorderClasses``), so the table is ``(rows, cols, K)``, a few per border,
    whatever the image's size (a depthwise convolution's compensation would otherwise cost as
    much as the convolution). Its channels run over ``dst``'s buffer positions (padding
    repeats the last channel), innermost, so the epilogue's channel vector reads it with one
    load and no guard."""
    (kh, kw), groups, kg = geo.kernel, geo.groups, geo.k // geo.groups
    zc = te.reduce_axis((0, c_red), "zc")

    def wsum(k, i, j):
        w.bounds = {k: (0, geo.k - 1), i: (0, kh - 1), j: (0, kw - 1), zc.var: (0, c_red - 1)}
        x = w(k, zc, i, j) if groups == 1 else w(k // kg, k % kg, zc, i, j)
        return te.sum(x.astype("int32"), axis=[zc])

    ws = te.compute((geo.k, kh, kw), wsum, name=WEIGHT_SUMS)
    rows, cols = (BorderClasses(size, out, r, s, p[0], d) for size, out, r, s, p, d in
                  zip((geo.h, geo.w), geo.out, geo.kernel, geo.stride, geo.pad, geo.dilation))
    before = dst.paddings[1][0]
    channels = dst.padded_shape[1] + sum(dst.paddings[1])
    zh, zw = te.reduce_axis((0, kh), "zh"), te.reduce_axis((0, kw), "zw")

    def comp(hc, wc, p):
        k = tirx.min(tirx.max(p - before, 0), geo.k - 1)
        inside = rows.inside(hc, zh) + cols.inside(wc, zw)
        tap = ws[k, zh, zw]
        if inside:
            tap = tirx.if_then_else(tirx.all(*inside), tap, 0)
        return te.sum(tap, axis=[zh, zw])

    table = te.compute((rows.count, cols.count, channels), comp, name=ZP_COMP)
    return lambda idx: table[rows.of(idx[2]), cols.of(idx[3]), idx[1] + before]


class BorderClasses:
    """The output rows (or columns) of one spatial dim in classes that see the same taps: rows
    ``0 .. first - 1`` (their windows start above the image) and ``last + 1 .. out - 1`` (end
    below it) one class each, the rows between, whose taps all read the image, one class.
    ``of(o)`` maps a destination index (a halo's too: clamped to the image first) to its
    class; ``inside(c, r)`` the conditions that tap ``r`` of class ``c``'s row reads the
    image."""

    def __init__(self, size, out, kernel, stride, pad, dilation):
        self.size, self.out, self.stride, self.pad, self.dilation = size, out, stride, pad, \
            dilation
        first = -(-pad // stride)                                      # ceil(pad / stride)
        last = min(out - 1, (size - 1 + pad - (kernel - 1) * dilation) // stride)
        self.first, self.run = first, max(0, last - first)   # rows merged into class `first`
        self.count = out - self.run
        self.padded = first > 0 or last < out - 1

    def of(self, o):
        o = tirx.min(tirx.max(o, 0), self.out - 1)
        if not self.run:
            return o
        return o - tirx.min(tirx.max(o - self.first, 0), self.run)

    def inside(self, c, r) -> list:
        if not self.padded:
            return []
        row = c + tirx.if_then_else(c > self.first, self.run, 0)       # the class's first row
        i = row * self.stride - self.pad + r * self.dilation
        return [i >= 0, i < self.size]


def matmul_compensation(w, dst, k_red: int):
    """``comp(idx)`` of a matmul: ``sum_k wei[k, n]`` over ``dst``'s buffer positions along n."""
    before, after = dst.paddings[1]
    n, last = dst.padded_shape[1] + before + after, dst.shape[1] - 1
    zk = te.reduce_axis((0, k_red), "zk")

    def comp(j):
        col = tirx.min(tirx.max(j - before, 0), last)
        w.bounds = {j: (0, n - 1), zk.var: (0, k_red - 1)}
        return te.sum(w(zk, col).astype("int32"), axis=[zk])

    table = te.compute((n,), comp, name=ZP_COMP)
    return lambda idx: table[idx[1] + before]


def recorded(attrs: dict) -> dict:
    """The attributes a kernel's manifest entry records: those that differ from their
    defaults (a kernel without any reads as it did before they existed)."""
    return {k: v for k, v in attrs.items() if v != QUANT_DEFAULTS[k]}
