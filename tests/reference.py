"""numpy references for every op, by spec entry: the checker compares kernels with these."""

from __future__ import annotations

import numpy as np
from scipy.special import erf

ELTWISE = {
    "relu": lambda x, a, b: np.where(x > 0, x, x * a),
    "gelu_erf": lambda x, a, b: 0.5 * x * (1 + erf(x / np.sqrt(2))),
    "gelu_tanh": lambda x, a, b: 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3))),
    "sigmoid": lambda x, a, b: 1 / (1 + np.exp(-x)),
    "exp": lambda x, a, b: np.exp(x),
    "tanh": lambda x, a, b: np.tanh(x),
    "clip": lambda x, a, b: np.clip(x, a, b),
    "linear": lambda x, a, b: a * x + b,
}


def eltwise(entry, src):
    return ELTWISE[entry.get("algorithm", "relu")](src.astype(np.float64), entry.get("alpha", 0.0),
                                                   entry.get("beta", 0.0))


def binary(entry, src0, src1):
    a, b = src0.astype(np.float64), src1.astype(np.float64)
    return a + b if entry.get("algorithm", "add") == "add" else a * b


REFERENCES = {"eltwise": eltwise, "binary": binary}


def softmax(entry, src):
    axis = entry.get("axis", 1)
    x = src.astype(np.float64)
    e = np.exp(x - x.max(axis, keepdims=True))
    s = e / e.sum(axis, keepdims=True)
    return np.log(s) if entry.get("log") else s


def pool(entry, src):
    k = entry.get("kernel", [2, 2])
    s = entry.get("stride") or k
    p = entry.get("pad", [0, 0])
    n, c, h, w = src.shape
    oh, ow = (h + 2 * p[0] - k[0]) // s[0] + 1, (w + 2 * p[1] - k[1]) // s[1] + 1
    out = np.zeros((n, c, oh, ow))
    for i in range(oh):
        for j in range(ow):
            h0, w0 = i * s[0] - p[0], j * s[1] - p[1]
            win = src[:, :, max(h0, 0):min(h0 + k[0], h), max(w0, 0):min(w0 + k[1], w)]
            if entry.get("algorithm", "max") == "max":
                out[:, :, i, j] = win.max((2, 3))
            else:
                cells = win.shape[2] * win.shape[3] if entry.get("exclude_pad", True) else k[0] * k[1]
                out[:, :, i, j] = win.sum((2, 3)) / cells
    return out


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


def conv_reference(x, w, params) -> np.ndarray:
    """Direct convolution with stride, pad, dilation and groups (weights (G, K/G, C/G, KH, KW)
    when grouped), as oneDNN defines it."""
    (sh, sw), (ph, pw), (dh, dw) = params["stride"], params["pad"], params["dilation"]
    g = params["groups"]
    w = w.reshape(-1, *w.shape[-3:]) if g > 1 else w        # (K, C/G, KH, KW)
    kh, kw = w.shape[2:]
    xp = np.pad(x, ((0, 0), (0, 0), (ph, ph), (pw, pw)))
    oh = (xp.shape[2] - dh * (kh - 1) - 1) // sh + 1
    ow = (xp.shape[3] - dw * (kw - 1) - 1) // sw + 1
    cg, kg = x.shape[1] // g, w.shape[0] // g
    out = []
    for gi in range(g):
        xg, wg = xp[:, gi * cg:(gi + 1) * cg], w[gi * kg:(gi + 1) * kg]
        out.append(sum(np.einsum("nchw,kc->nkhw", xg[:, :, i * dh:i * dh + sh * oh:sh,
                                                      j * dw:j * dw + sw * ow:sw], wg[:, :, i, j])
                       for i in range(kh) for j in range(kw)))
    return np.concatenate(out, axis=1)
