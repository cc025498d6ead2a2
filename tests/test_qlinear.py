"""blockpad.qlinear's formulas (docs/onnxruntime-int8.md) against ONNX Runtime itself, one
quantized operator at a time, on random data and random scales: equal to the bit."""

import numpy as np
import pytest

from blockpad import qlinear

onnx = pytest.importorskip("onnx", reason="pip install onnx")
ort = pytest.importorskip("onnxruntime", reason="pip install onnxruntime")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

U8, I8, I32, F = TensorProto.UINT8, TensorProto.INT8, TensorProto.INT32, TensorProto.FLOAT


def _run(nodes, inputs, outputs, inits, feeds, ms=False):
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info(n, t, s) for n, t, s in inputs],
        [helper.make_tensor_value_info(n, t, None) for n, t in outputs],
        [numpy_helper.from_array(np.asarray(v), k) for k, v in inits.items()])
    opsets = [helper.make_opsetid("", 17)] + ([helper.make_opsetid("com.microsoft", 1)]
                                              if ms else [])
    model = helper.make_model(graph, opset_imports=opsets)
    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = ort.InferenceSession(model.SerializeToString(), so,
                                providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)[0]


def _scale(rng, lo=1e-3, hi=0.1):
    return np.float32(np.exp(rng.uniform(np.log(lo), np.log(hi))))


