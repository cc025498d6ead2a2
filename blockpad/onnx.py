"""ONNX import: an inference model (opset 13 and later) as a ``bp.Graph``.

    g = bp.Graph.from_onnx("model.onnx", input_shapes={"x": (1, 3, 224, 224)})
    logits = g(x=array)

Each ONNX node becomes graph ops with the same numbers (checked against ONNX Runtime in
tests/test_onnx.py); the graph then picks blocked layouts and kernels as for any graph:

=====================  ===========================================================================
ONNX                   blockpad
=====================  ===========================================================================
Conv                   ``conv2d`` (group, dilations, strides, per-side ``pads``, ``auto_pad``);
                       ``algorithm="auto"`` unless ``conv_algorithm="direct"``: 3x3 stride-1
                       convolutions run as Winograd where ``blockpad.winograd`` says it pays
BatchNormalization     folded into the convolution that is its input's only producer and reader
                       (weights scaled, bias shifted); otherwise a per-channel ``mul`` and ``add``
Relu, Sigmoid          ``eltwise`` relu, sigmoid
Mul(x, Sigmoid(x))     ``eltwise`` swish (SiLU), one op, where the Mul is the Sigmoid's only
                       reader: a convolution then takes it as a post-op
Clip                   ``eltwise`` clip (min/max are constant inputs; relu6 = clip 0..6)
HardSigmoid            ``eltwise`` linear(alpha, beta), then clip 0..1
HardSwish              x * HardSigmoid(x) with alpha 1/6, beta 1/2
Mul, Add               ``binary`` with broadcasting (a scalar constant: ``eltwise`` linear)
Concat                 ``concat`` (blocked layouts kept whatever the channel offsets)
MaxPool, AveragePool   ``pool`` (per-side ``pads``, ``ceil_mode``, ``count_include_pad``)
GlobalAveragePool      ``pool`` avg over the whole image
Flatten, Reshape       ``reshape`` (shape a constant; 0 and -1 as ONNX means them)
Gemm, MatMul           ``matmul`` with constant weights (``transB``, ``alpha``, ``beta`` folded)
Softmax                ``softmax`` over ``axis``
Identity, Dropout      nothing (the name is the input's)
=====================  ===========================================================================

Quantized models (QDQ as ``quantize_static`` writes them, or QLinearConv / QLinearAdd / QGemm /
QLinearGlobalAveragePool) import onto int8 kernels with ONNX Runtime's integer results: see
``blockpad.onnx_int8``.

An op, an attribute or an attribute value this module does not handle raises
``UnsupportedModelError`` naming the node, the op, the attribute and the opset while the graph
is being built (kernels are compiled only when it first runs), so nothing is compiled for a
model that cannot run and nothing is silently dropped. Needs the ``onnx`` package (``pip
install -e ".[onnx]"``); the graph it makes does not.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from blockpad.errors import BlockpadError
from blockpad.onnx_int8 import ATTRS as INT8_ATTRS
from blockpad.onnx_int8 import MS_OPS, Quantized, QuantizedOps

MIN_OPSET = 13
MAX_OPSET = 23      # the newest opset whose changes to these ops this module knows


class UnsupportedModelError(BlockpadError, ValueError):
    """An ONNX model with an op, attribute or value blockpad cannot import."""


# ---- the model as plain data ------------------------------------------------------------------

@dataclass
class _Node:
    name: str
    op: str
    inputs: list
    outputs: list
    attrs: dict
    opset: int

    def fail(self, what, attribute=None):
        attr = f", attribute {attribute!r}" if attribute else ""
        raise UnsupportedModelError(f"ONNX node {self.name!r} ({self.op}, opset {self.opset}"
                                    f"{attr}): {what}")


def _onnx():
    try:
        import onnx
    except ImportError:
        raise ImportError("blockpad.onnx needs the onnx package: pip install -e \".[onnx]\" "
                          "(or pip install onnx)") from None
    return onnx


def _load(model):
    onnx = _onnx()
    if isinstance(model, (str, Path)):
        return onnx.load(str(model))
    if isinstance(model, onnx.ModelProto):
        return model
    if isinstance(model, (bytes, bytearray)):
        return onnx.load_from_string(bytes(model))
    raise UnsupportedModelError(f"expected a path, bytes or an onnx.ModelProto; got "
                                f"{type(model).__name__}")


def _opset(proto) -> int:
    versions = {o.domain: o.version for o in proto.opset_import}
    version = versions.get("", versions.get("ai.onnx"))
    if version is None:
        raise UnsupportedModelError("the model imports no version of the default ONNX domain")
    if not MIN_OPSET <= version <= MAX_OPSET:
        raise UnsupportedModelError(f"the model uses opset {version}; blockpad imports opsets "
                                    f"{MIN_OPSET} to {MAX_OPSET}")
    return version


def _nodes(proto, opset):
    onnx = _onnx()
    out = []
    for i, n in enumerate(proto.graph.node):
        name = n.name or f"{n.op_type}_{i}"
        if n.domain not in ("", "ai.onnx") and not (n.domain == "com.microsoft" and
                                                    n.op_type in MS_OPS):
            raise UnsupportedModelError(f"ONNX node {name!r} ({n.op_type}, domain {n.domain!r}, "
                                        f"opset {opset}): only the default ONNX domain (and "
                                        f"com.microsoft's {', '.join(MS_OPS)}) is supported")
        attrs = {}
        for a in n.attribute:
            value = onnx.helper.get_attribute_value(a)
            if isinstance(value, bytes):
                value = value.decode()
            elif a.type == onnx.AttributeProto.TENSOR:
                value = onnx.numpy_helper.to_array(value)
            attrs[a.name] = value
        out.append(_Node(name, n.op_type, list(n.input), list(n.output), attrs, opset))
    return out


# ---- the importer -----------------------------------------------------------------------------

CONV_ALGORITHMS = ("auto", "direct")


def from_onnx(model, input_shapes=None, conv_algorithm="auto", **options):
    """The graph of ``model`` (a path, serialized bytes or an ``onnx.ModelProto``).

    ``input_shapes``: {input name: shape} for inputs whose dims the model leaves symbolic
    (a batch dim) or that you want at another size; ``conv_algorithm``: the ``algorithm`` of
    every ``conv2d`` (``"auto"``: Winograd where the cost model of ``blockpad.winograd`` says
    it pays, within its error bound; ``"direct"``: never, for comparison); ``options``:
    ``bp.Graph``'s (policy, cache, block, ...). The graph's inputs and outputs are the
    model's, by name."""
    from blockpad.runtime.graph import Graph

    if conv_algorithm not in CONV_ALGORITHMS:
        raise UnsupportedModelError(f"conv_algorithm: expected one of "
                                    f"{', '.join(CONV_ALGORITHMS)}; got {conv_algorithm!r}")
    proto = _load(model)
    opset = _opset(proto)
    nodes = _nodes(proto, opset)
    g = Graph(**{"name": proto.graph.name or "onnx", **options})
    _Importer(proto, nodes, dict(input_shapes or {}), conv_algorithm).build(g)
    return g


