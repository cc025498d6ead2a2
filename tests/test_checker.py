"""benchdnn-style checks of every op x layout x policy, on shapes whose blocked dims are not
block multiples:

* results equal the numpy reference (tolerance per dtype);
* where the policy promises a clean destination, its padding is zero even though the buffer
  started full of NaN;
* where the policy tolerates dirty sources, the results hold with NaN in source padding;
* nothing outside the buffers' ``alloc_len`` is written (guard regions).
"""

from __future__ import annotations

import numpy as np
import pytest

import blockpad as bp
from blockpad.codegen.spec import parse_spec
from blockpad.vocabulary import CLEAN_AFTER_CALL, POLICIES

from .conftest import garbage
from .reference import REFERENCES, conv_reference

SHAPE = [2, 30, 3, 5]
CASES = [
    *({"op": "eltwise", "algorithm": alg, "alpha": a, "beta": b, "src": "nChw16c", "dst": "nChw16c"}
      for alg, a, b in [("relu", 0.0, 0.0), ("relu", 0.1, 0.0), ("gelu_erf", 0.0, 0.0),
                        ("gelu_tanh", 0.0, 0.0), ("sigmoid", 0.0, 0.0), ("exp", 0.0, 0.0),
                        ("tanh", 0.0, 0.0), ("clip", -0.5, 0.5), ("linear", 2.0, 0.0),
                        ("linear", 2.0, 1.0), ("swish", 1.0, 0.0), ("swish", 0.5, 0.0)]),
    {"op": "eltwise", "algorithm": "sigmoid", "src": "nchw", "dst": "nChw8c"},
    {"op": "eltwise", "algorithm": "relu", "src": "nhwc", "dst": "nChw16c"},
    {"op": "eltwise", "algorithm": "tanh", "src": {"tag": "nChw8c", "paddings": {"h": [1, 1]}},
     "dst": "nchw"},
    {"op": "binary", "algorithm": "add", "src0": "nChw16c", "src1": "nChw16c", "dst": "nChw16c"},
    {"op": "binary", "algorithm": "mul", "shape1": [1, 30, 1, 1], "src0": "nChw8c",
     "src1": "nchw", "dst": "nChw16c"},
    {"op": "binary", "algorithm": "add", "shape1": [2, 1, 3, 5], "src0": "nChw16c",
     "src1": "nchw", "dst": "nChw16c"},
    {"op": "softmax", "src": "nChw16c", "dst": "nChw16c"},
    {"op": "softmax", "log": True, "src": "nChw8c", "dst": "nChw8c"},
    {"op": "softmax", "axis": 3, "src": "nhwc", "dst": "nChw16c"},
    {"op": "pool", "algorithm": "max", "kernel": [3, 3], "stride": [2, 2], "pad": [1, 1],
     "src": "nChw16c", "dst": "nChw16c"},
    {"op": "pool", "algorithm": "avg", "kernel": [3, 3], "stride": [1, 1], "pad": [1, 1],
     "exclude_pad": False, "src": "nChw8c", "dst": "nChw8c"},
    {"op": "pool", "algorithm": "avg", "kernel": [2, 2], "pad": [1, 1], "src": "nchw",
     "dst": "nChw16c"},
]
GUARD = 32


@pytest.fixture(scope="module")
def libs(tmp_path_factory):
    """One library per policy holding every case."""
    out = {}
    for policy in POLICIES:
        kernels = [{**case, "name": f"case{i}", "shape": SHAPE} for i, case in enumerate(CASES)]
        d = tmp_path_factory.mktemp(policy)
        bp.build(parse_spec({"library": {"policy": policy}, "kernel": kernels}), "host", d,
                 log=lambda m: None)
        out[policy] = bp.load(d)
    return out


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("case", range(len(CASES)))
def test_case(libs, policy, case, rng):
    lib = libs[policy]
    kernel = lib[f"case{case}"]
    contract = kernel.signature.padding
    *sources, (_, _, dst_layout, _) = kernel.signature.args
    arrays, mems = [], []
    for _, _, layout, _ in sources:
        x = rng.standard_normal(layout.shape).astype("float32")
        mem = bp.Memory.from_numpy(x, layout)
        if contract["requires"] == "any":        # the policy says garbage there is fine
            mem.buffer[layout.padding_offsets()] = np.nan
            mem.state = "dirty"
        arrays.append(x)
        mems.append(mem)
    whole = garbage(dst_layout.alloc_len + 2 * GUARD, "float32")
    dst = lib.memory(dst_layout, whole[GUARD:-GUARD])
    kernel(*mems, dst)

    want = REFERENCES[CASES[case]["op"]](CASES[case], *arrays)
    np.testing.assert_allclose(dst.to_numpy(), want, rtol=2e-6, atol=2e-6)
    if policy in CLEAN_AFTER_CALL:
        assert dst.state == "clean"
    if dst.state == "clean":
        assert dst.padding_is_zero(), f"{policy}: padding promised clean is not zero"
    assert np.all(whole[:GUARD].view(np.uint32) == 0xFFFFFFFF)
    assert np.all(whole[-GUARD:].view(np.uint32) == 0xFFFFFFFF)


