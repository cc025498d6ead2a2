"""Quantized networks for int8 inference, as ONNX Runtime's ``quantize_static`` writes them.

The float models come from two places:

* ``resnet_block`` (a ResNet basic or bottleneck block) and ``mobilenet_v2_small`` (MobileNetV2's
  layers at a fraction of its width and depth) are written with ``onnx.helper``, so the tests
  that compare blockpad with ONNX Runtime need neither PyTorch nor a download;
* ``float_network`` exports any network of ``blockpad.models.NETWORKS`` (ResNet-50,
  MobileNetV2, ...) through PyTorch, batch norms folded by the exporter: the benchmark's models.

``quantize`` then calibrates a model on seeded random inputs (a ``CalibrationDataReader``,
min/max) and quantizes it in QDQ format (QuantizeLinear / DequantizeLinear around Conv, Add,
Gemm, ..., per-channel int8 weights, per-tensor uint8 activations) or QOperator format
(QLinearConv, QLinearAdd, QLinearGlobalAveragePool, QGemm). Weights use 7 bits
(``reduce_range``): ONNX Runtime's uint8 x int8 kernels on AVX2 machines without VNNI sum pairs
of products in int16 with saturation (``vpmaddubsw``), which 8-bit weights can overflow; 7-bit
weights cannot, so ONNX Runtime's integer results are the exact integer arithmetic on every
x86 CPU (its documentation recommends the same). Needs ``onnx`` and ``onnxruntime`` (the test
extra); ``float_network`` also PyTorch.
"""

from __future__ import annotations

import os
import tempfile

import numpy as np

from blockpad.errors import BlockpadError

from .onnx_resnet import _Builder

BLOCKS = ("basic", "bottleneck")
FORMATS = ("qdq", "qoperator")
OPSET = 17


