"""numpy references for ``blockpad check``, written from the ops' definitions (oneDNN
semantics) and nothing else: no code from ``codegen/`` or the runtime's graph ops, so a kernel is
never compared with what it was generated from.

``reference(entry, inputs)`` takes a spec entry and the logical arrays of its sources (by tensor
name) and returns ``(want, bound)``: the expected destination, computed in float64 (exactly, in
the destination's dtype, for data movement and integer arithmetic), and per element the largest
error a correct kernel may make (``None``: bit-exact). The bounds follow the arithmetic: one
rounding per operation in the kernel's type, a dot product's sum bounded by ``K u sum|x w|``
(the classic bound for any summation order), and a post-op chain carrying the error it was
handed through each function (``f(v +- bound)``)."""

from __future__ import annotations

import numpy as np

from blockpad import qlinear
from blockpad.layout import pad_sides
from blockpad.runtime.graph.ops import ELTWISE
from blockpad.vocabulary import QUANTIZED_ADD, post_op_tensors

# unit roundoff of the type a kernel computes in
UNIT = {"float64": 2.0 ** -53, "float32": 2.0 ** -24, "float16": 2.0 ** -11,
        "bfloat16": 2.0 ** -8}
# half the smallest subnormal of each type: below its smallest normal a type's values are evenly
# spaced, so one rounding errs by up to this much whatever the value's size (the standard model
# with gradual underflow: fl(x) = x (1 + d) + e, |d| <= unit, |e| <= this)
TINY = {"float64": 2.0 ** -1075, "float32": 2.0 ** -150, "float16": 2.0 ** -25,
        "bfloat16": 2.0 ** -134}


def rounding(dtype: str, v):
    """The error of rounding ``v`` to ``dtype`` once: relative above the smallest normal,
    absolute below it (a float16 result near 1e-5 is a subnormal with spacing 6e-8)."""
    return UNIT[dtype] * np.abs(v) + TINY[dtype]


# transcendental functions (exp, tanh, erf) are polynomial approximations: allow this many
# roundings for one evaluation
FUNCTION_ULPS = 32


def eltwise_fn(p: dict):
    """``x -> f(x)`` of an eltwise op or post-op entry (float64), by the graph runtime's numpy
    table (its fallback when no kernel can be had): one definition of each algorithm."""
    f = ELTWISE[p.get("algorithm", "relu")]
    a, b = float(p.get("alpha", 0.0)), float(p.get("beta", 0.0))
    return lambda x: f(np.asarray(x, np.float64), a, b)


def through(f, v, bound, unit):
    """``(f(v), bound)`` of ``f`` applied in a type of ``unit`` to a value known to ``bound``:
    the input's error carried through ``f`` plus the function's own."""
    y = f(v)
    carried = np.maximum(np.abs(f(v + bound) - y), np.abs(f(v - bound) - y))
    return y, carried + FUNCTION_ULPS * unit * (1 + np.abs(y))


def _wide(a):
    return a.astype(np.int64) if a.dtype.kind in "iu" else a.astype(np.float64)


# ---- ops --------------------------------------------------------------------------------------

def reorder(entry, t):
    return t["src"], None


def eltwise(entry, t):
    x = t["src"]
    return through(eltwise_fn(entry), _wide(x), 0.0, UNIT[x.dtype.name])


def binary(entry, t):
    a, b = t["src0"], t["src1"]
    op = np.add if entry.get("algorithm", "add") == "add" else np.multiply
    if a.dtype.kind in "iu":     # wraps like the kernel's integer arithmetic
        return op(_wide(a), _wide(b)).astype(a.dtype), None
    want = op(_wide(a), _wide(b))
    return want, 2 * rounding(a.dtype.name, want)


def softmax(entry, t):
    axis = entry.get("axis", 1)
    x = t["src"].astype(np.float64)
    shifted = x - x.max(axis, keepdims=True)
    e = np.exp(shifted)
    s = e / e.sum(axis, keepdims=True)
    u = UNIT["float32"]
    if entry.get("log"):
        want = np.log(s)
        return want, FUNCTION_ULPS * u * (1 + np.abs(want) + np.abs(x))
    # exp of an argument rounded to float32, then a sum of the axis' terms
    return s, u * s * (FUNCTION_ULPS * (1 + np.abs(shifted)) + x.shape[axis])


