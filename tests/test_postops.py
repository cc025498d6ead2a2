"""The post-op chain's entries: sums with their own scale, zero point and data type, several
sums, binary post-ops (add, mul, max, min, prelu with a per-tensor, per-channel or full operand)
on conv2d, matmul and Winograd conv, float32 and int8, blocked layouts with padded channels,
under all six padding policies, against numpy; what the zero-propagation derivation makes of
each entry; the argument names; the spec's refusals."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import blockpad as bp
from blockpad.check import execute
from blockpad.codegen.build import make_kernels
from blockpad.codegen.spec import parse_spec
from blockpad.runtime.cache import KernelCache
from blockpad.vocabulary import BINARY_OPERANDS, BINARY_POST_OPS, POLICIES

from .reference import conv_reference

BLK16 = {"src": "nChw16c", "weights": "OIhw16i16o", "dst": "nChw16c"}
# K = 20 output channels in 16-blocks: channels 20..31 are padding the chain must keep right
CONV = {"op": "conv2d", "shape": [1, 30, 6, 7], "channels": 20, "kernel": [3, 3],
        "pad": [1, 1], **BLK16}
MATMUL = {"op": "matmul", "shape": [7, 30], "n": 40, "src": "aB16b", "weights": "AB16b16a",
          "dst": "aB16b"}


def binary(algorithm, operand):
    return {"kind": "binary", "algorithm": algorithm, "operand": operand}


RELU = {"kind": "eltwise", "algorithm": "relu"}
# a chain that keeps padded channels zero (dst_fused computes them as they come) and one that
# does not (an explicit zero store): both must give the same numbers under every policy
KEEPS_ZERO = [binary("mul", "channel"), {"kind": "sum", "scale": 0.5},
              binary("prelu", "tensor"), binary("add", "full"), {"kind": "sum", "dt": "int32"},
              binary("max", "full")]
BREAKS_ZERO = [{"kind": "bias"}, {"kind": "sum", "scale": 2.0, "zero_point": 3},
               binary("min", "channel"), binary("add", "tensor"), RELU]
CASES = {
    "conv_keeps": {**CONV, "post_ops": KEEPS_ZERO, "sum": "nChw16c", "sum_1": "nChw16c",
                   "binary_2": "nChw16c", "binary_3": "nchw"},
    "conv_breaks": {**CONV, "post_ops": BREAKS_ZERO, "sum": "nChw16c"},
    "mm_chain": {**MATMUL, "sum": "aB16b", "binary_1": "ab",
                 "post_ops": [binary("add", "channel"), {"kind": "sum", "zero_point": -2},
                              binary("mul", "full"), binary("prelu", "channel")]},
    "u8_conv": {**CONV, "dtype": "uint8", "sum": "nChw16c", "post_ops": [
        binary("mul", "channel"), {"kind": "sum", "dt": "int32", "zero_point": 1},
        binary("max", "tensor")]},
    # q8's integer destination: the chain in float32 between the scale and the requantization,
    # a uint8 sum into an int8 destination (oneDNN's sum data type of dst's size)
    "u8_to_s8": {**CONV, "dtype": "uint8", "src_zero_point": 3, "dst_dtype": "int8",
                 "dst_scale": 0.05, "dst_zero_point": -2, "sum": "nChw16c", "post_ops": [
                     binary("add", "channel"), {"kind": "sum", "dt": "uint8", "zero_point": 128},
                     binary("prelu", "tensor")]},
    # a quantized model's residual add in the convolution: the value rounded to uint8 first,
    # then ONNX Runtime's QLinearAdd with an 8-bit addend, in either operand order
    "u8_qadd": {**CONV, "dtype": "uint8", "src_zero_point": 3, "dst_dtype": "uint8",
                "dst_zero_point": 100, "addend": "nChw16c", "post_ops": [
                    binary("mul", "channel"), RELU, {"kind": "quantized_add", "scales":
                    [0.02, 0.03, 0.045], "zero_points": [100, 7, 90], "addend_first": True}]},
    "s8_qadd": {**CONV, "dtype": "int8", "dst_dtype": "int8", "dst_scale": 0.5,
                "addend": "nChw16c", "post_ops": [{"kind": "quantized_add", "dt": "uint8",
                                                   "scales": [0.05, 0.01, 0.04],
                                                   "zero_points": [-3, 128, 5]}]},
    "s8_mm": {**MATMUL, "dtype": "int8", "weights": "BA16a16b", "binary_0": "aB16b",
              "sum": "aB16b", "sum_1": "aB16b",
              "post_ops": [binary("min", "full"), {"kind": "sum", "scale": 0.25},
                           {"kind": "sum", "dt": "int32", "zero_point": -5}]},
}


@pytest.fixture(scope="module")
def lib_dir(tmp_path_factory):
    """Every case under every policy, one library."""
    d = tmp_path_factory.mktemp("postops")
    spec = {"kernel": [{**e, "name": f"{c}_{p}", "policy": p}
                       for c, e in CASES.items() for p in POLICIES]}
    bp.build(parse_spec(spec), "host", d, log=lambda m: None)
    return str(d)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("case", CASES)
def test_every_policy_matches_numpy(lib_dir, case, policy):
    """blockpad check's harness: sources with dirty padding where the policy allows it, the
    destination NaN everywhere, guard bytes around every buffer; the result against the numpy
    reference within its error bound, the padding as the contract says."""
    runner = execute.Native(lib_dir)
    for seed in range(2):
        result = execute.run_case(0, {"name": f"{case}_{policy}"}, seed, runner)
        assert (result["status"], result["guard_bytes"]) == ("ok", 0), result["problems"]


def test_a_chain_of_transcendental_entries(tmp_path):
    """gelu, then exp of it: a vector polynomial reads its argument dozens of times, so an exp
    polynomial of the gelu's polynomial repeated the gelu in every read (with a prelu first,
    the build of this one small kernel ran past 8 minutes), and the exp was left a call, per
    lane. The chain now binds the gelu's value once before the exp (``postops.Chain``), so
    both are vector polynomials. The numbers: the checker's harness and numpy reference."""
    chain = [binary("prelu", "tensor"), {"kind": "eltwise", "algorithm": "gelu_tanh"},
             {"kind": "eltwise", "algorithm": "exp"}]
    bp.build(parse_spec({"kernel": [{**CONV, "post_ops": chain, "name": "chain"}]}), "host",
             tmp_path, log=lambda m: None)
    tir = (tmp_path / "source" / "chain.tir.py").read_text()
    assert "T.exp(" not in tir and "T.tanh(" not in tir and "post_op_" in tir
    runner = execute.Native(str(tmp_path))
    for seed in range(2):
        result = execute.run_case(0, {"name": "chain"}, seed, runner)
        assert (result["status"], result["guard_bytes"]) == ("ok", 0), result["problems"]


