"""What the graph runtime knows of each op: shapes, which layouts to ask for, the kernel request
for a layout choice, whether and over which input it can run in place, and a numpy reference the
graph falls back on when no kernel can be had (seed 004's FallBackCompute).

The runtime does not import the code generator, so this is the runtime's own view of the ops:
the spec fields it asks for are those of ``codegen/ops`` (checked when a kernel is built).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from blockpad import qlinear, winograd
from blockpad.channel_blocks import inner_block
from blockpad.errors import ArgumentError
from blockpad.layout import Layout, dtype_name, pad_sides, pad_sides_param, window_out_size
from blockpad.numpy_conv import direct_conv
from blockpad.vocabulary import (
    INPLACE_SOURCES,
    POOL_DTYPES,
    POST_OP_TENSORS,
    QUANT_DEFAULTS,
    QUANTIZED_ADD,
    QUANTIZED_DTYPES,
    post_op_tensors,
    with_defaults,
)

from ..cache import Request

_PLAIN_ACT = {1: "a", 2: "ab", 3: "abc", 4: "nchw", 5: "ncdhw", 6: "abcdef"}
_PLAIN_WEIGHTS = {4: "oihw", 5: "goihw"}


def plain(shape, dtype, weights=False) -> Layout:
    """The layout a numpy array of ``shape`` already is (weights get the oihw letters that
    weight layouts share)."""
    return _plain(tuple(int(s) for s in shape), str(dtype), bool(weights))


@functools.lru_cache(maxsize=1024)
def _plain(shape, dtype, weights):
    table = _PLAIN_WEIGHTS if weights and len(shape) in _PLAIN_WEIGHTS else _PLAIN_ACT
    return Layout(table[len(shape)], shape, dtype)


def _first(block, blocks) -> list:
    """``blocks`` with ``block`` first (None: as they are)."""
    return blocks if block is None else [block, *(b for b in blocks if b != block)]


def _source_block(home, block) -> int:
    """The channel block a kernel reads a source in: its home's where that is ``nChw8c`` or
    ``nChw16c`` (no reorder between the two), else ``block`` (a plain input's reorder)."""
    b = home.blocks[1] if home is not None and len(home.shape) == 4 else 1
    return b if b in (8, 16) and home.tag == f"nChw{b}c" else block


def blocked(shape, dtype, block) -> Layout | None:
    """``nChw<block>c`` (``nCdhw``...) for an activation of rank 4 or 5, else None."""
    if len(shape) == 4:
        return Layout(f"nChw{block}c", tuple(shape), dtype)
    if len(shape) == 5:
        return Layout(f"nCdhw{block}c", tuple(shape), dtype)
    return None


@dataclass
class Candidate:
    """One way to run a node: a layout per input and per output, ``request(inplace)`` giving
    the kernel request (None: the numpy reference), and the kernel's arguments as ('in', i) /
    ('out', j) in call order."""

    inputs: list
    outputs: list
    request: object
    args: list
    label: str = "blocked"


class OpInfo:
    name = "op"
    inplace_capable = False
    alias = False        # run in place, its output is its input's bytes seen in another shape

    def infer(self, node, types):
        """[(shape, dtype)] of the outputs, from the inputs' (shape, dtype)."""
        raise NotImplementedError

    def inplace_inputs(self, node, types) -> list:
        """Indices of inputs the node may overwrite with its output (seed 003's in-place ops)."""
        return []

    def choices(self, node, types, homes, graph) -> list:
        """Layout choices in order of preference: the runtime takes the first whose kernel it
        can get. The last is always all-plain."""
        raise NotImplementedError

    def reference(self, node, arrays):
        raise NotImplementedError


def _same_as_input(index=0):
    def infer(node, types):
        return [types[index]]
    return infer


# ---- eltwise ----------------------------------------------------------------------------------

def _erf(x):
    return np.frompyfunc(math.erf, 1, 1)(x).astype(np.float64)


ELTWISE = {
    "relu": lambda x, a, b: np.where(x > 0, x, x * a),
    "gelu_erf": lambda x, a, b: 0.5 * x * (1 + _erf(x / np.sqrt(2))),
    "gelu_tanh": lambda x, a, b: 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) *
                                                        (x + 0.044715 * x ** 3))),
    "sigmoid": lambda x, a, b: 1 / (1 + np.exp(-x)),
    "exp": lambda x, a, b: np.exp(x),
    "tanh": lambda x, a, b: np.tanh(x),
    "clip": lambda x, a, b: np.clip(x, a, b),
    "linear": lambda x, a, b: a * x + b,
    "abs": lambda x, a, b: np.abs(x),
    "round": lambda x, a, b: np.rint(x),
    "swish": lambda x, a, b: x / (1 + np.exp(-a * x)),
}


def eltwise_ref(x, algorithm="relu", alpha=0.0, beta=0.0):
    if algorithm not in ELTWISE:
        raise ArgumentError(f"eltwise algorithm: expected one of {', '.join(ELTWISE)}; "
                            f"got {algorithm!r}")
    return ELTWISE[algorithm](x.astype(np.float64), alpha, beta)


class Eltwise(OpInfo):
    name = "eltwise"
    inplace_capable = True

    def infer(self, node, types):
        return [types[0]]

    def inplace_inputs(self, node, types):
        return [0]

    def _params(self, node):
        a = node.attrs
        return {"algorithm": a["algorithm"], "alpha": float(a["alpha"]), "beta": float(a["beta"])}

    def choices(self, node, types, homes, graph):
        out = []
        for lay in _follow(homes[0]):
            req = lambda inplace, lay=lay: Request.make(   # noqa: E731
                "eltwise", [("src", lay), ("dst", lay)],
                {**self._params(node), **({"inplace": True} if inplace else {})}, graph.policy)
            out.append(Candidate([lay], [lay], req, [("in", 0), ("out", 0)],
                                 "plain" if lay.is_plain else "blocked"))
        return out

    def reference(self, node, arrays):
        return [eltwise_ref(arrays[0], **self._params(node))]