def pool(entry, t):
    x = t["src"].astype(np.float64)
    kernel = entry.get("kernel", [2, 2])     # pool's defaults
    (kh, kw), (ph, pw) = kernel, entry.get("pad", [0, 0])
    (dh, dw), (sh, sw) = entry.get("dilation", [1, 1]), entry.get("stride") or kernel
    n, c, h, w = x.shape
    oh, ow = (h + 2 * ph - dh * (kh - 1) - 1) // sh + 1, (w + 2 * pw - dw * (kw - 1) - 1) // sw + 1
    want, scale = np.zeros((n, c, oh, ow)), np.zeros((n, c, oh, ow))
    is_max = entry.get("algorithm", "max") == "max"
    for i in range(oh):
        rows = [r for r in (i * sh - ph + a * dh for a in range(kh)) if 0 <= r < h]
        for j in range(ow):
            cols = [q for q in (j * sw - pw + b * dw for b in range(kw)) if 0 <= q < w]
            win = x[:, :, rows][:, :, :, cols]
            if is_max:
                want[:, :, i, j] = win.max((2, 3))
                continue
            cells = len(rows) * len(cols) if entry.get("exclude_pad", True) else kh * kw
            want[:, :, i, j] = win.sum((2, 3)) / cells
            scale[:, :, i, j] = np.abs(win).sum((2, 3)) / cells
    if is_max:
        return want, np.zeros_like(want)
    u = UNIT["float32"]
    return want, (kh * kw + 2) * u * scale + u * np.abs(want)


def conv(x, w, entry):
    """Direct convolution of float64 or int64 arrays, oneDNN's definition: stride, pad (per
    side or symmetric: ``layout.pad_sides``), dilation (1 = dense), groups with weights
    ``(G, K/G, C/G, KH, KW)``. Integer arrays whose every partial sum float64 holds exactly
    (any int8 convolution) are summed in float64, where numpy has BLAS: int64 products have
    none, and oneDNN's larger problems (1000x1000 images) would take minutes."""
    if x.dtype.kind == "i" and x.size and w.size:
        terms = w[0].size if entry["groups"] == 1 else w[0, 0].size
        if float(np.abs(x).max()) * float(np.abs(w).max()) * terms < 2 ** 53:
            return conv(x.astype(np.float64), w.astype(np.float64), entry).astype(np.int64)
    (sh, sw), (dh, dw) = entry["stride"], entry["dilation"]
    g = entry["groups"]
    w = w.reshape(-1, *w.shape[-3:]) if g > 1 else w        # (K, C/G, KH, KW)
    kh, kw = w.shape[2:]
    xp = np.pad(x, ((0, 0), (0, 0), *pad_sides(entry["pad"])))
    oh = (xp.shape[2] - dh * (kh - 1) - 1) // sh + 1
    ow = (xp.shape[3] - dw * (kw - 1) - 1) // sw + 1
    cg, kg = x.shape[1] // g, w.shape[0] // g
    out = []
    for gi in range(g):
        xg, wg = xp[:, gi * cg:(gi + 1) * cg], w[gi * kg:(gi + 1) * kg]
        out.append(sum(np.tensordot(xg[:, :, i * dh:i * dh + sh * oh:sh,
                                       j * dw:j * dw + sw * ow:sw], wg[:, :, i, j],
                                    axes=([1], [1])).transpose(0, 3, 1, 2)
                       for i in range(kh) for j in range(kw)))
    return np.concatenate(out, axis=1)


# a dot product's (accumulator, destination) types by source type (oneDNN's, conv2d's doc)
DOT_TYPES = {"float64": ("float64", "float64"), "float16": ("float32", "float16")}


def dot(entry, t):
    """conv2d and matmul: the product in int64 or float64, the output scale, then the post-op
    chain in order, each step in the accumulator's type (float32 but for float64 sources),
    rounded to the destination's at the store. Integer sources (oneDNN's quantization
    attributes): the source shifted by its zero point, so that padding, zero after the
    shift, is the zero point; an int32 bias added to the exact sum; after the chain the
    destination scale and zero point (``requantize``)."""
    x, w = _wide(t["src"]), _wide(t["weights"])
    x = x - entry.get("src_zero_point", 0)
    int_bias = "bias" in t and t["bias"].dtype == np.int32
    if entry["op"] == "matmul":
        acc, absacc = x @ w, np.abs(x) @ np.abs(w)
        terms, channel = x.shape[1], (slice(None),)
    else:
        acc, absacc = conv(x, w, entry), conv(np.abs(x), np.abs(w), entry)
        # products per output: C/G x KH x KW (weights (K, C, KH, KW) or (G, K/G, C/G, KH, KW))
        terms = t["weights"][0].size if entry["groups"] == 1 else t["weights"][0, 0].size
        channel = (slice(None), None, None)
    acc_type, dst_type = DOT_TYPES.get(t["src"].dtype.name, ("float32", "float32"))
    u = UNIT[acc_type]
    if int_bias:
        acc = acc + t["bias"].astype(np.int64)[channel]
    v = acc.astype(np.float64)
    if "scale" in t:            # integer: exact int32 sum, rounded to float32, scaled
        v = v * t["scale"].astype(np.float64)[channel]
        bound = 3 * u * np.abs(v)
    else:
        bound = terms * u * absacc.astype(np.float64)
    v, bound = post_ops(entry.get("post_ops", []), t, v, bound, u, channel, int_bias)
    if "scale" in t:
        return quantized_add(entry, t, *requantize(entry, v, bound))
    return v, bound + rounding(dst_type, v)