class _QBuilder(_Builder):
    """``_Builder`` with biased, grouped convolutions and no batch norms: a float model as the
    exporter leaves it once batch norms are folded (what ``quantize_static`` expects)."""

    def conv(self, x, c_in, c_out, k, stride=1, groups=1):
        w = self.rng.standard_normal((c_out, c_in // groups, k, k)) * \
            np.sqrt(2 / (c_in // groups * k * k))
        b = self.rng.standard_normal(c_out) * 0.1
        p = (k - 1) // 2
        return self.node("Conv", [x, self._init("w", w), self._init("b", b)],
                         kernel_shape=[k, k], strides=[stride, stride], pads=[p, p, p, p],
                         group=groups)

    def act(self, x, kind):
        if kind == "relu":
            return self.node("Relu", [x])
        if kind == "relu6":
            lo = self._init("lo", np.zeros((), np.float32))
            hi = self._init("hi", np.full((), 6.0, np.float32))
            return self.node("Clip", [x, lo, hi])
        return x

    def model(self, name, in_shape, out_name, out_shape):
        from onnx import TensorProto, checker, helper

        self.nodes[-1].output[0] = out_name
        graph = helper.make_graph(
            self.nodes, name, [helper.make_tensor_value_info("input", TensorProto.FLOAT,
                                                             list(in_shape))],
            [helper.make_tensor_value_info(out_name, TensorProto.FLOAT, list(out_shape))],
            self.inits)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
        checker.check_model(model)
        return model


def resnet_block(kind="basic", c_in=16, width=16, hw=8, stride=2, batch=1, seed=0):
    """A ResNet ``kind`` block (``basic``: 3x3, 3x3; ``bottleneck``: 1x1, 3x3, 1x1 with 4x
    expansion) on ``(batch, c_in, hw, hw)``, with a strided 1x1 projection shortcut when the
    shape changes; the residual add is followed by ReLU. Output ``out``."""
    if kind not in BLOCKS:
        raise BlockpadError(f"resnet_block: kind must be one of {', '.join(BLOCKS)}; got "
                            f"{kind!r}")
    b = _QBuilder(seed)
    x = "input"
    out = width if kind == "basic" else 4 * width
    identity = x if stride == 1 and c_in == out else b.conv(x, c_in, out, 1, stride)
    if kind == "basic":
        y = b.conv(b.act(b.conv(x, c_in, width, 3, stride), "relu"), width, width, 3)
    else:
        y = b.act(b.conv(x, c_in, width, 1), "relu")
        y = b.conv(b.act(b.conv(y, width, width, 3, stride), "relu"), width, out, 1)
    b.act(b.node("Add", [y, identity]), "relu")
    side = (hw - 1) // stride + 1
    return b.model(f"resnet_{kind}_block", (batch, c_in, hw, hw), "out",
                   (batch, out, side, side))


# MobileNetV2's inverted residual settings (expansion, channels, blocks, stride), cut down:
# every kind of layer the full network has (expansion 1 and 6, strided and residual blocks,
# depthwise 3x3 with ReLU6, linear projections, the 1x1 head, pooling and the classifier)
SMALL_SETTINGS = ((1, 8, 1, 1), (6, 12, 2, 2), (6, 16, 2, 2))


def mobilenet_v2_small(hw=32, batch=1, seed=0, num_classes=10, settings=SMALL_SETTINGS,
                       stem=16, head=64):
    """MobileNetV2's architecture (torchvision's layer for layer, batch norms folded) with
    fewer, narrower blocks (``settings``) for ``(batch, 3, hw, hw)``; output ``logits``."""
    b = _QBuilder(seed)
    x = b.act(b.conv("input", 3, stem, 3, 2), "relu6")
    c = stem
    for t, ch, n, s in settings:
        for i in range(n):
            stride = s if i == 0 else 1
            hidden = c * t
            y = b.act(b.conv(x, c, hidden, 1), "relu6") if t != 1 else x
            y = b.act(b.conv(y, hidden, hidden, 3, stride, groups=hidden), "relu6")
            y = b.conv(y, hidden, ch, 1)
            x = b.node("Add", [x, y]) if stride == 1 and c == ch else y
            c = ch
    x = b.act(b.conv(x, c, head, 1), "relu6")
    x = b.node("Flatten", [b.node("GlobalAveragePool", [x])], axis=1)
    w = b._init("fc_w", b.rng.standard_normal((num_classes, head)) / np.sqrt(head))
    bias = b._init("fc_b", b.rng.standard_normal(num_classes) * 0.1)
    b.node("Gemm", [x, w, bias], transB=1)
    return b.model("mobilenet_v2_small", (batch, 3, hw, hw), "logits", (batch, num_classes))


def float_network(name, batch=1, hw=224, seed=0):
    """Network ``name`` of ``blockpad.models.NETWORKS`` exported by PyTorch (batch norms folded
    into the convolutions), as an onnx ModelProto."""
    import onnx

    from . import export_onnx

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, f"{name}.onnx")
        export_onnx(name, path, batch=batch, hw=hw, seed=seed, opset=OPSET)
        return onnx.load(path)


def calibration_inputs(model, samples=4, seed=0) -> list:
    """``samples`` seeded standard-normal feeds for ``model``'s (static-shaped) inputs."""
    rng = np.random.default_rng(seed)
    shapes = {vi.name: [d.dim_value for d in vi.type.tensor_type.shape.dim]
              for vi in model.graph.input}
    return [{n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()}
            for _ in range(samples)]


def quantize(model, fmt="qdq", samples=4, seed=0):
    """``model`` (a float ModelProto) quantized by ONNX Runtime, calibrated on ``samples``
    random inputs drawn from ``seed``: ``fmt`` ``"qdq"`` or ``"qoperator"`` (see the module
    docstring). Returns the quantized ModelProto."""
    import onnx
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

    if fmt not in FORMATS:
        raise BlockpadError(f"quantize: fmt must be one of {', '.join(FORMATS)}; got {fmt!r}")

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.feeds = iter(calibration_inputs(model, samples, seed))

        def get_next(self):
            return next(self.feeds, None)

    with tempfile.TemporaryDirectory() as tmp:
        src, dst = os.path.join(tmp, "float.onnx"), os.path.join(tmp, "int8.onnx")
        onnx.save(model, src)
        quantize_static(src, dst, Reader(),
                        quant_format=QuantFormat.QDQ if fmt == "qdq" else QuantFormat.QOperator,
                        per_channel=True, reduce_range=True, activation_type=QuantType.QUInt8,
                        weight_type=QuantType.QInt8)
        return onnx.load(dst)