INPLACE = [
    {"op": "eltwise", "algorithm": "gelu_tanh", "src": "nChw16c", "dst": "nChw16c"},
    {"op": "eltwise", "algorithm": "sigmoid", "src": "nChw8c", "dst": "nChw8c"},
    {"op": "binary", "algorithm": "add", "src0": "nChw16c", "src1": "nChw16c", "dst": "nChw16c"},
    {"op": "softmax", "src": "nChw16c", "dst": "nChw16c"},
]


@pytest.fixture(scope="module")
def inplace_lib(tmp_path_factory):
    d = tmp_path_factory.mktemp("inplace")
    kernels = [{**case, "name": f"inplace{i}", "shape": SHAPE, "inplace": True}
               for i, case in enumerate(INPLACE)]
    bp.build(parse_spec({"library": {"policy": "dst_fused"}, "kernel": kernels}), "host", d,
             log=lambda m: None)
    return bp.load(d)


@pytest.mark.parametrize("case", range(len(INPLACE)))
def test_inplace_kernels_overwrite_their_source(inplace_lib, case, rng):
    kernel = inplace_lib[f"inplace{case}"]
    roles = [role for _, role, _, _ in kernel.signature.args]
    assert roles[0] == "inout" and "out" not in roles
    mems, arrays = [], []
    for _, _, layout, _ in kernel.signature.args:
        x = rng.standard_normal(layout.shape).astype("float32")
        arrays.append(x)
        mems.append(bp.Memory.from_numpy(x, layout))
    kernel(*mems)
    want = REFERENCES[INPLACE[case]["op"]](INPLACE[case], *arrays)
    np.testing.assert_allclose(mems[0].to_numpy(), want, rtol=2e-6, atol=2e-6)
    assert mems[0].padding_is_zero()


SUM_CHAIN = [{"kind": "bias"}, {"kind": "sum", "scale": 0.5}, {"kind": "eltwise"}]
SUM_KERNELS = [
    {"op": "conv2d", "name": "conv_sum", "shape": SHAPE, "channels": 20, "kernel": [3, 3],
     "pad": [1, 1], "src": "nChw16c", "weights": "OIhw16i16o", "dst": "nChw16c",
     "sum": "nChw16c", "post_ops": SUM_CHAIN},
    {"op": "matmul", "name": "matmul_sum", "shape": [6, 30], "n": 20, "src": "ab",
     "weights": "Ba16b", "dst": "ab", "sum": "ab", "post_ops": SUM_CHAIN},
]


@pytest.fixture(scope="module")
def sum_lib(tmp_path_factory):
    """The conv2d and matmul above, each also built with ``inplace = true`` (over the sum)."""
    d = tmp_path_factory.mktemp("sum_inplace")
    kernels = SUM_KERNELS + [{**k, "name": k["name"] + "_inplace", "inplace": True}
                             for k in SUM_KERNELS]
    bp.build(parse_spec({"kernel": kernels}), "host", d, log=lambda m: None)
    return bp.load(d)


def _sum_reference(op, x, w, bias, total):
    if op == "matmul":
        acc = x.astype(np.float64) @ w
    else:
        acc = conv_reference(x.astype(np.float64), w.astype(np.float64),
                             {"stride": (1, 1), "pad": (1, 1), "dilation": (1, 1), "groups": 1})
    channel = (slice(None),) if op == "matmul" else (slice(None), None, None)
    return np.maximum(acc + bias[channel] + 0.5 * total, 0)


@pytest.mark.parametrize("spec", SUM_KERNELS, ids=lambda k: k["op"])
def test_a_sum_post_op_accumulates_in_place(sum_lib, spec, rng):
    """oneDNN's sum post-op in the destination's memory: the sum tensor is an inout argument,
    and the same Memory passed as sum and dst to the out-of-place kernel runs the in-place one."""
    kernel = sum_lib[spec["name"] + "_inplace"]
    assert [(n, role) for n, role, _, _ in kernel.signature.args][-1] == ("sum", "inout")
    arrays = [rng.standard_normal(lay.shape).astype("float32")
              for _, _, lay, _ in kernel.signature.args]
    want = _sum_reference(spec["op"], *arrays)
    for call in (lambda m: kernel(*m), lambda m: sum_lib[spec["name"]](*m, m[-1])):
        mems = [bp.Memory.from_numpy(a, lay) for a, (_, _, lay, _) in
                zip(arrays, kernel.signature.args)]
        assert call(mems) is None
        np.testing.assert_allclose(mems[-1].to_numpy(), want, rtol=1e-5, atol=1e-5)
        assert mems[-1].padding_is_zero()


def test_inplace_over_a_sum_needs_one():
    spec = {**SUM_KERNELS[0], "post_ops": [{"kind": "bias"}], "inplace": True}
    del spec["sum"]
    with pytest.raises(bp.SpecError, match="in place overwrites sum, which this kernel does "
                                           "not take \\(it needs a sum post-op\\)"):
        bp.build(parse_spec({"kernel": [spec]}), "host", "/nonexistent-never-built",
                 log=lambda m: None)


def test_inplace_needs_one_layout():
    with pytest.raises(bp.SpecError, match="in place needs src and dst in one layout"):
        bp.build(parse_spec({"kernel": [{"op": "eltwise", "name": "x", "shape": SHAPE,
                                          "src": "nchw", "dst": "nChw16c", "inplace": True}]}),
                 "host", "/nonexistent-never-built", log=lambda m: None)
