"""ONNX Runtime's integer arithmetic for quantized operators, in numpy: what blockpad's int8
kernels and graphs must reproduce bit for bit (docs/onnxruntime-int8.md derives each formula
from ONNX Runtime's CPU kernels; tests/test_qlinear.py checks them against ONNX Runtime).

Every scale is a float32 and every step rounds as float32 does; ``round`` is round half to
even (x86's default ``cvtps2dq`` and ``nearbyintf``), saturation is to the element type.

* ``quantize``: ``q = sat(round(clamp(x / scale, lo - zp, hi - zp)) + zp)``; a division, not
  a multiplication by the reciprocal.
* ``dequantize``: ``x = float(q - zp) * scale``.
* ``requantize`` (QLinearConv, QLinearMatMul, QGemm, QLinearGlobalAveragePool, and the QDQ
  patterns ONNX Runtime fuses into them): ``q = sat(round(float(acc) * m) + zp)`` with the
  int32 accumulator ``acc`` (bias added to it first) and the float32 multiplier
  ``m = (x_scale * w_scale) / y_scale`` (``conv_multiplier``); global average pooling is the
  same with ``acc = sum(q) - zp * n`` and ``m = x_scale / (y_scale * float(n))``.
* ``add`` (QLinearAdd, AVX2 kernel): ``r_a = s_a / s_c``, ``r_b = s_b / s_c``,
  ``f = float(z_c) - fma(r_a, z_a, r_b * z_b)`` (C++'s ``r_a * z_a + r_b * z_b``,
  contracted by the compiler), then per element
  ``q = sat(round(fma(a, r_a, fma(b, r_b, f))))``: two fused multiply-adds, one rounding each.
"""

from __future__ import annotations

import numpy as np

from .numpy_conv import direct_conv
from .vocabulary import qlinear_operands

F32 = np.float32
INT_RANGE = {"uint8": (0, 255), "int8": (-128, 127), "int32": (-2 ** 31, 2 ** 31 - 1)}


def _range(dtype) -> tuple:
    return INT_RANGE[np.dtype(dtype).name]


def saturate(v, dtype) -> np.ndarray:
    """``v`` (integers held in any type) clipped to ``dtype``'s range, in ``dtype``."""
    lo, hi = _range(dtype)
    return np.clip(v, lo, hi).astype(dtype)


def quantize(x, scale, zero_point, dtype) -> np.ndarray:
    """QuantizeLinear of float32 ``x`` with one float32 ``scale`` and integer zero point."""
    lo, hi = _range(dtype)
    zp = int(zero_point)
    v = np.asarray(x, F32) / F32(scale)
    v = np.clip(v, F32(lo - zp), F32(hi - zp))
    return saturate(np.rint(v).astype(np.int64) + zp, dtype)


def dequantize(q, scale, zero_point, axis=None) -> np.ndarray:
    """DequantizeLinear: ``float(q - zp) * scale`` in float32 (``scale``/``zero_point`` per
    tensor, or per slice along ``axis``)."""
    q = np.asarray(q).astype(np.int64)
    scale, zp = np.asarray(scale, F32), np.asarray(zero_point).astype(np.int64)
    if axis is not None and scale.ndim == 1:
        shape = [1] * q.ndim
        shape[axis] = -1
        scale, zp = scale.reshape(shape), zp.reshape(shape)
    return (q - zp).astype(F32) * scale


def conv_multiplier(x_scale, w_scale, y_scale) -> np.ndarray:
    """The float32 requantization multiplier per output channel: ``(x_scale * w_scale) /
    y_scale``, each step rounded to float32 (QLinearConv's order)."""
    return (F32(x_scale) * np.asarray(w_scale, F32).reshape(-1)) / F32(y_scale)


def pool_multiplier(x_scale, y_scale, n) -> np.float32:
    """Global average pooling's multiplier over ``n`` cells: ``x_scale / (y_scale * n)``."""
    return F32(x_scale) / (F32(y_scale) * F32(n))


