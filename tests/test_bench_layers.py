"""``blockpad bench layers``: ONNX Runtime's profiled nodes matched to blockpad's plan steps
(renamed NCHWc nodes, fused activations and sums, a folded batch norm), and one comparison
run end to end on a small residual block built ahead of time."""

from __future__ import annotations

import numpy as np
import pytest

onnx = pytest.importorskip("onnx", reason="pip install onnx (the [onnx] extra)")
pytest.importorskip("onnxruntime", reason="pip install onnxruntime (the [test] extra)")

from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from blockpad.bench import layers  # noqa: E402

SHAPE = (1, 16, 8, 8)


def _block(rng):
    """conv + batch norm + relu, conv + residual add + relu: ONNX Runtime's NCHWc
    transformer names its nodes after the relus' outputs."""
    w1, w2 = (rng.standard_normal((16, 16, 3, 3)).astype("float32") * 0.2 for _ in range(2))
    bn = {"g": rng.random(16) + 0.5, "b": rng.standard_normal(16), "m": rng.standard_normal(16),
          "v": rng.random(16) + 0.5}
    nodes = [helper.make_node("Conv", ["x", "w1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
             helper.make_node("BatchNormalization", ["c1", "g", "b", "m", "v"], ["n1"],
                              name="bn1"),
             helper.make_node("Relu", ["n1"], ["r1"], name="relu1"),
             helper.make_node("Conv", ["r1", "w2"], ["c2"], name="conv2", pads=[1, 1, 1, 1]),
             helper.make_node("Add", ["c2", "x"], ["s"], name="add"),
             helper.make_node("Relu", ["s"], ["y"], name="relu2")]
    inits = [numpy_helper.from_array(np.asarray(a, np.float32), n)
             for n, a in {"w1": w1, "w2": w2, **bn}.items()]
    g = helper.make_graph(nodes, "block",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, SHAPE)],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, SHAPE)], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def test_onnx_runtime_nodes_map_to_the_steps_that_compute_them(rng):
    lookup = layers.ort_to_steps(_block(rng), [["conv1", "relu1"], ["conv2", "add", "relu2"]],
                                 ["conv1", "conv2"])
    assert lookup("r1_nchwc") == "conv1"        # an NCHWc node: named after its output
    assert lookup("y_nchwc") == "conv2"         # the sum and relu fused into the convolution
    assert lookup("n1_nchwc") == "conv1"        # the batch norm blockpad folded away
    assert lookup("conv2") == "conv2" and lookup("relu2") == "conv2"   # source names
    assert lookup("ReorderOutput") is None and lookup("x_nchwc") is None


def test_quantized_nodes_map_to_the_step_their_output_flows_into():
    """A QDQ convolution (DequantizeLinear -> Conv -> Relu -> QuantizeLinear) is one QLinearConv
    in ONNX Runtime, named ``<conv>_token_<n>``, and one blockpad step named after the
    QuantizeLinear: the conv goes forward to it, not back to the step that produced its
    input."""
    def dq(x, y, name):
        return helper.make_node("DequantizeLinear", [x, "s", "z"], [y], name=name)

    def q(x, y, name):
        return helper.make_node("QuantizeLinear", [x, "s", "z"], [y], name=name)

    nodes = [q("x", "xq", "x_q"), dq("xq", "xd", "x_dq"), dq("wq", "wd", "w_dq"),
             helper.make_node("Conv", ["xd", "wd"], ["c"], name="conv"),
             helper.make_node("Relu", ["c"], ["r"], name="relu"), q("r", "rq", "r_q"),
             dq("rq", "rd", "r_dq"), helper.make_node("Add", ["rd", "xd"], ["s1"], name="add"),
             q("s1", "y", "y_q"), dq("y", "yd", "y_dq"),
             helper.make_node("MaxPool", ["yd"], ["p"], name="pool", kernel_shape=[2, 2]),
             q("p", "pq", "p_q"), dq("pq", "pd", "p_dq"), dq("pq", "pd2", "p_dq2")]
    g = helper.make_graph(nodes, "qdq", [helper.make_tensor_value_info(
        "x", TensorProto.FLOAT, SHAPE)], [helper.make_tensor_value_info(
            "y", TensorProto.UINT8, SHAPE)])
    lookup = layers.ort_to_steps(helper.make_model(g), [["r_q", "y_q"]],
                                 ["x_q", "r_q", "p_uint8"])
    assert lookup("conv_token_3") == "r_q"     # not x_q, the step before it
    assert lookup("add") == "r_q"              # the sum blockpad fused into the convolution
    # a max pool on quantized data: blockpad's step is named after its output and type; its
    # QuantizeLinear feeds two consumers, where the walk forward stops
    assert lookup("pool_token_9") == "p_uint8"
    assert lookup("x_q") == "x_q" and lookup("Transpose") is None


def test_a_block_compared_layer_by_layer(tmp_path, rng, capsys):
    from blockpad.model_build import build_model

    path = tmp_path / "block.onnx"
    onnx.save(_block(rng), path)
    build_model(str(path), "host", str(tmp_path / "bp"), log=lambda m: None)
    x = rng.standard_normal(SHAPE).astype("float32")
    result = layers.compare(str(path), str(tmp_path / "bp"), x, rounds=2)
    convs = [(label, b, o) for label, b, o in result["steps"] if label.startswith("conv")]
    assert [label for label, _, _ in convs] == ["conv1", "conv2"]
    assert all(b > 0 and o is not None and o > 0 for _, b, o in convs)
    assert result["totals"]["blockpad"] > 0 and result["totals"]["onnxruntime"] > 0
    layers.report("block", result)
    out = capsys.readouterr().out
    assert "conv2" in out and "matched layers" in out