def test_the_chain_counts_as_polynomials_the_functions_the_schedules_expand():
    """``vocabulary.POLYNOMIALS`` (what a chain counts as many reads of its argument) and
    ``schedules.vector_math.EXPANSIONS`` (what the CPU schedules write as polynomials) name
    the same functions: one added to one side alone would copy or bind for nothing."""
    from blockpad.schedules.vector_math import EXPANSIONS
    from blockpad.vocabulary import POLYNOMIALS

    assert set(EXPANSIONS) == set(POLYNOMIALS)


def test_a_chain_whose_entries_copy_their_operand_binds_it_once(tmp_path):
    """A NaN-aware max reads its operand four times and so does the min after it: sixteen
    copies of the value before them, each a select over masked reads, and the exp's polynomial
    copied that again. TVM's simplifier walks an expression as a tree: this kernel
    (``blockpad check --target zen4 --seed 2719`` case 113) took 450 s to build. The chain now
    binds a value to a variable once where its copies would pass ``MAX_COPIES``, and the edge
    copy of the register-tiled kernel (``tile_edges``) gets variables of its own. The numbers:
    the checker's harness and numpy reference, on both copies (main tiles and the rows past
    them)."""
    entry = {"name": "k", "op": "conv2d", "shape": [2, 2, 2, 9], "channels": 23,
             "kernel": [1, 5], "src": "nchw", "weights": "oIhw8i", "dst": "nhWc4w",
             "policy": "src", "binary_0": "ncHw16h", "binary_1": "wnhC8c",
             "post_ops": [binary("max", "full"), binary("min", "full"),
                          {"kind": "eltwise", "algorithm": "exp"}]}
    bp.build(parse_spec({"kernel": [entry]}), "host", tmp_path, log=lambda m: None)
    tir = (tmp_path / "source" / "k.tir.py").read_text()
    assert "post_op_0" in tir and "dst_rows" in tir
    runner = execute.Native(str(tmp_path))
    for seed in range(2):
        result = execute.run_case(0, {"name": "k"}, seed, runner)
        assert (result["status"], result["guard_bytes"]) == ("ok", 0), result["problems"]