_ELEM = {1: "float32"}   # TensorProto.FLOAT; the importer is fp32


class _Importer(QuantizedOps):
    def __init__(self, proto, nodes, input_shapes, conv_algorithm):
        onnx = _onnx()
        self.proto, self.nodes = proto, nodes
        self.conv_algorithm = conv_algorithm
        self.consts = {t.name: onnx.numpy_helper.to_array(t) for t in proto.graph.initializer}
        self.inputs = {}
        for vi in proto.graph.input:
            if vi.name in self.consts:
                continue            # an initializer listed as an input (IR version < 4)
            t = vi.type.tensor_type
            dtype = _ELEM.get(t.elem_type)
            if dtype is None:
                raise UnsupportedModelError(f"input {vi.name!r}: element type "
                                            f"{onnx.TensorProto.DataType.Name(t.elem_type)}; "
                                            f"blockpad imports float32 models")
            dims = [d.dim_value if d.HasField("dim_value") else None for d in t.shape.dim]
            shape = input_shapes.pop(vi.name, None)
            if shape is None:
                if None in dims:
                    names = [d.dim_param or "?" for d in t.shape.dim]
                    raise UnsupportedModelError(
                        f"input {vi.name!r} has symbolic dims {names}; give its shape: "
                        f"from_onnx(..., input_shapes={{{vi.name!r}: (...)}})")
                shape = dims
            elif len(shape) != len(dims) or any(d is not None and d != s
                                                 for d, s in zip(dims, shape)):
                raise UnsupportedModelError(f"input {vi.name!r}: input_shapes gives "
                                            f"{tuple(shape)}; the model declares {dims}")
            self.inputs[vi.name] = (tuple(int(s) for s in shape), dtype)
        if input_shapes:
            raise UnsupportedModelError(f"input_shapes names {sorted(input_shapes)}, which are not "
                                        f"inputs of the model ({', '.join(self.inputs)})")
        self.outputs = [o.name for o in proto.graph.output]
        self.readers = {}
        for n in nodes:
            for v in n.inputs:
                if v:
                    self.readers.setdefault(v, []).append(n)
        self.producers = {v: n for n in nodes for v in n.outputs}

    def build(self, g):
        self.g = g
        self.env = {}               # ONNX name -> ("t", Tensor), ("c", array), ("q", Quantized)
        #                             or ("qc", QConst): see blockpad.onnx_int8
        for name, (shape, dtype) in self.inputs.items():
            self.env[name] = ("t", g.input(name, shape, dtype))
        self.folded = set()         # BatchNormalization nodes folded into their convolution
        for node in self.nodes:
            if node.name in self.folded:
                continue
            handler = getattr(self, "_op_" + node.op, None)
            if handler is None:
                node.fail(f"the op is not supported (blockpad imports {', '.join(_supported())})")
            known = _ATTRS.get(node.op, set())
            extra = sorted(set(node.attrs) - known)
            if extra:
                node.fail(f"the attribute is not supported (known: "
                          f"{', '.join(sorted(known)) or 'none'})", extra[0])
            handler(node)
        missing = [o for o in self.outputs if o not in self.env]
        if missing:
            raise UnsupportedModelError(f"graph outputs {missing} are made by no node")
        outs = []
        for o in self.outputs:
            kind, v = self.env[o]
            if kind in ("c", "qc"):
                raise UnsupportedModelError(f"graph output {o!r} is a constant")
            if kind == "q":
                v = self._float_tensor(v.node, o, v) if v.dq else v.tensor
            outs.append(v)
        g.output(*outs)

    # -- values --
    def _const(self, node, i, what):
        name = node.inputs[i] if i < len(node.inputs) else ""
        if not name:
            return None
        kind, v = self._value(node, name)
        if kind == "qc":
            return v.dequantized()
        if kind != "c":
            node.fail(f"input {i} ({what}) must be a constant (an initializer or a Constant "
                      f"node); it is computed")
        return v

    def _tensor(self, node, i):
        kind, v = self._value(node, node.inputs[i])
        if kind == "q":
            return self._float_tensor(node, node.inputs[i], v)
        if kind != "t":
            node.fail(f"input {i} is a constant; blockpad computes this op on graph values only")
        return v

    def _value(self, node, name):
        if name in self.env:
            return self.env[name]
        if name in self.consts:
            return ("c", self.consts[name])
        node.fail(f"input {name!r} is not defined before the node")

    @staticmethod
    def _shape(t):
        return tuple(t.shape)

    def _param(self, node, label, array):
        """A constant the graph holds (weights, bias, a broadcast operand): float32, or the
        integers of a quantized model (int8 weights, int32 bias) as they are."""
        name = f"{node.name}.{label}"
        while name in self.g._types:
            name += "_"
        integer = np.issubdtype(np.asarray(array).dtype, np.integer)
        # the importer's own array (read from the model, or computed: folded batch norm)
        array = np.ascontiguousarray(array, dtype=None if integer else np.float32)
        return self.g.constant(name, array, owned=True)

    def _emit(self, node, method, *args, output=0, value=None, **kw):
        """Add one graph op for ``node``; its shape errors name the node. Its result is the
        graph value ``value`` (default: the node's output ``output``)."""
        name = value or node.outputs[output]
        try:
            t = getattr(self.g, method)(*args, name=self._fresh(node, name), out=name, **kw)
        except BlockpadError as e:
            node.fail(str(e))
        self.env[name] = ("t", t)
        return t

    def _fresh(self, node, name):
        """A graph op name: the ONNX node's, made unique."""
        base = node.name if len(node.outputs) == 1 and name == node.outputs[0] else name
        out, k = base, 0
        while any(n.name == out for n in self.g.nodes):
            k += 1
            out = f"{base}_{k}"
        return out

    def _alias(self, node, src):
        self.env[node.outputs[0]] = self._value(node, src)

    def _only_output(self, node, allowed=1):
        extra = [o for o in node.outputs[allowed:] if o]
        if any(self.readers.get(o) or o in self.outputs for o in extra):
            node.fail(f"only output(s) 0..{allowed - 1} may be used; the model reads {extra}")

    # -- ops --
    def _is_q(self, node, *inputs) -> bool:
        """Whether the inputs are 8-bit values (a QDQ group's dequantized inputs)."""
        return all(i < len(node.inputs) and node.inputs[i] in self.env and
                   self.env[node.inputs[i]][0] == "q" for i in inputs)

    def _op_Conv(self, node):
        if self._is_q(node, 0):
            kind, w = self._value(node, node.inputs[1])
            shape = self.env[node.inputs[0]][1].tensor.shape
            k = tuple(w.values.shape[2:]) if kind == "qc" else (1, 1)
            stride, dilation = _ints(node, "strides", 2, 1), _ints(node, "dilations", 2, 1)
            self._qdq_conv(node, stride, _pads(node, shape[2:], k, stride, dilation), dilation,
                           int(node.attrs.get("group", 1)))
            return
        x = self._tensor(node, 0)
        w = self._const(node, 1, "weights")
        b = self._const(node, 2, "bias")
        shape = self._shape(x)
        if w.ndim != 4 or len(shape) != 4:
            node.fail(f"only 2-D convolutions are supported; weights have shape {w.shape}")
        a = node.attrs
        kernel = tuple(a.get("kernel_shape", w.shape[2:]))
        if kernel != w.shape[2:]:
            node.fail(f"kernel_shape {list(kernel)} differs from the weights' {w.shape[2:]}",
                      "kernel_shape")
        stride = _ints(node, "strides", 2, 1)
        dilation = _ints(node, "dilations", 2, 1)
        pad = _pads(node, shape[2:], kernel, stride, dilation)
        groups = int(a.get("group", 1))
        w = w.astype(np.float32)
        bias = None if b is None else b.astype(np.float32)
        out = node.outputs[0]
        bn = self._foldable_bn(node, out)
        if bn is not None:
            scale, shift = _bn_affine(bn, self, w.shape[0])
            w = w * scale.reshape(-1, 1, 1, 1)
            bias = shift + (scale * bias if bias is not None else 0)
            self.folded.add(bn.name)
            node = _Node(node.name, node.op, node.inputs, [bn.outputs[0]], node.attrs,
                         node.opset)
        self._emit(node, "conv2d", x, self._param(node, "weight", w),
                   self._param(node, "bias", bias) if bias is not None else None,
                   stride=stride, pad=pad, dilation=dilation, groups=groups,
                   algorithm=self.conv_algorithm)

    def _foldable_bn(self, node, out):
        readers = self.readers.get(out, [])
        if len(readers) != 1 or out in self.outputs:
            return None
        r = readers[0]
        if r.op != "BatchNormalization" or r.inputs[0] != out:
            return None
        if any(self._value(r, v)[0] != "c" for v in r.inputs[1:5]):
            return None     # statistics computed in the graph: not foldable (and not handled)
        self._check_bn(r)
        return r

    def _check_bn(self, node):
        extra = sorted(set(node.attrs) - _ATTRS["BatchNormalization"])
        if extra:
            node.fail("the attribute is not supported", extra[0])
        if node.attrs.get("training_mode", 0):
            node.fail("training mode is not supported (an inference model has 0)",
                      "training_mode")
        self._only_output(node)

    def _op_BatchNormalization(self, node):
        self._check_bn(node)
        x = self._tensor(node, 0)
        shape = self._shape(x)
        scale, shift = _bn_affine(node, self, shape[1])
        bshape = (1, shape[1]) + (1,) * (len(shape) - 2)
        mid = f"{node.outputs[0]}.scaled"
        y = self._emit(_Node(node.name + ".scale", node.op, node.inputs, [mid], {}, node.opset),
                       "binary", x, self._param(node, "scale", scale.reshape(bshape)), "mul")
        self._emit(node, "binary", y, self._param(node, "shift", shift.reshape(bshape)), "add")

    def _op_Relu(self, node):
        self._emit(node, "eltwise", self._tensor(node, 0), "relu")

    def _op_Sigmoid(self, node):
        if self._silu(node) is None:
            self._emit(node, "eltwise", self._tensor(node, 0), "sigmoid")
        # else the Mul that is its only reader computes x * sigmoid(x) as one swish

    def _silu(self, sigmoid):
        """The Mul computing ``x * sigmoid(x)`` with this Sigmoid's result (SiLU, as PyTorch
        exports it), if it is the result's only reader and the result is not a model output;
        else None. Two ops would cost a pass over memory each and keep a convolution from
        taking the activation as a post-op (EfficientNet-B0: 49 sigmoid and 49 mul steps)."""
        out = sigmoid.outputs[0]
        readers = self.readers.get(out, [])
        if len(readers) != 1 or out in self.outputs:
            return None
        mul = readers[0]
        return mul if mul.op == "Mul" and sorted(mul.inputs) == sorted([sigmoid.inputs[0], out]) \
            else None

    def _op_Clip(self, node):
        x = self._tensor(node, 0)
        lo, hi = (self._const(node, i, what) for i, what in ((1, "min"), (2, "max")))
        for v, what in ((lo, "min"), (hi, "max")):
            if v is not None and v.size != 1:
                node.fail(f"{what} must be a scalar; got shape {v.shape}")
        big = float(np.finfo(np.float32).max)
        lo = -big if lo is None else float(lo.reshape(()))
        hi = big if hi is None else float(hi.reshape(()))
        if lo == 0 and hi == big:
            self._emit(node, "eltwise", x, "relu")
        else:
            self._emit(node, "eltwise", x, "clip", lo, hi)

    def _hard_sigmoid(self, node, x, alpha, beta, out):
        mid = _Node(node.name + ".linear", node.op, node.inputs, [out + ".linear"], {},
                    node.opset)
        y = self._emit(mid, "eltwise", x, "linear", alpha, beta)
        end = _Node(node.name + ".clip" if out != node.outputs[0] else node.name, node.op,
                    node.inputs, [out], {}, node.opset)
        return self._emit(end, "eltwise", y, "clip", 0.0, 1.0)

    def _op_HardSigmoid(self, node):
        a = node.attrs
        self._hard_sigmoid(node, self._tensor(node, 0), float(a.get("alpha", 0.2)),
                           float(a.get("beta", 0.5)), node.outputs[0])

    def _op_HardSwish(self, node):
        x = self._tensor(node, 0)
        gate = self._hard_sigmoid(node, x, 1 / 6, 0.5, node.outputs[0] + ".gate")
        self._emit(node, "binary", x, gate, "mul")

    def _op_Add(self, node):
        self._binary(node, "add")

    def _op_Mul(self, node):
        gate = next((self.producers[v] for v in node.inputs if v in self.producers
                     and self.producers[v].op == "Sigmoid"
                     and self._silu(self.producers[v]) is node), None)
        if gate is not None:
            self._emit(node, "eltwise", self._tensor(node, node.inputs.index(gate.inputs[0])),
                       "swish", 1.0)
        else:
            self._binary(node, "mul")

    def _binary(self, node, algorithm):
        if algorithm == "add" and self._is_q(node, 0, 1):
            self._qdq_add(node)
            return
        kinds = [self._value(node, v) for v in node.inputs[:2]]
        tensors = [v for k, v in kinds if k == "t"]
        if not tensors:
            node.fail("both operands are constants (fold them before import)")
        out_rank = max(len(self._shape(v)) if k == "t" else v.ndim for k, v in kinds)
        if len(tensors) == 1:
            x = tensors[0]
            c = next(v for k, v in kinds if k == "c").astype(np.float32)
            if c.size == 1:        # a scalar: one eltwise kernel (a*x + b)
                v = float(c.reshape(()))
                self._emit(node, "eltwise", x, "linear",
                           *((v, 0.0) if algorithm == "mul" else (1.0, v)))
                return
            if c.ndim > len(self._shape(x)):
                node.fail(f"the constant operand {c.shape} has more dims than the value "
                          f"{self._shape(x)}")
            c = c.reshape((1,) * (out_rank - c.ndim) + c.shape)
            operands = [x if k == "t" else self._param(node, "operand", c) for k, _ in kinds]
        else:
            ranks = {len(self._shape(v)) for v in tensors}
            if len(ranks) != 1:
                node.fail(f"operands of different ranks {sorted(ranks)} (broadcasting a "
                          f"computed value over new leading dims is not supported)")
            operands = tensors
        self._emit(node, "binary", *operands, algorithm)

    def _op_Concat(self, node):
        xs = [self._tensor(node, i) for i in range(len(node.inputs))]
        rank = len(self._shape(xs[0]))
        if "axis" not in node.attrs:
            node.fail("axis is required", "axis")
        axis = int(node.attrs["axis"]) % rank
        if len(xs) == 1:
            self._alias(node, node.inputs[0])
            return
        self._emit(node, "concat", xs, axis=axis)

    def _op_MaxPool(self, node):
        a = node.attrs
        if a.get("storage_order", 0):
            node.fail("storage_order 1 (column major indices) is not supported", "storage_order")
        self._only_output(node)
        if self._is_q(node, 0):
            v = self.env[node.inputs[0]][1]
            if v.dq and v.scale > 0:
                # max(DQ(q)) = DQ(max(q)): dequantization is monotonic, so the 8-bit value is
                # pooled as it is (ONNX Runtime pools it in uint8 too) and a following
                # QuantizeLinear with the same parameters is the identity
                t = self._pool(node, "max", True, v.tensor, f"{node.outputs[0]}_{v.dtype}")
                self.env[node.outputs[0]] = ("q", Quantized(t, v.scale, v.zero_point, True,
                                                            node))
                return
        self._pool(node, "max", exclude_pad=True)

    def _op_AveragePool(self, node):
        self._pool(node, "avg", exclude_pad=not node.attrs.get("count_include_pad", 0))

    def _pool(self, node, algorithm, exclude_pad, x=None, out=None):
        """The pooling ``node`` asks for, of ``x`` (default: its input as a float tensor),
        into the graph value ``out`` (default: its output)."""
        x = self._tensor(node, 0) if x is None else x
        shape = self._shape(x)
        a = node.attrs
        kernel = tuple(a.get("kernel_shape", ()))
        if len(shape) != 4 or len(kernel) != 2:
            node.fail(f"only 2-D pooling is supported; kernel_shape {list(kernel)}",
                      "kernel_shape")
        stride = _ints(node, "strides", 2, 1)
        dilation = _ints(node, "dilations", 2, 1)
        pad = _pads(node, shape[2:], kernel, stride, dilation)
        return self._emit(node, "pool", x, algorithm, kernel, stride, pad, dilation, value=out,
                          exclude_pad=exclude_pad, ceil_mode=bool(a.get("ceil_mode", 0)))

    def _op_GlobalAveragePool(self, node):
        if self._is_q(node, 0):
            self._qdq_avg_pool(node)
            return
        x = self._tensor(node, 0)
        if len(self._shape(x)) != 4:
            node.fail(f"only 2-D images are supported; the input is {self._shape(x)}")
        self._emit(node, "global_avg_pool", x)

    def _op_Flatten(self, node):
        q = self.env[node.inputs[0]][1] if self._is_q(node, 0) else None
        x = q.tensor if q else self._tensor(node, 0)
        shape = self._shape(x)
        axis = int(node.attrs.get("axis", 1)) % (len(shape) + 1)
        new = (math.prod(shape[:axis]), math.prod(shape[axis:]))
        if q:
            self._reshape_q(node, q, new)
        else:
            self._emit(node, "reshape", x, new)

    def _op_Reshape(self, node):
        q = self.env[node.inputs[0]][1] if self._is_q(node, 0) else None
        x = q.tensor if q else self._tensor(node, 0)
        shape = self._shape(x)
        new = self._const(node, 1, "shape")
        if new is None:
            node.fail("the shape input is required")
        new = [int(s) for s in new.reshape(-1)]
        if node.attrs.get("allowzero", 0) and 0 in new:
            node.fail("allowzero = 1 with a 0 in the shape is not supported", "allowzero")
        new = [shape[i] if s == 0 else s for i, s in enumerate(new)]
        if new.count(-1) > 1:
            node.fail(f"the shape {new} has more than one -1")
        if q:
            self._reshape_q(node, q, new)
        else:
            self._emit(node, "reshape", x, new)

    def _op_Gemm(self, node):
        a = node.attrs
        if a.get("transA", 0):
            node.fail("transA = 1 (a transposed activation) is not supported", "transA")
        if self._is_q(node, 0):
            if float(a.get("alpha", 1.0)) != 1.0 or float(a.get("beta", 1.0)) != 1.0:
                node.fail("alpha and beta must be 1 between DequantizeLinear and "
                          "QuantizeLinear", "alpha")
            self._qdq_matmul(node, 1, bool(a.get("transB", 0)), 2)
            return
        x = self._tensor(node, 0)
        w = self._const(node, 1, "B").astype(np.float32)
        if w.ndim != 2:
            node.fail(f"B must be 2-D; got {w.shape}")
        if a.get("transB", 0):
            w = w.T
        w = w * np.float32(a.get("alpha", 1.0))
        c = self._const(node, 2, "C")
        bias = None
        if c is not None:
            n = w.shape[1]
            if c.size not in (1, n) or (c.ndim == 2 and c.shape[0] != 1):
                node.fail(f"C must broadcast along the output columns ({n},); got {c.shape}")
            bias = np.broadcast_to(c.astype(np.float32).reshape(-1), (n,)) * \
                np.float32(a.get("beta", 1.0))
        self._matmul(node, x, w, bias)

    def _op_MatMul(self, node):
        if self._is_q(node, 0):
            self._qdq_matmul(node, 1, False, None)
            return
        x = self._tensor(node, 0)
        w = self._const(node, 1, "B")
        if w.ndim != 2 or len(self._shape(x)) != 2:
            node.fail(f"only (M, K) x (K, N) with constant weights is supported; got "
                      f"{self._shape(x)} x {w.shape}")
        self._matmul(node, x, w.astype(np.float32), None)

    def _matmul(self, node, x, w, bias):
        self._emit(node, "matmul", x, self._param(node, "weight", w),
                   None if bias is None else self._param(node, "bias", bias))

    def _op_Softmax(self, node):
        x = self._tensor(node, 0)
        self._emit(node, "softmax", x, axis=int(node.attrs.get("axis", -1)))

    def _op_Identity(self, node):
        self._alias(node, node.inputs[0])

    def _op_Dropout(self, node):
        if len(node.inputs) > 2 and node.inputs[2]:
            mode = self._const(node, 2, "training_mode")
            if mode is not None and bool(mode.reshape(())):
                node.fail("training_mode is true; an inference model drops nothing")
        self._only_output(node)
        self._alias(node, node.inputs[0])

    def _op_Constant(self, node):
        if "value" not in node.attrs:
            node.fail("only the 'value' form is supported", next(iter(node.attrs), None))
        self.env[node.outputs[0]] = ("c", np.asarray(node.attrs["value"]))


