"""Binary add and mul with numpy broadcasting (a source dim of 1 broadcasts). Integer types
compute in floating point and round and saturate the result, as eltwise does
(``eltwise.in_arithmetic``: a sum or product past the type's range saturates, never wraps)."""

from __future__ import annotations

from blockpad.errors import SpecError

from .common import OpDef, Source, materialize, plan_for
from .eltwise import in_arithmetic

ALGORITHMS = {"add": lambda a, b: a + b, "mul": lambda a, b: a * b}
PARAMS = {"algorithm": "add", "shape1": None}


def signature(shape, dtype, params):
    """``shape`` is src0's; ``shape1`` (default: the same) is src1's, broadcast against it."""
    shape0 = tuple(shape)
    shape1 = tuple(params.get("shape1") or shape0)
    if len(shape1) != len(shape0) or any(b not in (1, a) and a != 1 for a, b in zip(shape0, shape1)):
        raise SpecError(f"binary: shape1 {shape1} does not broadcast against shape {shape0} "
                        f"(same rank, each dim equal or 1)")
    out = tuple(max(a, b) for a, b in zip(shape0, shape1))
    return {"src0": (shape0, dtype), "src1": (shape1, dtype), "dst": (out, dtype)}


def make(layouts, name, policy, algorithm="add", shape1=None):
    if algorithm not in ALGORITHMS:
        raise SpecError(f"binary algorithm: expected one of {', '.join(ALGORITHMS)}; got {algorithm!r}")
    dst = layouts["dst"]

    def opdef(mode):
        a, b = Source("src0", layouts["src0"], mode), Source("src1", layouts["src1"], mode)

        def value(*i):
            return in_arithmetic(ALGORITHMS[algorithm], a(*_broadcast(i, a.layout.shape)),
                                 b(*_broadcast(i, b.layout.shape)))

        return OpDef("binary", [a, b], value, params={"algorithm": algorithm})

    p = plan_for(policy, opdef("trusted"), dst)
    return materialize(opdef(p.reads), dst, p, name)


def _broadcast(idx, shape):
    return [0 if n == 1 else i for i, n in zip(idx, shape)]
