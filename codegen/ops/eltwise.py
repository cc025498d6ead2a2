"""Elementwise functions: the eltwise op, and the eltwise post-op of convolution and matmul.

Each algorithm is one expression of ``x`` (oneDNN's alpha/beta parameters where it has them);
NaN and +-inf give what PyTorch gives (``nan_max``: relu and clip keep a NaN).
Whether it keeps padding zero is not recorded here: ``common.propagates_zero`` derives it.

Integer kernels (eltwise and binary) compute as oneDNN does: in floating point, the float
alpha/beta kept as they are, and the result converted to the destination type rounding half to
even and saturating to its range (``in_arithmetic``). int8 and uint8 compute in float32, like
oneDNN: their values, and sums and products of two, are exact there. int32 computes in float64,
unlike oneDNN (float32, which loses integers above 2**24): every int32, every sum of two and
every product inside the range are exact in float64 (a larger product saturates anyway), so
an int32 kernel gives the exactly rounded, saturated result. float16 computes in float32 and
rounds once to float16, as oneDNN does: TVM has no fp16 erf/tanh/exp lowering (``gelu_erf``
failed to build), and one rounding is what the reference computes."""

from __future__ import annotations

import math

from tvm import tirx

from blockpad.errors import SpecError
from blockpad.vocabulary import ELTWISE_DEFAULTS

from .common import OpDef, Source, dtype_of, is_nan, materialize, nan_max, nan_min, plan_for, round_clamped


def _c(x, v):
    return tirx.const(v, dtype_of(x))


ALGORITHMS = {
    "relu": lambda x, a, b: nan_max(x, _c(x, 0)) if a == 0 else
    tirx.Select(x > _c(x, 0), x, x * _c(x, a)),                        # alpha: leaky slope
    "gelu_erf": lambda x, a, b: _c(x, 0.5) * x * (_c(x, 1) + tirx.erf(x * _c(x, 1 / math.sqrt(2)))),
    "gelu_tanh": lambda x, a, b: _c(x, 0.5) * x * (_c(x, 1) + tirx.tanh(
        _c(x, math.sqrt(2 / math.pi)) * (x + _c(x, 0.044715) * x * x * x))),
    "sigmoid": lambda x, a, b: tirx.sigmoid(x),
    "exp": lambda x, a, b: tirx.exp(x),
    "tanh": lambda x, a, b: tirx.Select(is_nan(x), x, tirx.tanh(x)),    # TVM's clamps NaN
    "clip": lambda x, a, b: nan_min(nan_max(x, _c(x, a)), _c(x, b)),    # [alpha, beta]
    "linear": lambda x, a, b: x * _c(x, a) + _c(x, b),                  # alpha * x + beta
    "abs": lambda x, a, b: tirx.abs(x),
    "round": lambda x, a, b: tirx.nearbyint(x),          # half to even, as oneDNN's round
    "swish": lambda x, a, b: x * tirx.sigmoid(x * _c(x, a)),    # x sigmoid(alpha x): SiLU at 1
}

PARAMS = ELTWISE_DEFAULTS
ARITHMETIC = {"int8": "float32", "uint8": "float32", "int32": "float64",
              "float16": "float32"}   # see the docstring


def in_arithmetic(fn, *xs):
    """``fn(*xs)`` for operands of one type: integers and float16 are widened to their
    arithmetic type (``ARITHMETIC``); an integer result is saturated and rounded half to even
    (``common.round_clamped``), so no constant is truncated to the integer type and
    nothing wraps; a float16 result is rounded once to float16."""
    dtype = dtype_of(xs[0])
    wide = ARITHMETIC.get(dtype)
    if wide is None:
        return fn(*xs)
    v = fn(*(x.astype(wide) for x in xs))
    if dtype.startswith("float"):
        return v.astype(dtype)
    lo, hi = (float(f(dtype).value) for f in (tirx.min_value, tirx.max_value))
    return round_clamped(v, lo, hi).astype(dtype)


def apply(algorithm: str, x, alpha=0.0, beta=0.0):
    """The expression of ``algorithm`` on ``x``, in ``x``'s type (used by post-ops too)."""
    if algorithm not in ALGORITHMS:
        raise SpecError(f"eltwise algorithm: expected one of {', '.join(ALGORITHMS)}; "
                        f"got {algorithm!r}")
    return in_arithmetic(lambda v: ALGORITHMS[algorithm](v, float(alpha), float(beta)), x)


def check(layouts, params) -> None:
    """Refuse an unknown algorithm when the spec is parsed, not when the kernel is made."""
    apply(params["algorithm"], tirx.Var("x", "float32"), params["alpha"], params["beta"])


def make(layouts, name, policy, algorithm="relu", alpha=0.0, beta=0.0):
    src, dst = layouts["src"], layouts["dst"]
    check(layouts, {"algorithm": algorithm, "alpha": alpha, "beta": beta})

    def opdef(mode):
        x = Source("src", src, mode)
        return OpDef("eltwise", [x], lambda *i: apply(algorithm, x(*i), alpha, beta),
                     params={"algorithm": algorithm, "alpha": alpha, "beta": beta})

    p = plan_for(policy, opdef("trusted"), dst)
    return materialize(opdef(p.reads), dst, p, name)
