"""ONNX import of quantized models: int8 graphs with ONNX Runtime's integer results.

Two forms of one model import the same way, because ONNX Runtime runs them the same way
(docs/onnxruntime-int8.md): the QDQ form ``quantize_static`` writes, where
``DequantizeLinear -> Conv / Gemm / MatMul / Add / GlobalAveragePool -> QuantizeLinear`` groups
stand for integer operators, and the QOperator form that names them (``QLinearConv``,
``QLinearMatMul``, com.microsoft ``QLinearAdd``, ``QLinearGlobalAveragePool``, ``QGemm``):

=========================================  ==================================================
ONNX                                       blockpad graph op
=========================================  ==================================================
QuantizeLinear (float input)               ``quantize`` (per-tensor scale and zero point)
DequantizeLinear (graph output, float op)  ``dequantize``
QLinearConv, DQ-Conv-Q                     ``conv2d`` on uint8/int8, int8 weights, int32 bias,
                                           ``scale`` = (s_x * s_w[k]) / s_y, ``dst_zero_point``
QLinearMatMul, QGemm, DQ-MatMul/Gemm-Q     ``matmul``, the same attributes
QLinearGlobalAveragePool, DQ-GAP-Q         ``conv2d``: depthwise, all-ones weights over the
                                           whole image, ``scale`` = s_x / (s_y * H * W)
QLinearAdd, DQ-Add-Q                       quantized ``binary`` add (ONNX Runtime's two fmas)
Flatten, Reshape of quantized values       ``reshape`` of the 8-bit tensor
=========================================  ==================================================

Values stay 8-bit between layers; a float value exists only where the model computes one (its
input before the first QuantizeLinear, its outputs after the last DequantizeLinear). The
residual add is not fused into the convolution before it as a sum post-op: ONNX Runtime rounds
the convolution's output to 8 bits first, so a fused sum would differ from it.

Anything else quantized (a weight zero point other than 0, a float-output QGemm, a DQ-Conv
whose result is not requantized by the one QuantizeLinear that reads it, per-channel
activation scales) raises ``UnsupportedModelError`` naming the node.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from blockpad import qlinear

MS_OPS = ("QLinearAdd", "QLinearGlobalAveragePool", "QGemm")   # com.microsoft ops imported
ATTRS = {
    "QuantizeLinear": {"axis", "saturate"},
    "DequantizeLinear": {"axis"},
    "QLinearConv": {"auto_pad", "dilations", "group", "kernel_shape", "pads", "strides"},
    "QLinearMatMul": set(),
    "QLinearAdd": set(),
    "QLinearGlobalAveragePool": {"channels_last"},
    "QGemm": {"alpha", "transA", "transB"},
}
DTYPES = {np.dtype("uint8"): "uint8", np.dtype("int8"): "int8"}


@dataclass
class Quantized:
    """An 8-bit graph value and what it stands for: ``scale * (q - zero_point)``. ``dq``: the
    value is the model's dequantized (float) view of it, made a graph op only if a float op
    reads it (``node``: the DequantizeLinear that made it)."""

    tensor: object
    scale: float
    zero_point: int
    dq: bool = False
    node: object = None

    @property
    def dtype(self) -> str:
        return self.tensor.dtype

    def as_dq(self, node) -> Quantized:
        return Quantized(self.tensor, self.scale, self.zero_point, True, node)


@dataclass
class QConst:
    """A DequantizeLinear of a constant: the integers, their scale(s) and zero point(s)."""

    values: np.ndarray
    scale: np.ndarray
    zero_point: np.ndarray
    axis: int

    def dequantized(self) -> np.ndarray:
        return qlinear.dequantize(self.values, self.scale, self.zero_point,
                                  self.axis if self.scale.size > 1 else None)


class QuantizedOps:
    """The quantized half of ``blockpad.onnx._Importer`` (a mixin: it uses the importer's
    ``env``, ``g``, ``_value``, ``_const``, ``_emit``...)."""

    # -- values --
    def _quantized(self, node, i, dq=None) -> Quantized:
        kind, v = self._value(node, node.inputs[i])
        if kind != "q" or (dq is not None and v.dq != dq):
            want = "a dequantized 8-bit value" if dq else "an 8-bit quantized value"
            node.fail(f"input {i} must be {want}; it is {_describe(kind, v)}")
        return v

    def _qparams(self, node, i, what, dtype=None):
        """A per-tensor (scale, zero point) pair from inputs ``i`` and ``i + 1``."""
        s, z = self._const(node, i, f"{what} scale"), self._const(node, i + 1, f"{what} zero point")
        if s is None or s.size != 1 or (z is not None and z.size != 1):
            node.fail(f"the {what} scale and zero point must be single values (per tensor); got "
                      f"{None if s is None else s.shape} and {None if z is None else z.shape}")
        zp = 0 if z is None else int(z.reshape(()))
        if z is not None and dtype is None:
            dtype = DTYPES.get(z.dtype)
            if dtype is None:
                node.fail(f"the {what} zero point is {z.dtype}; blockpad imports uint8 and int8 "
                          f"activations")
        return float(np.float32(s.reshape(()))), zp, dtype or "uint8"

    def _float_tensor(self, node, name, v: Quantized):
        """The float view of a quantized value, for a float op: its DequantizeLinear as a
        graph op, made once."""
        if not v.dq:
            node.fail(f"input {name!r} is an 8-bit quantized value; a float op needs it "
                      f"dequantized (DequantizeLinear)")
        return self._emit(v.node, "dequantize", v.tensor, v.scale, v.zero_point)

    def _emit_op(self, node, op, inputs, attrs):
        """``_emit`` through ``add_op`` (integer conv2d and matmul: their quantization
        attributes), the output named as ``node``'s."""
        from blockpad.errors import BlockpadError

        name = node.outputs[0]
        try:
            t = self.g.add_op(op, inputs, attrs, name=self._fresh(node, name), outputs=[name])
        except BlockpadError as e:
            node.fail(str(e))
        self.env[name] = ("t", t)
        return t

    def _requantizer(self, node):
        """The QuantizeLinear that is the only reader of ``node``'s output (a QDQ group's
        end), folded into the integer op: (its node, scale, zero point, dtype)."""
        out = node.outputs[0]
        readers = self.readers.get(out, [])
        if len(readers) != 1 or readers[0].op != "QuantizeLinear" or out in self.outputs:
            node.fail(f"its inputs are dequantized 8-bit values, so it is one of ONNX Runtime's "
                      f"integer operators only between DequantizeLinear and one QuantizeLinear; "
                      f"its output goes to {[r.op for r in readers] or 'the graph outputs'}")
        q = readers[0]
        self._check_attrs(q)
        s, z, dtype = self._qparams(q, 1, "output")
        self.folded.add(q.name)
        return q, s, z, dtype

    def _qweights(self, node, i, what, dtype):
        """Input ``i``: integer constant weights of ``dtype`` with zero point 0, as
        (values, scales): a QLinear op's constant, or a QDQ group's DequantizeLinear of one."""
        kind, v = self._value(node, node.inputs[i])
        if kind != "qc" or v.values.dtype != np.dtype(dtype):
            node.fail(f"input {i} ({what}) must be a DequantizeLinear of a constant {dtype} "
                      f"tensor; it is {_describe(kind, v)}")
        if np.any(v.zero_point != 0):
            node.fail(f"input {i} ({what}): zero points other than 0 are not supported "
                      f"(quantize_static writes symmetric weights)")
        return v.values, np.broadcast_to(v.scale.astype(np.float32).reshape(-1),
                                         (v.values.shape[v.axis],) if v.scale.size > 1 else (1,))

    def _check_attrs(self, node):
        known = ATTRS.get(node.op, set())
        extra = sorted(set(node.attrs) - known)
        if extra:
            node.fail(f"the attribute is not supported (known: {', '.join(sorted(known))})",
                      extra[0])

    def _set_q(self, name, tensor, scale, zp):
        self.env[name] = ("q", Quantized(tensor, scale, zp))

    # -- QuantizeLinear / DequantizeLinear --
    def _op_QuantizeLinear(self, node):
        kind, v = self._value(node, node.inputs[0])
        s, z, dtype = self._qparams(node, 1, "output")
        if kind == "q":
            if v.scale == s and v.zero_point == z and v.dtype == dtype:
                self._set_q(node.outputs[0], v.tensor, s, z)   # Q(DQ(q)) with its own params
                return
            x = self._float_tensor(node, node.inputs[0], v)
        elif kind == "t":
            x = v
        else:
            node.fail("the input is a constant (quantize it before import)")
        t = self._emit(node, "quantize", x, s, z, dtype)
        self._set_q(node.outputs[0], t, s, z)

    def _op_DequantizeLinear(self, node):
        kind, v = self._value(node, node.inputs[0])
        if kind == "c":
            s = np.asarray(self._const(node, 1, "scale"), np.float32)
            z = self._const(node, 2, "zero point")
            z = np.zeros(s.shape, v.dtype) if z is None else z
            axis = int(node.attrs.get("axis", 1)) % max(v.ndim, 1)
            self.env[node.outputs[0]] = ("qc", QConst(v, s, z, axis))
            return
        if kind != "q" or v.dq:
            node.fail(f"the input must be an 8-bit quantized value; it is {_describe(kind, v)}")
        s, z, _ = self._qparams(node, 1, "input", v.dtype)
        if (s, z) != (v.scale, v.zero_point):
            node.fail(f"dequantizes with scale {s}, zero point {z} a value quantized with "
                      f"{v.scale}, {v.zero_point}")
        self.env[node.outputs[0]] = ("q", v.as_dq(node))

    # -- integer ops, QOperator form --
    def _op_QLinearConv(self, node):
        x = self._quantized(node, 0, dq=False)
        xs, xz, _ = self._qparams(node, 1, "input", x.dtype)
        w, ws = self._qlinear_weights(node, 3, 4, 5)
        ys, yz, dtype = self._qparams(node, 6, "output")
        bias = self._const(node, 8, "bias")
        self._conv(node, node, x, xs, xz, w, ws, bias, ys, yz, dtype)

    def _qlinear_weights(self, node, i, si, zi):
        w = self._const(node, i, "weights")
        s = np.asarray(self._const(node, si, "weight scale"), np.float32).reshape(-1)
        z = self._const(node, zi, "weight zero point")
        if w is None or w.dtype != np.int8:
            node.fail(f"weights must be a constant int8 tensor; got {None if w is None else w.dtype}")
        if z is not None and np.any(z != 0):
            node.fail("weight zero points other than 0 are not supported")
        return w, s

    def _op_QLinearAdd(self, node):
        a, b = self._quantized(node, 0, dq=False), self._quantized(node, 3, dq=False)
        sa, za, _ = self._qparams(node, 1, "A", a.dtype)
        sb, zb, _ = self._qparams(node, 4, "B", b.dtype)
        sc, zc, dtype = self._qparams(node, 6, "C")
        self._add(node, node, a, b, (sa, sb, sc), (za, zb, zc), dtype)

    def _op_QLinearGlobalAveragePool(self, node):
        if node.attrs.get("channels_last", 0):
            node.fail("channels_last = 1 is not supported", "channels_last")
        x = self._quantized(node, 0, dq=False)
        xs, xz, _ = self._qparams(node, 1, "input", x.dtype)
        ys, yz, dtype = self._qparams(node, 3, "output")
        self._avg_pool(node, node, x, xs, xz, ys, yz, dtype)

    def _op_QGemm(self, node):
        a = node.attrs
        if a.get("transA", 0) or float(a.get("alpha", 1.0)) != 1.0:
            node.fail("transA = 1 or alpha != 1 is not supported", "transA" if a.get("transA")
                      else "alpha")
        if len(node.inputs) < 9 or not node.inputs[7]:
            node.fail("a float output (no y_scale) is not supported: blockpad imports QGemm "
                      "with a quantized output")
        x = self._quantized(node, 0, dq=False)
        xs, xz, _ = self._qparams(node, 1, "A", x.dtype)
        w, ws = self._qlinear_weights(node, 3, 4, 5)
        w = w.T if a.get("transB", 0) else w
        ys, yz, dtype = self._qparams(node, 7, "output")
        self._matmul_q(node, node, x, xs, xz, w, ws, self._const(node, 6, "C"), ys, yz, dtype)

    def _op_QLinearMatMul(self, node):
        x = self._quantized(node, 0, dq=False)
        xs, xz, _ = self._qparams(node, 1, "A", x.dtype)
        w, ws = self._qlinear_weights(node, 3, 4, 5)
        ys, yz, dtype = self._qparams(node, 6, "output")
        self._matmul_q(node, node, x, xs, xz, w, ws, None, ys, yz, dtype)

    # -- integer ops, QDQ form: called by the float ops' handlers on dequantized inputs --
    def _qdq_conv(self, node, stride, pad, dilation, groups):
        x = self._quantized(node, 0, dq=True)
        w, ws = self._qweights(node, 1, "weights", "int8")
        bias = self._qdq_bias(node, 2)
        q, ys, yz, dtype = self._requantizer(node)
        self._conv(node, q, x, x.scale, x.zero_point, w, ws, bias, ys, yz, dtype,
                   (stride, pad, dilation, groups))

    def _qdq_bias(self, node, i):
        if i >= len(node.inputs) or not node.inputs[i]:
            return None
        return self._qweights(node, i, "bias", "int32")[0]

    def _qdq_matmul(self, node, w_index, trans_b, bias_index):
        x = self._quantized(node, 0, dq=True)
        w, ws = self._qweights(node, w_index, "weights", "int8")
        w = w.T if trans_b else w
        bias = self._qdq_bias(node, bias_index) if bias_index is not None else None
        q, ys, yz, dtype = self._requantizer(node)
        self._matmul_q(node, q, x, x.scale, x.zero_point, w, ws, bias, ys, yz, dtype)

    def _qdq_add(self, node):
        a, b = self._quantized(node, 0, dq=True), self._quantized(node, 1, dq=True)
        q, sc, zc, dtype = self._requantizer(node)
        self._add(node, q, a, b, (a.scale, b.scale, sc), (a.zero_point, b.zero_point, zc), dtype)

    def _qdq_avg_pool(self, node):
        x = self._quantized(node, 0, dq=True)
        q, ys, yz, dtype = self._requantizer(node)
        self._avg_pool(node, q, x, x.scale, x.zero_point, ys, yz, dtype)

    def _reshape_q(self, node, v: Quantized, shape):
        t = self._emit(node, "reshape", v.tensor, shape)
        self.env[node.outputs[0]] = ("q", Quantized(t, v.scale, v.zero_point, v.dq, v.node))

    # -- emitting the integer ops --
    def _conv(self, node, out_node, x, xs, xz, w, ws, bias, ys, yz, dtype, geometry=None):
        if geometry is None:
            from blockpad.onnx import _ints, _pads  # the float Conv's attribute rules
            stride = _ints(node, "strides", 2, 1)
            dilation = _ints(node, "dilations", 2, 1)
            pad = _pads(node, x.tensor.shape[2:], w.shape[2:], stride, dilation)
            geometry = (stride, pad, dilation, int(node.attrs.get("group", 1)))
        stride, pad, dilation, groups = geometry
        self._emit_conv(node, out_node, x, xz, w, bias, qlinear.conv_multiplier(xs, ws, ys),
                        "channel" if ws.size > 1 else "tensor", ys, yz, dtype, stride, pad,
                        dilation, groups)

    def _avg_pool(self, node, out_node, x, xs, xz, ys, yz, dtype):
        n, c, h, w = x.tensor.shape
        ones = np.ones((c, 1, h, w), np.int8)
        self._emit_conv(node, out_node, x, xz, ones, None, np.array(
            [qlinear.pool_multiplier(xs, ys, h * w)], np.float32), "tensor", ys, yz, dtype,
            (1, 1), ((0, 0), (0, 0)), (1, 1), c)

    def _emit_conv(self, node, out_node, x, xz, w, bias, multiplier, scales, ys, yz, dtype,
                   stride, pad, dilation, groups):
        from blockpad.layout import pad_sides

        attrs = {"stride": tuple(stride), "pad": pad_sides(pad), "dilation": tuple(dilation),
                 "groups": int(groups), "bias": bias is not None, "sum": False,
                 "algorithm": "direct", "winograd_tile": None}
        t = self._emit_quantized(node, out_node, "conv2d", x, xz, w, bias, multiplier, scales,
                                 yz, dtype, attrs)
        self._set_q(out_node.outputs[0], t, ys, yz)

    def _matmul_q(self, node, out_node, x, xs, xz, w, ws, bias, ys, yz, dtype):
        mult = qlinear.conv_multiplier(xs, ws, ys)
        t = self._emit_quantized(node, out_node, "matmul", x, xz, w, bias, mult,
                                 "channel" if mult.size > 1 else "tensor", yz, dtype,
                                 {"bias": bias is not None})
        self._set_q(out_node.outputs[0], t, ys, yz)

    def _emit_quantized(self, node, out_node, op, x, xz, w, bias, multiplier, scales, yz, dtype,
                        attrs):
        """An integer conv2d or matmul graph op: int8 weights, the float32 requantization
        multiplier as its ``scale`` (dst_scale 1: ONNX Runtime multiplies once), an int32 bias
        added to the accumulator first, the output's zero point and type."""
        inputs = [x.tensor, self._param(node, "weight", w),
                  self._param(node, "scale", np.asarray(multiplier, np.float32))]
        if bias is not None:
            inputs.append(self._param(node, "bias", bias))
        post = [{"kind": "bias", "dtype": "int32"}] if bias is not None else []
        quant = {"src_zero_point": int(xz), "scales": scales, "dst_scale": 1.0,
                 "dst_zero_point": int(yz), "dst_dtype": dtype}
        return self._emit_op(out_node, op, inputs, {**attrs, "post_ops": post, "quant": quant})

    def _add(self, node, out_node, a, b, scales, zero_points, dtype):
        if not a.dtype == b.dtype == dtype:
            node.fail(f"operands and result must share one 8-bit type; got {a.dtype}, "
                      f"{b.dtype} -> {dtype}")
        t = self._emit(out_node, "quantized_add", a.tensor, b.tensor, scales, zero_points)
        self._set_q(out_node.outputs[0], t, scales[2], zero_points[2])


def _describe(kind, v) -> str:
    if kind == "q":
        return "a dequantized 8-bit value" if v.dq else "an 8-bit quantized value"
    return {"t": "a float value", "c": "a constant", "qc": "a dequantized constant"}.get(kind,
                                                                                       kind)
