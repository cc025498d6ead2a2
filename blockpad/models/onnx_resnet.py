"""ResNet-18's architecture (``resnet.ResNet`` with basic blocks) written directly as an ONNX
graph with ``onnx.helper``, for machines without PyTorch (CI): the same layers as the
TorchScript export of ``resnet18``, except that batch norms stay ``BatchNormalization`` nodes
(the exporter folds them; the importer folds them here), with seeded random weights in
``models.randomize``'s distributions. Needs the ``onnx`` package, not torch."""

from __future__ import annotations

import numpy as np


class _Builder:
    def __init__(self, seed):
        from onnx import helper, numpy_helper

        self.helper, self.numpy_helper = helper, numpy_helper
        self.rng = np.random.default_rng(seed)
        self.nodes, self.inits = [], []
        self.count = 0

    def _name(self, base):
        self.count += 1
        return f"{base}_{self.count}"

    def _init(self, base, array):
        name = self._name(base)
        self.inits.append(self.numpy_helper.from_array(array.astype("float32"), name))
        return name

    def node(self, op, inputs, **attrs):
        out = self._name(op.lower())
        self.nodes.append(self.helper.make_node(op, inputs, [out], name=out, **attrs))
        return out

    def conv(self, x, c_in, c_out, k, stride=1):
        w = self.rng.standard_normal((c_out, c_in, k, k)) * np.sqrt(2 / (c_in * k * k))
        p = (k - 1) // 2
        return self.node("Conv", [x, self._init("w", w)], kernel_shape=[k, k],
                         strides=[stride, stride], pads=[p, p, p, p])

    def bn(self, x, c):
        r = self.rng
        params = [r.uniform(0.5, 1.5, c), r.standard_normal(c) * 0.1,
                  r.standard_normal(c) * 0.1, r.uniform(0.5, 1.5, c)]
        return self.node("BatchNormalization",
                         [x] + [self._init(n, a) for n, a in zip(("g", "b", "m", "v"), params)],
                         epsilon=1e-5)

    def conv_bn(self, x, c_in, c_out, k, stride=1, relu=True):
        y = self.bn(self.conv(x, c_in, c_out, k, stride), c_out)
        return self.node("Relu", [y]) if relu else y


def resnet18(batch=1, hw=224, seed=0, num_classes=1000, layers=(2, 2, 2, 2)):
    """ResNet-18 (``layers``: basic blocks per stage) for ``(batch, 3, hw, hw)`` inputs, as an
    onnx ModelProto (opset 17), input ``input``, output ``logits``."""
    from onnx import TensorProto, checker, helper

    b = _Builder(seed)
    x = b.node("MaxPool", [b.conv_bn("input", 3, 64, 7, 2)], kernel_shape=[3, 3],
               strides=[2, 2], pads=[1, 1, 1, 1])
    c = 64
    for i, n in enumerate(layers):
        width = 64 << i
        for j in range(n):
            stride = 2 if i > 0 and j == 0 else 1
            identity = x
            if stride != 1 or c != width:
                identity = b.conv_bn(x, c, width, 1, stride, relu=False)
            y = b.conv_bn(b.conv_bn(x, c, width, 3, stride), width, width, 3, relu=False)
            x = b.node("Relu", [b.node("Add", [y, identity])])
            c = width
    x = b.node("Flatten", [b.node("GlobalAveragePool", [x])], axis=1)
    w = b._init("fc_w", b.rng.standard_normal((num_classes, c)) / np.sqrt(c))
    bias = b._init("fc_b", b.rng.standard_normal(num_classes) * 0.1)
    b.nodes.append(helper.make_node("Gemm", [x, w, bias], ["logits"], name="fc", transB=1))
    graph = helper.make_graph(
        b.nodes, "resnet18",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, [batch, 3, hw, hw])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [batch, num_classes])],
        b.inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    checker.check_model(model)
    return model
