"""Operators, each declared once over logical indices and instantiated for any layouts.

``OPS`` is the table the build spec is checked against: an op's tensor arguments (in call
order, the destination last), its parameters with their defaults, how the tensors' shapes and
dtypes follow from the spec's ``shape``/``dtype`` and the parameters, and the function that
declares its kernels."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from blockpad.vocabulary import INPLACE_SOURCES

from . import (
    binary,
    concat,
    conv,
    eltwise,
    inverted_residual,
    matmul,
    pool,
    postops,
    quantize,
    softmax,
    winograd,
)
from .reorder import reorder, zero_pad


def same_shape(tensors):
    """Signature of ops whose tensors all share the spec's shape and dtype."""
    return lambda shape, dtype, params: {t: (tuple(shape), dtype) for t in tensors}


@dataclass(frozen=True)
class Op:
    tensors: tuple                       # tensor argument names, call order
    make: Callable                       # make(layouts, name, policy, **params) -> [KernelDef]
    params: dict = field(default_factory=dict)   # parameter -> default
    signature: Callable | None = None    # (shape, dtype, params) -> {tensor: (shape, dtype)}
    default_tags: dict = field(default_factory=dict)   # 1-D tensors a spec may leave out
    policy_free: bool = False            # data movement: the same code under every policy
    inplace: str | None = None           # the source a spec's `inplace = true` overwrites
    check: Callable | None = None        # check(layouts, params): SpecError at parse time

    def validate(self, layouts: dict, params: dict) -> None:
        """What make() would refuse and the spec alone shows: refused when it is parsed."""
        if self.check:
            self.check(layouts, params)
        if "post_ops" in params:
            postops.check_layouts(layouts)

    def shapes(self, shape, dtype, params):
        return (self.signature or same_shape(self.tensors))(shape, dtype, params)


OPS = {
    "reorder": Op(("src", "dst"), lambda l, name, policy: [reorder(l["src"], l["dst"], name)],
                  policy_free=True),
    "zero_pad": Op(("layout",), lambda l, name, policy: [zero_pad(l["layout"], name)],
                   policy_free=True),
    "eltwise": Op(("src", "dst"), eltwise.make, eltwise.PARAMS, inplace=INPLACE_SOURCES["eltwise"],
                  check=eltwise.check),
    "binary": Op(("src0", "src1", "dst"), binary.make, binary.PARAMS, binary.signature,
                 inplace=INPLACE_SOURCES["binary"]),
    "conv2d": Op(conv.TENSORS, conv.make, conv.PARAMS, conv.signature, postops.DEFAULT_TAGS,
                 inplace=INPLACE_SOURCES["conv2d"]),
    "matmul": Op(matmul.TENSORS, matmul.make, matmul.PARAMS, matmul.signature,
                 postops.DEFAULT_TAGS, inplace=INPLACE_SOURCES["matmul"]),
    "softmax": Op(("src", "dst"), softmax.make, softmax.PARAMS, inplace="src",
                  check=softmax.check),
    "pool": Op(("src", "dst"), pool.make, pool.PARAMS, pool.signature),
    "concat": Op(concat.TENSORS, concat.make, concat.PARAMS, concat.signature),
    "quantize": Op(("src", "dst"), quantize.make_quantize, quantize.QUANTIZE_PARAMS,
                   quantize.quantize_signature),
    "dequantize": Op(("src", "dst"), quantize.make_dequantize, quantize.DEQUANTIZE_PARAMS,
                     quantize.dequantize_signature),
    "inverted_residual": Op(inverted_residual.TENSORS, inverted_residual.make,
                            inverted_residual.PARAMS, inverted_residual.signature,
                            inverted_residual.DEFAULT_TAGS),
    "winograd_weights": Op(("src", "dst"), winograd.make_transform, winograd.PARAMS,
                           winograd.transform_signature, policy_free=True),
}
