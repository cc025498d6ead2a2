"""eltwise and binary in every element type they accept (fp32, fp64, fp16, s8, u8, s32; bf16
in test_bf16_eltwise): a derandomized hypothesis
sample of algorithms, layouts, broadcasting and policies per type, built into one library and
checked against numpy in float64, with the padding contract and guards around the
destination. Integer kernels get inputs over the type's whole range and alpha/beta that leave it
(negative clip bounds of unsigned types too): the reference computes in float64, then rounds
half to even and saturates to the type's range, as oneDNN converts its f32 result."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import blockpad as bp

from .conftest import garbage
from .reference import ELTWISE, REFERENCES

DTYPES = ("float32", "float64", "float16", "int8", "uint8", "int32")
TAGS = ("nchw", "nhwc", "nChw8c", "nChw16c")
# relative and absolute tolerance per float type (the unit roundoff of the type, times the
# few roundings of the longest algorithm); integers are exact
TOLERANCE = {"float64": 1e-9, "float32": 2e-6, "float16": 4e-3, "bfloat16": 3e-2}
# integer eltwise: alpha and beta are half-integers (products of inputs with them are exact in
# f32, so rounding half to even is tested, not luck) and some leave the type's range
INT_ALPHA = (-300.0, -1.5, -1.0, 0.0, 0.5, 2.5)
INT_BETA = (-0.5, 2.0, 5.0, 1000.0)
GUARD = 16


@st.composite
def entries(draw, dtype):
    """One eltwise or binary kernel of ``dtype``: integers take the algorithms exact in their
    arithmetic type (relu and leaky relu, clip, linear; add, mul)."""
    shape = [draw(st.integers(1, 2)), draw(st.integers(1, 20)), draw(st.integers(1, 3)),
             draw(st.integers(1, 5))]
    entry = {"dtype": dtype, "shape": shape, "policy": draw(st.sampled_from(
        ["dst_fused", "dst_stage", "src"])), "dst": draw(st.sampled_from(TAGS))}
    if draw(st.booleans()):
        entry |= {"op": "binary", "src0": draw(st.sampled_from(TAGS)),
                  "src1": draw(st.sampled_from(TAGS)),
                  "algorithm": draw(st.sampled_from(["add", "mul"]))}
        if draw(st.booleans()):
            entry["shape1"] = [1, shape[1], 1, 1]    # a per-channel operand, broadcast
        return entry
    floats = dtype in TOLERANCE
    algorithm = draw(st.sampled_from(sorted(ELTWISE) if floats else ["relu", "clip", "linear"]))
    entry |= {"op": "eltwise", "src": draw(st.sampled_from(TAGS)), "algorithm": algorithm}
    if floats and algorithm in ("clip", "linear"):
        entry |= {"alpha": float(draw(st.integers(-3, 1))), "beta": float(draw(st.integers(2, 5)))}
    elif not floats:
        entry |= {"alpha": draw(st.sampled_from(INT_ALPHA)), "beta": draw(st.sampled_from(INT_BETA))}
    return entry


def _source(lay, rng, dirty):
    dt = bp.layout.numpy_dtype(lay.dtype)
    if dt.kind in "iu":   # the whole range: add, mul and linear overflow
        info = np.iinfo(dt)
        x = rng.integers(info.min, info.max, size=lay.shape, endpoint=True, dtype=dt)
    else:
        x = rng.standard_normal(lay.shape).astype(dt)
    mem = bp.Memory.from_numpy(x, lay)
    if dirty and lay.has_padding:   # the src policy must not trust source padding
        mem.buffer[lay.padding_offsets()] = garbage(1, lay.dtype)[0]
        mem.state = "dirty"
    return x, mem


def _check(kernel, entry, rng):
    sig = kernel.signature
    arrays, mems = [], []
    for _, _, lay, _ in sig.args[:-1]:
        x, mem = _source(lay, rng, entry["policy"] == "src")
        arrays.append(x)
        mems.append(mem)
    lay = sig.args[-1][2]
    whole = garbage(lay.alloc_len + 2 * GUARD, lay.dtype)
    dst = bp.Memory.from_buffer(whole[GUARD:-GUARD], lay)
    kernel(*mems, dst)
    want = REFERENCES[entry["op"]](entry, *arrays)
    got = dst.to_numpy().astype(np.float64)
    tol = TOLERANCE.get(lay.dtype)
    if tol is None:
        info = np.iinfo(bp.layout.numpy_dtype(lay.dtype))
        want = np.clip(np.rint(want), info.min, info.max)   # oneDNN's conversion of its result
        np.testing.assert_array_equal(got, want, err_msg=kernel.name)
    else:
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol, err_msg=kernel.name)
    bits = whole.view(np.uint8).reshape(whole.size, -1)
    assert np.all(bits[:GUARD] == 0xFF) and np.all(bits[-GUARD:] == 0xFF), \
        f"{kernel.name}: wrote outside the destination"
    contract = sig.padding
    if contract["dst_writes"] in ("full", "select") or contract["dst_stage"]:
        assert dst.padding_is_zero(), f"{kernel.name}: destination padding not zeroed"


# two examples: hypothesis tries the simplest sample first, then a random one; no shrinking
# (each step is a build): a failure reports the drawn sample as it is
@settings(max_examples=2, deadline=None, derandomize=True,
          phases=[Phase.explicit, Phase.generate],
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.tuples(*[entries(d) for d in DTYPES for _ in range(2)]))
def test_eltwise_and_binary_in_every_dtype(tmp_path_factory, sample):
    named = [{**e, "name": f"k{i}_{e['dtype']}"} for i, e in enumerate(sample)]
    d = tmp_path_factory.mktemp("dtypes")
    bp.build({"kernel": named}, "host", d, log=lambda m: None)
    lib = bp.load(d)
    rng = np.random.default_rng(0)
    for e in named:
        _check(lib[e["name"]], e, rng)


# the integer cases that code generation got wrong, every time (the sample above draws them
# only sometimes): a negative clip bound of an unsigned type, sums and products past the type's
# range, results past it, and halves (rounded to even)
SATURATING = [
    {"op": "eltwise", "dtype": "uint8", "algorithm": "clip", "alpha": -2.0, "beta": 300.0},
    {"op": "eltwise", "dtype": "uint8", "algorithm": "linear", "alpha": -1.5, "beta": 200.0},
    {"op": "eltwise", "dtype": "int8", "algorithm": "linear", "alpha": 2.5, "beta": 0.5},
    {"op": "eltwise", "dtype": "int8", "algorithm": "relu", "alpha": -1.5},
    {"op": "eltwise", "dtype": "int32", "algorithm": "linear", "alpha": 2.5, "beta": -0.5},
    {"op": "binary", "dtype": "uint8", "algorithm": "add"},
    {"op": "binary", "dtype": "int8", "algorithm": "mul"},
    {"op": "binary", "dtype": "int32", "algorithm": "add"},
    {"op": "binary", "dtype": "int32", "algorithm": "mul"},
]


# float16 exp/erf/tanh/sigmoid compute in float32 (TVM has no float16 erf: gelu_erf failed to
# build, found by blockpad check)
FLOAT16 = [{"op": "eltwise", "dtype": "float16", "algorithm": alg}
           for alg in ("gelu_erf", "gelu_tanh", "exp", "tanh", "sigmoid")]


def test_cases_that_failed_are_built_every_time(tmp_path):
    named = []
    for i, e in enumerate(SATURATING + FLOAT16):
        ports = {"src": "nChw8c"} if e["op"] == "eltwise" else {"src0": "nChw8c", "src1": "nchw"}
        named.append({**e, **ports, "name": f"k{i}_{e['dtype']}", "shape": [2, 11, 3, 5],
                      "dst": "nChw8c", "policy": "dst_fused"})
    bp.build({"kernel": named}, "host", tmp_path, log=lambda m: None)
    lib = bp.load(tmp_path)
    rng = np.random.default_rng(1)
    for e in named:
        _check(lib[e["name"]], e, rng)


def test_bf16_eltwise(tmp_path):
    """bf16 kernels take bfloat16 buffers, which numpy cannot export through DLPack (the
    runtime passes their uint16 bits as a bfloat16 view). Checked against numpy in float64 on
    the bf16 inputs, rounded to bf16 by ml_dtypes: relu exactly, sigmoid to one bf16 ulp
    (the kernel rounds its float32 result once more); plus the guards and padding contract."""
    import ml_dtypes

    entries = [{"op": "eltwise", "name": f"{alg}_bf16", "dtype": "bfloat16",
                "shape": [1, 3, 2, 2], "src": "nChw8c", "dst": dst, "algorithm": alg,
                "policy": "dst_fused"} for alg, dst in (("relu", "nChw8c"), ("sigmoid", "nchw"))]
    bp.build({"kernel": entries}, "host", tmp_path, log=lambda m: None)
    lib = bp.load(tmp_path)
    x = np.random.default_rng(0).standard_normal((1, 3, 2, 2)).astype(ml_dtypes.bfloat16)
    x64 = x.astype(np.float64)
    for entry, want in zip(entries, (np.maximum(x64, 0), 1 / (1 + np.exp(-x64)))):
        kernel = lib[entry["name"]]
        (_, _, src_l, _), (_, _, dst_l, _) = kernel.signature.args
        dst = lib.memory(dst_l)
        kernel(bp.Memory.from_numpy(x, src_l), dst)
        got = dst.to_numpy()
        assert got.dtype == np.dtype(ml_dtypes.bfloat16)
        rounded = want.astype(ml_dtypes.bfloat16).astype(np.float64)
        np.testing.assert_allclose(got.astype(np.float64), rounded,
                                   rtol=0 if entry["algorithm"] == "relu" else 2.0 ** -7,
                                   err_msg=kernel.name)
        _check(kernel, entry, np.random.default_rng(1))
