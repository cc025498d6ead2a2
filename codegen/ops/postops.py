"""Post-ops of convolution and matmul, oneDNN's post-op chain, fused into the kernel's epilogue:

    post_ops = [{kind = "bias"}, {kind = "eltwise", algorithm = "relu"}, {kind = "sum"},
                {kind = "binary", algorithm = "mul", operand = "channel"}]

applied in the order given to the reduced value ``v`` at destination element ``idx``:

* ``bias``:    v + bias[k], a 1-D (K,) tensor over the output channels (kernel argument ``bias``);
* ``eltwise``: ``eltwise.apply(algorithm, v, alpha, beta)``;
* ``sum``:     v + scale * (sum[idx] - zero_point), a second tensor laid out like dst: same
  padded dims and halo (oneDNN's sum reads the destination's own memory). Its element type is
  dst's, or ``dt``, one of the same size (oneDNN reinterprets dst's memory: a uint8 dst may
  accumulate an int8 sum; a float32 one an int32 sum). A chain may hold several sums, each
  reading its own tensor: arguments ``sum``, ``sum_1``, ``sum_2``, ... in chain order;
* ``binary``:  v = algorithm(v, operand) for ``add``, ``mul``, ``max``, ``min`` (NaN from either
  side, as oneDNN) and ``prelu`` (v >= 0 ? v : v * operand); the operand is a (1,) tensor
  (``operand = "tensor"``), a (K,) one over the output channels (``"channel"``) or a tensor of
  dst's shape in any layout (``"full"``), in the chain's type: oneDNN's binary post-op with its
  per-tensor, per-channel and full broadcast masks. Arguments ``binary_0``, ``binary_1``, ... in
  chain order.
* ``quantized_add`` (integer kernels with a uint8/int8 destination; last in the chain): the
  value is first rounded and saturated to the destination's type (the kernel's own
  quantization: ``dst_scale``, ``dst_zero_point``), then summed with ``addend``, an 8-bit
  tensor laid out like dst, as ONNX Runtime's QLinearAdd sums two quantized tensors
  (``quantize.add``: two float32 fmas, round half to even, saturate) into the destination's
  type. ``scales`` and ``zero_points`` are [value, addend, result]'s; ``addend_first``: the
  addend is QLinearAdd's first operand. oneDNN has no such entry (its sum runs before the
  destination's rounding); it is what fuses a quantized model's residual ``QLinearAdd`` into
  the convolution before it and keeps the result bit-exact with ONNX Runtime's two ops.

The chain runs in the accumulator's type: the source's for float32 and float64, float32 for
float16 (cast to the destination's at the store). Integer kernels (uint8/int8 x int8 -> int32)
start it in int32 (source zero-point compensation, an int32 bias: ``{kind = "bias", dtype =
"int32"}``, first in the chain) and with the weight scale, v = scale * float(acc) (oneDNN's
output scales), and end it with the destination scale, zero point, rounding and saturation to
``dst_dtype``: ``quant.py`` holds both ends and their order. Bias has the destination's dtype
(float32 for integer kernels unless it says int32), sums the destination's (or ``dt``), binary
operands the chain's (float32 for integer kernels). The tensors come as kernel arguments in the
fixed order scale, bias, the sums, the binary operands (``vocabulary.POST_OP_TENSORS``),
whatever the order of the chain; a chain holds one bias at most.

Per-channel tensors (scale, bias, per-channel operands) are read through a copy extended over
the destination's padded channels, which repeat the last channel's value. So the epilogue reads
them with no bounds check, and none can be lost: inside ``materialize``'s ``select(is_padding,
0, v)`` TVM simplifies ``v`` assuming a valid channel, which would drop a guard or a clamp and
leave a vector load past the end of a (K,) buffer. It also lets the zero-propagation derivation
(``common.propagates_zero``) see what oneDNN's ``wants_zero_pad_dst`` knows: a bias breaks
zeros (a padded channel gets bias[K-1]); an output scale does not (scale * 0 = 0). So with the
new entries: adding or taking the max/min with a per-tensor or per-channel operand breaks
zeros, multiplying by one or a prelu does not, a full operand keeps them (its own padding reads
as 0), and a sum with a zero point breaks them (0 - zero_point).
"""

from __future__ import annotations

from tvm import te, tirx
from tvm.ir.expr import Call

from blockpad.errors import SpecError
from blockpad.layout import Layout
from blockpad.vocabulary import (
    BINARY_OPERANDS,
    BINARY_POST_OPS,
    MAX_BINARIES,
    MAX_SUMS,
    POLYNOMIAL_READS,
    POLYNOMIALS,
    POST_OP_DEFAULTS,
    POST_OP_TENSORS,
    QUANTIZED_ADD,
    QUANTIZED_DTYPES,
    post_op_tensors,
    qlinear_operands,
    quantized_add_entry,
)