def post_ops(chain, t, v, bound, u, channel, int_bias=False):
    """``(v, bound)`` after the post-op chain of conv2d, matmul or inverted_residual, each step
    in a type of unit roundoff ``u``; ``channel`` indexes a per-channel (K,) tensor against
    ``v``; ``int_bias``: the bias was added to the integer sum already."""
    for p, name in zip(chain, post_op_tensors(chain)):
        if p["kind"] == "bias":
            if int_bias:
                continue
            v = v + t["bias"].astype(np.float64)[channel]
            bound = bound + u * np.abs(v)
        elif p["kind"] == "sum":     # oneDNN: v + scale * (sum - zero_point)
            s = p.get("scale", 1.0) * (t[name].astype(np.float64) - p.get("zero_point", 0))
            v = v + s
            bound = bound + 2 * u * (np.abs(v) + np.abs(s))
        elif p["kind"] == QUANTIZED_ADD:
            continue                 # after the destination's rounding: ``quantized_add``
        elif p["kind"] == "binary":
            b = t[name].astype(np.float64)
            b = b[(0,) * b.ndim] if p.get("operand", "full") == "tensor" else \
                b[channel] if p.get("operand", "full") == "channel" else b
            v, bound = BINARY[p.get("algorithm", "add")](v, b, bound)
            bound = bound + u * np.abs(v)
        else:
            v, bound = through(eltwise_fn(p), v, bound, u)
    return v, bound


