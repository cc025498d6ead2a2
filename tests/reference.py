"""numpy references for the tests, by spec entry. The ops' definitions (eltwise functions,
convolution, softmax, pooling) are blockpad check's (``blockpad.check.reference``), written from
oneDNN's semantics and independent of the code generator."""

from __future__ import annotations

import numpy as np

from blockpad.check import reference as check_reference
from blockpad.check.reference import ELTWISE
from blockpad.check.reference import conv as conv_reference


def eltwise(entry, src):
    return ELTWISE[entry.get("algorithm", "relu")](src.astype(np.float64), entry.get("alpha", 0.0),
                                                   entry.get("beta", 0.0))


def binary(entry, src0, src1):
    a, b = src0.astype(np.float64), src1.astype(np.float64)
    return a + b if entry.get("algorithm", "add") == "add" else a * b


REFERENCES = {"eltwise": eltwise, "binary": binary}


def softmax(entry, src):
    return check_reference.softmax(entry, {"src": src})[0]


def pool(entry, src):
    return check_reference.pool(entry, {"src": src})[0]


REFERENCES.update(softmax=softmax, pool=pool)


# ---- dot-product kernels (conv2d, matmul) of any dtype, by signature -------------------------

def dot_reference(sig, args) -> np.ndarray:
    """The op on numpy: int64 (integer) or float64 products, then scale, bias, relu."""
    wide = np.int64 if sig.args[0][2].dtype in ("int8", "uint8") else np.float64
    x, w = (args[n].to_numpy().astype(wide) for n in ("src", "weights"))
    channel = (slice(None),) if sig.op == "matmul" else (slice(None), None, None)
    if sig.op == "matmul":
        acc = x @ w
    else:
        acc = conv_reference(x, w, sig.params)
    want = acc.astype(np.float64)
    if "scale" in args:
        want = want * args["scale"].to_numpy()[channel]
    post = [p["kind"] for p in sig.params.get("post_ops", [])]
    if "bias" in post:
        want = want + args["bias"].to_numpy()[channel]
    if any(p.get("algorithm") == "relu" for p in sig.params.get("post_ops", [])):
        want = np.maximum(want, 0)
    return want
