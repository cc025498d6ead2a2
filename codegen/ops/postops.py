"""Post-ops of convolution and matmul, oneDNN's post-op chain, fused into the kernel's epilogue:

    post_ops = [{kind = "bias"}, {kind = "eltwise", algorithm = "relu"}, {kind = "sum"}]

applied in the order given to the reduced value ``v`` at destination element ``idx``:

* ``bias``:    v + bias[k], a 1-D (K,) tensor over the output channels (kernel argument ``bias``);
* ``eltwise``: ``eltwise.apply(algorithm, v, alpha, beta)``;
* ``sum``:     v + scale * sum[idx], a second tensor (argument ``sum``) in dst's dtype and laid
  out like dst: same padded dims and halo (oneDNN's sum reads the destination's own memory).

The chain runs in the accumulator's type: the source's for float32 and float64, float32 for
float16 (cast to the destination's at the store). Integer kernels (uint8/int8 x int8 -> int32)
start it in int32 (source zero-point compensation, an int32 bias: ``{kind = "bias", dtype =
"int32"}``, first in the chain) and with the weight scale, v = scale * float(acc) (oneDNN's
output scales), and end it with the destination scale, zero point, rounding and saturation to
``dst_dtype``: ``quant.py`` holds both ends and their order. Bias has the destination's dtype
(float32 for integer kernels unless it says int32), sum the destination's. The tensors come as
kernel arguments in the fixed order scale, bias, sum, whatever the order of the chain; each
kind that reads a tensor may appear once.

Per-channel tensors (scale, bias) are read through a copy extended over the destination's
padded channels, which repeat the last channel's value. So the epilogue reads them with no
bounds check, and none can be lost: inside ``materialize``'s ``select(is_padding, 0, v)`` TVM
simplifies ``v`` assuming a valid channel, which would drop a guard or a clamp and leave a
vector load past the end of a (K,) buffer. It also lets the zero-propagation derivation
(``common.propagates_zero``) see what oneDNN's ``wants_zero_pad_dst`` knows: a bias breaks
zeros (a padded channel gets bias[K-1]); an output scale does not (scale * 0 = 0).
"""

from __future__ import annotations

from tvm import te, tirx

from blockpad.errors import SpecError
from blockpad.layout import Layout
from blockpad.vocabulary import POST_OP_DEFAULTS

from . import eltwise, quant
from .common import Source, dtype_of

INTEGER = quant.INTEGER
# floating sources and their accumulators; bfloat16 would need the bit storage (uint16 buffers)
# that reorders use, in compute ops, which no op has yet
ACCUMULATOR = {"float32": "float32", "float64": "float64", "float16": "float32"}
CHANNEL = 1   # the output-channel dim of the destination's logical index (n k h w; m n)
TENSORS = ("scale", "bias", "sum")   # argument order
DEFAULT_TAGS = {"scale": "a", "bias": "a"}   # 1-D: a spec may leave their layouts out
OPTIONAL = {"bias": ("dtype",)}   # keys without a default (quant.bias_dtype)


BF16 = "bfloat16"   # in kernel arguments as its uint16 bits: numpy and DLPack have no bf16


def types(dtype: str) -> tuple:
    """``(weights, accumulator, destination)`` element types for a source of ``dtype``."""
    if dtype in INTEGER:
        return "int8", "int32", "float32"
    if dtype == BF16:
        return BF16, "float32", "float32"
    if dtype not in ACCUMULATOR:
        raise SpecError(f"dtype: expected one of {', '.join([*ACCUMULATOR, BF16, *INTEGER])} "
                        f"(the source's); got {dtype!r}")
    return dtype, ACCUMULATOR[dtype], dtype


def dot_operand(dtype: str) -> tuple:
    """``(bits, widen)`` for the sources of a dot product (matmul, conv) of ``dtype``: the
    storage type their Sources are declared with (uint16 for bf16, else None: their own), and
    the function that turns a loaded element into the accumulator type (bf16: reinterpret the
    bits first)."""
    acc = types(dtype)[1]
    bits = "uint16" if dtype == BF16 else None

    def widen(v):
        return (tirx.reinterpret(BF16, v) if bits else v).astype(acc)

    return bits, widen