from . import eltwise, quant, quantize
from .common import Source, dtype_of, nan_max, nan_min
from .quant import BF16

# floating sources and their accumulators; bfloat16 would need the bit storage (uint16 buffers)
# that reorders use, in compute ops, which no op has yet
ACCUMULATOR = {"float32": "float32", "float64": "float64", "float16": "float32"}
CHANNEL = 1   # the output-channel dim of the destination's logical index (n k h w; m n)
TENSORS = ("scale", *POST_OP_TENSORS)   # argument order
# 1-D tensors whose layouts a spec may leave out (a full binary operand, dst's rank, needs one)
DEFAULT_TAGS = {"scale": "a", "bias": "a", **{n: "a" for n in TENSORS if n.startswith("binary")}}
OPTIONAL = {"bias": ("dtype",)}   # keys without a default (quant.bias_dtype)
# a sum tensor's element types: dst's, or another of its size (oneDNN reinterprets dst's memory)
SUM_TYPES = ("float32", "int32", "float64", "float16", "int8", "uint8")
BINARY = {"add": lambda v, b: v + b, "mul": lambda v, b: v * b, "max": nan_max, "min": nan_min,
          "prelu": lambda v, b: tirx.Select(v >= tirx.const(0, dtype_of(v)), v, v * b)}


def types(dtype: str) -> tuple:
    """``(weights, accumulator, destination)`` element types for a source of ``dtype``."""
    if dtype in QUANTIZED_DTYPES:
        return "int8", "int32", "float32"
    if dtype == BF16:
        return BF16, "float32", "float32"
    if dtype not in ACCUMULATOR:
        known = ", ".join([*ACCUMULATOR, BF16, *QUANTIZED_DTYPES])
        raise SpecError(f"dtype: expected one of {known} (the source's); got {dtype!r}")
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
        most = {"bias": 1, "sum": MAX_SUMS, "binary": MAX_BINARIES, QUANTIZED_ADD: 1}.get(kind)
        if most is not None and sum(q["kind"] == kind for q in out) == most:
            raise SpecError(f"post_ops[{i}]: at most {'one' if most == 1 else most} {kind!r} "
                            f"post-op{'s' if most > 1 else ''} (each names a tensor)")
        if out and out[-1]["kind"] == QUANTIZED_ADD:
            raise SpecError(f"post_ops[{i}]: a {QUANTIZED_ADD!r} post-op ends the chain (its "
                            f"result is the destination's rounded value); got {p!r} after it")
        out.append({"kind": kind, **POST_OP_DEFAULTS[kind], **p})
        _check_entry(i, out[-1])
    return out


def _check_entry(i: int, p: dict) -> None:
    def expect(key, ok, what):
        if not ok:
            raise SpecError(f"post_ops[{i}] ({p['kind']}): {key} must be {what}; "
                            f"got {p[key]!r}")

    if p["kind"] == "eltwise":
        eltwise.apply(p["algorithm"], tirx.Var("x", "float32"))  # rejects unknown ones
    elif p["kind"] == "sum":
        expect("scale", _number(p["scale"]), "a number")
        expect("zero_point", isinstance(p["zero_point"], int) and
               not isinstance(p["zero_point"], bool) and -2**31 <= p["zero_point"] < 2**31,
               "an int32 integer")
        expect("dt", p["dt"] is None or p["dt"] in SUM_TYPES,
               f"one of {', '.join(SUM_TYPES)} (or left out: the destination's)")
    elif p["kind"] == "binary":
        expect("algorithm", p["algorithm"] in BINARY_POST_OPS, f"one of {', '.join(BINARY_POST_OPS)}")
        expect("operand", p["operand"] in BINARY_OPERANDS, f"one of {', '.join(BINARY_OPERANDS)}")
    elif p["kind"] == QUANTIZED_ADD:
        expect("scales", _triple(p["scales"], lambda s: _number(s) and 0 < s < float("inf")),
               "three positive numbers (value, addend, result)")
        expect("zero_points", _triple(p["zero_points"], lambda z: isinstance(z, int) and
                                      not isinstance(z, bool) and -128 <= z <= 255),
               "three integers in -128..255 (value, addend, result)")
        expect("addend_first", isinstance(p["addend_first"], bool), "true or false")
        expect("dt", p["dt"] in (None, *QUANTIZED_DTYPES),
               f"one of {', '.join(QUANTIZED_DTYPES)} (or left out: the destination's)")
        p.update(quantized_add_entry(p))


