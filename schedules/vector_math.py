"""Transcendental functions as vector polynomials, on every CPU target.

LLVM lowers a vectorised fp32 ``exp``, ``erf`` or ``tanh`` to one libm call per lane (no vector
math library is linked in: not on AArch64, and on x86 TVM's ``erf`` becomes scalar ``erff``),
and the whole loop body is scalarised around the calls; a gelu then runs at a fraction of the
memory bandwidth. oneDNN's JIT and Arm Compute Library evaluate polynomials in vector registers
instead; TVM has the same ones (topi.fast_exp / fast_erf / fast_tanh: Cephes and Eigen, a few
ulp in fp32), which replace the calls here. Rules call ``vector_math`` on the func they are
given; ``VectorMath`` is the rule of last resort for kernels no other rule took. A function
of one of these polynomials stays a call: with no ``Let`` to bind the inner value, each level
of polynomials would copy the level below into every read of its argument. A post-op chain
binds the value it passes to one (``codegen/ops/postops.Chain``: a gelu's, then an exp), so
there both are polynomials.
"""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import tirx

from blockpad.vocabulary import POLYNOMIALS

from . import generic
from .rule import ScheduleRule


class VectorMath(ScheduleRule):
    """Kernels no other rule took (softmax, pooling) that call exp/erf/tanh/sigmoid: the
    generic schedule over ``vector_math``'s rewrite. Kernels without such calls are left to
    ``generic.Fallback`` as they are. The convolution and matmul rules rewrite their own."""

    def schedule(self, func, target):
        new = vector_math(func)
        return None if new.same_as(func) else generic.Fallback().apply(new, target)


_TANH_CLAMP = 9.0   # beyond it tanh is +-1 in fp32 (fast_tanh's rational function is not)


def vector_math(func):
    """``func`` with fp32 exp/erf/tanh/sigmoid calls replaced by polynomial expressions that
    vectorise (unchanged when it has none)."""
    found = []
    tvm_ffi.structural_walk(func.body, (tvm.ir.expr.Call,
                                        lambda c: found.append(c) if _replaced(c) else None))
    if not found:
        return func

    made = []   # the polynomials written so far (the walk rewrites arguments first)

    def rewrite(call):
        new = expand(call)
        if not new.same_as(call):
            made.append(new)
        return new

    def expand(call):
        if not _replaced(call) or _contains(call.args[0], made):
            # a function of a polynomial (exp of a gelu): the polynomial reads its argument
            # dozens of times, and with no Let to bind it (below) each level of such a chain
            # multiplied the expression: one small convolution's build ran past 8 minutes.
            # The outer function stays a call, per lane (libm): slower, and rare
            return call
        return EXPANSIONS[call.op.name](call.args[0])
    return tvm_ffi.structural_map(func, (tvm.ir.expr.Call, rewrite))


def _replaced(call) -> bool:
    """Whether ``call`` is one of the fp32 functions ``vector_math`` writes as a polynomial."""
    name = getattr(call.op, "name", "")
    return name in POLYNOMIALS and str(call.ty.dtype) == "float32"


def _contains(x, nodes) -> bool:
    """Whether expression ``x`` holds one of ``nodes`` (the same objects)."""
    if not nodes:
        return False

    def visit(e):
        return tvm_ffi.VisitInterrupt() if any(e.same_as(n) for n in nodes) else None
    return tvm_ffi.structural_walk(x, (tvm.ir.expr.Expr, visit), order="pre") is not None


def _exp(x):
    """exp over the whole fp32 range: fast_exp builds 2**n in the exponent bits, so it clamps
    its input to +-88.376 (n <= 127); beyond, exp(x) = exp(x/2)**2, which overflows to inf
    past log(FLT_MAX) and underflows gradually, as expf does. One polynomial per element: the
    repeated subexpressions are one value to LLVM."""
    big = tirx.abs(x) > tirx.const(88.3762626647949, "float32")
    half = _fast("fast_exp", x * tirx.Select(big, tirx.const(0.5, "float32"),
                                             tirx.const(1.0, "float32")))
    return tirx.Select(big, half * half, half)


def _sigmoid(x):
    one = tirx.const(1.0, "float32")
    return one / (one + _fast("fast_exp", -x))


def _tanh(x):
    return _fast("fast_tanh", tirx.max(tirx.min(x, tirx.const(_TANH_CLAMP, "float32")),
                                       tirx.const(-_TANH_CLAMP, "float32")))


#: The polynomial of each function of ``vocabulary.POLYNOMIALS`` (the same names: tested)
EXPANSIONS = {"tirx.exp": _exp, "tirx.erf": lambda x: _fast("fast_erf", x), "tirx.tanh": _tanh,
              "tirx.sigmoid": _sigmoid}


def _fast(kind, x):
    """topi's ``kind`` (fast_exp, ...) of expression ``x``. No ``Let`` binds ``x``: loop
    partitioning copies a body, and the simplifier refuses one Let var bound to two values."""
    return tvm_ffi.structural_map(
        _template(kind), (tvm.ir.expr.Call,
                          lambda c: x if getattr(c.op, "name", "") == "te.tensor_load" else c))


_templates = {}


def _template(kind):
    """topi's fp32 expression for ``kind`` over the element of a placeholder."""
    if kind not in _templates:
        from tvm import te, topi

        a = te.placeholder((1,), "float32", "a")
        _templates[kind] = getattr(topi, kind)(a).op.body[0]
    return _templates[kind]
