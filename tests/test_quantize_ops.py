"""The ``quantize`` and ``dequantize`` kernels and the quantized ``binary`` add against ONNX
Runtime's QuantizeLinear, DequantizeLinear and QLinearAdd, run on the same random data: equal
to the bit, on plain and blocked layouts (channel padding), under every padding policy."""

import numpy as np
import pytest

import blockpad as bp
from blockpad.errors import SpecError
from blockpad.vocabulary import POLICIES

onnx = pytest.importorskip("onnx", reason="pip install onnx")
ort = pytest.importorskip("onnxruntime", reason="pip install onnxruntime")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

SHAPE = (1, 20, 5, 7)          # 20 channels: nChw16c pads 12
TAGS = ("nchw", "nChw16c")
Q = dict(scale=0.0371, zero_point=131)          # activations: uint8, zero point inside
A = dict(scales=[0.0413, 0.0217, 0.0529], zero_points=[121, 37, 140])


def _ort(node, inputs, output, inits, feeds, ms=False):
    graph = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info(n, t, s) for n, t, s in inputs],
        [helper.make_tensor_value_info(output[0], output[1], None)],
        [numpy_helper.from_array(np.asarray(v), k) for k, v in inits.items()])
    opsets = [helper.make_opsetid("", 17)] + ([helper.make_opsetid("com.microsoft", 1)]
                                              if ms else [])
    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = ort.InferenceSession(helper.make_model(graph, opset_imports=opsets).SerializeToString(),
                                so, providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)[0]


def _name(op, tag, policy):
    return f"{op}_{tag}_{policy}"


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    kernels = []
    for tag in TAGS:
        for policy in POLICIES:
            kernels += [
                {"name": _name("q", tag, policy), "op": "quantize", "shape": list(SHAPE),
                 "src": tag, "dst": tag, "policy": policy, "dst_dtype": "uint8", **Q},
                {"name": _name("dq", tag, policy), "op": "dequantize", "shape": list(SHAPE),
                 "dtype": "uint8", "src": tag, "dst": tag, "policy": policy, **Q},
                {"name": _name("add", tag, policy), "op": "binary", "shape": list(SHAPE),
                 "dtype": "uint8", "src0": tag, "src1": tag, "dst": tag, "policy": policy,
                 "algorithm": "add", **A}]
    d = tmp_path_factory.mktemp("quantize_ops")
    bp.build({"kernel": kernels}, "host", d, log=lambda m: None)
    return bp.load(d)


def _data(seed):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(SHAPE) * 3).astype(np.float32)
    x.flat[:6] = [0.5 * Q["scale"], -0.5 * Q["scale"], 1.5 * Q["scale"], 1e9, -1e9, 0.0]
    return x, rng.integers(0, 256, SHAPE, dtype=np.uint8), rng.integers(0, 256, SHAPE,
                                                                           dtype=np.uint8)


def _call(lib, name, *arrays):
    sig = lib[name].signature
    lays = [a[2] for a in sig.args]
    mems = [bp.Memory.from_numpy(a, lay) for a, lay in zip(arrays, lays)]
    out = bp.Memory.empty(lays[-1])
    lib[name](*mems, out)
    return out.to_numpy()


@pytest.mark.parametrize("tag", TAGS)
@pytest.mark.parametrize("policy", POLICIES)
def test_quantize_dequantize_add_equal_onnxruntime(lib, tag, policy):
    x, a, b = _data(len(policy) + len(tag))
    s, z = np.float32(Q["scale"]), np.uint8(Q["zero_point"])
    want_q = _ort(helper.make_node("QuantizeLinear", ["x", "s", "z"], ["y"]),
                  [("x", TensorProto.FLOAT, SHAPE)], ("y", TensorProto.UINT8), {"s": s, "z": z},
                  {"x": x})
    np.testing.assert_array_equal(_call(lib, _name("q", tag, policy), x), want_q)
    want_dq = _ort(helper.make_node("DequantizeLinear", ["q", "s", "z"], ["y"]),
                   [("q", TensorProto.UINT8, SHAPE)], ("y", TensorProto.FLOAT), {"s": s, "z": z},
                   {"q": a})
    assert _call(lib, _name("dq", tag, policy), a).tobytes() == want_dq.tobytes()
    inits = {f"{k}{i}": np.float32(v) if k == "s" else np.uint8(v)
             for k, vs in (("s", A["scales"]), ("z", A["zero_points"])) for i, v in enumerate(vs)}
    want_add = _ort(helper.make_node("QLinearAdd", ["a", "s0", "z0", "b", "s1", "z1", "s2", "z2"],
                                     ["c"], domain="com.microsoft"),
                    [("a", TensorProto.UINT8, SHAPE), ("b", TensorProto.UINT8, SHAPE)],
                    ("c", TensorProto.UINT8), inits, {"a": a, "b": b}, ms=True)
    np.testing.assert_array_equal(_call(lib, _name("add", tag, policy), a, b), want_add)


def test_bad_quantization_parameters_are_refused(tmp_path):
    bad = [{"op": "quantize", "shape": [1, 4, 2, 2], "src": "nchw", "dst": "nchw",
            "zero_point": 300},
           {"op": "dequantize", "shape": [1, 4, 2, 2], "dtype": "float32", "src": "nchw",
            "dst": "nchw"},
           {"op": "binary", "shape": [1, 4, 2, 2], "dtype": "uint8", "src0": "nchw",
            "src1": "nchw", "dst": "nchw", "algorithm": "mul", **A}]
    for entry in bad:
        with pytest.raises(SpecError):
            bp.build({"kernel": [entry]}, "host", tmp_path, log=lambda m: None)