# ---- the chain as oneDNN's documentation writes it, on explicit numpy ------------------------

BINARY = {"add": np.add, "mul": np.multiply, "max": np.maximum, "min": np.minimum,
          "prelu": lambda v, b: np.where(v >= 0, v, v * b)}


def chain_ref(v, chain, arrays, channel):
    """``v`` (float64) through ``chain``, reading ``arrays`` by the documented tensor names:
    ``sum``, ``sum_1``, ... and ``binary_0``, ``binary_1``, ... in chain order."""
    sums, binaries = iter(["sum", "sum_1", "sum_2", "sum_3"]), iter(f"binary_{i}" for i in range(8))
    for p in chain:
        if p["kind"] == "bias":
            v = v + arrays["bias"][channel]
        elif p["kind"] == "sum":
            s = arrays[next(sums)].astype(np.float64)
            v = v + p.get("scale", 1.0) * (s - p.get("zero_point", 0))
        elif p["kind"] == "binary":
            b = arrays[next(binaries)].astype(np.float64)
            if p["operand"] != "full":     # a (1,) or (K,) operand, broadcast
                b = b[0] if p["operand"] == "tensor" else b[channel]
            v = BINARY[p["algorithm"]](v, b)
        else:
            assert p["algorithm"] == "relu"
            v = np.maximum(v, 0)
    return v


def _inputs(sig, rng):
    out = {}
    for name, role, lay, _ in sig.args:
        if role != "in":
            continue
        if lay.dtype in ("int8", "uint8", "int32"):
            out[name] = rng.integers(0 if lay.dtype == "uint8" else -8, 8, lay.shape).astype(lay.dtype)
        elif name == "scale":
            out[name] = (2.0 ** rng.integers(-3, 2, lay.shape)).astype("float32")
        else:
            out[name] = rng.standard_normal(lay.shape).astype(lay.dtype)
    return out


def _run(lib, name, arrays):
    """Run kernel ``name`` on ``arrays`` (logical arrays, or Memory objects as they are)."""
    sig = lib.kernels[name]
    mems = [a if isinstance(a, bp.Memory) else bp.Memory.from_numpy(a, lay)
            for a, lay in ((arrays[n], lay) for n, role, lay, _ in sig.args if role == "in")]
    dst = lib.memory(sig.args[-1][2])
    lib[name](*mems, dst)
    return dst


@pytest.mark.parametrize("case", ["conv_keeps", "conv_breaks", "mm_chain", "u8_conv"])
def test_dst_fused_against_the_documented_formula(lib_dir, case, rng):
    lib = bp.load(lib_dir)
    name = f"{case}_dst_fused"
    sig = lib.kernels[name]
    arrays = _inputs(sig, rng)
    x, w = arrays["src"].astype(np.float64), arrays["weights"].astype(np.float64)
    if sig.op == "matmul":
        v, channel = x @ w, (slice(None),)
    else:
        v, channel = conv_reference(x, w, sig.params), (slice(None), None, None)
    if "scale" in arrays:
        v = v * arrays["scale"][channel]
    want = chain_ref(v, CASES[case]["post_ops"], arrays, channel)
    dst = _run(lib, name, arrays)
    np.testing.assert_allclose(dst.to_numpy(), want, rtol=1e-5, atol=1e-4)
    assert dst.padding_is_zero()