def _triple(v, ok) -> bool:
    return isinstance(v, (list, tuple)) and len(v) == 3 and all(ok(x) for x in v)


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def tensors(post_ops, dst_shape, channels: int, src_dtype: str, params=None) -> dict:
    """The extra tensors the chain reads, in argument order: ``{name: (shape, dtype)}``;
    ``params``: the op's, for its quantization attributes (``quant.py``)."""
    chain = check(post_ops)
    params = quant.check(src_dtype, params or {})
    natural = types(src_dtype)[2]
    dst = quant.dst_dtype(src_dtype, params, natural)
    out = {"scale": (quant.scale_shape(params, channels), "float32")} \
        if src_dtype in QUANTIZED_DTYPES else {}
    shapes = {"tensor": (1,), "channel": (channels,), "full": tuple(dst_shape)}
    if any(p["kind"] == QUANTIZED_ADD for p in chain) and dst not in QUANTIZED_DTYPES:
        raise SpecError(f"{QUANTIZED_ADD} post-op: it sums two quantized 8-bit values, so the "
                        f"kernel needs a uint8/int8 source and a dst_dtype of uint8 or int8; got "
                        f"a {src_dtype} source with a {dst} destination")
    for p, name in zip(chain, post_op_tensors(chain)):
        if p["kind"] == "bias":
            out[name] = ((channels,), quant.bias_dtype(chain, src_dtype, natural))
        elif p["kind"] == "sum":
            out[name] = (tuple(dst_shape), _sum_type(p, dst))
        elif p["kind"] == "binary":
            out[name] = (shapes[p["operand"]], natural)
        elif p["kind"] == QUANTIZED_ADD:
            out[name] = (tuple(dst_shape), p["dt"] or dst)
    return {n: out[n] for n in TENSORS if n in out}


def _sum_type(p: dict, dst: str) -> str:
    """A sum tensor's element type: ``dt`` if it names one of dst's size, else dst's."""
    dt = p["dt"] or dst
    if _bits(dt) != _bits(dst):
        raise SpecError(f"sum post-op: dt must have the destination's element size ({dst}: "
                        f"{', '.join(t for t in SUM_TYPES if _bits(t) == _bits(dst))}); "
                        f"got {dt!r}")
    return dt


def _bits(dtype: str) -> int:
    return int("".join(c for c in dtype if c.isdigit()))


def check_layouts(layouts: dict) -> None:
    """A sum tensor (and a quantized add's addend) is read at dst's physical positions: it
    needs dst's padded dims and halo (checked when a spec is parsed, and again when the chain
    is made)."""
    dst = layouts["dst"]
    for name in TENSORS:
        if (name.startswith("sum") or name == "addend") and name in layouts and \
                (layouts[name].padded_shape, layouts[name].paddings) != \
                (dst.padded_shape, dst.paddings):
            kind = "a sum" if name.startswith("sum") else "a quantized add"
            raise SpecError(f"{name} ({kind} post-op): its layout must have dst's padded dims "
                            f"and halo; got {layouts[name]} for dst {dst}")


