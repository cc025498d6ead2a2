"""Quantized ONNX models imported by ``bp.Graph.from_onnx`` give ONNX Runtime's results exactly:
the final dequantized float output equal bit for bit (so every 8-bit value before it too), in
both the QDQ and the QOperator form, with every op on a kernel (no numpy fallback)."""

import numpy as np
import pytest

import blockpad as bp
from blockpad.onnx import UnsupportedModelError

onnx = pytest.importorskip("onnx", reason="pip install onnx")
ort = pytest.importorskip("onnxruntime", reason="pip install onnxruntime")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from blockpad.models import quantized  # noqa: E402

FMTS = quantized.FORMATS


def _ort(model, feeds):
    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def _check(model, feeds, **options):
    """``model`` through blockpad equals ONNX Runtime to the bit, every op on a kernel."""
    want = _ort(model, feeds)
    g = bp.Graph.from_onnx(model, **options)
    res = g.run(**feeds)
    assert res.report.fallbacks == {}, res.report.fallbacks
    for (name, got), w in zip(res.numpy().items(), want):
        assert got.dtype == w.dtype and got.shape == w.shape, name
        assert got.tobytes() == w.tobytes(), \
            f"{name}: {np.mean(got != w):.1%} differ, max |diff| {np.abs(got - w).max()}"
    return g, res


def _model(nodes, inputs, outputs, inits, ms=False):
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in inputs],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in outputs],
        [numpy_helper.from_array(np.asarray(v), k) for k, v in inits.items()])
    opsets = [helper.make_opsetid("", 17)] + ([helper.make_opsetid("com.microsoft", 1)]
                                              if ms else [])
    return helper.make_model(graph, opset_imports=opsets)


ADD_INITS = {"sx": np.float32(0.031), "zx": np.uint8(128), "sy": np.float32(0.017),
             "zy": np.uint8(90), "sc": np.float32(0.041), "zc": np.uint8(100)}


def _add_model(fmt):
    """x, y -> QuantizeLinear -> a quantized add -> DequantizeLinear, in either form; x's
    quantized value is an output too, so the add may overwrite y's but not x's (the operands
    of a quantized add must not be swapped: each has its scale, and the fmas' order rounds)."""
    q = [helper.make_node("QuantizeLinear", ["x", "sx", "zx"], ["xq"]),
         helper.make_node("QuantizeLinear", ["y", "sy", "zy"], ["yq"])]
    if fmt == "qoperator":
        body = [helper.make_node("QLinearAdd", ["xq", "sx", "zx", "yq", "sy", "zy", "sc", "zc"],
                                 ["cq"], domain="com.microsoft")]
    else:
        body = [helper.make_node("DequantizeLinear", ["xq", "sx", "zx"], ["xd"]),
                helper.make_node("DequantizeLinear", ["yq", "sy", "zy"], ["yd"]),
                helper.make_node("Add", ["xd", "yd"], ["c"]),
                helper.make_node("QuantizeLinear", ["c", "sc", "zc"], ["cq"])]
    out = [helper.make_node("DequantizeLinear", ["cq", "sc", "zc"], ["out"]),
           helper.make_node("DequantizeLinear", ["xq", "sx", "zx"], ["x_out"])]
    shape = [1, 20, 5, 7]
    return _model(q + body + out, [("x", shape), ("y", shape)], ["out", "x_out"], ADD_INITS,
                  ms=fmt == "qoperator")


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("policy", ["dst_fused", "tracked"])
def test_quantized_add(fmt, policy):
    rng = np.random.default_rng(3)
    feeds = {k: (rng.standard_normal((1, 20, 5, 7)) * 3).astype(np.float32) for k in "xy"}
    g, res = _check(_add_model(fmt), feeds, policy=policy)
    ops = [n.op for n in g.nodes]
    assert ops == ["quantize", "quantize", "binary", "dequantize", "dequantize"], ops
    assert res.report.inplace == []     # over y's value only by swapping: wrong (it was)


@pytest.mark.parametrize("dtype", [np.uint8, np.int8])
@pytest.mark.parametrize("pool", [dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1]),
                                  dict(kernel_shape=[2, 2], strides=[2, 2], ceil_mode=1)])
def test_quantized_max_pool_stays_8_bit(dtype, pool):
    """``DequantizeLinear -> MaxPool -> QuantizeLinear`` (ResNet's stem, as ``quantize_static``
    writes it) pools the 8-bit value itself: no float op in between, ONNX Runtime's bits, the
    window's padding the type's smallest value (an int8 image of negatives next to it)."""
    nodes = [helper.make_node("QuantizeLinear", ["x", "sx", "zx"], ["xq"]),
             helper.make_node("DequantizeLinear", ["xq", "sx", "zx"], ["xd"]),
             helper.make_node("MaxPool", ["xd"], ["p"], **pool),
             helper.make_node("QuantizeLinear", ["p", "sx", "zx"], ["pq"]),
             helper.make_node("DequantizeLinear", ["pq", "sx", "zx"], ["out"])]
    inits = {"sx": np.float32(0.031), "zx": dtype(128 if dtype == np.uint8 else 5)}
    model = _model(nodes, [("x", [1, 20, 9, 11])], ["out"], inits)
    x = (np.random.default_rng(5).standard_normal((1, 20, 9, 11)) * 2 - 1).astype(np.float32)
    g, _ = _check(model, {"x": x})
    assert [(n.op, g._types[n.outputs[0]][1]) for n in g.nodes] == [
        ("quantize", np.dtype(dtype).name), ("pool", np.dtype(dtype).name),
        ("dequantize", "float32")]