def _follow(home: Layout):
    """Ops that follow their input's layout: that layout, then plain."""
    p = plain(home.shape, home.dtype)
    return [home, p] if home != p else [p]


# ---- binary -----------------------------------------------------------------------------------

class Binary(OpInfo):
    name = "binary"
    inplace_capable = True

    def infer(self, node, types):
        (s0, d0), (s1, d1) = types
        if d0 != d1:
            raise ArgumentError(f"{node.name}: binary inputs must share a dtype; got {d0} and {d1}")
        if len(s0) != len(s1) or any(a != b and 1 not in (a, b) for a, b in zip(s0, s1)):
            raise ArgumentError(f"{node.name}: shapes {s0} and {s1} do not broadcast (same rank, "
                                f"each dim equal or 1)")
        return [(tuple(max(a, b) for a, b in zip(s0, s1)), d0)]

    def inplace_inputs(self, node, types):
        """The kernel overwrites src0; add and mul commute, so an src1 of the result's shape
        may be overwritten too (the graph swaps the operands). A quantized add does not: each
        operand has its own scale, and its two fmas round differently swapped."""
        out = self.infer(node, types)[0][0]
        return [i for i in ((0,) if _quantized(node) else (0, 1))
                if tuple(types[i][0]) == tuple(out)]

    def choices(self, node, types, homes, graph):
        (s0, dt), (s1, _) = types
        out_shape = self.infer(node, types)[0][0]
        if tuple(s1) == tuple(s0) == out_shape:
            lead = next((h for h in homes if not h.is_plain), homes[0])
            lay = Layout(lead.tag, s0, dt) if lead.shape == s0 else plain(s0, dt)
            picks = [(lay, lay, lay)] + ([] if lay.is_plain else [(plain(s0, dt),) * 3])
        else:
            lay0 = homes[0] if tuple(s0) == out_shape else plain(s0, dt)
            picks = [(l0, plain(s1, dt), l0 if tuple(s0) == out_shape else plain(out_shape, dt))
                     for l0 in _follow(lay0)]
        out = []
        for l0, l1, ld in picks:
            def req(inplace, l0=l0, l1=l1, ld=ld):
                params = {"algorithm": node.attrs["algorithm"], **_quantized(node)}
                if inplace:
                    params["inplace"] = True
                return Request.make("binary", [("src0", l0), ("src1", l1), ("dst", ld)],
                                    params, graph.policy, shape=s0, implied={"shape1": list(s1)})
            out.append(Candidate([l0, l1], [ld], req, [("in", 0), ("in", 1), ("out", 0)],
                                 "plain" if l0.is_plain else "blocked"))
        return out

    def reference(self, node, arrays):
        q = _quantized(node)
        if q:
            (s0, s1, sd), (z0, z1, zd) = q["scales"], q["zero_points"]
            return [qlinear.add(*arrays, qlinear.add_params(s0, z0, s1, z1, sd, zd),
                                arrays[0].dtype)]
        a, b = (x.astype(np.float64) for x in arrays)
        return [a + b if node.attrs["algorithm"] == "add" else a * b]


def _quantized(node) -> dict:
    """A quantized add's ``scales`` and ``zero_points`` ([src0, src1, dst]), or {}."""
    a = node.attrs
    return {"scales": list(a["scales"]), "zero_points": list(a["zero_points"])} \
        if a.get("scales") is not None else {}


# ---- quantize / dequantize --------------------------------------------------------------------

class _Convert(OpInfo):
    """An elementwise change of type at a quantized model's float edge (codegen/ops/quantize.py:
    ONNX Runtime's QuantizeLinear / DequantizeLinear); follows its input's layout."""

    def out_dtype(self, node, dtype) -> str:
        raise NotImplementedError

    def infer(self, node, types):
        (shape, dt), = types
        return [(shape, self.out_dtype(node, dt))]

    def _params(self, node):
        a = node.attrs
        return {"scale": float(a["scale"]), "zero_point": int(a["zero_point"]),
                **({"dst_dtype": a["dtype"]} if self.name == "quantize" else {})}

    def choices(self, node, types, homes, graph):
        (shape, dt), = types
        out = []
        for lay in _follow(homes[0]):
            d = Layout(lay.tag, shape, self.out_dtype(node, dt))
            out.append(Candidate([lay], [d], lambda inplace, lay=lay, d=d: Request.make(
                self.name, [("src", lay), ("dst", d)], self._params(node), graph.policy),
                [("in", 0), ("out", 0)], "plain" if lay.is_plain else "blocked"))
        return out


class Quantize(_Convert):
    name = "quantize"

    def out_dtype(self, node, dtype):
        if dtype != "float32" or node.attrs["dtype"] not in QUANTIZED_DTYPES:
            raise ArgumentError(f"{node.name}: quantize takes float32 to uint8 or int8; got "
                                f"{dtype} to {node.attrs['dtype']}")
        return node.attrs["dtype"]

    def reference(self, node, arrays):
        a = node.attrs
        return [qlinear.quantize(arrays[0], a["scale"], a["zero_point"], a["dtype"])]


class Dequantize(_Convert):
    name = "dequantize"

    def out_dtype(self, node, dtype):
        if dtype not in QUANTIZED_DTYPES:
            raise ArgumentError(f"{node.name}: dequantize takes uint8 or int8; got {dtype}")
        return "float32"

    def reference(self, node, arrays):
        a = node.attrs
        return [qlinear.dequantize(arrays[0], a["scale"], a["zero_point"])]


# ---- softmax ----------------------------------------------------------------------------------

def softmax_ref(x, axis=1, log=False):
    x = x.astype(np.float64)
    e = x - x.max(axis=axis, keepdims=True)
    if log:
        return e - np.log(np.exp(e).sum(axis=axis, keepdims=True))
    e = np.exp(e)
    return e / e.sum(axis=axis, keepdims=True)