class Chain:
    """The chain of one kernel: its sources (``sources``, argument order) and, called as
    ``chain(v, idx)``, the epilogue ``OpDef`` applies to the reduced value."""

    def __init__(self, post_ops, layouts: dict, mode: str, requant=None):
        self.ops = check(post_ops)
        self.names = post_op_tensors(self.ops)
        self.requant = requant   # quant.Requant: the ends of an integer kernel's chain
        check_layouts(layouts)
        dst = layouts["dst"]
        self.sources = {n: Source(n, layouts[n], mode) for n in TENSORS if n in layouts}
        channel = {"scale", "bias", *(n for p, n in zip(self.ops, self.names)
                                      if p["kind"] == "binary" and p["operand"] == "channel")}
        self.per_channel = {n: _extended(s, dst) for n, s in self.sources.items() if n in channel}
        self.offset = dst.paddings[CHANNEL][0]

    def __call__(self, v, idx):
        """Computed in the accumulator's type (float32 for integer and 16-bit sources).

        A step that reads its operand several times (a NaN-aware max or min: four; an exp,
        which ``schedules/vector_math`` writes as a polynomial: 109) copies the expression so
        far as often; along a chain the copies multiply, and TVM's simplifier, which walks the
        expression as a tree, took 450 s on a max, a min and an exp (23 s with the exp's
        argument copied 109 times). Where the copies would pass ``MAX_COPIES`` the value so far
        is bound to a variable once (``tirx.Let``): the expression grows by a sum, not a
        product."""
        k = idx[CHANNEL] + self.offset
        int_bias = "bias" in self.sources and self.sources["bias"].dtype == "int32"
        if self.requant is not None:
            v = self.requant.start(v, idx, self.per_channel["bias"][k] if int_bias else None)
        if "scale" in self.per_channel:
            v = v.astype("float32") * self.per_channel["scale"][k]
        dtype = dtype_of(v)
        steps = [self._step(p, name, idx, k, dtype) for p, name in zip(self.ops, self.names)
                 if not (p["kind"] == "bias" and int_bias)]   # int32: requant.start adds it
        if self.requant is not None:
            steps.append(self._finish(idx))
        lets, copies = [], 1
        for step in steps:
            uses = _uses(step, dtype)
            if copies * uses > MAX_COPIES and not _is_leaf(v):
                bound = tirx.Var(f"post_op_{len(lets)}", dtype)
                lets.append((bound, v))
                v, copies = bound, 1
            v, copies = step(v), copies * uses
        for bound, value in reversed(lets):
            v = tirx.Let(bound, value, v)
        return v

    def _step(self, p, name, idx, k, dtype):
        """Post-op ``p`` as a function of the value so far."""
        if p["kind"] == "bias":
            return lambda v: v + self.per_channel["bias"][k].astype(dtype)
        if p["kind"] == "sum":
            s = self.sources[name](*idx).astype(dtype)
            if p["zero_point"]:
                s = s - tirx.const(p["zero_point"], dtype)
            return lambda v: v + tirx.const(p["scale"], dtype) * s
        if p["kind"] == "binary":
            operand = self._operand(p, name, idx, k).astype(dtype)
            return lambda v: BINARY[p["algorithm"]](v, operand)
        if p["kind"] == "eltwise":
            return lambda v: eltwise.apply(p["algorithm"], v, p["alpha"], p["beta"])
        return lambda v: v   # quantized_add: the requantization's end sums it (_finish)

    def _finish(self, idx):
        """The integer chain's end: the destination's rounding and saturation, or the
        quantized add that ends the chain."""
        last = self.ops[-1] if self.ops else None
        if last is None or last["kind"] != QUANTIZED_ADD:
            return self.requant.finish

        def add(v):
            q = self.requant.finish(v, as_float=True)   # the add reads it as float32
            a = self.sources[self.names[-1]](*idx)
            pair, scales, zero_points = qlinear_operands(last, q, a)
            return quantize.add(*pair, scales, zero_points, self.requant.dst)
        return add

    def _operand(self, p, name, idx, k):
        if p["operand"] == "tensor":
            return self.sources[name](0)
        if p["operand"] == "channel":
            return self.per_channel[name][k]
        return self.sources[name](*idx)


#: the most copies of one value a chain's expression may hold before it is bound once (``Chain``)
MAX_COPIES = 8
_CHILDREN = ("a", "b", "condition", "true_value", "false_value", "value", "body", "args",
             "indices")


def _is_leaf(v) -> bool:
    """A variable, a constant or a tensor read: nothing to bind."""
    return isinstance(v, (tirx.Var, tirx.IntImm, tirx.FloatImm, te.tensor.TensorSlice)) or \
        (isinstance(v, Call) and getattr(v.op, "name", "") == "te.tensor_load")


def _uses(step, dtype) -> int:
    """How many times ``step`` reads the value it is given: its expression on a fresh
    variable, walked as a tree (the tree a simplifier walks), a function written later as a
    polynomial counted as the polynomial's reads of its argument."""
    x = tirx.Var("x", dtype)

    def count(e) -> int:
        if isinstance(e, tirx.Var):
            return int(e.same_as(x))
        if isinstance(e, Call) and getattr(e.op, "name", "") in POLYNOMIALS:
            return POLYNOMIAL_READS * count(e.args[0])
        n = 0
        for field in _CHILDREN:
            child = getattr(e, field, None)
            if isinstance(child, tirx.Expr):
                n += count(child)
            elif child is not None and not isinstance(child, (str, int, float)):
                n += sum(count(c) for c in child if isinstance(c, tirx.Expr))
        return n
    return max(count(step(x)), 1)


def _extended(t: Source, dst: Layout) -> te.Tensor:
    """A stage holding the per-channel ``t`` at every channel index of ``dst``'s buffer (halo
    first): ``t[clamp(k, 0, K - 1)]``."""
    before, after = dst.paddings[CHANNEL]
    n, last = dst.padded_shape[CHANNEL] + before + after, t.layout.shape[0] - 1
    return te.compute((n,), lambda i: t(tirx.min(tirx.max(i - before, 0), last)),
                      name=f"{t.name}_extended")