# ---- attributes -------------------------------------------------------------------------------

_ATTRS = {
    "Conv": {"auto_pad", "dilations", "group", "kernel_shape", "pads", "strides"},
    "BatchNormalization": {"epsilon", "momentum", "training_mode"},
    "Clip": set(),
    "HardSigmoid": {"alpha", "beta"},
    "Concat": {"axis"},
    "MaxPool": {"auto_pad", "ceil_mode", "dilations", "kernel_shape", "pads", "storage_order",
                "strides"},
    "AveragePool": {"auto_pad", "ceil_mode", "count_include_pad", "dilations", "kernel_shape",
                    "pads", "strides"},
    "Flatten": {"axis"},
    "Reshape": {"allowzero"},
    "Gemm": {"alpha", "beta", "transA", "transB"},
    "Softmax": {"axis"},
    "Dropout": {"seed"},
    "Constant": {"value"},
    **INT8_ATTRS,
}


def _supported():
    return sorted(n[4:] for n in dir(_Importer) if n.startswith("_op_"))


def _ints(node, attr, rank, default):
    v = node.attrs.get(attr)
    if v is None:
        return (default,) * rank
    if len(v) != rank:
        node.fail(f"expected {rank} values; got {list(v)}", attr)
    return tuple(int(x) for x in v)


