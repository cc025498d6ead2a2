"""Binary add and mul with numpy broadcasting (a source dim of 1 broadcasts). Integer types
compute in floating point and round and saturate the result, as eltwise does
(``eltwise.in_arithmetic``: a sum or product past the type's range saturates, never wraps).

A quantized add (uint8/int8, ``scales`` and ``zero_points`` given, each ``[src0, src1, dst]``)
adds the values the operands stand for and quantizes the sum with ONNX Runtime's QLinearAdd
arithmetic (``quantize.add``: two fused multiply-adds, the destination zero point inside)."""

from __future__ import annotations

from blockpad.errors import SpecError
from blockpad.vocabulary import QUANTIZED_DTYPES

from .common import OpDef, Source, materialize, plan_for
from .eltwise import in_arithmetic
from .quant import RANGE
from .quantize import add as quantized_add

ALGORITHMS = {"add": lambda a, b: a + b, "mul": lambda a, b: a * b}
PARAMS = {"algorithm": "add", "shape1": None, "scales": None, "zero_points": None}


def signature(shape, dtype, params):
    """``shape`` is src0's; ``shape1`` (default: the same) is src1's, broadcast against it."""
    shape0 = tuple(shape)
    shape1 = tuple(params.get("shape1") or shape0)
    if len(shape1) != len(shape0) or any(b not in (1, a) and a != 1 for a, b in zip(shape0, shape1)):
        raise SpecError(f"binary: shape1 {shape1} does not broadcast against shape {shape0} "
                        f"(same rank, each dim equal or 1)")
    out = tuple(max(a, b) for a, b in zip(shape0, shape1))
    return {"src0": (shape0, dtype), "src1": (shape1, dtype), "dst": (out, dtype)}


def _check_quantized(algorithm, dtype, scales, zero_points):
    if scales is None and zero_points is None:
        return
    if algorithm != "add" or dtype not in QUANTIZED_DTYPES:
        raise SpecError(f"binary: scales and zero_points make a quantized add of uint8/int8; "
                        f"got algorithm {algorithm!r} on {dtype}")
    lo, hi = RANGE[dtype]
    if not (isinstance(scales, (list, tuple)) and len(scales) == 3 and
            all(isinstance(s, (int, float)) and s > 0 for s in scales)):
        raise SpecError(f"binary: scales must be three positive numbers [src0, src1, dst]; got "
                        f"{scales!r}")
    if not (isinstance(zero_points, (list, tuple)) and len(zero_points) == 3 and
            all(isinstance(z, int) and lo <= z <= hi for z in zero_points)):
        raise SpecError(f"binary: zero_points must be three integers in {lo}..{hi} [src0, src1, "
                        f"dst]; got {zero_points!r}")


def make(layouts, name, policy, algorithm="add", shape1=None, scales=None, zero_points=None):
    if algorithm not in ALGORITHMS:
        raise SpecError(f"binary algorithm: expected one of {', '.join(ALGORITHMS)}; got {algorithm!r}")
    dst = layouts["dst"]
    _check_quantized(algorithm, dst.dtype, scales, zero_points)
    params = {"algorithm": algorithm}
    if scales is not None:
        params.update(scales=list(scales), zero_points=list(zero_points))

    def opdef(mode):
        a, b = Source("src0", layouts["src0"], mode), Source("src1", layouts["src1"], mode)

        def value(*i):
            x, y = a(*_broadcast(i, a.layout.shape)), b(*_broadcast(i, b.layout.shape))
            if scales is not None:
                return quantized_add(x, y, scales, zero_points, dst.dtype)
            return in_arithmetic(ALGORITHMS[algorithm], x, y)

        return OpDef("binary", [a, b], value, params=params)

    p = plan_for(policy, opdef("trusted"), dst)
    return materialize(opdef(p.reads), dst, p, name)


def _broadcast(idx, shape):
    return [0 if n == 1 else i for i, n in zip(idx, shape)]