class Softmax(OpInfo):
    name = "softmax"
    inplace_capable = True

    def infer(self, node, types):
        return [types[0]]

    def inplace_inputs(self, node, types):
        return [0]

    def choices(self, node, types, homes, graph):
        out = []
        for lay in _follow(homes[0]):
            def req(inplace, lay=lay):
                params = {"axis": node.attrs["axis"], "log": bool(node.attrs.get("log"))}
                if inplace:
                    params["inplace"] = True
                return Request.make("softmax", [("src", lay), ("dst", lay)], params, graph.policy)
            out.append(Candidate([lay], [lay], req, [("in", 0), ("out", 0)],
                                 "plain" if lay.is_plain else "blocked"))
        return out

    def reference(self, node, arrays):
        return [softmax_ref(arrays[0], node.attrs["axis"], node.attrs.get("log", False))]


# ---- convolution ------------------------------------------------------------------------------

def conv_out_shape(src, channels, kernel, stride, pad, dilation):
    """``pad``: anything ``layout.pad_sides`` takes (symmetric pairs or per side)."""
    n, _, h, w = src
    return (n, channels) + tuple(window_out_size(x, r, s, p, d) for x, p, d, r, s in
                                 zip((h, w), pad_sides(pad), dilation, kernel, stride))


def conv_ref(x, w, bias=None, stride=(1, 1), pad=(0, 0), dilation=(1, 1), groups=1,
             post_ops=(), operands=None):
    """Direct convolution in float64 (NCHW source, (K, C/groups, KH, KW) weights, ``pad``
    symmetric or per side), then the post-op chain in order (``chain_ref``; ``operands``: the
    sums' and binary entries' tensors by argument name)."""
    out = direct_conv(x.astype(np.float64), w.astype(np.float64), stride, pad_sides(pad),
                      dilation, groups)
    return chain_ref(out, post_ops, {**(operands or {}), "bias": bias})


_BINARY_REF = {"add": np.add, "mul": np.multiply, "max": np.maximum, "min": np.minimum,
               "prelu": lambda v, b: np.where(v >= 0, v, v * b)}


def chain_ref(v, post_ops, tensors):
    """``v`` (float64, channels on axis 1) through a post-op chain, reading ``tensors`` by
    argument name (``bias``, ``sum``, ``sum_1``, ..., ``binary_0``, ...)."""
    channel = (slice(None),) + (None,) * (v.ndim - 2)
    for p, name in zip(map(with_defaults, post_ops), post_op_tensors(post_ops)):
        t = None if name is None else tensors[name].astype(np.float64)
        if p["kind"] == "bias":
            v = v + t[channel]
        elif p["kind"] == "sum":
            v = v + p["scale"] * (t - p["zero_point"])
        elif p["kind"] == "binary":
            b = t if p["operand"] == "full" else t[0] if p["operand"] == "tensor" else t[channel]
            v = _BINARY_REF[p["algorithm"]](v, b)
        else:
            v = eltwise_ref(v, p["algorithm"], p["alpha"], p["beta"])
    return v


def post_op_inputs(attrs) -> list:
    """The argument names of a conv2d's or matmul's post-op tensors, in the order the node
    takes them as inputs after src, weights and an integer kernel's scale (the kernel's:
    ``POST_OP_TENSORS``)."""
    names = set(post_op_tensors(attrs["post_ops"]))
    return [n for n in POST_OP_TENSORS if n in names]


def sum_inplace_inputs(node, types, out) -> list:
    """``[index]`` of a conv2d's or matmul's first sum post-op tensor where the result may
    overwrite it (the result's shape and dtype: oneDNN's sum post-op accumulates into the
    destination's memory), else []. Its inputs: src, weights, an integer kernel's scale, then
    ``post_op_inputs``."""
    names = post_op_inputs(node.attrs)
    source = INPLACE_SOURCES[node.op]
    if source not in names:
        return []
    i = 2 + (node.attrs.get("quant") is not None) + names.index(source)
    return [i] if (tuple(types[i][0]), types[i][1]) == (tuple(out[0]), out[1]) else []


def _post_op_arrays(attrs, rest) -> dict:
    """The inputs after src and weights (and scale) by argument name."""
    return dict(zip(post_op_inputs(attrs), rest[1:] if attrs.get("quant") else rest))


def check_post_op_inputs(node, types, out, channels: int) -> None:
    """Each post-op tensor of a conv2d or matmul node has its entry's shape: bias and a
    per-channel operand (channels,), a per-tensor one (1,), a sum and a full operand the
    result's; a sum the dtype it names (``dt``) or the result's."""
    kinds = dict(zip(post_op_tensors(node.attrs["post_ops"]), node.attrs["post_ops"]))
    for name, (shape, dt) in _post_op_arrays(node.attrs, types[2:]).items():
        p = with_defaults(kinds[name])
        want = {"tensor": (1,), "channel": (channels,)}.get(p.get("operand"), out[0]) \
            if p["kind"] != "bias" else (channels,)
        if tuple(shape) != tuple(want):
            raise ArgumentError(f"{node.name}: the {p['kind']} post-op's tensor ({name}) must "
                                f"be {tuple(want)}; got {tuple(shape)}")
        if p["kind"] in ("sum", QUANTIZED_ADD) and dt != (p["dt"] or out[1]):
            raise ArgumentError(f"{node.name}: the {p['kind']} post-op's tensor ({name}) must "
                                f"be {p['dt'] or out[1]}; got {dt}")


# ---- integer convolution and matmul: the quantization attributes ------------------------------

def quant_types(node, types, channels) -> str:
    """For a node with quantization attributes (``attrs["quant"]``, codegen/ops/quant.py's
    names): check the integer source, int8 weights and the ``scale`` input (index 2: (K,) per
    channel, (1,) per tensor); the destination's dtype."""
    q = node.attrs["quant"]
    (_, dt), (_, wdt), (sshape, sdt) = types[:3]
    if dt not in QUANTIZED_DTYPES or wdt != "int8":
        raise ArgumentError(f"{node.name}: quantization attributes need a uint8/int8 source and "
                            f"int8 weights; got {dt} and {wdt}")
    want = (channels,) if q.get("scales", "channel") == "channel" else (1,)
    if tuple(sshape) != want or sdt != "float32":
        raise ArgumentError(f"{node.name}: the scale must be float32 {want}; got {sdt} "
                            f"{tuple(sshape)}")
    return q.get("dst_dtype") or "float32"