def _pads(node, size, kernel, stride, dilation):
    """``((top, bottom), (left, right))`` from ``pads`` ([top, left, bottom, right]) or
    ``auto_pad``."""
    auto = node.attrs.get("auto_pad", "NOTSET")
    if auto == "NOTSET":
        p = node.attrs.get("pads", [0, 0, 0, 0])
        if len(p) != 4 or min(p) < 0:
            node.fail(f"expected 4 non-negative pads [top, left, bottom, right]; got {list(p)}",
                      "pads")
        return ((int(p[0]), int(p[2])), (int(p[1]), int(p[3])))
    if "pads" in node.attrs:
        node.fail(f"pads and auto_pad {auto} are both given", "pads")
    if auto == "VALID":
        return ((0, 0), (0, 0))
    if auto not in ("SAME_UPPER", "SAME_LOWER"):
        node.fail(f"auto_pad {auto!r} is not one of NOTSET, SAME_UPPER, SAME_LOWER, VALID",
                  "auto_pad")
    if node.attrs.get("ceil_mode", 0):
        node.fail("ceil_mode with auto_pad SAME_* is not supported", "ceil_mode")
    out = []
    for n, k, s, d in zip(size, kernel, stride, dilation):
        total = max((-(-n // s) - 1) * s + (k - 1) * d + 1 - n, 0)
        small, big = total // 2, total - total // 2
        out.append((small, big) if auto == "SAME_UPPER" else (big, small))
    return tuple(out)


def _bn_affine(node, importer, channels):
    """BatchNormalization as y = scale * x + shift per channel, in float64 then float32."""
    gamma, beta, mean, var = (importer._const(node, i, what).astype(np.float64).reshape(-1)
                              for i, what in ((1, "scale"), (2, "B"), (3, "mean"),
                                              (4, "var")))
    if not all(v.size == channels for v in (gamma, beta, mean, var)):
        node.fail(f"scale, B, mean and var must have {channels} values (one per channel)")
    scale = gamma / np.sqrt(var + float(node.attrs.get("epsilon", 1e-5)))
    return scale.astype(np.float32), (beta - mean * scale).astype(np.float32)