# ---- Winograd conv: the same chain in its output transform ------------------------------------

WINO = {"op": "conv2d", "shape": [1, 20, 7, 9], "channels": 20, "kernel": [3, 3], "pad": [1, 1],
        "src": "nChw16c", "weights": "hwOi16o", "dst": "nChw16c", "algorithm": "winograd",
        "winograd_tile": 4, "sum": "nChw16c", "sum_1": "nChw16c", "binary_0": "nchw",
        "post_ops": [binary("add", "full"), {"kind": "sum", "zero_point": 2},
                     binary("prelu", "channel"), {"kind": "sum", "scale": 0.5},
                     binary("mul", "tensor")]}


@pytest.fixture(scope="module")
def wino_lib(tmp_path_factory):
    d = tmp_path_factory.mktemp("wino")
    spec = {"kernel": [{**WINO, "name": f"wino_{p}", "policy": p} for p in POLICIES]}
    bp.build(parse_spec(spec), "host", d, log=lambda m: None)
    return bp.load(d)


def test_winograd_chain_under_every_policy(wino_lib):
    rng = np.random.default_rng(5)
    sig = wino_lib.kernels["wino_dst_fused"]
    arrays = _inputs(sig, rng)
    w = rng.standard_normal((20, 20, 3, 3)).astype("float32")
    channel = (slice(None), None, None)
    v = conv_reference(arrays["src"].astype(np.float64), w.astype(np.float64), sig.params)
    want = chain_ref(v, WINO["post_ops"], arrays, channel)
    arrays["weights"] = wino_lib.memory(sig.args[1][2])     # Winograd-domain weights
    wino_lib[sig.params["winograd"]["weights_transform"]](w, arrays["weights"])
    outs = []
    for p in POLICIES:
        outs.append(_run(wino_lib, f"wino_{p}", arrays).to_numpy())
        np.testing.assert_allclose(outs[-1], want, rtol=1e-3, atol=1e-3, err_msg=p)
    for p, o in zip(POLICIES[1:], outs[1:]):
        np.testing.assert_array_equal(o, outs[0], err_msg=p)


# ---- what the generator derives from each entry -----------------------------------------------

def _kernel(entry, policy="dst_fused"):
    spec = {"library": {"policy": policy}, "kernel": [{**entry, "name": "k"}]}
    return make_kernels(parse_spec(spec).kernels[0])[0]


# does a padded channel stay 0 through the entry? (oneDNN's wants_zero_pad_dst, by hand)
KEEPS = {("add", "tensor"): False, ("add", "channel"): False, ("add", "full"): True,
         ("mul", "tensor"): True, ("mul", "channel"): True, ("mul", "full"): True,
         ("max", "tensor"): False, ("max", "channel"): False, ("max", "full"): True,
         ("min", "tensor"): False, ("min", "channel"): False, ("min", "full"): True,
         ("prelu", "tensor"): True, ("prelu", "channel"): True, ("prelu", "full"): True}


@pytest.mark.parametrize("algorithm", BINARY_POST_OPS)
@pytest.mark.parametrize("operand", BINARY_OPERANDS)
def test_zero_propagation_of_binary_entries(algorithm, operand):
    """Derived from the TE: v + c or max(v, c) with a per-tensor or per-channel c is c on a
    padded channel; v * c and prelu are 0; a full operand reads its own (zero) padding there."""
    for base, dst in ((CONV, "nChw16c"), (MATMUL, "aB16b")):
        entry = {**base, "post_ops": [binary(algorithm, operand)]}
        if operand == "full":
            entry["binary_0"] = dst
        writes = _kernel(entry).contract["dst_writes"]
        assert writes == ("full" if KEEPS[algorithm, operand] else "select"), (base["op"], writes)


@pytest.mark.parametrize("sum_entry,keeps", [
    ({"kind": "sum"}, True), ({"kind": "sum", "scale": 3.0}, True),
    ({"kind": "sum", "dt": "int32"}, True), ({"kind": "sum", "zero_point": 2}, False),
])
def test_zero_propagation_of_sums(sum_entry, keeps):
    """scale * (0 - zero_point) is 0 only without a zero point."""
    entry = {**CONV, "post_ops": [sum_entry], "sum": "nChw16c"}
    assert _kernel(entry).contract["dst_writes"] == ("full" if keeps else "select")