def test_unsupported_patterns_name_the_node():
    # a Conv of dequantized values whose output is not requantized
    w = numpy_helper.from_array(np.ones((4, 3, 1, 1), np.int8), "w")
    nodes = [helper.make_node("QuantizeLinear", ["x", "sx", "zx"], ["xq"]),
             helper.make_node("DequantizeLinear", ["xq", "sx", "zx"], ["xd"]),
             helper.make_node("DequantizeLinear", ["w", "sw"], ["wd"], axis=0),
             helper.make_node("Conv", ["xd", "wd"], ["out"], name="lonely_conv")]
    model = _model(nodes, [("x", [1, 3, 4, 4])], ["out"], {**ADD_INITS,
                                                           "sw": np.full(4, 0.1, np.float32)})
    model.graph.initializer.append(w)
    with pytest.raises(UnsupportedModelError, match="lonely_conv.*QuantizeLinear"):
        bp.Graph.from_onnx(model)
    # a weight zero point other than 0
    nodes = [helper.make_node("QuantizeLinear", ["x", "sx", "zx"], ["xq"]),
             helper.make_node("QLinearConv", ["xq", "sx", "zx", "w", "sw", "zw", "sc", "zc"],
                              ["cq"], name="asym"),
             helper.make_node("DequantizeLinear", ["cq", "sc", "zc"], ["out"])]
    model = _model(nodes, [("x", [1, 3, 4, 4])], ["out"],
                   {**ADD_INITS, "sw": np.full(4, 0.1, np.float32), "zw": np.full(4, 3, np.int8)})
    model.graph.initializer.append(w)
    with pytest.raises(UnsupportedModelError, match="asym.*zero point"):
        bp.Graph.from_onnx(model)


# ---- whole quantized networks (CI-sized) ------------------------------------------------------

MODELS = {
    "basic": lambda: quantized.resnet_block("basic", c_in=16, width=16, hw=8, stride=2),
    "bottleneck": lambda: quantized.resnet_block("bottleneck", c_in=32, width=8, hw=6,
                                                 stride=1),
    "mobilenet_v2": lambda: quantized.mobilenet_v2_small(hw=16),
}


@pytest.fixture(scope="module")
def models():
    cache = {}

    def get(name, fmt):
        if (name, fmt) not in cache:
            cache[name, fmt] = quantized.quantize(MODELS[name](), fmt, samples=3)
        return cache[name, fmt]
    return get


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("name", list(MODELS))
def test_quantized_networks_equal_onnxruntime(models, name, fmt):
    model = models(name, fmt)
    feeds = quantized.calibration_inputs(model, 1, seed=11)[0]
    g, res = _check(model, feeds)
    assert any(n.op == "conv2d" for n in g.nodes)
    # int8 stays int8 between layers: the only float ops are the edges
    floats = [n.op for n in g.nodes if g._types[n.outputs[0]][1] == "float32"]
    assert floats == ["dequantize"] * len(g.outputs), floats
    # each residual add runs in the convolution before it (its quantized_add post-op), and
    # the bits above are still ONNX Runtime's
    adds = [n.name for n in g.nodes if n.op == "binary"]
    assert adds and [f.split(" + ")[1] for f in res.report.fused] == adds, res.report.fused



@pytest.mark.filterwarnings("ignore::blockpad.errors.FallbackWarning")   # the fallback is the point
@pytest.mark.parametrize("fmt", FMTS)
def test_numpy_references_equal_onnxruntime(models, fmt, tmp_path):
    """With no compiler and an empty cache every step runs the graph's numpy reference (the
    fallback: integer conv2d and matmul, quantize, dequantize, the quantized add): the same
    bits as ONNX Runtime."""
    empty = bp.KernelCache(compiler=None, cache_dir=tmp_path)
    model = models("mobilenet_v2", fmt)
    feeds = quantized.calibration_inputs(model, 1, seed=11)[0]
    g = bp.Graph.from_onnx(model, cache=empty)
    res = g.run(**feeds)
    assert set(res.report.fallbacks.values()) == {"numpy"}
    fused = len(res.report.fused)      # residual adds run inside their convolutions
    assert fused == sum(n.op == "binary" for n in g.nodes) > 0
    assert len(res.report.fallbacks) == \
        len(g.nodes) - sum(n.op == "reshape" for n in g.nodes) - fused
    got, want = res.numpy()["logits"], _ort(model, feeds)[0]
    assert got.tobytes() == want.tobytes()


def test_quantized_model_built_ahead_of_time(models, tmp_path):
    """``blockpad build`` of a quantized model (kernels, plan, packed int8 weights) loads and
    gives ONNX Runtime's output to the bit."""
    from blockpad.model_build import build_model

    model = models("basic", "qdq")
    path = tmp_path / "basic_qdq.onnx"
    onnx.save(model, str(path))
    build_model(str(path), "host", str(tmp_path / "built"), log=lambda m: None)
    feeds = quantized.calibration_inputs(model, 1, seed=11)[0]
    got = bp.load(str(tmp_path / "built"))(feeds["input"])
    assert got.tobytes() == _ort(model, feeds)[0].tobytes()