def requantize(acc, multiplier, zero_point, dtype, axis=1) -> np.ndarray:
    """``sat(round(float32(acc) * multiplier) + zp)``: ``acc`` int32 (the bias already in),
    ``multiplier`` float32, one per tensor or one per index of ``axis``."""
    m = np.asarray(multiplier, F32)
    if m.size > 1:
        shape = [1] * np.ndim(acc)
        shape[axis] = -1
        m = m.reshape(shape)
    v = np.asarray(acc, np.int64).astype(F32) * m
    return saturate(np.rint(v).astype(np.int64) + int(zero_point), dtype)


def conv_acc(x, x_zero_point, w, bias=None, stride=(1, 1), pad=((0, 0), (0, 0)),
             dilation=(1, 1), groups=1) -> np.ndarray:
    """The exact int32 accumulator of a quantized convolution: ``sum((x - x_zp) * w) + bias``
    (NCHW ``x``, ``(K, C/groups, KH, KW)`` int8 ``w`` with zero point 0, int32 ``bias``)."""
    x = np.asarray(x, np.int64) - int(x_zero_point)
    out = direct_conv(x, np.asarray(w, np.int64), stride, pad, dilation, groups)
    if bias is not None:
        out += np.asarray(bias, np.int64).reshape(1, -1, 1, 1)
    return out


def matmul_acc(x, x_zero_point, w, bias=None) -> np.ndarray:
    """``(x - x_zp) @ w + bias`` exactly: ``x`` (M, K) 8-bit, ``w`` (K, N) int8."""
    out = (np.asarray(x, np.int64) - int(x_zero_point)) @ np.asarray(w, np.int64)
    return out if bias is None else out + np.asarray(bias, np.int64)


def add_params(a_scale, a_zero_point, b_scale, b_zero_point, c_scale, c_zero_point) -> tuple:
    """``(r_a, r_b, f)`` of QLinearAdd, float32, computed as ONNX Runtime does."""
    r_a, r_b = F32(a_scale) / F32(c_scale), F32(b_scale) / F32(c_scale)
    # ``r_a * z_a + r_b * z_b`` in C++, which the compiler contracts: the first product is
    # fused into the sum, the second rounded (an element of MobileNetV2 lands on x.5 or
    # x.5 - 1 ulp by this last bit; tests/test_qlinear.py)
    fixed = F32(c_zero_point) - fma(r_a, F32(a_zero_point), r_b * F32(b_zero_point))
    return r_a, r_b, F32(fixed)


def fma(x, y, z) -> np.ndarray:
    """float32 ``x * y + z`` rounded once. The product of two float32 is exact in the 64-bit
    significand of x86's long double, and so is its sum with ``z`` where, as here, the
    exponents are close; the one rounding is then the cast to float32."""
    ld = np.longdouble
    return (np.asarray(x, F32).astype(ld) * ld(y) + np.asarray(z, F32).astype(ld)).astype(F32)


def add(a, b, params, dtype) -> np.ndarray:
    """QLinearAdd of 8-bit ``a`` and ``b`` (broadcasting) with ``add_params``' ``params``."""
    r_a, r_b, fixed = params
    a, b = np.asarray(a).astype(F32), np.asarray(b).astype(F32)
    v = fma(a, r_a, fma(b, r_b, fixed))
    return saturate(np.rint(v).astype(np.int64), dtype)


def add_in_order(value, addend, post_op, dtype) -> np.ndarray:
    """A ``quantized_add`` post-op's sum: QLinearAdd of ``value`` and ``addend`` in the
    operand order the entry says (the fmas round in operand order)."""
    (first, second), (s0, s1, sr), (z0, z1, zr) = qlinear_operands(post_op, value, addend)
    return add(first, second, add_params(s0, z0, s1, z1, sr, zr), dtype)