def test_arguments_name_each_tensor_in_chain_order():
    chain = [binary("add", "full"), {"kind": "sum"}, {"kind": "bias"}, binary("mul", "tensor"),
             {"kind": "sum", "dt": "int32"}, binary("prelu", "channel"), {"kind": "sum"}]
    entry = {**CONV, "post_ops": chain, "binary_0": "nchw", "sum": "nChw16c",
             "sum_1": "nChw16c", "sum_2": "nChw16c"}
    args = {a.name: a.layout for a in _kernel(entry).args}
    assert list(args) == ["src", "weights", "bias", "sum", "sum_1", "sum_2", "binary_0",
                          "binary_1", "binary_2", "dst"]
    assert (args["binary_0"].shape, args["binary_1"].shape, args["binary_2"].shape) == \
        ((1, 20, 6, 7), (1,), (20,))
    assert (args["sum_1"].dtype, args["sum"].dtype) == ("int32", "float32")


@pytest.mark.parametrize("change,message", [
    ({"post_ops": [{"kind": "sum"}] * 5}, "at most 4 'sum' post-ops"),
    ({"post_ops": [binary("add", "full")] * 9}, "at most 8 'binary' post-ops"),
    ({"post_ops": [{"kind": "sum"}, {"kind": "sum"}], "sum": "nChw16c", "sum_1": "nchw"},
     "sum_1 \\(a sum post-op\\): its layout"),
    ({"post_ops": [binary("add", "full")]}, "needs a layout for binary_0"),
    ({"post_ops": [binary("sub", "full")], "binary_0": "nchw"}, "algorithm must be one of"),
    ({"post_ops": [binary("add", "row")]}, "operand must be one of"),
    ({"post_ops": [{"kind": "sum", "zero_point": 1.5}], "sum": "nChw16c"}, "an int32 integer"),
    ({"post_ops": [{"kind": "sum", "dt": "float64"}], "sum": "nChw16c"},
     "dt must have the destination's element size \\(float32: float32, int32\\)"),
    ({"post_ops": [{"kind": "binary", "mask": 2}]}, "unknown key mask"),
    ({"post_ops": [{"kind": "quantized_add"}], "addend": "nChw16c"},
     "needs a uint8/int8 source and a dst_dtype of uint8 or int8"),
    ({"post_ops": [{"kind": "quantized_add"}, RELU], "addend": "nChw16c", "dtype": "uint8",
      "dst_dtype": "uint8"}, "'quantized_add' post-op ends the chain"),
    ({"post_ops": [{"kind": "quantized_add", "scales": [1.0, 0.0, 1.0]}], "addend": "nChw16c",
      "dtype": "uint8", "dst_dtype": "uint8"}, "scales must be three positive numbers"),
])
def test_spec_errors(change, message):
    with pytest.raises(bp.SpecError, match=message):
        _kernel({**CONV, **change})


# ---- random chains ----------------------------------------------------------------------------

@st.composite
def chains(draw):
    """A matmul with a random chain of sums and binary entries over a blocked, padded dst."""
    chain = draw(st.lists(st.one_of(
        st.builds(binary, st.sampled_from(BINARY_POST_OPS), st.sampled_from(BINARY_OPERANDS)),
        st.fixed_dictionaries({"kind": st.just("sum"), "scale": st.sampled_from([1.0, -0.5]),
                               "zero_point": st.integers(-3, 3)})), min_size=1, max_size=4))
    n = draw(st.integers(1, 20))
    entry = {"op": "matmul", "shape": [draw(st.integers(1, 5)), draw(st.integers(1, 20))],
             "n": n, "dtype": draw(st.sampled_from(["float32", "uint8"])),
             "src": "ab", "weights": draw(st.sampled_from(["ab", "BA16a16b"])),
             "dst": draw(st.sampled_from(["ab", "aB8b", "aB16b"])), "post_ops": chain,
             "policy": draw(st.sampled_from(POLICIES))}
    sums = [i for i, p in enumerate(chain) if p["kind"] == "sum"]
    for i, _ in enumerate(sums):
        entry["sum" if i == 0 else f"sum_{i}"] = entry["dst"]
    fulls = [p for p in chain if p["kind"] == "binary"]
    for i, p in enumerate(fulls):
        if p["operand"] == "full":
            entry[f"binary_{i}"] = draw(st.sampled_from(["ab", "aB8b", "ba"]))
    return entry