def check(post_ops) -> list[dict]:
    """The chain with every entry's defaults filled in; SpecError on anything unknown."""
    if not isinstance(post_ops, (list, tuple)):
        raise SpecError(f"post_ops: expected a list of tables; got {post_ops!r}")
    out = []
    for i, p in enumerate(post_ops):
        kind = p.get("kind") if isinstance(p, dict) else None
        if kind not in POST_OP_DEFAULTS:
            raise SpecError(f"post_ops[{i}]: kind must be one of {', '.join(POST_OP_DEFAULTS)}; got {p!r}")
        unknown = sorted(set(p) - {"kind", *POST_OP_DEFAULTS[kind], *OPTIONAL.get(kind, ())})
        if unknown:
            raise SpecError(f"post_ops[{i}] ({kind}): unknown key {', '.join(unknown)}; "
                            f"expected {', '.join(['kind', *POST_OP_DEFAULTS[kind]])}")
        if kind != "eltwise" and any(q["kind"] == kind for q in out):
            raise SpecError(f"post_ops[{i}]: at most one {kind!r} post-op (it names a tensor)")
        out.append({"kind": kind, **POST_OP_DEFAULTS[kind], **p})
        if kind == "eltwise":
            eltwise.apply(out[-1]["algorithm"], tirx.Var("x", "float32"))  # rejects unknown ones
    return out


def tensors(post_ops, dst_shape, channels: int, src_dtype: str, params=None) -> dict:
    """The extra tensors the chain reads, in argument order: ``{name: (shape, dtype)}``;
    ``params``: the op's, for its quantization attributes (``quant.py``)."""
    ops = check(post_ops)
    kinds = {p["kind"] for p in ops}
    params = quant.check(src_dtype, params or {})
    natural = types(src_dtype)[2]
    dst = quant.dst_dtype(src_dtype, params, natural)
    out = {"scale": (quant.scale_shape(params, channels), "float32")} \
        if src_dtype in INTEGER else {}
    if "bias" in kinds:
        out["bias"] = ((channels,), quant.bias_dtype(ops, src_dtype, natural))
    if "sum" in kinds:
        out["sum"] = (tuple(dst_shape), dst)
    return out


def check_layouts(layouts: dict) -> None:
    """The sum tensor is read at dst's physical positions: it needs dst's padded dims and halo
    (checked when a spec is parsed, and again when the chain is made)."""
    dst = layouts["dst"]
    if "sum" in layouts and (layouts["sum"].padded_shape, layouts["sum"].paddings) != \
            (dst.padded_shape, dst.paddings):
        raise SpecError(f"sum post-op: its layout must have dst's padded dims and halo; "
                        f"got {layouts['sum']} for dst {dst}")


class Chain:
    """The chain of one kernel: its sources (``sources``, argument order) and, called as
    ``chain(v, idx)``, the epilogue ``OpDef`` applies to the reduced value."""

    def __init__(self, post_ops, layouts: dict, mode: str, requant=None):
        self.ops = check(post_ops)
        self.requant = requant   # quant.Requant: the ends of an integer kernel's chain
        check_layouts(layouts)
        dst = layouts["dst"]
        self.sources = {n: Source(n, layouts[n], mode) for n in TENSORS if n in layouts}
        self.per_channel = {n: _extended(self.sources[n], dst) for n in ("scale", "bias")
                            if n in self.sources}
        self.offset = dst.paddings[CHANNEL][0]

    def __call__(self, v, idx):
        """Computed in the accumulator's type (float32 for integer and 16-bit sources)."""
        k = idx[CHANNEL] + self.offset
        int_bias = "bias" in self.sources and self.sources["bias"].dtype == "int32"
        if self.requant is not None:
            v = self.requant.start(v, idx, self.per_channel["bias"][k] if int_bias else None)
        if "scale" in self.per_channel:
            v = v.astype("float32") * self.per_channel["scale"][k]
        dtype = dtype_of(v)
        for p in self.ops:
            if p["kind"] == "bias" and not int_bias:
                v = v + self.per_channel["bias"][k].astype(dtype)
            elif p["kind"] == "sum":
                v = v + tirx.const(p["scale"], dtype) * self.sources["sum"](*idx).astype(dtype)
            elif p["kind"] == "eltwise":
                v = eltwise.apply(p["algorithm"], v, p["alpha"], p["beta"])
        return v if self.requant is None else self.requant.finish(v)


def _extended(t: Source, dst: Layout) -> te.Tensor:
    """A stage holding the per-channel ``t`` at every channel index of ``dst``'s buffer (halo
    first): ``t[clamp(k, 0, K - 1)]``."""
    before, after = dst.paddings[CHANNEL]
    n, last = dst.padded_shape[CHANNEL] + before + after, t.layout.shape[0] - 1
    return te.compute((n,), lambda i: t(tirx.min(tirx.max(i - before, 0), last)),
                      name=f"{t.name}_extended")
