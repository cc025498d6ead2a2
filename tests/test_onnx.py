"""ONNX import (issue 14): small models built with ``onnx.helper``, one per group of ops, run
through ``bp.Graph.from_onnx`` and compared with ONNX Runtime (an independent implementation):
largest error <= 1e-4 of the largest output magnitude, fp32, batch 1 and 2. Every op and
attribute the importer handles appears below; what it does not handle must raise before
anything is compiled.

Kernels come from the JIT cache directory the graph tests share (first use compiles)."""

from __future__ import annotations

import numpy as np
import pytest

import blockpad as bp

onnx = pytest.importorskip("onnx", reason="pip install onnx (the [onnx] extra)")
ort = pytest.importorskip("onnxruntime", reason="pip install onnxruntime (the [test] extra)")

from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from blockpad.onnx import UnsupportedModelError  # noqa: E402
from blockpad.vocabulary import POLICIES  # noqa: E402

TOL = 1e-4


@pytest.fixture(scope="session")
def cache(tmp_path_factory):
    return bp.jit_cache(cache_dir=tmp_path_factory.getbasetemp() / "bp-jit")


def model(nodes, inputs, outputs, inits=(), opset=17):
    """A model whose inputs have a symbolic batch dim ``N``: ``inputs`` {name: (C, H, W)}."""
    g = helper.make_graph(
        nodes, "test",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["N", *s]) for n, s in
         inputs.items()],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in outputs],
        [numpy_helper.from_array(np.asarray(a, np.float32), n) for n, a in dict(inits).items()])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 8
    return m


def node(op, inputs, outputs, **attrs):
    outs = [outputs] if isinstance(outputs, str) else outputs
    return helper.make_node(op, inputs, outs, name=f"{op}:{outs[0]}", **attrs)


def check(m, inputs, policies=("dst_fused",), batches=(1, 2), cache=None, seed=0, **options):
    """Run ``m`` in ONNX Runtime and in blockpad (each policy, each batch); compare every
    output. Returns the last graph."""
    sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in m.graph.output]
    rng = np.random.default_rng(seed)
    g = None
    for n in batches:
        feeds = {k: rng.standard_normal((n, *s)).astype(np.float32) for k, s in inputs.items()}
        refs = dict(zip(names, sess.run(None, feeds)))
        for policy in policies:
            g = bp.Graph.from_onnx(m, {k: v.shape for k, v in feeds.items()}, policy=policy,
                                   cache=cache, **options)
            res = g.run(feeds)
            for name, ref in refs.items():
                out = res[name].numpy()
                assert out.shape == ref.shape, (name, out.shape, ref.shape)
                err = np.abs(out.astype(np.float64) - ref).max()
                scale = np.abs(ref).max()
                assert err <= TOL * scale, f"{name} batch {n} {policy}: {err} > {TOL} * {scale}"
    return g