@given(chains())
@settings(max_examples=6, deadline=None, phases=[Phase.explicit, Phase.generate],
          suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_random_chains(tmp_path_factory, entry):
    d = tmp_path_factory.mktemp("chain")
    bp.build(parse_spec({"kernel": [{**entry, "name": "k"}]}), "host", d, log=lambda m: None)
    runner = execute.Native(str(d))
    result = execute.run_case(0, {"name": "k"}, 0, runner)
    assert (result["status"], result["guard_bytes"]) == ("ok", 0), (entry, result["problems"])


# ---- the Graph: chains whose entries name their tensors --------------------------------------

@pytest.fixture(scope="module")
def jit(tmp_path_factory):
    return bp.jit_cache(cache_dir=tmp_path_factory.getbasetemp() / "bp-jit")


def _graph(cache, policy):
    """A conv2d (20 -> 20 channels: nChw16c pads them) and a matmul (40 columns), each with
    a chain of sums and binary entries whose tensors are graph inputs."""
    g = bp.Graph(policy=policy, cache=cache)
    x, s0, s1 = g.input("x", (1, 20, 5, 6)), g.input("s0", (1, 20, 5, 6)), g.input("s1", (1, 20, 5, 6))
    full, per_k, one = g.input("full", (1, 20, 5, 6)), g.input("k", (20,)), g.input("one", (1,))
    w = g.input("w", (20, 20, 3, 3))
    y = g.conv2d(x, w, pad=1, sum=s0, name="conv", post_ops=[
        {"kind": "binary", "algorithm": "mul", "operand": per_k},
        {"kind": "sum", "scale": 0.5, "zero_point": 1, "operand": s1}, "relu",
        {"kind": "sum", "scale": 2.0},                   # sum=: the one naming no tensor
        {"kind": "binary", "algorithm": "add", "operand": full},
        {"kind": "binary", "algorithm": "prelu", "operand": one}])
    a, wm, bias = g.input("a", (3, 30)), g.input("wm", (30, 40)), g.input("bias", (40,))
    sm, cols = g.input("sm", (3, 40)), g.input("cols", (40,))
    z = g.matmul(a, wm, bias, sum=sm, name="mm", post_ops=[
        "bias", {"kind": "binary", "algorithm": "max", "operand": cols}, "sum",
        {"kind": "binary", "algorithm": "min", "operand": one}])
    g.output(y, z)
    return g


def _graph_inputs(rng):
    shapes = {"x": (1, 20, 5, 6), "s0": (1, 20, 5, 6), "s1": (1, 20, 5, 6), "full": (1, 20, 5, 6),
              "k": (20,), "one": (1,), "w": (20, 20, 3, 3), "a": (3, 30), "wm": (30, 40),
              "bias": (40,), "sm": (3, 40), "cols": (40,)}
    return {n: rng.standard_normal(s).astype("float32") for n, s in shapes.items()}


def _graph_want(v):
    conv = conv_reference(v["x"].astype(np.float64), v["w"].astype(np.float64),
                          {"stride": (1, 1), "pad": (1, 1), "dilation": (1, 1), "groups": 1})
    ch = (slice(None), None, None)
    y = conv * v["k"][ch]
    y = np.maximum(y + 0.5 * (v["s1"] - 1), 0) + 2.0 * v["s0"] + v["full"]
    y = np.where(y >= 0, y, y * v["one"][0])
    z = v["a"].astype(np.float64) @ v["wm"] + v["bias"]
    z = np.minimum(np.maximum(z, v["cols"]) + v["sm"], v["one"][0])
    return y, z


@pytest.mark.parametrize("policy", ["dst_fused", "tracked", "src"])
def test_graph_runs_chains_with_named_operands(jit, policy, rng):
    g = _graph(jit, policy)
    v = _graph_inputs(rng)
    res = g.run(**v)
    assert res.report.fallbacks == {}
    want_y, want_z = _graph_want(v)
    np.testing.assert_allclose(res["conv"].numpy(), want_y, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(res["mm"].numpy(), want_z, rtol=1e-4, atol=1e-4)


@pytest.mark.filterwarnings("ignore::blockpad.errors.FallbackWarning")   # the fallback is the point
def test_graph_numpy_fallback_runs_the_same_chains(tmp_path, rng):
    """No compiler: the graph's own numpy references (runtime/graph/ops.py) apply the chain."""
    g = _graph(KernelCache(compiler=None, cache_dir=tmp_path), "dst_fused")
    v = _graph_inputs(rng)
    res = g.run(**v)
    assert set(res.report.fallbacks.values()) == {"numpy"}
    want_y, want_z = _graph_want(v)
    np.testing.assert_allclose(res["conv"].numpy(), want_y, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(res["mm"].numpy(), want_z, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("post_ops,kw,message", [
    ([{"kind": "binary", "algorithm": "mul"}], {}, "needs its second tensor"),
    ([{"kind": "binary", "algorithm": "sub", "operand": "t"}], {}, "algorithm must be one of"),
    (["sum", "sum"], {"sum": "s"}, "post_ops has 2 that name no operand"),
    ([{"kind": "sum", "operand": "s"}], {"sum": "s"}, "post_ops has no 'sum' entry"),
    ([{"kind": "sum", "operand": "s", "zero_point": 0.5}], {}, "zero_point must be an integer"),
    ([{"kind": "binary", "operand": "bad"}], {}, "must be \\(1, 8, 4, 4\\); got \\(1, 7, 4, 4\\)"),
    ([{"kind": "binary", "operand": "k7"}], {}, "must be \\(8,\\); got \\(7,\\)"),
])
def test_graph_refuses_bad_chains(post_ops, kw, message):
    g = bp.Graph()
    x = g.input("x", (1, 8, 4, 4))
    for n, s in (("s", (1, 8, 4, 4)), ("t", (1, 8, 4, 4)), ("bad", (1, 7, 4, 4)), ("k7", (7,))):
        g.input(n, s)
    w = g.constant("w", np.ones((8, 8, 1, 1), "float32"))
    with pytest.raises(bp.ArgumentError, match=message):
        g.conv2d(x, w, post_ops=post_ops, **kw)


def test_graph_fuses_an_add_into_a_chain_with_a_binary_entry(jit, rng):
    """fuse=("eltwise", "sum"): the add becomes the chain's sum, its tensor placed before the
    binary operand (the kernel's argument order), then the relu."""
    g = bp.Graph(cache=jit, fuse=("eltwise", "sum"))
    x, t, k = g.input("x", (1, 20, 5, 6)), g.input("t", (1, 20, 5, 6)), g.input("k", (20,))
    w = g.input("w", (20, 20, 3, 3))
    y = g.conv2d(x, w, pad=1, post_ops=[{"kind": "binary", "algorithm": "mul", "operand": k}])
    g.output(g.relu(g.add(y, t), name="out"))
    v = {n: rng.standard_normal(s).astype("float32") for n, s in
         (("x", (1, 20, 5, 6)), ("t", (1, 20, 5, 6)), ("k", (20,)), ("w", (20, 20, 3, 3)))}
    res = g.run(**v)
    assert res.report.fallbacks == {} and len(res.report.fused) == 2
    conv = conv_reference(v["x"].astype(np.float64), v["w"].astype(np.float64),
                          {"stride": (1, 1), "pad": (1, 1), "dilation": (1, 1), "groups": 1})
    want = np.maximum(conv * v["k"][:, None, None] + v["t"], 0)
    np.testing.assert_allclose(res["out"].numpy(), want, rtol=1e-4, atol=1e-4)