def dot_steps(dtype: str, features) -> int | None:
    """The reduction steps a dot-product instruction sums per lane for ``dtype`` weights on a
    target whose CPU features ``features()`` gives (asked only for bf16: a graph of float32
    or int8 never looks its target up), which the weights' packing pairs up: 4 for int8
    (every target has one: ``vpmaddubsw``, ``vpdpbusd``, ``sdot``), 2 for bf16 where the
    target has ``vdpbf16ps`` (``avx512_bf16``), else None (FMAs: plain blocks)."""
    if dtype == "int8":
        return 4
    return 2 if dtype == "bfloat16" and "avx512_bf16" in features() else None


#: the floating types of convolution and matmul nodes (bf16 results stay bf16: quant_params)
DOT_FLOATS = ("float32", "float16", "bfloat16", "float64")


def quant_params(node, graph, dtype) -> dict:
    """The node's quantization attributes as a kernel request names them: those that differ
    from their defaults (what a kernel's manifest entry records), and ``weight_bits = 7``
    where the node's weights (input 1) are a constant in [-64, 64] (one ``vpmaddubsw`` a
    step on x86 without VNNI; ``WeightCache.seven_bit``). A bf16 source (``dtype``) asks for
    a bf16 destination: the graph keeps bf16 results bf16, the kernels write float32 unless
    told (``dst_dtype``)."""
    q = node.attrs.get("quant")
    if dtype == "bfloat16":
        return {"dst_dtype": "bfloat16"}
    if q is None:
        return {}
    out = {k: v for k, v in q.items() if v != QUANT_DEFAULTS[k]}
    if graph.weight_cache.seven_bit(node.inputs[1]):
        out["weight_bits"] = 7
    return out


def requantize_ref(node, acc, scale, axis=1):
    """The integer kernels' epilogue on the exact int32 accumulator ``acc`` (bias in):
    ``float32(acc) * scale``, then ``/ dst_scale``, round half to even, ``+ dst_zero_point``,
    saturate (codegen/ops/quant.py's order)."""
    q = node.attrs["quant"]
    shape = [1] * acc.ndim
    shape[axis] = -1
    v = acc.astype(np.float32) * np.asarray(scale, np.float32).reshape(shape)
    if float(q.get("dst_scale", 1.0)) != 1.0:
        v = v / np.float32(q["dst_scale"])
    dst = q.get("dst_dtype") or "float32"
    if dst == "float32":
        return v + np.float32(q.get("dst_zero_point", 0))
    return qlinear.saturate(np.rint(v).astype(np.int64) + int(q.get("dst_zero_point", 0)), dst)


def _int32_bias(post_ops) -> bool:
    return any(p["kind"] == "bias" and p.get("dtype") == "int32" for p in post_ops)


def _only_int32_bias(node) -> None:
    """The numpy reference of an integer convolution or matmul (no compiler) runs the chains
    quantized models import: an int32 bias, and a quantized add at the end (a residual
    ``QLinearAdd`` fused into the convolution, ``passes.fuse_post_ops``). Refuse any other
    chain rather than drop its entries."""
    a = node.attrs
    if a.get("sum") or any(p["kind"] not in ("bias", QUANTIZED_ADD) for p in a["post_ops"]) or \
            (a["bias"] and not _int32_bias(a["post_ops"])):
        raise ArgumentError(f"{node.name}: the numpy reference of an integer {node.op} takes an "
                            f"int32 bias and a quantized add, no other post-op; got "
                            f"{a['post_ops']}")


def quantized_add_ref(node, q, addend):
    """A chain's closing ``quantized_add`` (if any) on the requantized ``q``: ONNX Runtime's
    QLinearAdd of ``q`` and ``addend``, in the order the entry says."""
    last = node.attrs["post_ops"][-1] if node.attrs["post_ops"] else None
    if last is None or last["kind"] != QUANTIZED_ADD:
        return q
    return qlinear.add_in_order(q, addend, last, q.dtype.name)