def rand(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


# ---- convolution: every attribute -------------------------------------------------------------

def test_conv_attributes(cache):
    """Asymmetric pads with stride, auto_pad SAME_UPPER/SAME_LOWER (an even kernel, so they
    differ), VALID with dilation, grouped and depthwise, with and without bias."""
    rng = np.random.default_rng(1)
    c = 6
    nodes = [
        node("Conv", ["x", "w0", "b0"], "asym", pads=[1, 0, 2, 1], strides=[2, 1]),
        node("Conv", ["x", "w1"], "upper", auto_pad="SAME_UPPER", strides=[2, 2]),
        node("Conv", ["x", "w1"], "lower", auto_pad="SAME_LOWER", strides=[2, 2]),
        node("Conv", ["x", "w0", "b0"], "valid", auto_pad="VALID", dilations=[2, 1]),
        node("Conv", ["x", "wg", "bg"], "grouped", group=2, pads=[1, 1, 1, 1]),
        node("Conv", ["x", "wd"], "depthwise", group=c, pads=[0, 1, 1, 0], strides=[2, 2],
             kernel_shape=[3, 3]),
    ]
    inits = {"w0": rand(rng, 11, c, 3, 3, scale=0.3), "b0": rand(rng, 11),
             "w1": rand(rng, 9, c, 4, 4, scale=0.3), "wg": rand(rng, 10, c // 2, 3, 3),
             "bg": rand(rng, 10), "wd": rand(rng, c, 1, 3, 3)}
    outs = ["asym", "upper", "lower", "valid", "grouped", "depthwise"]
    check(model(nodes, {"x": (c, 9, 8)}, outs, inits), {"x": (c, 9, 8)}, cache=cache)


def test_conv_algorithm_auto_is_winograd_where_it_pays(cache):
    """Convolutions import as ``algorithm="auto"``: the eligible 3x3 stride-1 one at 48
    channels on 16x16 runs as Winograd (the cost model's pick; its weights transformed once,
    ``hwOi16o``), the 3x3 stride-2 and the 1x1 direct; all match ONNX Runtime. With
    ``conv_algorithm="direct"`` nothing is Winograd."""
    from blockpad import winograd

    rng = np.random.default_rng(7)
    c, hw = 48, 16
    assert winograd.choose(1, c, c, hw, hw) is not None      # what the test relies on
    nodes = [node("Conv", ["x", "w3", "b3"], "a", pads=[1, 1, 1, 1]),
             node("Relu", ["a"], "r"),
             node("Conv", ["r", "w1"], "p"),
             node("Conv", ["p", "w3"], "s2", pads=[1, 1, 1, 1], strides=[2, 2])]
    inits = {"w3": rand(rng, c, c, 3, 3, scale=0.1), "b3": rand(rng, c),
             "w1": rand(rng, c, c, 1, 1, scale=0.2)}
    m = model(nodes, {"x": (c, hw, hw)}, ["s2"], inits)
    g = check(m, {"x": (c, hw, hw)}, batches=(1,), cache=cache)
    assert [n.attrs["algorithm"] for n in g.nodes if n.op == "conv2d"] == ["auto"] * 3
    x = np.zeros((1, c, hw, hw), np.float32)
    assert g.plan(x=x).describe().count("hwOi16o") == 1
    direct = check(m, {"x": (c, hw, hw)}, batches=(1,), cache=cache, conv_algorithm="direct")
    assert "hwOi" not in direct.plan(x=x).describe()
    with pytest.raises(UnsupportedModelError, match="conv_algorithm"):
        bp.Graph.from_onnx(m, {"x": (1, c, hw, hw)}, conv_algorithm="winograd")


# ---- batch norm, activations, broadcasting ----------------------------------------------------

def _bn(rng, k, prefix):
    return {f"{prefix}g": rng.random(k) + 0.5, f"{prefix}b": rng.standard_normal(k),
            f"{prefix}m": rng.standard_normal(k), f"{prefix}v": rng.random(k) + 0.5}


def test_batchnorm_folded_and_standalone(cache):
    """A BatchNormalization that is its convolution's only reader is folded into the weights
    and bias; one after a convolution read twice, and one on a graph input, run as a
    per-channel mul and add."""
    rng = np.random.default_rng(2)
    inits = {"w": rand(rng, 10, 5, 3, 3, scale=0.3), "b": rand(rng, 10),
             "w2": rand(rng, 10, 5, 1, 1), **_bn(rng, 10, "a"), **_bn(rng, 10, "c"),
             **_bn(rng, 5, "i")}
    nodes = [
        node("Conv", ["x", "w", "b"], "c1", pads=[1, 1, 1, 1]),
        node("BatchNormalization", ["c1", "ag", "ab", "am", "av"], "folded", epsilon=1e-3),
        node("Conv", ["x", "w2"], "c2"),
        node("BatchNormalization", ["c2", "cg", "cb", "cm", "cv"], "kept"),
        node("Add", ["kept", "c2"], "kept_sum"),
        node("BatchNormalization", ["x", "ig", "ib", "im", "iv"], "on_input"),
    ]
    g = check(model(nodes, {"x": (5, 6, 7)}, ["folded", "kept_sum", "on_input"], inits),
              {"x": (5, 6, 7)}, cache=cache)
    ops = [n.op for n in g.nodes]
    assert ops.count("conv2d") == 2 and ops.count("binary") == 5, ops
    # the imported weights are the graph's own: read-only, never copied or compared per run
    assert g.constants and not any(a.flags.writeable for a in g.constants.values())
    assert g.weight_cache._kept == {}


def test_activations_and_broadcasting(cache):
    """Relu, Clip (relu6, min only, max only), Sigmoid, HardSigmoid, HardSwish, SiLU (Sigmoid +
    Mul), squeeze-excitation (GlobalAveragePool, 1x1 convs, a broadcast Mul), Add of a
    residual, of a per-channel constant and of a scalar, Mul by a scalar."""
    rng = np.random.default_rng(3)
    c = 12
    inits = {"w": rand(rng, c, 5, 3, 3, scale=0.4), "lo": np.float32(0), "hi": np.float32(6),
             "neg": np.float32(-0.5), "w_se1": rand(rng, 3, c, 1, 1), "b_se1": rand(rng, 3),
             "w_se2": rand(rng, c, 3, 1, 1), "b_se2": rand(rng, c),
             "chan": rand(rng, 1, c, 1, 1), "two": np.float32(2), "half": np.float32(0.5)}
    nodes = [
        node("Conv", ["x", "w"], "c", pads=[1, 1, 1, 1]),
        node("Relu", ["c"], "relu"),
        node("Clip", ["c", "lo", "hi"], "relu6"),
        node("Clip", ["c", "neg"], "min_only"),
        node("Clip", ["c", "", "hi"], "max_only"),
        node("Sigmoid", ["c"], "sig"),
        node("Mul", ["c", "sig"], "silu"),
        node("HardSigmoid", ["c"], "hsig", alpha=0.3, beta=0.4),
        node("HardSwish", ["c"], "hswish"),
        node("GlobalAveragePool", ["silu"], "sq"),
        node("Conv", ["sq", "w_se1", "b_se1"], "se1"),
        node("Relu", ["se1"], "se1r"),
        node("Conv", ["se1r", "w_se2", "b_se2"], "se2"),
        node("Sigmoid", ["se2"], "gate"),
        node("Mul", ["silu", "gate"], "excited"),
        node("Add", ["excited", "relu"], "residual"),
        node("Add", ["chan", "residual"], "biased"),
        node("Mul", ["biased", "two"], "scaled"),
        node("Add", ["half", "scaled"], "shifted"),
    ]
    outs = ["relu6", "min_only", "max_only", "hsig", "hswish", "shifted"]
    check(model(nodes, {"x": (5, 6, 6)}, outs, inits), {"x": (5, 6, 6)}, cache=cache)


# ---- pooling ----------------------------------------------------------------------------------

def test_pooling_attributes(cache):
    """MaxPool with asymmetric pads, ceil_mode (a last window over the padding, and one that
    would start past it: dropped), dilation, auto_pad SAME_UPPER; AveragePool with and without
    count_include_pad, ceil_mode and per-side pads."""
    nodes = [
        node("MaxPool", ["x"], "max_ceil", kernel_shape=[3, 3], strides=[2, 2], ceil_mode=1,
             pads=[1, 0, 0, 1]),
        node("MaxPool", ["x"], "max_drop", kernel_shape=[2, 2], strides=[2, 2], ceil_mode=1,
             pads=[1, 1, 1, 1]),
        node("MaxPool", ["x"], "max_dil", kernel_shape=[2, 3], dilations=[2, 2]),
        node("MaxPool", ["x"], "max_same", kernel_shape=[3, 3], strides=[2, 2],
             auto_pad="SAME_UPPER"),
        node("AveragePool", ["x"], "avg_incl", kernel_shape=[3, 3], strides=[2, 2],
             pads=[1, 0, 1, 2], count_include_pad=1, ceil_mode=1),
        node("AveragePool", ["x"], "avg_excl", kernel_shape=[3, 2], strides=[2, 1],
             pads=[1, 1, 0, 1], ceil_mode=1),
        node("AveragePool", ["x"], "avg_plain", kernel_shape=[2, 2]),
    ]
    outs = [n.output[0] for n in nodes]
    # H = 7, W = 8: ceil_mode adds a window for some of these and not for others
    check(model(nodes, {"x": (5, 7, 8)}, outs), {"x": (5, 7, 8)}, cache=cache)


# ---- concat -----------------------------------------------------------------------------------

def _concat_model(rng):
    """Channel counts 5 + 11 (+ 6 + 5): offsets that are not multiples of 8 or 16; a
    convolution reads the concat, so its reduction over padded channels sees the concat's
    padding."""
    inits = {"wa": rand(rng, 5, 6, 3, 3, scale=0.3), "wb": rand(rng, 11, 6, 1, 1),
             "wc": rand(rng, 7, 16, 3, 3, scale=0.3), "wd": rand(rng, 7, 27, 1, 1)}
    nodes = [
        node("Conv", ["x", "wa"], "a", pads=[1, 1, 1, 1]),
        node("Relu", ["a"], "ar"),
        node("Conv", ["x", "wb"], "b"),
        node("Concat", ["ar", "b"], "ab", axis=1),
        node("Conv", ["ab", "wc"], "c", pads=[1, 1, 1, 1]),
        node("Concat", ["ab", "x", "ar"], "abxa", axis=-3),
        node("Conv", ["abxa", "wd"], "d"),
    ]
    return model(nodes, {"x": (6, 5, 6)}, ["c", "d", "abxa"], inits)


def test_concat_blocked(cache):
    rng = np.random.default_rng(4)
    g = check(_concat_model(rng), {"x": (6, 5, 6)}, cache=cache)
    steps = g.plan(x=np.zeros((2, 6, 5, 6), np.float32)).steps
    cat = [s for s in steps if s.node is not None and s.node.op == "concat"]
    assert cat and all(not b.layout.is_plain for s in cat for b in s.reads + s.writes), \
        "a channel concat on blocked values fell back to plain layouts"


# ---- classifier head --------------------------------------------------------------------------

def test_classifier_head(cache):
    """GlobalAveragePool, Flatten, Gemm (transB, alpha, beta, a (1, N) bias), Dropout,
    Identity, Reshape (0 and -1) + MatMul, Softmax; the logits are compared too (softmax
    can hide errors)."""
    rng = np.random.default_rng(5)
    inits = {"w": rand(rng, 10, 7, 3, 3, scale=0.3), "fw": rand(rng, 12, 10),
             "fb": rand(rng, 1, 12), "shape": np.array([0, -1]), "mw": rand(rng, 10, 4),
             "ratio": np.float32(0.5)}
    nodes = [
        node("Conv", ["x", "w"], "c"),
        node("GlobalAveragePool", ["c"], "gap"),
        node("Flatten", ["gap"], "flat"),
        node("Dropout", ["flat", "ratio"], "drop"),
        node("Gemm", ["drop", "fw", "fb"], "logits", transB=1, alpha=0.5, beta=2.0),
        node("Identity", ["logits"], "same"),
        node("Softmax", ["same"], "probs", axis=1),
        node("GlobalAveragePool", ["c"], "gap2"),
        node("Reshape", ["gap2", "shape"], "flat2"),
        node("MatMul", ["flat2", "mw"], "mm"),
        node("Softmax", ["mm"], "mm_probs"),
    ]
    m = model(nodes, {"x": (7, 6, 6)}, ["gap", "logits", "probs", "mm", "mm_probs"], inits)
    m.graph.initializer[3].CopyFrom(numpy_helper.from_array(np.array([0, -1], np.int64),
                                                             "shape"))
    g = check(m, {"x": (7, 6, 6)}, cache=cache)
    # gap is a result too: its Flatten copies; gap2 has one reader: its Reshape is an alias
    steps = g.plan(x=np.zeros((2, 7, 6, 6), np.float32)).steps
    assert [s.node.name for s in steps if s.node is not None and s.node.op == "reshape"] == \
        ["Flatten:flat"]


# ---- no kernels at all: the graph's numpy references -----------------------------------------

def test_numpy_fallback_matches_onnxruntime(tmp_path):
    """With no compiler and an empty cache every op runs its numpy reference (the graph's
    fallback): the references of pooling, matmul, reshape and concat agree with ONNX Runtime
    too."""
    empty = bp.KernelCache(compiler=None, cache_dir=tmp_path)
    pools = [node("MaxPool", ["x"], "max_ceil", kernel_shape=[3, 3], strides=[2, 2],
                  ceil_mode=1, pads=[1, 0, 0, 1]),
             node("AveragePool", ["x"], "avg_incl", kernel_shape=[3, 3], strides=[2, 2],
                  pads=[1, 0, 1, 2], count_include_pad=1, ceil_mode=1),
             node("AveragePool", ["x"], "avg_excl", kernel_shape=[3, 2], strides=[2, 1],
                  pads=[1, 1, 0, 1], ceil_mode=1)]
    with pytest.warns(bp.FallbackWarning, match="no kernel in any layout"):
        g = check(model(pools, {"x": (5, 7, 8)}, [n.output[0] for n in pools]), {"x": (5, 7, 8)},
                  cache=empty)
        assert set(g.run(x=np.zeros((2, 5, 7, 8), np.float32)).report.fallbacks.values()) == \
            {"numpy"}
        check(_concat_model(np.random.default_rng(4)), {"x": (6, 5, 6)}, cache=empty)


# ---- every policy, the same numbers -----------------------------------------------------------

def test_policies_agree(cache):
    """Asymmetric conv pads, ceil_mode pooling and channel concat on blocked layouts, under
    every padding policy (batch 2): padding is whatever each policy says, the numbers are
    ONNX Runtime's."""
    rng = np.random.default_rng(6)
    inits = {"w": rand(rng, 5, 6, 3, 3, scale=0.3), "w2": rand(rng, 7, 11, 3, 3, scale=0.3)}
    nodes = [
        node("Conv", ["x", "w"], "a", pads=[0, 1, 2, 1], strides=[1, 2]),
        node("MaxPool", ["x"], "p", kernel_shape=[3, 2], strides=[1, 2], ceil_mode=1,
             pads=[1, 0, 1, 0]),
        node("Concat", ["a", "p"], "ap", axis=1),
        node("AveragePool", ["ap"], "q", kernel_shape=[2, 2], strides=[2, 2], ceil_mode=1,
             count_include_pad=1, pads=[0, 1, 1, 0]),
        node("Conv", ["ap", "w2"], "r", pads=[1, 1, 1, 1]),
    ]
    check(model(nodes, {"x": (6, 7, 7)}, ["q", "r"], inits), {"x": (6, 7, 7)},
          policies=POLICIES, batches=(2,), cache=cache)


# ---- refusals: before anything is compiled ----------------------------------------------------

class _NoCompiler:
    """A cache that fails the test if asked for any kernel."""

    def __getattr__(self, name):
        raise AssertionError(f"the cache was used ({name}) for a model that cannot import")


def _refused(m, match, **kw):
    with pytest.raises(UnsupportedModelError, match=match) as e:
        bp.Graph.from_onnx(m, {"x": (1, 4, 6, 6)}, cache=_NoCompiler(), **kw)
    return str(e.value)


def test_unsupported_op_names_node_op_and_opset():
    m = model([node("LRN", ["x"], "y", size=3)], {"x": (4, 6, 6)}, ["y"])
    msg = _refused(m, "LRN")
    assert "'LRN:y'" in msg and "opset 17" in msg


def test_unsupported_attribute_and_value():
    w = {"w": np.ones((4, 4, 3, 3), np.float32)}
    m = model([node("Conv", ["x", "w"], "y", auto_pad="FOO")], {"x": (4, 6, 6)}, ["y"], w)
    msg = _refused(m, "auto_pad")
    assert "'Conv:y'" in msg and "Conv" in msg and "opset 17" in msg
    m = model([node("MaxPool", ["x"], "y", kernel_shape=[2, 2], storage_order=1)],
              {"x": (4, 6, 6)}, ["y"])
    assert "storage_order" in _refused(m, "storage_order")
    m = model([node("Relu", ["x"], "y", foo=1)], {"x": (4, 6, 6)}, ["y"])
    assert "'foo'" in _refused(m, "attribute")
    bn = {k: np.ones(4, np.float32) for k in "gbmv"}
    m = model([node("BatchNormalization", ["x", "g", "b", "m", "v"], "y", training_mode=1)],
              {"x": (4, 6, 6)}, ["y"], bn)
    assert "training_mode" in _refused(m, "training")
    m = model([node("MaxPool", ["x"], ["y", "idx"], kernel_shape=[2, 2])], {"x": (4, 6, 6)},
              ["y", "idx"])
    _refused(m, "only output")


def test_refused_before_compiling_and_opsets():
    """An error late in the model is raised while importing: no kernel is asked for."""
    w = {"w": np.ones((4, 4, 3, 3), np.float32)}
    m = model([node("Conv", ["x", "w"], "c"), node("Relu", ["c"], "r"),
               node("Erf", ["r"], "y")], {"x": (4, 6, 6)}, ["y"], w)
    with pytest.raises(UnsupportedModelError, match="Erf"):
        bp.Graph.from_onnx(m, {"x": (1, 4, 6, 6)}, cache=_NoCompiler())
    old = model([node("Relu", ["x"], "y")], {"x": (4, 6, 6)}, ["y"], opset=11)
    _refused(old, "opset 11")
    sym = model([node("Relu", ["x"], "y")], {"x": (4, 6, 6)}, ["y"])
    with pytest.raises(UnsupportedModelError, match="input_shapes"):
        bp.Graph.from_onnx(sym, cache=_NoCompiler())


# ---- the op parameters behind the import, in a build spec -------------------------------------

def test_spec_pad_forms_and_ceil_mode():
    """Per-side pads and ceil_mode are spec parameters: a symmetric per-side pad is recorded
    as the pair form (so a graph's request matches either); bad forms are SpecErrors."""
    from blockpad.codegen.build import make_kernels
    from blockpad.codegen.spec import parse_spec

    def conv(pad, **kw):
        entry = {"op": "conv2d", "shape": [1, 5, 7, 7], "channels": 4, "kernel": [3, 3],
                 "pad": pad, "src": "nChw8c", "weights": "OIhw8i8o", "dst": "nChw8c", **kw}
        return parse_spec({"kernel": [entry]}).kernels[0]

    assert make_kernels(conv([[1, 1], [2, 2]]))[0].params["pad"] == [1, 2]
    asym = conv([[0, 2], [1, 0]])
    assert make_kernels(asym)[0].params["pad"] == [[0, 2], [1, 0]]
    assert asym.layout["dst"].shape == (1, 4, 7, 6)
    for bad in ([[1], [2]], [1, 2, 3], [[1, -1], [0, 0]], "1"):
        with pytest.raises(bp.SpecError, match="pad"):
            conv(bad)
    pool = {"op": "pool", "shape": [1, 5, 7, 7], "kernel": [2, 2], "src": "nchw",
            "dst": "nchw"}
    assert parse_spec({"kernel": [{**pool, "ceil_mode": True}]}).kernels[0] \
        .layout["dst"].shape == (1, 5, 4, 4)
    assert parse_spec({"kernel": [pool]}).kernels[0].layout["dst"].shape == (1, 5, 3, 3)
    with pytest.raises(bp.SpecError, match="ceil_mode"):
        parse_spec({"kernel": [{**pool, "ceil_mode": 1}]})


@pytest.mark.parametrize("policy", ["dst_fused", "tracked"])
def test_asymmetric_conv_staged_and_prepadded(tmp_path, policy):
    """The two other ways a convolution reads spatial padding, with per-side pads: a staged
    zero-halo copy (``spatial_pad = "stage"``) and a source whose halo covers the pads; checked
    against the numpy reference."""
    from blockpad.codegen.spec import parse_spec
    from blockpad.runtime.graph.ops import conv_ref

    pad = [[1, 2], [0, 1]]
    common = {"op": "conv2d", "shape": [2, 5, 6, 7], "channels": 6, "kernel": [3, 2],
              "stride": [2, 1], "pad": pad, "weights": "OIhw8i8o", "dst": "nChw8c"}
    halo = {"tag": "nChw8c", "paddings": {"h": [1, 2], "w": [0, 1]}}
    spec = {"library": {"name": "asym", "policy": policy}, "kernel": [
        {**common, "name": "staged", "src": "nChw8c", "spatial_pad": "stage"},
        {**common, "name": "prepadded", "src": halo}]}
    bp.build(parse_spec(spec), "host", tmp_path, log=lambda m: None)
    lib = bp.load(tmp_path)
    rng = np.random.default_rng(7)
    x, w = rand(rng, 2, 5, 6, 7), rand(rng, 6, 5, 3, 2)
    want = conv_ref(x, w, stride=(2, 1), pad=pad)
    wm = bp.Memory.from_numpy(w, bp.Layout("OIhw8i8o", w.shape))
    for name, src in (("staged", bp.Layout("nChw8c", x.shape)),
                      ("prepadded", bp.Layout("nChw8c", x.shape, paddings=halo["paddings"]))):
        dst = bp.Layout("nChw8c", want.shape)
        out = bp.Memory(dst, np.full(dst.alloc_len, np.nan, np.float32))
        lib[name](bp.Memory.from_numpy(x, src), wm, out)
        assert np.abs(out.to_numpy() - want).max() <= TOL * np.abs(want).max(), name
