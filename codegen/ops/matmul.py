"""Matmul / inner product: ``dst[m, n] = post_ops(sum_k src[m, k] * wei[k, n])``.

The weights are logically ``(K, N)`` (matmul's ``wei[k, n]``); oneDNN's inner-product weights
``(N, K)`` (``oi``) are the same tensor in layout ``ba``, and packed weights are any blocked
layout of the ``ab`` family: ``BA16a16b`` (N-blocks of K x 16 panels, 16 output columns
contiguous: the one the x86 micro-kernel streams), ``AB16b16a``, ``BA16b4a`` (VNNI-style: 4 k
innermost for each of 16 columns), .... Element types as in conv2d (``postops.types``):
float32 (float64, float16), or ``uint8``/``int8`` x ``int8`` accumulated in int32, then
``dst = scale[n] * acc`` (+ post-ops) in float32 (or with the quantization attributes of
``quant.py``), or ``bfloat16`` x ``bfloat16`` accumulated
and written in float32 (AMX ``tdpbf16ps``; bf16 is kept as its uint16 bits in the kernel's
arguments, as everywhere in blockpad: DLPack and numpy have no bfloat16). The reduction runs
over the K that both the source and the weights pad to (whole blocks), relying on zero padding
there, so it reads source padding.
"""

from __future__ import annotations

from tvm import te

from blockpad.errors import SpecError
from blockpad.vocabulary import QUANTIZED_DTYPES

from . import postops, quant
from .common import OpDef, Source, materialize, plan_for

TENSORS = ("src", "weights", *postops.TENSORS, "dst")
PARAMS = {"n": None, "post_ops": [], **quant.PARAMS}


def signature(shape, dtype, params):
    """``shape``: the source (M, K); ``n``: the output columns N."""
    n = params["n"]
    if len(shape) != 2 or not isinstance(n, int) or n < 1:
        raise SpecError(f"matmul: shape is the source's (M, K) and n a positive integer; got "
                        f"shape {list(shape)}, n {n!r}")
    wei, _, out = postops.types(dtype)
    out = quant.dst_dtype(dtype, quant.check(dtype, params, shape[1]), out)
    dst = (shape[0], n)
    return {"src": (tuple(shape), dtype), "weights": ((shape[1], n), wei),
            **postops.tensors(params["post_ops"], dst, n, dtype, params),
            "dst": (dst, out)}


def make(layouts, name, policy, n=None, post_ops=(), **attrs):
    src, wei, dst = layouts["src"], layouts["weights"], layouts["dst"]
    attrs = quant.check(src.dtype, attrs)   # quantization: refused on float sources
    k_red = min(src.padded_shape[1], wei.padded_shape[0])
    reduces_over_padding = k_red > src.shape[1]
    bits, widen = postops.dot_operand(src.dtype)

    def opdef(mode):
        a, b = Source("src", src, mode, bits), Source("weights", wei, mode, bits)
        comp = quant.matmul_compensation(b, dst, k_red) if attrs["src_zero_point"] else None
        requant = quant.Requant(attrs, dst.dtype, comp) if src.dtype in QUANTIZED_DTYPES else None
        post = postops.Chain(post_ops, layouts, mode, requant)
        rk = te.reduce_axis((0, k_red), "rk")

        def value(i, j):
            return te.sum(widen(a(i, rk)) * widen(b(rk, j)), axis=[rk])

        return OpDef("matmul", [a, b, *post.sources.values()], value, reduce=True,
                     epilogue=post, params={"n": dst.shape[1], "post_ops": list(post_ops),
                                            **quant.recorded(attrs)},
                     axes=[rk])

    p = plan_for(policy, opdef("trusted"), dst, reduces_over_padding=reduces_over_padding)
    return materialize(opdef(p.reads), dst, p, name)
