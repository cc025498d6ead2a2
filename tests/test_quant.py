"""Quantization attributes of conv2d and matmul (codegen/ops/quant.py): source and destination
zero points, per-tensor and per-channel weight scales, int32 bias, destination scale, int8 /
uint8 / int32 destinations rounded half to even and saturated.

Every result is compared for integer equality with an integer numpy reference written here
from oneDNN's definitions: int64 accumulation of the zero-point-shifted source (np.pad's zeros
after the shift: padding is the zero point), then the float32 steps in the documented order
(scale, chain, / dst_scale, rint, + dst_zero_point, saturate). Scales and float biases are
dyadic, so that whether the compiler contracts a multiply and an add into an FMA cannot change
a bit; the destination scale is not (a correctly rounded float32 division, as numpy's), and
0.5 makes exact ties, where half-to-even shows."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import blockpad as bp
from blockpad import manifest as mf
from blockpad.check.reference import saturate
from blockpad.codegen.build import make_kernels
from blockpad.codegen.spec import parse_spec
from blockpad.errors import SpecError
from blockpad.runtime.library import Signature
from blockpad.testing import qemu
from blockpad.vocabulary import POLICIES, QUANT_DEFAULTS

from .conftest import GUARD, asm_functions, garbage, kernel_instructions, policy_libraries, run_guarded

RELU = {"kind": "eltwise", "algorithm": "relu"}
INT_BIAS = {"kind": "bias", "dtype": "int32"}
HALO = {"tag": "nChw16c", "paddings": {"h": [1, 1], "w": [1, 1]}}

CASES = {
    # blocked, channel padding (30 of 32), OIhw4i16o4i, fused spatial padding, int8 out
    "blk16": {"op": "conv2d", "dtype": "uint8", "shape": [1, 30, 5, 6], "channels": 20,
              "kernel": [3, 3], "pad": [1, 1], "src": "nChw16c", "weights": "OIhw4i16o4i",
              "dst": "nChw16c", "src_zero_point": 131, "dst_dtype": "int8",
              "dst_zero_point": -5, "dst_scale": 0.5, "post_ops": [INT_BIAS, RELU]},
    # nChw8c, asymmetric pads, stride 2, per-tensor scale, uint8 out, float bias
    "blk8": {"op": "conv2d", "dtype": "int8", "shape": [2, 13, 7, 6], "channels": 10,
             "kernel": [3, 2], "stride": [2, 1], "pad": [[1, 2], [0, 1]], "src": "nChw8c",
             "weights": "OIhw4i16o4i", "dst": "nChw8c", "src_zero_point": -7,
             "scales": "tensor", "dst_dtype": "uint8", "dst_zero_point": 128,
             "dst_scale": 0.37, "post_ops": [{"kind": "bias"}]},
    # staged spatial padding, int32 out with a zero point
    "staged": {"op": "conv2d", "dtype": "uint8", "shape": [1, 17, 5, 5], "channels": 16,
               "kernel": [3, 3], "pad": [1, 1], "spatial_pad": "stage", "src": "nChw16c",
               "weights": "OIhw16i16o", "dst": "nChw16c", "src_zero_point": 200,
               "dst_dtype": "int32", "dst_zero_point": 1000, "post_ops": [INT_BIAS]},
    # a pre-padded halo (read unguarded: the compensation leaves its taps out), float32 out
    "halo": {"op": "conv2d", "dtype": "uint8", "shape": [1, 30, 5, 5], "channels": 20,
             "kernel": [3, 3], "pad": [1, 1], "src": HALO, "weights": "OIhw4i16o4i",
             "dst": "nChw16c", "src_zero_point": 9, "dst_scale": 0.25, "dst_zero_point": 3},
    # groups and dilation, plain layouts, a sum post-op of the int8 destination's type
    "groups": {"op": "conv2d", "dtype": "uint8", "shape": [1, 6, 7, 7], "channels": 4,
               "kernel": [3, 3], "pad": [2, 2], "dilation": [2, 2], "groups": 2,
               "src": "nchw", "weights": "goihw", "dst": "nchw", "sum": "nchw",
               "src_zero_point": 3, "dst_dtype": "int8", "post_ops": [{"kind": "sum"}]},
    # depthwise, stride 2: its compensation as cheap as its border
    "depthwise": {"op": "conv2d", "dtype": "uint8", "shape": [1, 20, 9, 7], "channels": 20,
                  "groups": 20, "kernel": [3, 3], "stride": [2, 2], "pad": [1, 1],
                  "src": "nChw16c", "weights": "Goihw16g", "dst": "nChw16c",
                  "src_zero_point": 100, "dst_dtype": "uint8", "dst_zero_point": 3,
                  "post_ops": [INT_BIAS]},
    "mm": {"op": "matmul", "dtype": "uint8", "shape": [6, 37], "n": 20, "src": "aB16b",
           "weights": "AB4b16a4b", "dst": "aB16b", "src_zero_point": 77, "dst_dtype": "int8",
           "dst_zero_point": 10, "dst_scale": 0.5, "post_ops": [INT_BIAS]},
    "mm_tensor": {"op": "matmul", "dtype": "int8", "shape": [5, 20], "n": 24, "src": "ab",
                  "weights": "BA16a16b", "dst": "ab", "src_zero_point": -128,
                  "scales": "tensor", "dst_dtype": "uint8", "dst_zero_point": 128,
                  "post_ops": [{"kind": "bias"}, RELU]},
    # weights blocked 8 steps a row (Ab8a), not the dot intrinsics' 4: the tensorized rules
    # took them and read the wrong bytes (blockpad check seed 20261126 case 36); a source of 3
    # channels a block, not a multiple of the 4 bytes one step reads
    "mm_rows8": {"op": "matmul", "dtype": "uint8", "shape": [13, 15], "n": 16, "src": "aB8b",
                 "weights": "Ab8a", "dst": "aB8b", "src_zero_point": 72, "scales": "tensor",
                 "dst_dtype": "int32", "dst_scale": 0.02, "dst_zero_point": -729},
    "mm_src3": {"op": "matmul", "dtype": "int8", "shape": [5, 12], "n": 16, "src": "aB3b",
                "weights": "BA16a4b", "dst": "ab"},
}
# under every policy: the cases with channel padding on both sides, and a halo
POLICY_CASES = ("blk16", "blk8", "halo", "mm")
RUNS = [("dst_fused", c) for c in CASES] + \
    [(p, c) for p in POLICIES if p != "dst_fused" for c in POLICY_CASES]


@pytest.fixture(scope="module")
def libs(tmp_path_factory):
    """One library per policy (a library's policy is one), built once for the module."""
    return policy_libraries(tmp_path_factory, "quant", CASES,
                            {p: POLICY_CASES for p in POLICIES if p != "dst_fused"})


# ---- the integer reference ----------------------------------------------------------------

def conv_int(x, w, entry):
    """Direct convolution in int64 of an already shifted source; the spatial padding np.pad
    adds is 0 after the shift, i.e. the source's zero point before it."""
    (sh, sw), (dh, dw) = entry.get("stride", [1, 1]), entry.get("dilation", [1, 1])
    pad = entry.get("pad", [0, 0])
    (pt, pb), (pl, pr) = [p if isinstance(p, list) else [p, p] for p in pad]
    g = entry.get("groups", 1)
    w = w.reshape(-1, *w.shape[-3:])          # (K, C/G, KH, KW)
    kh, kw = w.shape[2:]
    xp = np.pad(x, ((0, 0), (0, 0), (pt, pb), (pl, pr)))
    oh = (xp.shape[2] - dh * (kh - 1) - 1) // sh + 1
    ow = (xp.shape[3] - dw * (kw - 1) - 1) // sw + 1
    cg, kg = x.shape[1] // g, w.shape[0] // g
    out = np.zeros((x.shape[0], w.shape[0], oh, ow), np.int64)
    for gi in range(g):
        for i in range(kh):
            for j in range(kw):
                patch = xp[:, gi * cg:(gi + 1) * cg, i * dh:i * dh + sh * (oh - 1) + 1:sh,
                           j * dw:j * dw + sw * (ow - 1) + 1:sw]
                out[:, gi * kg:(gi + 1) * kg] += np.einsum(
                    "nchw,kc->nkhw", patch, w[gi * kg:(gi + 1) * kg, :, i, j])
    return out


def exact(entry, a):
    """The destination, bit for bit: int32 sums, then float32 in the kernel's order."""
    x = a["src"].astype(np.int64) - entry.get("src_zero_point", 0)
    w = a["weights"].astype(np.int64)
    if entry["op"] == "conv2d":
        acc, ch = conv_int(x, w, entry), (slice(None), None, None)
    else:
        acc, ch = x @ w, (slice(None),)
    assert np.abs(acc).max() < 2 ** 31          # what an int32 accumulator holds
    int_bias = "bias" in a and a["bias"].dtype == np.int32
    if int_bias:
        acc = acc + a["bias"].astype(np.int64)[ch]
    v = acc.astype(np.float32) * a["scale"][ch]
    for p in entry.get("post_ops", []):
        if p["kind"] == "bias" and not int_bias:
            v = v + a["bias"][ch]
        elif p["kind"] == "sum":
            v = v + np.float32(p.get("scale", 1.0)) * a["sum"].astype(np.float32)
        elif p["kind"] == "eltwise":
            v = np.maximum(v, np.float32(0))
    v = v / np.float32(entry.get("dst_scale", 1.0))
    dtype, zp = entry.get("dst_dtype", "float32"), entry.get("dst_zero_point", 0)
    if dtype == "float32":
        return v + np.float32(zp)
    return saturate(np.rint(v), dtype, zp).astype(dtype)


def inputs(kernel, rng, spread=6) -> dict:
    """Full-range integer sources and weights; dyadic scales (2**-spread .. 2**-(spread-3)),
    float biases in quarters, int32 biases of the accumulator's size. ``kernel``: a loaded
    kernel or its signature."""
    out = {}
    for name, role, lay, _ in getattr(kernel, "signature", kernel).args:
        if role != "in":
            continue
        dt = np.dtype(lay.dtype)
        if name == "scale":
            out[name] = (2.0 ** -rng.integers(spread - 3, spread + 1, lay.shape)).astype(dt)
        elif name == "bias" and dt == np.float32:
            out[name] = (rng.integers(-400, 400, lay.shape) / 4).astype(dt)
        elif name == "bias":
            out[name] = rng.integers(-20000, 20000, lay.shape).astype(dt)
        else:
            info = np.iinfo(dt)
            out[name] = rng.integers(info.min, int(info.max) + 1, lay.shape).astype(dt)
    return out


def run(kernel, policy, arrays):
    """Call ``kernel`` on Memory objects (dirty source padding under ``src``: all ones) into
    a guarded destination full of all-ones bytes; the destination and its buffer."""
    dst, whole = run_guarded(kernel, arrays, policy)
    lay = dst.layout
    guard = garbage(GUARD, lay.dtype).view(np.uint8)
    assert np.array_equal(whole[:GUARD].view(np.uint8), guard) and \
        np.array_equal(whole[-GUARD:].view(np.uint8), guard), "wrote outside dst"
    return dst, whole[GUARD:-GUARD]


# ---- results -------------------------------------------------------------------------------

@pytest.mark.parametrize("policy,case", RUNS)
def test_exact_under_every_policy(libs, policy, case, rng):
    kernel, entry = libs[policy][case], CASES[case]
    arrays = inputs(kernel, rng)
    dst, buf = run(kernel, policy, arrays)
    want = exact(entry, arrays)
    got = dst.to_numpy()
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(got, want)
    c, lay = kernel.signature.padding, dst.layout
    if lay.has_padding and (c["dst_writes"] in ("full", "select") or c["dst_stage"]):
        # oneDNN writes zeros into a blocked destination's padding, not the zero point
        assert not buf[lay.padding_offsets()].any(), "destination padding not zero"


@pytest.mark.parametrize("case,spread", [("blk16", 4), ("blk16", 9), ("mm", 3), ("mm", 9),
                                         ("blk8", 5), ("mm_tensor", 2), ("mm_tensor", 12)])
def test_saturates_at_both_ends_and_rounds_half_to_even(libs, case, spread):
    """Large scales push the rounded values past both ends of the destination type (the
    kernel must clamp, not wrap); small ones leave exact ties (dst_scale 0.5 of an odd sum),
    which half-to-even rounds to the even neighbour."""
    kernel, entry = libs["dst_fused"][case], CASES[case]
    arrays = inputs(kernel, np.random.default_rng(spread), spread)
    want = exact(entry, arrays)
    np.testing.assert_array_equal(kernel_result(kernel, arrays), want)
    info = np.iinfo(want.dtype)
    if spread <= 5 and entry["dst_dtype"] != "int32":
        hit = {info.min, info.max} if not any(p == RELU for p in entry["post_ops"]) else \
            {info.max}
        assert hit <= set(np.unique(want).tolist()), "no saturation drawn: the test is moot"


def kernel_result(kernel, arrays):
    return run(kernel, "dst_fused", arrays)[0].to_numpy()


def test_ties_round_half_to_even(libs):
    """scale 1/4 and dst_scale 1/2 make acc / 2: a tie wherever acc is odd, which must go to
    the even neighbour (2.5 -> 2, -1.5 -> -2), before the zero point is added."""
    kernel, entry = libs["dst_fused"]["mm"], CASES["mm"]
    rng = np.random.default_rng(3)
    arrays = inputs(kernel, rng)
    arrays["src"] = (entry["src_zero_point"] + rng.integers(-3, 4, (6, 37))).astype(np.uint8)
    arrays["weights"] = rng.integers(-3, 4, (37, 20)).astype(np.int8)
    arrays["scale"][:], arrays["bias"][:] = 0.25, 0
    got = kernel_result(kernel, arrays).astype(np.int64) - entry["dst_zero_point"]
    acc = (arrays["src"].astype(np.int64) - entry["src_zero_point"]) @ \
        arrays["weights"].astype(np.int64)
    half = acc // 2                      # the tie's lower neighbour
    even = np.where(half % 2 == 0, half, half + 1)
    tie = (acc % 2 == 1) & (np.abs(acc) < 200)     # within int8 after the zero point
    assert tie.sum() > 10
    np.testing.assert_array_equal(got[tie], even[tie])


# ---- the padding contract with zero points ------------------------------------------------

def test_zero_point_padding_is_the_zero_point(libs):
    """All sources equal to the zero point: every tap, in the image or in the padding (halo,
    padded channels), contributes 0, so the result is the bias alone everywhere, the border
    too, under fused, staged and pre-padded spatial padding."""
    for case in ("blk16", "staged", "halo", "groups", "depthwise"):
        kernel, entry = libs["dst_fused"][case], CASES[case]
        arrays = inputs(kernel, np.random.default_rng(1))
        arrays["src"][:] = entry["src_zero_point"]
        got = kernel_result(kernel, arrays)
        np.testing.assert_array_equal(got, exact(entry, arrays))
        assert len(np.unique(got[:, 0])) == 1 or "sum" in entry, case   # border = interior


def test_the_manifest_records_the_attributes(libs):
    """A kernel's manifest entry names the attributes that differ from their defaults (the
    Graph's kernel cache matches requests against it)."""
    params = libs["dst_fused"]["blk8"].signature.params
    assert {k: params[k] for k in ("src_zero_point", "scales", "dst_dtype", "dst_zero_point",
                                   "dst_scale")} == \
        {"src_zero_point": -7, "scales": "tensor", "dst_dtype": "uint8", "dst_zero_point": 128,
         "dst_scale": 0.37}
    assert "dst_scale" not in libs["dst_fused"]["mm_tensor"].signature.params   # 1.0


def test_compensation_is_computed_in_the_kernel():
    """The kernel takes no compensation argument: it reduces its own weights (zp_wsum,
    zp_comp stages), and only when the source has a zero point."""
    with_zp = _kernels(CASES["blk16"])[0]
    assert [a.name for a in with_zp.args] == ["src", "weights", "scale", "bias", "dst"]
    script = with_zp.func.script()
    assert 'T.sblock("zp_wsum")' in script and 'T.sblock("zp_comp")' in script
    # one row and column per border class (top, interior, bottom), not per output pixel
    assert 'zp_comp = T.sblock_alloc_buffer((3, 3, 32), "int32")' in script
    plain = _kernels({**CASES["blk16"], "src_zero_point": 0})[0]
    assert "zp_comp" not in plain.func.script()


def test_the_reduction_walks_the_weights_in_their_order():
    """DotTiled reduces a block of 16 channels inside the taps, as ``OIhw4i16o4i`` lies (block,
    kh, kw, 4 steps of 4), not every channel inside each tap: that order jumped kh x kw rows of
    weights per block, and a network's layer4 weights, coming from memory, arrived one miss at a
    time (int8 ResNet-50 layer4 3x3: 0.77-0.89 -> 0.62-0.70 ms in the network)."""
    from blockpad.codegen.targets import get_target
    from blockpad.schedules import RULES
    from blockpad.schedules.dot_tiled import DotTiled
    from blockpad.schedules.rule import first_match

    entry = {"op": "conv2d", "dtype": "uint8", "shape": [1, 64, 7, 7], "channels": 32,
             "kernel": [3, 3], "pad": [1, 1], "src": "nChw16c", "weights": "OIhw4i16o4i",
             "dst": "nChw16c", "dst_dtype": "int8"}
    rule, sch = first_match(RULES["x86"], _kernels(entry)[0].func, get_target("avx512-vnni"))
    assert isinstance(rule, DotTiled)
    step = next(b for b in ("acc_update_o", "acc_update") if b in sch.mod["main"].script())
    extents = [int(sch.get(loop).extent) for loop in sch.get_loops(sch.get_sblock(step))]
    # ... 4 blocks of 16 channels, (the unit group dim), kh, kw, 4 steps of 4, then the tile
    assert [e for e in extents if e != 1][-6:-2] == [4, 3, 3, 4]


def test_destination_zero_point_breaks_zero_propagation():
    """dst_fused stores explicit zeros in the padded channels (select) once a zero point or a
    source compensation would leave something else there; without them the output scale and
    relu keep zeros, as before."""
    base = {**CASES["blk16"], "src_zero_point": 0, "dst_zero_point": 0, "post_ops": [RELU],
            "dst_dtype": "float32", "dst_scale": 1.0}
    assert _kernels(base)[0].contract["dst_writes"] == "full"
    assert _kernels({**base, "dst_zero_point": 3})[0].contract["dst_writes"] == "select"
    assert _kernels({**base, "src_zero_point": 3})[0].contract["dst_writes"] == "select"


# ---- spec errors ----------------------------------------------------------------------------

@pytest.mark.parametrize("change,message", [
    ({"dtype": "float32", "weights": "OIhw16i16o", "src_zero_point": 1}, "need a uint8 or int8"),
    ({"src_zero_point": 2 ** 24}, "cannot overflow"),   # 128 x 2**24 = 2**31: no taps fit
    ({"src_zero_point": 1.5}, "src_zero_point"),
    ({"dst_zero_point": 200}, "dst_zero_point"),       # int8 destination
    ({"dst_scale": 0.0}, "dst_scale"),
    ({"scales": "group"}, "scales"),
    ({"dst_dtype": "float16"}, "dst_dtype"),
    ({"post_ops": [RELU, INT_BIAS]}, r"must be post_ops\[0\]"),
    ({"post_ops": [{"kind": "bias", "dtype": "int8"}]}, "dtype"),
])
def test_bad_attributes_are_spec_errors(change, message):
    with pytest.raises(SpecError, match=message):
        parse_spec({"kernel": [{**CASES["blk16"], **change}]})


def _kernels(entry, policy="dst_fused"):
    req = parse_spec({"kernel": [{**entry, "policy": policy}]}).kernels[0]
    return make_kernels(req)


# ---- shapes ---------------------------------------------------------------------------------

@st.composite
def quant_convs(draw):
    """A small integer convolution: odd channels, pads up to the kernel's reach, blocked or
    plain, a zero point on each side, each destination type."""
    kh, kw = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    dst_dtype = draw(st.sampled_from(["float32", "int32", "int8", "uint8"]))
    lo, hi = {"int8": (-128, 127), "uint8": (0, 255)}.get(dst_dtype, (-1000, 1000))
    src_dtype = draw(st.sampled_from(["uint8", "int8"]))
    zlo, zhi = (0, 255) if src_dtype == "uint8" else (-128, 127)
    blocked = draw(st.booleans())
    return {"op": "conv2d", "dtype": src_dtype, "shape": [1, draw(st.integers(1, 20)),
                                                          draw(st.integers(1, 6)),
                                                          draw(st.integers(1, 6))],
            "channels": draw(st.integers(1, 20)), "kernel": [kh, kw],
            "stride": [draw(st.integers(1, 2)), 1],
            "pad": [draw(st.integers(0, kh - 1)), draw(st.integers(0, kw - 1))],
            "spatial_pad": draw(st.sampled_from(["fused", "stage"])),
            "src": "nChw8c" if blocked else "nchw",
            "weights": "OIhw4i16o4i" if blocked else "oihw",
            "dst": draw(st.sampled_from(["nchw", "nChw16c"])),
            "src_zero_point": draw(st.integers(zlo, zhi)),
            "scales": draw(st.sampled_from(["channel", "tensor"])),
            "dst_dtype": dst_dtype, "dst_zero_point": draw(st.integers(lo, hi)),
            "dst_scale": draw(st.sampled_from([1.0, 0.5, 0.3])),
            "post_ops": draw(st.sampled_from([[], [INT_BIAS], [{"kind": "bias"}, RELU]]))}


@settings(max_examples=6, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(entry=quant_convs(), policy=st.sampled_from(POLICIES))
def test_random_shapes(tmp_path_factory, entry, policy):
    """Random geometry, zero points, scales and destination types, one library for the draw
    (6 draws: each is a compile)."""
    d = tmp_path_factory.mktemp("quant-shapes")
    bp.build(parse_spec({"library": {"policy": policy}, "kernel": [{**entry, "name": "q"}]}),
             "host", d, log=lambda m: None)
    kernel = bp.load(d)["q"]
    arrays = inputs(kernel, np.random.default_rng(0))
    dst, _ = run(kernel, policy, arrays)
    np.testing.assert_array_equal(dst.to_numpy(), exact(entry, arrays))


# ---- aarch64 (sdot) -------------------------------------------------------------------------

DOTPROD = {
    "conv_sdot": {"op": "conv2d", "dtype": "int8", "shape": [1, 30, 5, 6], "channels": 10,
                  "kernel": [3, 3], "pad": [1, 1], "src": "nChw4c", "weights": "OIhw4o4i",
                  "dst": "nChw4c", "src_zero_point": -9, "dst_dtype": "int8",
                  "dst_zero_point": 4, "dst_scale": 0.5, "post_ops": [INT_BIAS, RELU]},
    "mm_sdot": {"op": "matmul", "dtype": "int8", "shape": [5, 30], "n": 30, "src": "ab",
                "weights": "BA4b4a", "dst": "ab", "src_zero_point": 17, "scales": "tensor",
                "dst_dtype": "uint8", "dst_zero_point": 128, "post_ops": [{"kind": "bias"}]},
}


@pytest.mark.skipif(bool(qemu.missing_tools()), reason="runs aarch64 code under qemu; this "
                    "machine lacks: " + "; ".join(qemu.missing_tools()))
def test_neon_dotprod_sdot_tiles_are_exact(tmp_path, rng):
    """The attributes live in the epilogue and the compensation stages, so ``sdot`` register
    tiles still take the dot product (s8 x s8: the zero point of an s8 source), under
    qemu-aarch64, bit for bit."""
    bp.build(parse_spec({"kernel": [{**e, "name": n} for n, e in DOTPROD.items()]}),
             "neon-dotprod", tmp_path, log=lambda m: None)
    funcs = asm_functions(tmp_path)
    sigs = {k["name"]: Signature(k) for k in mf.read(str(tmp_path))["kernels"]}
    calls, checks = [], []
    for name, entry in DOTPROD.items():
        assert any("sdot" in line for line in kernel_instructions(funcs, name)), name
        sig = sigs[name]
        arrays = inputs(sig, rng)
        args = [bp.Memory.from_numpy(arrays[a], lay) for a, _, lay, _ in sig.args[:-1]]
        dst = bp.Memory(sig.args[-1][2], garbage(sig.args[-1][2].alloc_len, sig.args[-1][3]))
        calls.append((name, [*args, dst]))
        checks.append((entry, arrays, dst))
    qemu.run_many(tmp_path, calls)
    for entry, arrays, dst in checks:
        np.testing.assert_array_equal(dst.to_numpy(), exact(entry, arrays))


# ---- bp.Graph -------------------------------------------------------------------------------

def test_graph_takes_the_attributes_and_int8_stays_int8(tmp_path_factory):
    """``Graph.conv2d`` / ``Graph.matmul`` take the kernels' attribute names: a uint8 image
    through a conv into int8 (its int32 bias selected by the bias's dtype), that int8 into a
    second conv (its zero point the first's destination zero point) into uint8, and an int8
    matmul with a per-tensor scale into int32; blocked kernels (no numpy fallback), equal to
    the integer reference."""
    rng = np.random.default_rng(5)
    g = bp.Graph(cache=bp.jit_cache(cache_dir=tmp_path_factory.mktemp("bp-jit")))
    e1 = {"op": "conv2d", "pad": [1, 1], "src_zero_point": 9, "dst_dtype": "int8",
          "dst_zero_point": -4, "dst_scale": 0.5, "post_ops": [INT_BIAS, RELU]}
    e2 = {"op": "conv2d", "stride": [2, 2], "src_zero_point": -4, "dst_dtype": "uint8",
          "dst_zero_point": 120}
    e3 = {"op": "matmul", "src_zero_point": 3, "scales": "tensor", "dst_dtype": "int32"}
    a = {"x": rng.integers(0, 256, (1, 20, 5, 6)).astype(np.uint8),
         "w1": rng.integers(-128, 128, (24, 20, 3, 3)).astype(np.int8),
         "s1": (2.0 ** -rng.integers(8, 11, 24)).astype(np.float32),
         "b1": rng.integers(-9000, 9000, 24).astype(np.int32),
         "w2": rng.integers(-128, 128, (10, 24, 1, 1)).astype(np.int8),
         "s2": (2.0 ** -rng.integers(5, 8, 10)).astype(np.float32),
         "m": rng.integers(-128, 128, (7, 33)).astype(np.int8),
         "wm": rng.integers(-128, 128, (33, 12)).astype(np.int8),
         "sm": np.array([0.125], np.float32)}
    x, m = g.input("x", a["x"].shape, "uint8"), g.input("m", a["m"].shape, "int8")
    c = {n: g.constant(n, a[n]) for n in ("w1", "s1", "b1", "w2", "s2", "wm", "sm")}
    attrs = lambda e: {k: e[k] for k in QUANT_DEFAULTS if k in e}  # noqa: E731
    y1 = g.conv2d(x, c["w1"], bias=c["b1"], pad=1, post_ops=["relu"], scale=c["s1"],
                  **attrs(e1))
    y2 = g.conv2d(y1, c["w2"], stride=2, scale=c["s2"], **attrs(e2))
    y3 = g.matmul(m, c["wm"], scale=c["sm"], **attrs(e3))
    assert (y1.dtype, y2.dtype, y3.dtype) == ("int8", "uint8", "int32")
    g.output(y2, y3)
    res = g.run(x=a["x"], m=a["m"])
    assert not res.report.fallbacks
    want1 = exact(e1, {"src": a["x"], "weights": a["w1"], "scale": a["s1"], "bias": a["b1"]})
    want2 = exact(e2, {"src": want1, "weights": a["w2"], "scale": a["s2"]})
    want3 = exact(e3, {"src": a["m"], "weights": a["wm"], "scale": a["sm"]})
    np.testing.assert_array_equal(res[y2.name].numpy(), want2)
    np.testing.assert_array_equal(res[y3.name].numpy(), want3)


def test_graph_refuses_attributes_on_float_and_an_integer_source_without_scale():
    g = bp.Graph()
    x, w = g.input("x", (1, 4, 3, 3)), g.constant("w", np.ones((2, 4, 1, 1), np.float32))
    with pytest.raises(bp.ArgumentError, match="uint8/int8 source"):
        g.conv2d(x, w, src_zero_point=3)
    q = g.input("q", (1, 4, 3, 3), "uint8")
    with pytest.raises(bp.ArgumentError, match="needs scale="):
        g.conv2d(q, g.constant("w8", np.ones((2, 4, 1, 1), np.int8)))
    # an int32 bias goes on the int32 accumulator: after a relu it would mean something else
    with pytest.raises(bp.ArgumentError, match="put 'bias' first"):
        g.conv2d(q, g.constant("w9", np.ones((2, 4, 1, 1), np.int8)),
                 bias=g.constant("b9", np.ones(2, np.int32)), post_ops=["relu", "bias"],
                 scale=g.constant("s9", np.ones(2, np.float32)))


@pytest.mark.filterwarnings("ignore::blockpad.errors.FallbackWarning")   # the fallback is the point
def test_graph_numpy_reference_refuses_an_integer_chain_it_cannot_run(tmp_path):
    """With no compiler the graph runs integer convs and matmuls in numpy, which takes an int32
    bias and a closing quantized add, nothing else: a relu after an integer matmul is refused,
    never silently dropped (it was, for matmul)."""
    from blockpad.runtime.cache import KernelCache
    g = bp.Graph(cache=KernelCache(compiler=None, cache_dir=tmp_path))
    m = g.input("m", (3, 8), "int8")
    y = g.matmul(m, g.constant("wm", np.ones((8, 4), np.int8)),
                 scale=g.constant("sm", np.array([0.5], np.float32)), scales="tensor",
                 post_ops=["relu"])
    g.output(y)
    with pytest.raises(bp.ArgumentError, match="int32 bias and a quantized add, no other post-op"):
        g.run(m=np.ones((3, 8), np.int8))


def test_float_rounding_equals_the_integer_one():
    """``round_clamped_float`` (the requantized value a quantized add reads, kept in float32)
    against numpy's rint of the clamped value plus the offset: ties both ways, both ends,
    vectorized as an epilogue is (the sum goes through its bits, so neither TVM nor LLVM may
    fold ``(x + M) - M`` back into ``x``)."""
    import tvm
    from tvm import te

    from blockpad.codegen.ops.common import round_clamped_float

    lo, hi, offset = -117.0, 138.0, 117
    x = te.placeholder((64,), "float32", name="x")
    y = te.compute((64,), lambda i: round_clamped_float(x[i] + 0.0, lo, hi, offset), name="y")
    sch = tvm.s_tir.Schedule(te.create_prim_func([x, y]))
    sch.vectorize(sch.get_loops(sch.get_sblock("y"))[0])
    f = tvm.compile(sch.mod, target="llvm")["main"]
    vals = np.array([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 137.5, 138.4, 139.0, -117.5, -1e9, 1e9,
                     3.49999976, -3.50000024, 0.0, -0.0] * 4, np.float32)
    out = tvm.runtime.tensor(np.zeros(64, np.float32))
    f(tvm.runtime.tensor(vals), out)
    want = np.rint(np.clip(vals, lo, hi)) + offset
    np.testing.assert_array_equal(out.numpy(), want.astype(np.float32))
    with pytest.raises(ValueError, match="float32 within 2\\*\\*22"):
        round_clamped_float(tvm.tirx.Var("v", "float32"), -2.0 ** 31, 2.0 ** 31)