class Conv2d(OpInfo):
    """Inputs: src (NCHW), weights ((K, C/groups, KH, KW), PyTorch's convention), then, with
    quantization attributes (``attrs["quant"]``), the float32 ``scale``, then the post-op
    chain's tensors in argument order (``post_op_inputs``: bias, sums, binary operands).
    Blocked: ``nChw<b>c`` source and
    destination with ``Graph.weight_tag``'s weights (``OIhw<b>i<b>o``; grouped ``gOIhw<b>i<b>o``,
    depthwise ``Goihw<b>g``); plain: ``nchw`` with ``oihw`` (``goihw`` when grouped)."""

    name = "conv2d"
    inplace_capable = True

    def inplace_inputs(self, node, types):
        return sum_inplace_inputs(node, types, self.infer(node, types)[0])

    def infer(self, node, types):
        a = node.attrs
        (src, dt), (w, wdt) = types[:2]
        if len(src) != 4 or len(w) != 4:
            raise ArgumentError(f"{node.name}: conv2d takes an NCHW source and (K, C/groups, KH, "
                                f"KW) weights; got shapes {src} and {w}")
        out_dt = dt
        if a.get("quant") is not None:
            out_dt = quant_types(node, types, w[0])
        elif dt not in DOT_FLOATS or wdt != dt:
            raise ArgumentError(f"{node.name}: graph convolutions are floating point with "
                                f"weights of the source's dtype (or integer with quantization "
                                f"attributes); got {dt} and {wdt}")
        if src[1] != w[1] * a["groups"] or w[0] % a["groups"]:
            raise ArgumentError(f"{node.name}: source has {src[1]} channels; weights {w} with "
                                f"groups={a['groups']} take {w[1] * a['groups']}")
        out = conv_out_shape(src, w[0], w[2:], a["stride"], a["pad"], a["dilation"])
        if min(out) < 1:
            raise ArgumentError(f"{node.name}: the kernel does not fit the padded image")
        check_post_op_inputs(node, types, (out, out_dt), w[0])
        if a.get("algorithm") == "winograd" and not self._winograd_fits(a, w, dt):
            raise ArgumentError(f"{node.name}: algorithm 'winograd' needs a 3x3 kernel, stride "
                                f"1, dilation 1, groups 1 and float32; got kernel {list(w[2:])}, "
                                f"stride {list(a['stride'])}, dilation {list(a['dilation'])}, "
                                f"groups {a['groups']}, {dt}")
        return [(out, out_dt)]

    @staticmethod
    def _winograd_fits(a, w, dt) -> bool:
        return (tuple(w[2:]) == (3, 3) and tuple(a["stride"]) == (1, 1) and dt == "float32"
                and tuple(a["dilation"]) == (1, 1) and a["groups"] == 1)

    def winograd_tile(self, node, types, graph):
        """F(m x m, 3x3)'s m for this node's blocked kernel, or None (direct): the node's
        ``algorithm``; ``auto`` asks the cost model of the target ``graph``'s kernels are for
        (``blockpad.winograd.choose``)."""
        a = node.attrs
        (src, dt), (w, _) = types[:2]
        algorithm = a.get("algorithm", "direct")
        if algorithm == "direct" or not self._winograd_fits(a, w, dt):
            return None
        if algorithm == "winograd":
            return a.get("winograd_tile") or winograd.DEFAULT_TILE
        out = conv_out_shape(src, w[0], w[2:], a["stride"], a["pad"], a["dilation"])
        rates = winograd.target_rates(graph.cache.target_name)
        return winograd.choose(src[0], src[1], w[0], *out[2:], rates)

    def _request(self, node, types, lays, graph, tile=None, inplace=False):
        a = node.attrs
        (src, dt), (w, _) = types[:2]
        q = a.get("quant")
        names = ["src", "weights"] + (["scale"] if q is not None else []) + \
            post_op_inputs(a) + ["dst"]
        params = {"channels": int(w[0]), "kernel": list(w[2:]), "stride": list(a["stride"]),
                  "pad": pad_sides_param(a["pad"]), "dilation": list(a["dilation"]),
                  "groups": int(a["groups"]), "post_ops": [dict(p) for p in a["post_ops"]],
                  **quant_params(node, graph, dt)}
        if tile is not None:
            params.update(algorithm="winograd", winograd_tile=tile)
        if inplace:
            params["inplace"] = True
        return Request.make("conv2d", list(zip(names, lays)), params, graph.policy, shape=src,
                            dtype=dt)

    def _weights(self, w, dt, groups, tag=None):
        if groups == 1:
            return Layout(tag or "oihw", tuple(w), dt)
        shape = (groups, w[0] // groups, w[1], w[2], w[3])
        return Layout(tag or "goihw", shape, dt)

    def choices(self, node, types, homes, graph):
        a = node.attrs
        (src, dt), (w, wdt) = types[:2]
        groups = a["groups"]
        out_shape, out_dt = self.infer(node, types)[0]
        extra = types[2:]
        args = [("in", i) for i in range(len(types))] + [("out", 0)]
        depthwise = groups > 1 and groups == src[1] == w[0]
        out = []
        tile = self.winograd_tile(node, types, graph)
        # a direct float32 convolution may change blocks: its source's block as it comes, its
        # destination's nChw8c where channel_blocks says a block of 16 wastes too much (not
        # Winograd: its input transform on 40 channels in nChw8c, vectors of 16 partly past
        # the channels, took 0.66 ms against 0.37 on nChw16c)
        mixed = groups == 1 and tile is None and dtype_name(dt) == dtype_name(wdt) == "float32"
        blocks = graph.conv_blocks(src[1], out_shape[1], groups)
        # the block tried first: a narrow destination's, or a depthwise one's source's (its
        # blocks in and out alike) as it comes
        first = graph.narrow_block(out_shape[1], dt) if mixed else \
            _source_block(homes[0], None) if depthwise else None
        for block in _first(first, blocks):
            sb = _source_block(homes[0], blocks[0] if block == first else block) \
                if mixed else block
            if tile is not None:   # Winograd-domain weights, transformed once (graph.py)
                wl = winograd.weights_layout(w[0], w[1], tile, block, dt)
            else:
                tag = graph.weight_tag(block, groups, depthwise, wdt, sb)
                wl = self._weights(w, wdt, groups, tag)
            s, d = blocked(src, dt, sb), blocked(out_shape, out_dt, block)
            rest = [plain(t[0], t[1]) if len(t[0]) == 1 else blocked(*t, block)
                    for t in extra] + [d]
            if groups == 1 and tile is None and 2 * src[1] <= block:
                # at most half a block of input channels (an image's 3): read them plain, as
                # ONNX Runtime's NCHWc convolutions do, rather than reduce over a block of
                # mostly zeros after a reorder (MobileNetV2's first layer, 1 thread: 0.58 ms
                # against 2.4 ms plus a 0.17 ms reorder of the image)
                lays = [plain(src, dt), Layout(f"Ohwi{block}o", tuple(w), wdt)] + rest
                label = f"nchw->nChw{block}c"
                if wdt == "int8":   # the dot products take 4 channels at once: one block of 4
                    lays[:2] = [Layout("nChw4c", tuple(src), dt),
                                Layout(f"OIhw1i{block}o4i", tuple(w), wdt)]
                    label = f"nChw4c->nChw{block}c"
                out.append(Candidate(lays[:-1], [d], lambda inplace, lays=lays: self._request(
                    node, types, lays, graph, inplace=inplace), args, label))
            lays = [s, wl] + rest
            out.append(Candidate(lays[:-1], [d], lambda inplace, lays=lays: self._request(
                node, types, lays, graph, tile, inplace), args, f"nChw{block}c"))
        lays = [plain(src, dt), self._weights(w, wdt, groups)] + \
            [plain(t[0], t[1]) for t in extra] + [plain(out_shape, out_dt)]
        out.append(Candidate(lays[:-1], [lays[-1]], lambda inplace, lays=lays: self._request(
            node, types, lays, graph, inplace=inplace), args, "plain"))
        return out

    def reference(self, node, arrays):
        a = node.attrs
        x, w, *rest = arrays
        w = w.reshape(w.shape[0] if w.ndim == 4 else w.shape[0] * w.shape[1], *w.shape[-3:])
        if a.get("quant") is not None:
            return [self._quantized_ref(node, x, w, rest)]
        tensors = _post_op_arrays(a, rest)
        return [conv_ref(x, w, tensors.pop("bias", None), a["stride"], a["pad"], a["dilation"],
                         a["groups"], a["post_ops"], tensors)]

    @staticmethod
    def _quantized_ref(node, x, w, rest):
        """int32 bias and requantization only: the chains quantized models import."""
        a = node.attrs
        _only_int32_bias(node)
        scale, bias = rest[0], (rest[1] if a["bias"] else None)
        acc = qlinear.conv_acc(x, node.attrs["quant"].get("src_zero_point", 0), w, bias,
                               a["stride"], pad_sides(a["pad"]), a["dilation"], a["groups"])
        return quantized_add_ref(node, requantize_ref(node, acc, scale), rest[-1] if rest else None)


class InvertedResidual(OpInfo):
    """A 1x1 expansion, a depthwise convolution and a 1x1 projection in one kernel
    (codegen/ops/inverted_residual.py), made by ``passes.fuse_inverted_residuals`` from three
    conv2d nodes. Inputs: src (NCHW), the expansion's weights (E, C, 1, 1) and bias, the
    depthwise weights (E, 1, KH, KW) and bias, the projection's weights (K, E, 1, 1), then the
    projection's post-op tensors (``post_op_inputs``). Blocked: ``nChw<b>c`` with the
    convolutions' blocked weights; plain: ``nchw`` with ``oihw``/``goihw`` (the generic
    schedule: correct, not fast)."""

    name = "inverted_residual"

    ATTRS = ("expanded", "channels", "kernel", "stride", "expand_post_ops",
             "depthwise_post_ops", "post_ops")

    def infer(self, node, types):
        a = node.attrs
        missing = [k for k in self.ATTRS if k not in a]
        if missing or len(types) < 6:
            raise ArgumentError(f"{node.name}: an inverted_residual node is made by the fusion "
                                f"pass from three conv2d nodes (Graph(fuse=...)); add those "
                                f"instead (got attrs {sorted(a)}, {len(types)} inputs)")
        (src, dt), (w, _) = types[0], types[5]
        pad = [k // 2 for k in a["kernel"]]
        return [(conv_out_shape(src, int(w[0]), a["kernel"], a["stride"], pad, (1, 1)), dt)]

    def _request(self, node, types, lays, graph):
        a = node.attrs
        names = ["src", "expand_weights", "expand_bias", "depthwise_weights", "depthwise_bias",
                 "weights", *post_op_inputs(a), "dst"]
        params = {k: a[k] for k in ("expanded", "channels", "kernel", "stride",
                                    "expand_post_ops", "depthwise_post_ops")}
        params["post_ops"] = [dict(p) for p in a["post_ops"]]
        return Request.make("inverted_residual", list(zip(names, lays)), params, graph.policy,
                            shape=types[0][0], dtype=types[0][1])

    def choices(self, node, types, homes, graph):
        (src, dt), (w1, _), (b1, _), (wd, _), (bd, _), (w2, _) = types[:6]
        (out, _), = self.infer(node, types)
        dw_shape = (wd[0], 1, 1, *wd[2:])
        args = [("in", i) for i in range(len(types))] + [("out", 0)]
        out_lays = []
        # the source in the block it comes in, the inner stages on channel_blocks.inner_block,
        # the destination in nChw8c where a block of 16 wastes too much (MobileNetV2's 24)
        blocks = graph.conv_blocks(max(src[1], w1[0]), out[1], 1)
        narrow = graph.narrow_block(out[1], dt)
        for block in _first(narrow, blocks):
            sb = _source_block(homes[0], blocks[0] if block == narrow else block)
            cb = inner_block(block)
            lays = [blocked(src, dt, sb),
                    Layout(graph.weight_tag(cb, 1, False, dt, sb), tuple(w1), dt), plain(b1, dt),
                    Layout(graph.weight_tag(cb, wd[0], True, dt), dw_shape, dt), plain(bd, dt),
                    Layout(graph.weight_tag(block, 1, False, dt, cb), tuple(w2), dt),
                    *(plain(*t) if len(t[0]) == 1 else blocked(*t, block) for t in types[6:]),
                    blocked(out, dt, block)]
            out_lays.append(Candidate(lays[:-1], lays[-1:], lambda inplace, lays=lays:
                                      self._request(node, types, lays, graph), args,
                                      f"nChw{block}c"))
        lays = [plain(src, dt), Layout("oihw", tuple(w1), dt), plain(b1, dt),
                Layout("goihw", dw_shape, dt), plain(bd, dt), Layout("oihw", tuple(w2), dt),
                *(plain(*t) for t in types[6:]), plain(out, dt)]
        out_lays.append(Candidate(lays[:-1], lays[-1:], lambda inplace, lays=lays:
                                  self._request(node, types, lays, graph), args, "plain"))
        return out_lays

    def reference(self, node, arrays):
        a = node.attrs
        x, w1, b1, wd, bd, w2, *rest = arrays
        kh, kw = a["kernel"]
        e = conv_ref(x, w1, b1, post_ops=[{"kind": "bias"}, *a["expand_post_ops"]])
        d = conv_ref(e, wd, bd, a["stride"], (kh // 2, kw // 2), groups=wd.shape[0],
                     post_ops=[{"kind": "bias"}, *a["depthwise_post_ops"]])
        tensors = _post_op_arrays(a, rest)
        return [conv_ref(d, w2, tensors.pop("bias", None), post_ops=a["post_ops"],
                         operands=tensors)]


# ---- pooling ----------------------------------------------------------------------------------

def pool_ref(x, algorithm="max", kernel=(2, 2), stride=None, pad=0, dilation=(1, 1),
             exclude_pad=True, ceil_mode=False):
    """Pooling in float64 with codegen/ops/pool.py's semantics (per-side pads, ceil_mode, the
    average over the cells in the image or in the padded image)."""
    x = x.astype(np.float64)
    stride = stride or kernel
    pad = pad_sides(pad)
    out = [window_out_size(n, k, s, p, d, ceil_mode)
           for n, k, s, p, d in zip(x.shape[2:], kernel, stride, pad, dilation)]
    span = [(o - 1) * s + d * (k - 1) + 1 for o, s, d, k in zip(out, stride, dilation, kernel)]
    # a frame around the image wide enough for every window (ceil_mode's last one may hang
    # beyond the padding): -inf for the max, 0 for the sum; the padding is counted in an
    # average when included, the frame beyond it never (NaN in the image propagates)
    far = [max(0, sp - p[0] - n - p[1]) for sp, p, n in zip(span, pad, x.shape[2:])]
    fill = -np.inf if algorithm == "max" else 0.0
    frame = [(a, b + f) for (a, b), f in zip(pad, far)]
    xp = np.pad(x, ((0, 0), (0, 0), *frame), constant_values=fill)
    inside = np.pad(np.ones(x.shape[2:]), pad)
    inside = np.pad(inside if exclude_pad else np.ones_like(inside), ((0, far[0]), (0, far[1])))
    taps, cells = [], 0
    for i in range(kernel[0]):
        for j in range(kernel[1]):
            sl = (slice(i * dilation[0], i * dilation[0] + (out[0] - 1) * stride[0] + 1,
                        stride[0]),
                  slice(j * dilation[1], j * dilation[1] + (out[1] - 1) * stride[1] + 1,
                        stride[1]))
            taps.append(xp[(slice(None), slice(None)) + sl])
            cells = cells + inside[sl]
    taps = np.stack(taps)
    if algorithm == "max":
        return taps.max(axis=0)
    return taps.sum(axis=0) / cells


class Pool(OpInfo):
    """Max or average pooling with codegen/ops/pool.py's parameters; follows its input's
    layout."""

    name = "pool"

    def infer(self, node, types):
        (shape, dt), = types
        a = node.attrs
        if len(shape) != 4:
            raise ArgumentError(f"{node.name}: pooling takes an NCHW source; got {shape}")
        dtypes = POOL_DTYPES[a["algorithm"]]
        if dt not in dtypes:
            raise ArgumentError(f"{node.name}: {a['algorithm']} pooling takes "
                                f"{' or '.join(dtypes)}; got {dt}")
        out = tuple(window_out_size(n, k, s, p, d, a["ceil_mode"]) for n, k, s, p, d in
                    zip(shape[2:], a["kernel"], a["stride"], a["pad"], a["dilation"]))
        if min(out) < 1:
            raise ArgumentError(f"{node.name}: the window {a['kernel']} does not fit the padded "
                                f"image {shape[2:]}")
        return [((*shape[:2], *out), dt)]

    def _params(self, node):
        a = node.attrs
        return {"algorithm": a["algorithm"], "kernel": list(a["kernel"]),
                "stride": list(a["stride"]), "pad": pad_sides_param(a["pad"]),
                "dilation": list(a["dilation"]), "exclude_pad": bool(a["exclude_pad"]),
                "ceil_mode": bool(a["ceil_mode"])}

    def choices(self, node, types, homes, graph):
        (shape, dt), = types
        out_shape = self.infer(node, types)[0][0]
        out = []
        for lay in _follow(homes[0]):
            d = Layout(lay.tag, out_shape, dt) if not lay.is_plain else plain(out_shape, dt)
            out.append(Candidate([lay], [d], lambda inplace, lay=lay, d=d: Request.make(
                "pool", [("src", lay), ("dst", d)], self._params(node), graph.policy),
                [("in", 0), ("out", 0)], "plain" if lay.is_plain else "blocked"))
        return out

    def reference(self, node, arrays):
        return [pool_ref(arrays[0], **self._params(node))]


# ---- matmul -----------------------------------------------------------------------------------

class Matmul(OpInfo):
    """``(M, K) x (K, N)`` (+ bias (N,) and post-ops): an inner product, a classifier head.
    Blocked: weights packed ``Ba16b`` (K x 16 column panels, what the x86 kernel streams);
    int8 ``BA16b4a`` (16 columns x 4 rows a register: the dot-product instructions'),
    ``weight_bits = 7`` where the constant weights fit (as ``Conv2d``)."""

    name = "matmul"
    inplace_capable = True

    def inplace_inputs(self, node, types):
        return sum_inplace_inputs(node, types, self.infer(node, types)[0])

    def infer(self, node, types):
        (src, dt), (w, wdt) = types[:2]
        if len(src) != 2 or len(w) != 2 or src[1] != w[0]:
            raise ArgumentError(f"{node.name}: matmul takes (M, K) and (K, N); got {src} and {w}")
        q = node.attrs.get("quant")
        out_dt = dt
        if q is not None:
            out_dt = quant_types(node, types, w[1])
        elif wdt != dt or dt not in DOT_FLOATS:
            raise ArgumentError(f"{node.name}: graph matmuls are floating point "
                                f"({', '.join(DOT_FLOATS)}) with weights of the source's dtype "
                                f"(or integer with quantization attributes); got {dt} and {wdt}")
        out = (src[0], w[1])
        check_post_op_inputs(node, types, (out, out_dt), w[1])
        return [(out, out_dt)]

    def choices(self, node, types, homes, graph):
        (src, dt), (w, wdt) = types[:2]
        out_shape, out_dt = self.infer(node, types)[0]
        q = node.attrs.get("quant")
        names = ["src", "weights"] + (["scale"] if q is not None else []) + \
            post_op_inputs(node.attrs) + ["dst"]
        args = [("in", i) for i in range(len(types))] + [("out", 0)]
        out = []
        params = {"n": int(w[1]), "post_ops": node.attrs["post_ops"],
                  **quant_params(node, graph, dt)}
        steps = dot_steps(wdt, graph.cache.target_features)
        packed = f"BA16b{steps}a" if steps else "Ba16b"
        for wtag in ([] if graph.layouts == "plain" else [packed]) + ["ab"]:
            lays = [plain(src, dt), Layout(wtag, w, wdt)] + \
                [plain(t[0], t[1]) for t in types[2:]] + [plain(out_shape, out_dt)]
            out.append(Candidate(lays[:-1], lays[-1:], lambda inplace, lays=lays: Request.make(
                "matmul", list(zip(names, lays)), {**params, **({"inplace": True} if inplace
                                                                else {})}, graph.policy), args,
                "blocked" if wtag != "ab" else "plain"))
        return out

    def reference(self, node, arrays):
        if node.attrs.get("quant") is not None:
            _only_int32_bias(node)
            x, w, scale, *rest = arrays
            acc = qlinear.matmul_acc(x, node.attrs["quant"].get("src_zero_point", 0), w,
                                     rest[0] if node.attrs["bias"] else None)
            return [quantized_add_ref(node, requantize_ref(node, acc, scale),
                                      rest[-1] if rest else None)]
        x, w, *rest = arrays
        out = x.astype(np.float64) @ w.astype(np.float64)
        return [chain_ref(out, node.attrs["post_ops"], _post_op_arrays(node.attrs, rest))]


# ---- reshape and concat -----------------------------------------------------------------------

class Reshape(OpInfo):
    """The same elements, another shape (a classifier head's flatten). Run "in place" it is an
    alias of its input's plain bytes (no copy); the in-place pass decides when it may be (no
    other reader of the input), else a copy."""

    name = "reshape"
    inplace_capable = True
    alias = True

    def infer(self, node, types):
        (shape, dt), = types
        new = tuple(node.attrs["shape"])
        if math.prod(new) != math.prod(shape):
            raise ArgumentError(f"{node.name}: cannot reshape {shape} ({math.prod(shape)} "
                                f"elements) to {new}")
        return [(new, dt)]

    def inplace_inputs(self, node, types):
        return [0]

    def choices(self, node, types, homes, graph):
        (shape, dt), = types
        return [Candidate([plain(shape, dt)], [plain(node.attrs["shape"], dt)], None, [], "plain")]

    def reference(self, node, arrays):
        return [arrays[0].reshape(node.attrs["shape"])]


class Concat(OpInfo):
    """Concatenation along ``axis`` (codegen/ops/concat.py). Channel concat of blocked values
    stays blocked whatever the channel offsets (the kernel reads each lane's source)."""

    name = "concat"

    def infer(self, node, types):
        axis = node.attrs["axis"]
        (s0, dt) = types[0]
        for s, d in types[1:]:
            if d != dt or len(s) != len(s0) or \
                    any(a != b for i, (a, b) in enumerate(zip(s, s0)) if i != axis):
                raise ArgumentError(f"{node.name}: concat along axis {axis} needs one dtype and "
                                    f"equal other dims; got {s0} {dt} and {s} {d}")
        return [((*s0[:axis], sum(s[axis] for s, _ in types), *s0[axis + 1:]), dt)]

    def choices(self, node, types, homes, graph):
        axis = node.attrs["axis"]
        out_shape, dt = self.infer(node, types)[0]
        lead = next((h for h in homes if not h.is_plain), None)
        tags = ([lead.tag] if lead is not None and graph.layouts == "blocked" else []) + [None]
        names = [f"src{i}" for i in range(len(types))] + ["dst"]
        args = [("in", i) for i in range(len(types))] + [("out", 0)]
        out = []
        for tag in tags:
            lays = [Layout(tag, s, dt) if tag else plain(s, dt) for s, _ in types] + \
                [Layout(tag, out_shape, dt) if tag else plain(out_shape, dt)]
            out.append(Candidate(lays[:-1], lays[-1:], lambda inplace, lays=lays: Request.make(
                "concat", list(zip(names, lays)),
                {"axis": axis, "sizes": [int(s[axis]) for s, _ in types]}, graph.policy),
                args, "plain" if tag is None else "blocked"))
        return out

    def reference(self, node, arrays):
        return [np.concatenate(arrays, axis=node.attrs["axis"])]


# ---- custom numpy ops -------------------------------------------------------------------------

class Custom(OpInfo):
    """A Python function on plain numpy arrays (an op blockpad has no kernel for: the seed's
    top_k, a framework's native op). Never in place; always on plain layouts."""

    name = "custom"

    def infer(self, node, types):
        return [tuple(t) for t in node.attrs["outputs"]]

    def choices(self, node, types, homes, graph):
        outs = [plain(s, d) for s, d in node.attrs["outputs"]]
        return [Candidate([plain(s, d) for s, d in types], outs, None, [], "numpy")]

    def reference(self, node, arrays):
        result = node.attrs["fn"](*arrays)
        return list(result) if isinstance(result, (list, tuple)) else [result]


GRAPH_OPS = {"eltwise": Eltwise(), "binary": Binary(), "softmax": Softmax(), "conv2d": Conv2d(),
             "inverted_residual": InvertedResidual(),
             "pool": Pool(), "matmul": Matmul(), "reshape": Reshape(), "concat": Concat(),
             "quantize": Quantize(), "dequantize": Dequantize(), "custom": Custom()}