@pytest.mark.parametrize("seed", range(3))
def test_quantize_dequantize(seed):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((2, 5, 7, 9)) * 3).astype(np.float32)
    x.flat[:4] = [0.5, -0.5, 1e9, -1e9]
    s, zp = _scale(rng, 0.01, 0.05), np.uint8(rng.integers(0, 256))
    q = _run([helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"])],
             [("x", F, x.shape)], [("q", U8)], {"s": s, "z": zp}, {"x": x})
    np.testing.assert_array_equal(qlinear.quantize(x, s, zp, np.uint8), q)
    y = _run([helper.make_node("DequantizeLinear", ["q", "s", "z"], ["y"])],
             [("q", U8, q.shape)], [("y", F)], {"s": s, "z": zp}, {"q": q})
    assert qlinear.dequantize(q, s, zp).tobytes() == y.tobytes()


@pytest.mark.parametrize("groups,stride", [(1, 1), (1, 2), (24, 1), (24, 2)])
def test_qlinear_conv(groups, stride):
    rng = np.random.default_rng(groups + stride)
    c, k, hw = 24, 24 if groups > 1 else 40, 9
    x = rng.integers(0, 256, (1, c, hw, hw), dtype=np.uint8)
    w = rng.integers(-64, 64, (k, c // groups, 3, 3), dtype=np.int8)   # 7-bit: reduce_range
    bias = rng.integers(-3000, 3000, k).astype(np.int32)
    xs, ys = _scale(rng), _scale(rng, 0.05, 0.2)
    ws = np.array([_scale(rng, 1e-3, 1e-2) for _ in range(k)], np.float32)
    xz, yz = np.uint8(rng.integers(0, 256)), np.uint8(rng.integers(0, 256))
    node = helper.make_node("QLinearConv", ["x", "xs", "xz", "w", "ws", "wz", "ys", "yz", "b"],
                            ["y"], pads=[1, 1, 1, 1], strides=[stride, stride], group=groups)
    y = _run([node], [("x", U8, x.shape)], [("y", U8)],
             {"xs": xs, "xz": xz, "w": w, "ws": ws, "wz": np.zeros(k, np.int8), "ys": ys,
              "yz": yz, "b": bias}, {"x": x})
    acc = qlinear.conv_acc(x, xz, w, bias, (stride, stride), ((1, 1), (1, 1)), groups=groups)
    want = qlinear.requantize(acc, qlinear.conv_multiplier(xs, ws, ys), yz, np.uint8)
    np.testing.assert_array_equal(want, y)
    assert np.unique(y).size > 5          # not everything saturated to one value


@pytest.mark.parametrize("seed", range(4))
def test_qlinear_add(seed):
    rng = np.random.default_rng(seed)
    a = rng.integers(0, 256, (1, 20, 5, 7), dtype=np.uint8)
    b = rng.integers(0, 256, (1, 20, 5, 7), dtype=np.uint8)
    sa, sb, sc = _scale(rng), _scale(rng), _scale(rng)
    za, zb, zc = (np.uint8(rng.integers(0, 256)) for _ in range(3))
    node = helper.make_node("QLinearAdd", ["a", "sa", "za", "b", "sb", "zb", "sc", "zc"], ["c"],
                            domain="com.microsoft")
    c = _run([node], [("a", U8, a.shape), ("b", U8, b.shape)], [("c", U8)],
             {"sa": sa, "za": za, "sb": sb, "zb": zb, "sc": sc, "zc": zc}, {"a": a, "b": b},
             ms=True)
    want = qlinear.add(a, b, qlinear.add_params(sa, za, sb, zb, sc, zc), np.uint8)
    np.testing.assert_array_equal(want, c)


# (s_a, z_a, s_b, z_b, s_c, z_c) of MobileNetV2's features.12 add (quantized with seed 0): a = 140,
# b = 72 comes to 88.5 where the fixed part is computed unfused, to 88.49999 in ONNX Runtime
TIE = (0.13486525416374207, 132, 0.12496309727430344, 120, 0.16128875315189362, 119)


@pytest.mark.parametrize("params", [TIE, (0.02, 3, 0.05, 250, 0.07, 128)])
def test_qlinear_add_every_byte_pair(params):
    """All 256 x 256 operand pairs: the fixed part ``z_c - fma(r_a, z_a, r_b z_b)`` is what
    ONNX Runtime's compiler makes of ``r_a * z_a + r_b * z_b`` (random data rarely lands on
    the one rounding it decides)."""
    sa, za, sb, zb, sc, zc = params
    a, b = (x.astype(np.uint8) for x in np.meshgrid(np.arange(256), np.arange(256)))
    node = helper.make_node("QLinearAdd", ["a", "sa", "za", "b", "sb", "zb", "sc", "zc"], ["c"],
                            domain="com.microsoft")
    inits = {"sa": np.float32(sa), "za": np.uint8(za), "sb": np.float32(sb), "zb": np.uint8(zb),
             "sc": np.float32(sc), "zc": np.uint8(zc)}
    c = _run([node], [("a", U8, a.shape), ("b", U8, b.shape)], [("c", U8)], inits,
             {"a": a, "b": b}, ms=True)
    want = qlinear.add(a, b, qlinear.add_params(sa, za, sb, zb, sc, zc), np.uint8)
    np.testing.assert_array_equal(want, c)
    if params == TIE:
        assert c[72, 140] == 88


@pytest.mark.parametrize("hw", [1, 3, 7])
def test_qlinear_global_average_pool(hw):
    rng = np.random.default_rng(hw)
    x = rng.integers(0, 256, (1, 19, hw, hw), dtype=np.uint8)
    xs, ys = _scale(rng, 0.01, 0.1), _scale(rng, 0.001, 0.01)
    xz, yz = np.uint8(rng.integers(0, 256)), np.uint8(rng.integers(0, 256))
    node = helper.make_node("QLinearGlobalAveragePool", ["x", "xs", "xz", "ys", "yz"], ["y"],
                            domain="com.microsoft", channels_last=0)
    y = _run([node], [("x", U8, x.shape)], [("y", U8)],
             {"xs": xs, "xz": xz, "ys": ys, "yz": yz}, {"x": x}, ms=True)
    acc = x.astype(np.int64).sum(axis=(2, 3), keepdims=True) - int(xz) * hw * hw
    want = qlinear.requantize(acc, qlinear.pool_multiplier(xs, ys, hw * hw), yz, np.uint8)
    np.testing.assert_array_equal(want, y)


def test_qgemm():
    rng = np.random.default_rng(7)
    m, k, n = 1, 48, 10
    a = rng.integers(0, 256, (m, k), dtype=np.uint8)
    b = rng.integers(-64, 64, (n, k), dtype=np.int8)      # transB: (N, K)
    bias = rng.integers(-3000, 3000, n).astype(np.int32)
    sa, sy = _scale(rng), _scale(rng, 0.05, 0.2)
    sb = np.array([_scale(rng, 1e-3, 1e-2) for _ in range(n)], np.float32)
    za, zy = np.uint8(rng.integers(0, 256)), np.uint8(rng.integers(0, 256))
    node = helper.make_node("QGemm", ["a", "sa", "za", "b", "sb", "zb", "c", "sy", "zy"], ["y"],
                            domain="com.microsoft", transB=1)
    y = _run([node], [("a", U8, a.shape)], [("y", U8)],
             {"sa": sa, "za": za, "b": b, "sb": sb, "zb": np.zeros(n, np.int8), "c": bias,
              "sy": sy, "zy": zy}, {"a": a}, ms=True)
    acc = qlinear.matmul_acc(a, za, b.T, bias)
    want = qlinear.requantize(acc, qlinear.conv_multiplier(sa, sb, sy), zy, np.uint8)
    np.testing.assert_array_equal(want, y)


@pytest.mark.parametrize("fmt", ["qdq", "qoperator"])
def test_quantized_models(fmt):
    """The generator's models quantize in both formats, with the ops each format names."""
    from collections import Counter

    from blockpad.models import quantized

    ops = {"qdq": {"Conv", "QuantizeLinear", "DequantizeLinear", "Add"},
           "qoperator": {"QLinearConv", "QLinearAdd", "QuantizeLinear", "DequantizeLinear"}}
    for model in (quantized.resnet_block("basic"), quantized.resnet_block("bottleneck"),
                  quantized.mobilenet_v2_small(hw=16)):
        q = quantized.quantize(model, fmt, samples=2)
        counts = Counter(n.op_type for n in q.graph.node)
        assert ops[fmt] <= set(counts), counts
        assert not {"Relu", "Clip"} & set(counts)     # folded into the outputs' ranges
        feeds = quantized.calibration_inputs(q, 1, seed=5)[0]
        so = ort.SessionOptions()
        so.log_severity_level = 3
        out = ort.InferenceSession(q.SerializeToString(), so,
                                   providers=["CPUExecutionProvider"]).run(None, feeds)[0]
        assert np.isfinite(out).all() and out.std() > 0
