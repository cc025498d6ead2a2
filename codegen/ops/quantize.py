"""Conversions at a quantized model's float edges, with ONNX Runtime's arithmetic to the bit
(``blockpad/qlinear.py``, docs/onnxruntime-int8.md):

* ``quantize``: float32 ``src`` -> ``dst_dtype`` (uint8/int8)
  ``dst = sat(round(clamp(src / scale, lo - zero_point, hi - zero_point)) + zero_point)``
  (a true division; round half to even);
* ``dequantize``: uint8/int8 ``src`` -> float32 ``dst = float(src - zero_point) * scale``.

``scale`` and ``zero_point`` are per tensor (QuantizeLinear / DequantizeLinear of activations).
Neither keeps zero padding zero (0 quantizes to the zero point), which the padding policy's
derivation sees in the TE (``common.propagates_zero``)."""

from __future__ import annotations

import numpy as np
from tvm import tirx
from tvm.tirx.op import fma

from blockpad import qlinear
from blockpad.errors import SpecError
from blockpad.vocabulary import QUANTIZED_DTYPES

from .common import OpDef, Source, materialize, plan_for, round_clamped
from .quant import RANGE

QUANTIZE_PARAMS = {"scale": 1.0, "zero_point": 0, "dst_dtype": "uint8"}
DEQUANTIZE_PARAMS = {"scale": 1.0, "zero_point": 0}


def _check(op, scale, zero_point, dtype):
    if dtype not in QUANTIZED_DTYPES:
        raise SpecError(f"{op}: the quantized type must be one of "
                        f"{', '.join(QUANTIZED_DTYPES)}; got {dtype!r}")
    lo, hi = RANGE[dtype]
    if not isinstance(zero_point, (int, np.integer)) or not lo <= zero_point <= hi:
        raise SpecError(f"{op}: zero_point must be an integer in {lo}..{hi}; got "
                        f"{zero_point!r}")
    if not (isinstance(scale, (int, float)) and np.isfinite(scale) and scale > 0):
        raise SpecError(f"{op}: scale must be a positive finite number; got {scale!r}")


def quantize_signature(shape, dtype, params):
    """``dtype`` is the source's (float32); ``dst_dtype`` the destination's."""
    if dtype != "float32":
        raise SpecError(f"quantize: the source is float32; got {dtype!r}")
    _check("quantize", params["scale"], params["zero_point"], params["dst_dtype"])
    return {"src": (tuple(shape), dtype), "dst": (tuple(shape), params["dst_dtype"])}


def dequantize_signature(shape, dtype, params):
    """``dtype`` is the source's (uint8/int8); the destination is float32."""
    _check("dequantize", params["scale"], params["zero_point"], dtype)
    return {"src": (tuple(shape), dtype), "dst": (tuple(shape), "float32")}


def _f32(v):
    return tirx.const(float(np.float32(v)), "float32")


def make_quantize(layouts, name, policy, scale=1.0, zero_point=0, dst_dtype="uint8"):
    src, dst = layouts["src"], layouts["dst"]
    _check("quantize", scale, zero_point, dst.dtype)
    lo, hi = RANGE[dst.dtype]

    def opdef(mode):
        x = Source("src", src, mode)

        def value(*i):
            v = x(*i) / _f32(scale)
            q = round_clamped(v, float(lo - zero_point), float(hi - zero_point))
            return (q + tirx.const(int(zero_point), "int32")).astype(dst.dtype)

        return OpDef("quantize", [x], value, params={"scale": scale, "zero_point": zero_point,
                                                     "dst_dtype": dst.dtype})

    p = plan_for(policy, opdef("trusted"), dst)
    return materialize(opdef(p.reads), dst, p, name)


def make_dequantize(layouts, name, policy, scale=1.0, zero_point=0):
    src, dst = layouts["src"], layouts["dst"]
    _check("dequantize", scale, zero_point, src.dtype)

    def opdef(mode):
        x = Source("src", src, mode)

        def value(*i):
            q = x(*i).astype("int32") - tirx.const(int(zero_point), "int32")
            return q.astype("float32") * _f32(scale)

        return OpDef("dequantize", [x], value, params={"scale": scale,
                                                       "zero_point": zero_point})

    p = plan_for(policy, opdef("trusted"), dst)
    return materialize(opdef(p.reads), dst, p, name)


def add_params(scales, zero_points) -> tuple:
    """QLinearAdd's float32 constants ``(r_0, r_1, f)`` from ``scales`` and ``zero_points``
    (src0, src1, dst), formed as ONNX Runtime forms them (blockpad.qlinear.add_params)."""
    (s0, s1, sd), (z0, z1, zd) = scales, zero_points
    return qlinear.add_params(s0, z0, s1, z1, sd, zd)


def add(a, b, scales, zero_points, dtype):
    """The quantized sum of 8-bit values ``a`` and ``b`` (either may arrive as the float32
    that holds it): two fused multiply-adds in float32, each rounded once, then round
    half to even and saturate (ONNX Runtime's AVX2 QLinearAdd)."""
    r0, r1, fixed = add_params(scales, zero_points)
    lo, hi = RANGE[dtype]
    t = fma(b.astype("float32"), _f32(r1), _f32(fixed))
    v = fma(a.astype("float32"), _f32(r0), t)
    return round_clamped(v, float(lo), float(hi)).astype(dtype)