def inverted_residual(entry, t):
    """MobileNetV2's block as three convolutions (``conv``), each stage's value and error bound
    handed to the next, all in the source's type (float32 or float64):

    * expansion: a 1x1 convolution (C terms), its bias, its eltwise chain;
    * depthwise: groups = E, stride, padding kernel // 2 of zeros (the padded cells are exact),
      its bias and chain; the error it was handed carried through the weights (sum of
      ``bound x |w|`` over the window) and the window's KH x KW terms rounded on ``|e| + bound``;
    * projection: a 1x1 convolution (E terms) carried and rounded the same way, then conv2d's
      post-op chain (``post_ops``) and the store's rounding."""
    x = t["src"].astype(np.float64)
    dtype = t["src"].dtype.name
    u = UNIT[dtype]
    kh, kw = entry.get("kernel", [3, 3])
    stride = entry.get("stride", [1, 1])
    e = t["expand_weights"].shape[0]
    dense = {"stride": [1, 1], "pad": [0, 0], "dilation": [1, 1], "groups": 1}
    depthwise = {"stride": stride, "pad": [kh // 2, kw // 2], "dilation": [1, 1], "groups": e}
    channel = (slice(None), None, None)

    def stage(v, bound, weights, geometry, bias, chain):
        w = t[weights].astype(np.float64)
        w = w.reshape(w.shape[0], -1, *w.shape[-2:])    # depthwise (E, 1, 1, KH, KW): 4-D
        terms = int(np.prod(w.shape[1:]))       # C, KH x KW, E
        carried = conv(bound, np.abs(w), geometry) if np.any(bound) else 0.0
        v_next = conv(v, w, geometry)
        bound = carried + terms * u * conv(np.abs(v) + bound, np.abs(w), geometry)
        if bias is not None:
            v_next = v_next + t[bias].astype(np.float64)[channel]
            bound = bound + u * np.abs(v_next)
        for p in chain:
            v_next, bound = through(eltwise_fn(p), v_next, bound, u)
        return v_next, bound

    v, bound = stage(x, np.zeros_like(x), "expand_weights", dense, "expand_bias",
                     entry.get("expand_post_ops", []))
    v, bound = stage(v, bound, "depthwise_weights", depthwise, "depthwise_bias",
                     entry.get("depthwise_post_ops", []))
    v, bound = stage(v, bound, "weights", dense, None, [])
    v, bound = post_ops(entry.get("post_ops", []), t, v, bound, u, channel)
    return v, bound + rounding(dtype, v)


def _prelu(v, b, bound):
    return np.where(v >= 0, v, v * b), bound * np.maximum(1, np.abs(b))


# a binary post-op: (v, its error bound, the operand) -> (result, the error carried through)
BINARY = {"add": lambda v, b, e: (v + b, e), "mul": lambda v, b, e: (v * b, e * np.abs(b)),
          "max": lambda v, b, e: (np.maximum(v, b), e), "min": lambda v, b, e: (np.minimum(v, b), e),
          "prelu": _prelu}


INT_RANGES = {"int8": (-128, 127), "uint8": (0, 255), "int32": (-2 ** 31, 2 ** 31 - 1)}


def saturate(r, dtype: str, zp: int):
    """``r`` (integers as floats) plus ``zp``, saturated to ``dtype``: the sum clamped to the
    float32 values nearest inside ``[min - zp, max - zp]`` first (an int32 destination
    saturates at 2**31 - 128 - zp, the float32 below 2**31, as oneDNN's conversion does; the
    value before the zero point stays inside [-2**31, 2**31 - 128], which int32 holds)."""
    lo, hi = INT_RANGES[dtype]
    f_lo, f_hi = np.float32(lo - zp), np.float32(hi - zp)
    f_lo = f_lo if int(f_lo) >= lo - zp else np.nextafter(f_lo, np.float32(np.inf))
    f_hi = f_hi if int(f_hi) <= hi - zp else np.nextafter(f_hi, np.float32(-np.inf))
    if dtype == "int32":   # converted to int32 before zp is added: inside [-2**31, 2**31 - 128]
        f_lo, f_hi = max(f_lo, np.float32(lo)), min(f_hi, np.float32(2 ** 31 - 128))
    return np.clip(r, float(f_lo), float(f_hi)) + zp


def requantize(entry, v, bound):
    """The end of an integer kernel's chain: ``v / dst_scale + dst_zero_point`` into a
    float32 destination; into an integer one rounded half to even (``np.rint``) before the
    zero point is added, then saturated. The bound of an integer result is the rounding
    step it may take: 1 where ``v +- bound`` straddles a half-way point, else 0 (exact)."""
    scale, zp = float(entry.get("dst_scale", 1.0)), int(entry.get("dst_zero_point", 0))
    dtype = entry.get("dst_dtype") or "float32"
    u = UNIT["float32"]
    v, bound = v / scale, bound / scale + (u * np.abs(v / scale) if scale != 1.0 else 0)
    if dtype == "float32":
        v = v + zp
        return v, bound + u * np.abs(v)
    want = saturate(np.rint(v), dtype, zp)
    lo, hi = (saturate(np.rint(v + s * bound), dtype, zp) for s in (-1, 1))
    return want, np.maximum(hi - want, want - lo)


def quantized_add(entry, t, q, bound):
    """A chain's closing ``quantized_add`` on the rounded destination value ``q`` (which may
    be ``bound`` steps off): ONNX Runtime's QLinearAdd with ``addend`` (``qlinear.add``, two
    float32 fmas), in the entry's operand order. The bound: how far the sums of ``q -
    bound`` and ``q + bound`` fall from the sum of ``q``."""
    chain = entry.get("post_ops") or []
    if not chain or chain[-1]["kind"] != QUANTIZED_ADD:
        return q, bound
    p, dtype = chain[-1], entry["dst_dtype"]
    lo_q, hi_q = np.iinfo(dtype).min, np.iinfo(dtype).max

    def add(v):
        return qlinear.add_in_order(np.clip(v, lo_q, hi_q), t["addend"], p, dtype)

    want = add(q).astype(np.float64)
    lo, hi = add(q - bound), add(q + bound)
    return want, np.maximum(hi - want, want - lo)


REFERENCES = {"reorder": reorder, "eltwise": eltwise, "binary": binary, "softmax": softmax,
              "pool": pool, "conv2d": dot, "matmul": dot, "inverted_residual": inverted_residual}


def reference(entry: dict, inputs: dict):
    """``(want, bound)`` for a spec entry (defaults filled in) on its sources' logical
    arrays."""
    return REFERENCES[entry["op"]](entry, inputs)
