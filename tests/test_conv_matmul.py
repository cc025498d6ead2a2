"""Convolution and matmul with fused post-ops: numpy references over blocked and plain layouts,
odd channel counts, groups, depthwise, dilation, strides, int8; the padding contract the
generator derives; the destination padding each policy promises; the x86 register-tiled rule."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from scipy.special import expit

import blockpad as bp
from blockpad import machine
from blockpad.codegen.build import make_kernels
from blockpad.codegen.spec import parse_spec
from blockpad.codegen.targets import get_target
from blockpad.schedules.register_tiled import RegisterTiled
from blockpad.schedules.register_tiled import _schedule as rule_schedule

from .conftest import (
    asm_functions,
    assert_padding_contract,
    garbage,
    kernel_instructions,
    policy_libraries,
    run_guarded,
    run_in_pool,
)

RELU = {"kind": "eltwise", "algorithm": "relu"}
SIGMOID = {"kind": "eltwise", "algorithm": "sigmoid"}
BLK16 = {"src": "nChw16c", "weights": "OIhw16i16o", "dst": "nChw16c"}

CASES = {
    "blk16_chain": {"op": "conv2d", "shape": [2, 30, 7, 9], "channels": 20, "kernel": [3, 3],
                    "pad": [1, 1], **BLK16, "sum": "nChw16c",
                    "post_ops": [{"kind": "bias"}, RELU, {"kind": "sum", "scale": 0.5}]},
    "blk8_7x7s2": {"op": "conv2d", "shape": [1, 3, 11, 10], "channels": 20, "kernel": [7, 7],
                   "stride": [2, 2], "pad": [3, 3], "src": "nChw8c", "weights": "OIhw8i8o",
                   "dst": "nChw8c", "sum": "nChw8c", "post_ops": [{"kind": "sum"}, SIGMOID]},
    # the blocks the graph changes between on Zen 4 (channel_blocks): into nChw8c where 16
    # would pad 24 channels to 32, and out of it
    "to_8c": {"op": "conv2d", "shape": [1, 40, 5, 9], "channels": 24, "src": "nChw16c",
              "weights": "OIhw16i8o", "dst": "nChw8c", "sum": "nChw8c",
              "post_ops": [{"kind": "bias"}, {"kind": "sum"}]},
    "from_8c": {"op": "conv2d", "shape": [1, 24, 6, 7], "channels": 37, "kernel": [3, 3],
                "pad": [1, 1], "src": "nChw8c", "weights": "OIhw8i16o", "dst": "nChw16c",
                "post_ops": [{"kind": "bias"}, RELU]},
    # 170 channels: a 3x3 reduces over all 176 of the blocks (170 would save under 5%:
    # reduced_channels), so the source's padding must hold zeros (garbage under "src")
    "whole_blocks_3x3": {"op": "conv2d", "shape": [1, 170, 4, 5], "channels": 20,
                         "kernel": [3, 3], "pad": [1, 1], **BLK16, "post_ops": [RELU]},
    "plain_dilated": {"op": "conv2d", "shape": [1, 5, 9, 8], "channels": 6, "kernel": [3, 3],
                      "pad": [2, 2], "dilation": [2, 2], "src": "nchw", "weights": "oihw",
                      "dst": "nchw", "post_ops": [{"kind": "eltwise", "algorithm": "linear",
                                                   "alpha": 2.0, "beta": 1.0}, {"kind": "bias"}]},
    "nhwc": {"op": "conv2d", "shape": [1, 30, 6, 6], "channels": 16, "kernel": [3, 3],
             "pad": [1, 1], "src": "nhwc", "weights": "OIhw16i16o", "dst": "nhwc"},
    "groups2": {"op": "conv2d", "shape": [1, 30, 7, 7], "channels": 20, "kernel": [3, 3],
                "pad": [1, 1], "groups": 2, "src": "nChw16c", "weights": "gOIhw8i8o",
                "dst": "nChw16c", "post_ops": [RELU]},
    "depthwise": {"op": "conv2d", "shape": [1, 30, 9, 9], "channels": 30, "kernel": [3, 3],
                  "stride": [2, 2], "pad": [1, 1], "groups": 30, "src": "nChw16c",
                  "weights": "Goihw16g", "dst": "nChw16c", "post_ops": [{"kind": "bias"}]},
    "u8_blocked": {"op": "conv2d", "dtype": "uint8", "shape": [1, 30, 6, 7], "channels": 20,
                   "kernel": [3, 3], "pad": [1, 1], **BLK16, "post_ops": [{"kind": "bias"}]},
    "u8_downsample": {"op": "conv2d", "dtype": "uint8", "shape": [1, 64, 7, 9], "channels": 20,
                      "stride": [2, 2], "src": "nChw16c", "weights": "OIhw4i16o4i",
                      "dst": "nChw16c", "post_ops": [{"kind": "bias"}]},
    "s8_plain": {"op": "conv2d", "dtype": "int8", "shape": [1, 3, 5, 5], "channels": 5,
                 "kernel": [3, 3], "src": "nchw", "weights": "oihw", "dst": "nchw",
                 "post_ops": [RELU]},
    "f16_blocked": {"op": "conv2d", "dtype": "float16", "shape": [1, 20, 5, 6], "channels": 24,
                    "kernel": [3, 3], "pad": [1, 1], **BLK16, "post_ops": [{"kind": "bias"}, RELU]},
    "prepadded": {"op": "conv2d", "shape": [1, 30, 7, 7], "channels": 20, "kernel": [3, 3],
                  "pad": [1, 1], "src": {"tag": "nChw16c", "paddings": {"h": [1, 1], "w": [1, 1]}},
                  "weights": "OIhw16i16o", "dst": "nChw16c"},
    "staged": {"op": "conv2d", "shape": [1, 30, 7, 7], "channels": 20, "kernel": [3, 3],
               "pad": [1, 1], "spatial_pad": "stage", **BLK16, "post_ops": [SIGMOID]},
    "ow_tail": {"op": "conv2d", "shape": [1, 16, 5, 13], "channels": 16, "kernel": [3, 3],
                "pad": [1, 1], **BLK16},
    # 34 KiB of weights a panel: the channels reduced in passes (register_tiled.chunk_plan),
    # 7 columns in tiles of 4, 20 output channels (padding in the last block), a sum
    "chunked_1x1": {"op": "conv2d", "shape": [1, 544, 5, 7], "channels": 20, **BLK16,
                    "sum": "nChw16c",
                    "post_ops": [{"kind": "bias"}, RELU, {"kind": "sum", "scale": 0.5}]},
    # a ResNet downsample: 1x1, stride 2, read from a dense copy of every other row and column
    # (halo.subsampled_source); odd rows and columns, 20 of 32 output channels, a sum
    "downsample_1x1": {"op": "conv2d", "shape": [1, 30, 9, 11], "channels": 20, "stride": [2, 2],
                       **BLK16, "sum": "nChw16c",
                       "post_ops": [{"kind": "bias"}, {"kind": "sum"}, RELU]},
    # three output-channel blocks: tiles of all three (Config.mu = 3), 9 columns in tiles of 4
    "three_blocks": {"op": "conv2d", "shape": [1, 30, 5, 9], "channels": 47, "kernel": [3, 3],
                     "pad": [1, 1], **BLK16, "post_ops": [{"kind": "bias"}, RELU]},
    # five output-channel blocks: tiles of two, the fifth block cut off into a part of its own
    # (tile_edges.edge_parts), 70 of 80 channels; chunked passes over 544 input channels
    "five_blocks": {"op": "conv2d", "shape": [1, 544, 5, 7], "channels": 70, **BLK16,
                    "sum": "nChw16c", "post_ops": [{"kind": "bias"}, {"kind": "sum"}, RELU]},
    "mm_packed": {"op": "matmul", "shape": [10, 30], "n": 20, "src": "ab", "weights": "BA16a16b",
                  "dst": "ab", "post_ops": [{"kind": "bias"}, RELU]},
    "mm_blocked": {"op": "matmul", "shape": [7, 30], "n": 40, "src": "aB16b",
                   "weights": "AB16b16a", "dst": "aB16b", "sum": "aB16b",
                   "post_ops": [SIGMOID, {"kind": "sum", "scale": 2.0}]},
    "mm_inner_product": {"op": "matmul", "shape": [7, 13], "n": 34, "src": "ab", "weights": "ba",
                         "dst": "ab", "post_ops": [{"kind": "eltwise", "algorithm": "relu",
                                                    "alpha": 0.1}]},
    "mm_u8": {"op": "matmul", "dtype": "uint8", "shape": [6, 64], "n": 32, "src": "ab",
              "weights": "AB4b16a4b", "dst": "ab", "post_ops": [{"kind": "bias"}]},
    "mm_s8": {"op": "matmul", "dtype": "int8", "shape": [5, 20], "n": 24, "src": "ab",
              "weights": "BA16a16b", "dst": "aB16b"},
}
POLICY_CASES = {   # the policies beside dst_fused, on the cases where they differ most
    "dst_stage": ["blk16_chain", "groups2", "u8_blocked", "mm_blocked"],
    "on_handle": ["blk16_chain", "mm_blocked"],
    "src": ["blk16_chain", "blk8_7x7s2", "groups2", "u8_blocked", "mm_blocked", "mm_u8",
            "chunked_1x1", "downsample_1x1", "five_blocks", "whole_blocks_3x3"],
}
RUNS = [("dst_fused", c) for c in CASES] + [(p, c) for p, cs in POLICY_CASES.items() for c in cs]


@pytest.mark.parametrize("c,taps,step,reduced", [
    (24, 9, 8, 24), (164, 1, 8, 168), (164, 9, 8, 176), (450, 9, 8, 464), (450, 1, 8, 456),
    (40, 9, 8, 40), (41, 1, 1, 41), (213, 1, 1, 213), (164, 9, 1, 164), (450, 9, 1, 464)])
def test_a_kernel_of_several_taps_reduces_over_whole_blocks_where_its_channels_save_little(
        c, taps, step, reduced):
    """``reduced_channels``: the logical channels rounded up to ``step`` (41 on nChw16c: 7
    zeros of 48 a pixel; 24 rounded to 8: a third of the work), but whole blocks for a kernel
    of several taps where they add under 5% (its passes walked each tap's weights half a
    block at a time: 450 -> 334 3x3 1.454 -> 1.282 ms in the pruned ResNet-50, Zen 4)."""
    from blockpad.codegen.ops.common import reduced_channels

    src = bp.Layout("nChw16c", (1, c, 7, 7))
    weights = bp.Layout("OIhw16i16o", (32, c, 3, 3))
    assert reduced_channels(c, src, weights, step, taps) == reduced


@pytest.fixture(scope="module")
def libs(tmp_path_factory):
    """One library per policy: every case under dst_fused, a few under the others."""
    return policy_libraries(tmp_path_factory, "conv", CASES, POLICY_CASES)


# Shapes that whole AVX-512 tiles (8 x 32, 8 x 16 x 2 blocks) do not cover: the rule cuts the
# last rows and columns off into kernels of their own, and peels k's tail off the unrolled loop.
ODD_CASES = {
    "mm_odd": {"op": "matmul", "shape": [19, 37], "n": 40, "src": "ab", "weights": "Ba16b",
               "dst": "ab", "post_ops": [{"kind": "bias"}, RELU]},
    "mm_odd_plain": {"op": "matmul", "shape": [19, 37], "n": 40, "src": "ab", "weights": "ba",
                     "dst": "ab"},
    "conv_ow_tail": CASES["ow_tail"],
    "conv_three_blocks": CASES["three_blocks"],   # tiles of 3 x 16 output channels (mu = 3)
    "conv_five_blocks": CASES["five_blocks"],     # tiles of 2 blocks, the fifth cut off
    # fused spatial padding that no staged copy replaces (dilation 2): the cut-off rows'
    # guards must be shifted with their indices (a fuzzed case, once 0.54 off)
    "conv_dilated_tail": {"op": "conv2d", "shape": [1, 3, 10, 13], "channels": 31,
                          "kernel": [2, 4], "stride": [2, 1], "pad": [2, 3], "dilation": [2, 2],
                          "src": "nChw16c", "weights": "oihw", "dst": "nChw8c",
                          "post_ops": [{"kind": "bias"}]},
}
HAVE_AVX512 = "avx512f" in machine.cpu_features()


@pytest.fixture(scope="module")
def avx512_libs(tmp_path_factory):
    """The odd cases for AVX-512 under dst_fused, and under dst_stage (a predicated
    destination stage: the valid plan)."""
    if not HAVE_AVX512:
        pytest.skip("this CPU has no avx512f")
    out = {}
    for policy in ("dst_fused", "dst_stage"):
        d = tmp_path_factory.mktemp(f"avx512-{policy}")
        spec = {"library": {"policy": policy},
                "kernel": [{**entry, "name": n} for n, entry in ODD_CASES.items()]}
        bp.build(parse_spec(spec), "avx512", d, log=lambda m: None)
        out[policy] = bp.load(d)
    return out


# ---- numpy references -------------------------------------------------------------------------

def conv_ref(x, w, stride=(1, 1), pad=(0, 0), dilation=(1, 1), groups=1):
    """Direct convolution in float64; weights (K, C, KH, KW), or (G, K/G, C/G, KH, KW)."""
    x, w = x.astype(np.float64), w.astype(np.float64)
    w = w[None] if groups == 1 else w
    g, kg, cg, kh, kw = w.shape
    n, _, h, wd = x.shape
    (sh, sw), (ph, pw), (dh, dw) = stride, pad, dilation
    oh, ow = (h + 2 * ph - dh * (kh - 1) - 1) // sh + 1, (wd + 2 * pw - dw * (kw - 1) - 1) // sw + 1
    xp = np.pad(x, ((0, 0), (0, 0), (ph, ph), (pw, pw)))
    out = np.zeros((n, g, kg, oh, ow))
    for i in range(kh):
        for j in range(kw):
            rows = slice(i * dh, i * dh + sh * (oh - 1) + 1, sh)
            cols = slice(j * dw, j * dw + sw * (ow - 1) + 1, sw)
            patch = xp[:, :, rows, cols].reshape(n, g, cg, oh, ow)
            out += np.einsum("ngchw,gkc->ngkhw", patch, w[:, :, :, i, j])
    return out.reshape(n, g * kg, oh, ow)


ELTWISE = {"relu": lambda x, a, b: np.where(x > 0, x, a * x), "sigmoid": lambda x, a, b: expit(x),
           "linear": lambda x, a, b: a * x + b}


def reference(entry, arrays: dict):
    """The kernel's result in float64 from its named input arrays."""
    if entry["op"] == "conv2d":
        acc = conv_ref(arrays["src"], arrays["weights"], *(entry.get(k, d) for k, d in (
            ("stride", (1, 1)), ("pad", (0, 0)), ("dilation", (1, 1)), ("groups", 1))))
        channel = (slice(None), None, None)
    else:
        acc = arrays["src"].astype(np.float64) @ arrays["weights"].astype(np.float64)
        channel = (slice(None),)
    v = acc * arrays["scale"][channel] if "scale" in arrays else acc
    for p in entry.get("post_ops", []):
        if p["kind"] == "bias":
            v = v + arrays["bias"][channel]
        elif p["kind"] == "sum":
            v = v + p.get("scale", 1.0) * arrays["sum"]
        else:
            v = ELTWISE[p["algorithm"]](v, p.get("alpha", 0.0), p.get("beta", 0.0))
    return v


def inputs(kernel, rng) -> dict:
    """Random logical arrays for every input; integers small and scales powers of two, so that
    int8 results are exact in float32."""
    out = {}
    for name, role, lay, _ in kernel.signature.args:
        if role != "in":
            continue
        if lay.dtype in ("int8", "uint8"):
            lo = 0 if lay.dtype == "uint8" else -8
            out[name] = rng.integers(lo, 8, lay.shape).astype(lay.dtype)
        elif name == "scale":
            out[name] = (2.0 ** rng.integers(-3, 2, lay.shape)).astype("float32")
        elif name == "bias" and kernel.signature.args[0][2].dtype in ("int8", "uint8"):
            out[name] = rng.integers(-20, 20, lay.shape).astype("float32")
        else:
            out[name] = rng.standard_normal(lay.shape).astype(lay.dtype)
    return out


# ---- results and destination padding under each policy ----------------------------------------

@pytest.mark.parametrize("policy,case", RUNS)
def test_matches_numpy_and_keeps_the_padding_contract(libs, policy, case, rng):
    _check(libs[policy][case], CASES[case], policy, rng)


@pytest.mark.parametrize("policy", ["dst_fused", "dst_stage"])
@pytest.mark.parametrize("case", ODD_CASES)
def test_avx512_odd_shapes_match_numpy(avx512_libs, policy, case, rng):
    """Rows, columns and k that whole tiles and unrolled steps do not cover (19 x 37 x 40,
    ow = 13): the cut-off rows and columns and the peeled k tail compute the right numbers
    and store nothing outside the destination."""
    _check(avx512_libs[policy][case], ODD_CASES[case], policy, rng)


def _check(kernel, entry, policy, rng):
    """Run ``kernel`` on random inputs (NaN in source padding under ``src``, a NaN-filled
    destination with guards) and compare with the numpy reference and the padding contract."""
    arrays = inputs(kernel, rng)
    dst, whole = run_guarded(kernel, arrays, policy)

    got, want = dst.to_numpy(), reference(entry, arrays)
    tolerance = {"float32": 1e-4, "float16": 2e-2}.get(entry.get("dtype", "float32"))
    if tolerance:
        np.testing.assert_allclose(got, want, rtol=tolerance, atol=tolerance)
    else:
        np.testing.assert_array_equal(got, want)          # int32 accumulation is exact
    assert_padding_contract(kernel, whole)


@st.composite
def conv_entries(draw):
    """A convolution of random geometry and layouts: odd sizes, strides, dilations, pads up to
    the kernel's reach, fused or staged spatial padding, a zero-breaking post-op or none."""
    kh, kw = draw(st.integers(1, 5)), draw(st.integers(1, 4))
    dh, dw = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    ph, pw = draw(st.integers(0, dh * (kh - 1))), draw(st.integers(0, dw * (kw - 1)))
    h = draw(st.integers(max(1, dh * (kh - 1) + 1 - 2 * ph), 12))
    w = draw(st.integers(9, 15))   # rows past a whole AVX-512 tile (7 or 8): an edge part
    return {"op": "conv2d", "shape": [1, draw(st.integers(1, 33)), h, w],
            "channels": draw(st.integers(1, 33)), "kernel": [kh, kw],
            "stride": [draw(st.integers(1, 3)), draw(st.integers(1, 2))], "pad": [ph, pw],
            "dilation": [dh, dw], "spatial_pad": draw(st.sampled_from(["fused", "stage"])),
            "src": draw(st.sampled_from(["nchw", "nhwc", "nChw8c", "nChw16c"])),
            "weights": draw(st.sampled_from(["oihw", "OIhw8i8o", "OIhw16i16o"])),
            "dst": draw(st.sampled_from(["nchw", "nChw8c", "nChw16c"])),
            "post_ops": draw(st.sampled_from([[], [{"kind": "bias"}], [{"kind": "bias"},
                                                                          SIGMOID]]))}


@settings(max_examples=10, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(entry=conv_entries(), policy=st.sampled_from(["dst_fused", "dst_stage"]))
def test_conv_geometry_on_the_widest_target(tmp_path_factory, entry, policy):
    """Random geometry through the register-tiled rule of the widest target this CPU runs
    (its edge parts, clamped rows, whole-tile columns, fused guards): numbers, padding and
    guards as ``_check`` has them. A fixed (derandomized) sample of 10 keeps the suite
    fast; a fuzz over many seeds of specs like these found ``conv_dilated_tail``."""
    target = "avx512" if HAVE_AVX512 else "host"
    d = tmp_path_factory.mktemp("conv-geometry")
    bp.build(parse_spec({"library": {"policy": policy},
                         "kernel": [{**entry, "name": "conv"}]}), target, d, log=lambda m: None)
    _check(bp.load(d)["conv"], entry, policy, np.random.default_rng(0))


@st.composite
def grouped_conv_entries(draw):
    """A convolution with groups (depthwise among them), a batch of up to 3 and an fp32, s8
    or u8 source, under a policy of its own."""
    groups = draw(st.sampled_from([1, 2, 3]))
    per_c, per_k = draw(st.integers(1, 9)), draw(st.integers(1, 9))
    depthwise = draw(st.booleans())
    if depthwise:
        groups, per_c, per_k = draw(st.integers(2, 12)), 1, 1
    kh, kw = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    blocked = draw(st.booleans())
    weights = ("goihw" if groups > 1 else "oihw") if not blocked else \
        ("Goihw8g" if depthwise else "gOIhw8i8o" if groups > 1 else "OIhw8i8o")
    return {"op": "conv2d", "dtype": draw(st.sampled_from(["float32", "int8", "uint8"])),
            "shape": [draw(st.integers(1, 3)), groups * per_c, draw(st.integers(kh, 7)),
                      draw(st.integers(kw, 7))],
            "channels": groups * per_k, "groups": groups, "kernel": [kh, kw],
            "pad": [draw(st.integers(0, kh - 1)), draw(st.integers(0, kw - 1))],
            "stride": [draw(st.integers(1, 2)), 1], "weights": weights,
            "src": draw(st.sampled_from(["nchw", "nhwc", "nChw8c"])),
            "dst": draw(st.sampled_from(["nchw", "nChw8c", "nChw16c"])),
            "post_ops": draw(st.sampled_from([[], [{"kind": "bias"}, RELU]])),
            "policy": draw(st.sampled_from(["dst_fused", "dst_stage", "src"]))}


@st.composite
def matmul_entries(draw):
    """A matmul of odd sizes, plain or blocked, fp32 or int8, with or without post-ops, under a
    policy of its own."""
    dtype = draw(st.sampled_from(["float32", "int8", "uint8"]))
    dst = draw(st.sampled_from(["ab", "aB8b", "aB16b"]))
    chains = [[], [{"kind": "bias"}, RELU]]   # int8: exact (_check), so no sigmoid after it
    post = draw(st.sampled_from(chains + [[SIGMOID, {"kind": "sum"}]] * (dtype == "float32")))
    entry = {"op": "matmul", "dtype": dtype,
             "shape": [draw(st.integers(1, 9)), draw(st.integers(1, 40))],
             "n": draw(st.integers(1, 40)), "src": draw(st.sampled_from(["ab", "aB16b"])),
             "weights": draw(st.sampled_from(["ba", "BA16a16b", "AB16b16a"])), "dst": dst,
             "post_ops": post, "policy": draw(st.sampled_from(["dst_fused", "dst_stage", "src"]))}
    return {**entry, "sum": dst} if post and post[-1]["kind"] == "sum" else entry


SAMPLE_PHASES = [Phase.explicit, Phase.generate]


def _sample(tmp_path_factory, entries):
    """Every entry of a drawn sample in one library (one build for the lot), each checked like
    the fixed cases (numbers against numpy, padding contract, guards)."""
    named = [{**e, "name": f"k{i}"} for i, e in enumerate(entries)]
    d = tmp_path_factory.mktemp("sample")
    bp.build({"kernel": named}, "host", d, log=lambda m: None)
    lib = bp.load(d)
    for e in named:
        _check(lib[e["name"]], e, e["policy"], np.random.default_rng(0))


# two examples: hypothesis tries the simplest sample (all 1x1) first, then a random one; no
# shrinking (each step is a build): a failure reports the drawn sample as it is
@settings(max_examples=2, deadline=None, derandomize=True, phases=SAMPLE_PHASES,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(grouped_conv_entries(), min_size=6, max_size=6))
def test_conv_groups_batches_and_int8_sample(tmp_path_factory, entries):
    _sample(tmp_path_factory, entries)


@settings(max_examples=2, deadline=None, derandomize=True, phases=SAMPLE_PHASES,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(matmul_entries(), min_size=6, max_size=6))
def test_matmul_sample(tmp_path_factory, entries):
    _sample(tmp_path_factory, entries)


def test_staged_kernel_leaves_padding_to_its_zero_pad_stage(libs, rng):
    """dst_stage: the conv itself computes the valid region only; the stage kernel zeroes."""
    lib = libs["dst_stage"]
    kernel = lib["blk16_chain"]
    arrays = inputs(kernel, rng)
    views = [bp.Memory.from_numpy(arrays[n], lay).physical_view() for n, _, lay, _ in
             kernel.signature.args[:-1]]
    lay = kernel.signature.args[-1][2]
    buf = garbage(lay.alloc_len, lay.dtype)
    dst = bp.Memory.from_buffer(buf, lay).physical_view()
    kernel.run_raw([*views, dst])
    assert np.all(np.isnan(buf[lay.padding_offsets()]))
    lib[kernel.signature.padding["dst_stage"]].run_raw([dst])
    assert np.all(buf[lay.padding_offsets()] == 0)


# ---- what the generator derives and emits -----------------------------------------------------

def _with_post_ops(case, post_ops):
    """``CASES[case]`` with another chain (and a sum tensor only if the chain has a sum)."""
    entry = {k: v for k, v in CASES[case].items() if k != "sum"}
    if any(p["kind"] == "sum" for p in post_ops):
        entry["sum"] = entry["dst"]
    return {**entry, "post_ops": post_ops}


def _kernels(entry, policy="dst_fused", name="k"):
    spec = {"library": {"policy": policy}, "kernel": [{**entry, "name": name}]}
    return make_kernels(parse_spec(spec).kernels[0])


@pytest.mark.parametrize("post_ops,dst_writes", [
    ([], "full"), ([RELU], "full"), ([{"kind": "sum"}, RELU], "full"),
    ([{"kind": "bias"}], "select"), ([SIGMOID], "select"), ([RELU, {"kind": "bias"}], "select"),
])
def test_zero_propagation_is_derived(post_ops, dst_writes):
    """Derived from the TE, not tabulated: relu(0) = 0 and a clean sum keep zeros; a bias or
    sigmoid(0) = 0.5 does not, so dst_fused stores an explicit zero."""
    for case in ("blk16_chain", "mm_blocked"):
        assert _kernels(_with_post_ops(case, post_ops))[0].contract["dst_writes"] == dst_writes


def test_int8_output_scale_keeps_zeros():
    assert _kernels(_with_post_ops("u8_blocked", []))[0].contract["dst_writes"] == "full"
    assert _kernels(CASES["u8_blocked"])[0].contract["dst_writes"] == "select"   # + bias


def test_src_policy_contract():
    """A conv or matmul that reduces over padded channel blocks (a 3x3 over 170 channels takes
    all 176, a blocked matmul its whole blocks) asks for clean sources (a zero-pad stage):
    masking would sit in the innermost loop. A float conv over its logical channels (30 of
    32) and a grouped conv reduce exactly and mask their reads instead."""
    for case in ("whole_blocks_3x3", "mm_blocked"):
        c = _kernels(CASES[case], "src")[0].contract
        assert c["src_stage"] is True and c["requires"] == "clean" and c["reads"] == "trusted"
    for case in ("blk16_chain", "groups2"):
        c = _kernels(CASES[case], "src")[0].contract
        assert c["src_stage"] is False and c["requires"] == "any" and c["reads"] == "masked"


def _acc_block(script):
    return script[script.index('T.sblock("acc")'):]


def test_spatial_padding_three_ways():
    fused = _kernels(CASES["blk16_chain"])[0]
    pre = _kernels(CASES["prepadded"])[0]
    staged = _kernels(CASES["staged"])[0]
    assert "T.if_then_else" in _acc_block(fused.func.script())       # predicate in the load
    assert "T.if_then_else" not in _acc_block(pre.func.script())     # halo: no bounds checks
    assert 'T.sblock("src_padded")' in staged.func.script()           # a separate pad stage
    assert "T.if_then_else" not in _acc_block(staged.func.script())


def test_arguments_follow_the_post_op_tensors():
    assert [a.name for a in _kernels(CASES["blk16_chain"])[0].args] == \
        ["src", "weights", "bias", "sum", "dst"]
    assert [a.name for a in _kernels(CASES["u8_blocked"])[0].args] == \
        ["src", "weights", "scale", "bias", "dst"]


@pytest.mark.parametrize("change,message", [
    ({"groups": 4}, "groups must divide"),
    ({"post_ops": [{"kind": "prelu"}]}, "kind must be one of"),
    ({"post_ops": [{"kind": "bias"}, {"kind": "bias"}]}, "at most one 'bias'"),
    ({"post_ops": [{"kind": "sum"}], "sum": "nchw"}, "sum \\(a sum post-op\\): its layout"),
    ({"kernel": [9, 9], "pad": [0, 0]}, "does not fit"),
    ({"spatial_pad": "mirror"}, "spatial_pad must be"),
    ({"dtype": "int32"}, "expected one of float32"),
])
def test_spec_errors(change, message):
    entry = {**_with_post_ops("blk16_chain", []), **change}
    with pytest.raises(bp.SpecError, match=message):
        _kernels(entry)


# ---- the x86 rule -----------------------------------------------------------------------------

@pytest.mark.parametrize("policy", ["dst_fused", "dst_stage"])
@pytest.mark.parametrize("case", CASES)
def test_register_tiled_rule_takes_every_case(case, policy):
    """Every case gets the micro-kernel (the tile's accumulators in a scratch buffer, the
    epilogue fused into it, outer loops parallel), the valid plan's predicated stages too."""
    sch = RegisterTiled().apply(_kernels(CASES[case], policy)[0].func, get_target("host"))
    script = sch.mod["main"].script()
    assert "acc = T.sblock_alloc_buffer" in script and "T.parallel" in script \
        and "T.vectorized" in script


POINTWISE = {"op": "conv2d", "shape": [1, 16, 12, 12], "channels": 96, "src": "nChw16c",
             "weights": "OIhw16i16o", "dst": "nChw16c"}


@pytest.mark.parametrize("entry", [POINTWISE, CASES["mm_blocked"]], ids=["conv1x1", "matmul"])
def test_x86_register_tiles_live_on_the_stack(entry):
    """The accumulator tile is a stack buffer LLVM keeps in registers, not a workspace from
    TVMBackendAllocWorkspace, which it must keep in memory (zero stores, stores, reloads:
    a C16 -> K96 1x1 conv ran at 43 GFLOP/s that way, 55 on the stack; schedules.common).
    These kernels have no other scratch (no staged source, no bias copy)."""
    import tvm

    kernel = _kernels(entry)[0]
    sch = RegisterTiled().apply(kernel.func, get_target("host"))
    lib = tvm.compile(tvm.IRModule({"k": sch.mod["main"]}), target=get_target("host").tvm_target())
    assert "TVMBackendAllocWorkspace" not in lib.mod.inspect_source("ll").split("define", 1)[1]


def test_register_tiled_rule_leaves_other_ops():
    relu = _kernels({"op": "eltwise", "shape": [1, 30, 3, 3], "src": "nChw16c", "dst": "nChw16c"})
    assert RegisterTiled().apply(relu[0].func, get_target("host")) is None


@pytest.mark.parametrize("case,target", [
    *((c, "host") for c in ["ow_tail", "blk8_7x7s2", "mm_inner_product", "u8_blocked"]),
    pytest.param("mm_odd", "avx512", marks=pytest.mark.skipif(not HAVE_AVX512,
                                                              reason="this CPU has no avx512f"))])
def test_register_tiled_space_variants_all_compute_the_same(case, target, rng):
    """``space`` (MetaSchedule's design spaces): every variant is a complete schedule giving
    the numbers of the default one, which comes first and is ``apply``'s; tiles that do not
    divide the destination (ow = 13, 7 x 7 stride 2 outputs, 7 matmul rows, 19 x 40 cut into
    four kernels) included."""
    import tvm
    import tvm_ffi

    func = _kernels({**CASES, **ODD_CASES}[case])[0].func
    target = get_target(target)
    rule = RegisterTiled()
    space = rule.space(func, target)
    assert len(space) >= 3
    assert tvm_ffi.structural_equal(space[0].mod, rule.apply(func, target).mod)
    args = []
    for p in func.params[:-1]:
        shape = [int(s) for s in p.ty.shape]
        dtype = str(p.ty.dtype)
        a = rng.integers(0, 4, shape) if "int" in dtype else rng.standard_normal(shape)
        args.append(tvm.runtime.tensor(a.astype(dtype)))
    out_shape = [int(s) for s in func.params[-1].ty.shape]
    results = []
    for sch in space:
        out = tvm.runtime.tensor(np.zeros(out_shape, str(func.params[-1].ty.dtype)))
        tvm.compile(sch.mod, target=target.tvm_target())["main"](*args, out)
        results.append(out.numpy())
    for r in results[1:]:
        np.testing.assert_allclose(r, results[0], rtol=1e-5, atol=1e-5)


def test_panels_run_inside_the_rows_where_the_source_outgrows_l2(rng):
    """A 1x1 convolution whose source passes L2 (320 channels at 32 x 32: 1.3 MB) and whose
    weights are small: the default schedule runs the output-channel panels inside the image
    rows (``rows_outer_pays``), and both orders give numpy's result."""
    import tvm

    entry = {"op": "conv2d", "shape": [1, 320, 32, 32], "channels": 48, "src": "nChw16c",
             "weights": "OIhw16i16o", "dst": "nChw16c"}
    func = _kernels(entry)[0].func
    target = get_target("host")
    rule = RegisterTiled()
    configs = rule.configs(func, target)
    assert configs[0].rows_outer and not configs[1].rows_outer
    x = rng.standard_normal((1, 320, 32, 32)).astype("float32")
    w = rng.standard_normal((48, 320, 1, 1)).astype("float32")
    src, wts = bp.Memory.from_numpy(x, bp.Layout("nChw16c", x.shape)), \
        bp.Memory.from_numpy(w, bp.Layout("OIhw16i16o", w.shape))
    dst_layout = bp.Layout("nChw16c", (1, 48, 32, 32))
    want = np.einsum("nchw,kc->nkhw", x.astype(np.float64), w[:, :, 0, 0].astype(np.float64))
    for cfg in configs[:2]:
        sch = rule_schedule(func, target, cfg)
        out = np.zeros(dst_layout.physical_shape, "float32")
        args = [tvm.runtime.tensor(m.buffer.reshape(m.layout.physical_shape)) for m in (src, wts)]
        res = tvm.runtime.tensor(out)
        tvm.compile(sch.mod, target=target.tvm_target())["main"](*args, res)
        got = bp.Memory(dst_layout, res.numpy().reshape(-1)).to_numpy()
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("shape,channels,kernel,stride,want", [
    # (host: AVX2, 2 x 8-lane columns a tile, one panel of 16 output channels)
    # 1x1, 1024 channels: 64 KiB of weights per panel -> 16 blocks a pass; a row a group, as
    # 2 panels x 4 rows make fewer than register_tiled.MIN_TASKS (8) tasks for the threads
    ([1, 1024, 4, 4], 32, 1, 1, (16, 1)),
    # 3x3 stride 2 with spatial padding (the staged halo): one block a pass, a row a group
    ([1, 64, 9, 9], 32, 3, 2, (1, 1)),
    # 28 columns in tiles of 6 (30 computed): 1.9 KiB of sums per row would allow groups of
    # 14 rows; groups of 7 leave 2 panels x 4 groups, 8 tasks
    ([1, 1024, 28, 28], 32, 1, 1, (16, 7)),
])
@pytest.mark.parametrize("target_name", ["host", "zen4"])
def test_channels_are_reduced_in_passes_where_the_weights_outgrow_l1(rng, shape, channels,
                                                                     kernel, stride, want,
                                                                     target_name):
    """Where a panel's weights pass L1 the default schedule reduces the source channels a few
    blocks at a time over a group of rows (``chunk_plan``), the partial sums in a scratch;
    with a bias and a relu in the epilogue, it gives numpy's result, as the one-pass order
    does. A target whose cores want one pass (``zen4``: ``reduction_passes`` False) has the
    two the other way round: one pass the default, the passes its first neighbour (``want``:
    AVX2's tiles, host's)."""
    import tvm

    pad = kernel // 2
    entry = {"op": "conv2d", "shape": shape, "channels": channels, "kernel": [kernel] * 2,
             "stride": [stride] * 2, "pad": [pad] * 2, "src": "nChw16c",
             "weights": "OIhw16i16o", "dst": "nChw16c",
             "post_ops": [{"kind": "bias"}, {"kind": "eltwise", "algorithm": "relu"}]}
    func = _kernels(entry)[0].func
    target = get_target(target_name)
    configs = RegisterTiled().configs(func, target)
    if target.reduction_passes:
        assert (configs[0].chunk, configs[0].rows) == want and not configs[1].chunk
    else:   # the same two as avx512-bf16's (the same registers), the other way round
        assert configs[:2] == RegisterTiled().configs(func, get_target("avx512-bf16"))[1::-1]
        assert configs[1].chunk and not configs[0].chunk
    missing = machine.missing_features(target.features)
    if missing:
        pytest.skip(f"{target_name}'s kernels need {missing} (the schedules were checked)")
    x = rng.standard_normal(shape).astype("float32")
    w = rng.standard_normal((channels, shape[1], kernel, kernel)).astype("float32")
    b = rng.standard_normal(channels).astype("float32")
    ref = np.maximum(conv_ref(x, w, (stride,) * 2, (pad,) * 2) + b[None, :, None, None], 0)
    src, wts = bp.Memory.from_numpy(x, bp.Layout("nChw16c", x.shape)), \
        bp.Memory.from_numpy(w, bp.Layout("OIhw16i16o", w.shape))
    dst_layout = bp.Layout("nChw16c", ref.shape)
    for cfg in configs[:2]:
        sch = rule_schedule(func, target, cfg)
        res = tvm.runtime.tensor(np.zeros(dst_layout.physical_shape, "float32"))
        args = [tvm.runtime.tensor(m.buffer.reshape(m.layout.physical_shape)) for m in (src, wts)]
        tvm.compile(sch.mod, target=target.tvm_target())["main"](*args, tvm.runtime.tensor(b),
                                                                 res)
        got = bp.Memory(dst_layout, res.numpy().reshape(-1)).to_numpy()
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("target_name", ["host", "zen4"])
def test_one_thread_reads_a_panels_weights_once(tmp_path, target_name):
    """A 3x3 stride 2 from 1024 channels at 14x14: a panel's weights (590 KiB on host's
    one-block panels, 1.2 MiB on zen4's pairs) and the source (784 KiB) overflow L2 together.
    The default passes over the channels a row at a time (``MIN_TASKS`` tasks for many
    cores), and ``zen4``, whose default is one pass elsewhere, passes too; the build adds a
    variant for a pool of one thread that passes over all 7 rows at once, so each weight is
    read once (``chunk_plan``'s ``once``). Both processes' results against numpy, and equal to
    the bit: the same sums in the same order."""
    entry = {"op": "conv2d", "shape": [1, 1024, 14, 14], "channels": 20, "kernel": [3, 3],
             "stride": [2, 2], "pad": [1, 1], **BLK16,
             "post_ops": [{"kind": "bias"}, RELU]}
    func = _kernels(entry)[0].func
    target = get_target(target_name)
    rule = RegisterTiled()
    default, single = rule.configs(func, target)[0], rule.configs(func, target, 1)[0]
    assert default.chunk and default.rows == 1
    assert single == dataclasses.replace(default, rows=7)
    assert rule.for_threads(func, target, 2) is None
    missing = machine.missing_features(target.features)
    if missing:
        pytest.skip(f"{target_name}'s kernels need {missing} (the schedules were checked)")
    bp.build(parse_spec({"kernel": [{**entry, "name": "k"}]}), target_name, tmp_path,
             log=lambda m: None)
    record, = (k for k in bp.load(tmp_path).manifest["kernels"] if k["name"] == "k")
    assert record["threads"] == {"1": "k__threads1"}
    got = {threads: run_in_pool(tmp_path, "k", threads, weight_scale=0.05)
           for threads in (1, 2)}
    assert got[1][0] == "k__threads1" and got[2][0] == "k"
    for symbol, arrays in got.values():
        ref = np.maximum(conv_ref(arrays["src"], arrays["weights"], (2, 2), (1, 1))
                         + arrays["bias"][None, :, None, None], 0)
        np.testing.assert_allclose(arrays["dst"], ref, rtol=1e-4, atol=1e-4, err_msg=symbol)
    np.testing.assert_array_equal(got[1][1]["dst"], got[2][1]["dst"])


@pytest.mark.parametrize("target_name", ["host", "zen4"])
def test_large_weights_prefetch_the_next_panel(tmp_path, target_name):
    """A 1x1 with 1.9 MB of weights (330 -> 1416: 89 output-channel blocks, so on ``zen4``'s
    three-block panels a two-block part of its own): they come from memory on every
    inference, so each task of the leading part prefetches its share of the next panel
    (``prefetch.prefetch_next_panel``: pruned ResNet-50 1.5-2% faster at 1 and 2 threads on
    Zen 4); a kernel with small weights prefetches nothing. Both against numpy."""
    spec = {"kernel": [{"name": name, "op": "conv2d", "shape": [1, c, 2, 7], "channels": k,
                        "kernel": [1, 1], **BLK16, "post_ops": [{"kind": "bias"}, RELU]}
                       for name, c, k in (("large", 330, 1416), ("small", 64, 64))]}
    target = get_target(target_name)
    bp.build(parse_spec(spec), target_name, tmp_path, log=lambda m: None)
    funcs = asm_functions(tmp_path)
    fetches = {name: sum(i.split()[0] == "prefetcht1" for i in kernel_instructions(funcs, name)
                         if i.split()) for name in ("large", "small")}
    assert fetches["large"] > 0 and fetches["small"] == 0, fetches
    missing = machine.missing_features(target.features)
    if missing:
        pytest.skip(f"{target_name}'s kernels need {missing} (their assembly was checked)")
    for name in ("large", "small"):
        _, arrays = run_in_pool(tmp_path, name, 1, weight_scale=0.05)
        ref = np.maximum(conv_ref(arrays["src"], arrays["weights"])
                         + arrays["bias"][None, :, None, None], 0)
        np.testing.assert_allclose(arrays["dst"], ref, rtol=1e-4, atol=1e-4, err_msg=name)


def test_three_block_panels_cover_short_rows_whole():
    """Tiles of three output-channel blocks keep 12 accumulators (4 rows) where 4 divides the
    rows, and take 7 rows (21 accumulators) where tiles of 4 would compute 8 columns for 7
    (``_whole_row_height``)."""
    def first(width):
        entry = {"op": "conv2d", "shape": [1, 64, width, width], "channels": 48,
                 "kernel": [3, 3], "pad": [1, 1], **BLK16}
        return RegisterTiled().configs(_kernels(entry)[0].func, get_target("avx512"))[0]

    assert (first(7).mu, first(7).mr) == (3, 7)
    assert (first(14).mu, first(14).mr) == (3, 7)
    assert (first(28).mu, first(28).mr) == (3, 4)


def test_register_tiled_hot_loop_has_no_guards_or_tails():
    """Spatial padding is read from a zero-haloed copy (a stage of the kernel), and the tile
    that overhangs ow = 13 is computed whole: the reduction block has neither a bounds check
    nor a predicate; only the destination store keeps one."""
    sch = RegisterTiled().apply(_kernels(CASES["ow_tail"])[0].func, get_target("host"))
    script = sch.mod["main"].script()
    update = script[script.index('T.sblock("acc_update")'):script.index('T.sblock("dst")')]
    assert "T.if_then_else" not in update and "T.where" not in update
    assert 'T.sblock("src_pad")' in script


def test_strided_1x1_reads_a_dense_copy_of_its_rows_and_columns():
    """A downsample 1x1 (stride 2) reads every other row and column: the schedule copies those
    into a dense stage (``halo.subsampled_source``) that the reduction reads contiguously; a
    3x3 with stride 2 reads the rows between too and keeps its source (numbers: the
    ``downsample_1x1`` case)."""
    sch = RegisterTiled().apply(_kernels(CASES["downsample_1x1"])[0].func, get_target("host"))
    script = sch.mod["main"].script()
    update = script[script.index('T.sblock("acc_update")'):script.index('T.sblock("dst")')]
    assert 'T.sblock("src_sub")' in script and "src_sub[" in update and " src[" not in update
    strided_3x3 = {**CASES["downsample_1x1"], "kernel": [3, 3], "pad": [1, 1]}
    script = RegisterTiled().apply(_kernels(strided_3x3)[0].func, get_target("host")).mod["main"]
    assert 'T.sblock("src_sub")' not in script.script()


def test_three_output_blocks_share_each_broadcast():
    """Output channels in three blocks (47 -> 3 x 16) take tiles of all three on AVX-512 (32
    registers), at most 12 accumulators; four blocks take pairs; AVX2 keeps one block a tile
    (numbers: the ``three_blocks`` case)."""
    def first(channels, target):
        func = _kernels({**CASES["three_blocks"], "channels": channels})[0].func
        return RegisterTiled().configs(func, get_target(target))[0]
    cfg = first(47, "avx512")
    assert cfg.mu == 3 and cfg.mu * cfg.mr <= 12
    assert first(64, "avx512").mu == 2 and first(47, "host").mu == 1


def test_odd_output_blocks_take_pairs_and_cut_the_last_off():
    """Five output-channel blocks (70 channels) take tiles of two on AVX-512; the fifth block
    is a part of its own with one-block tiles, so no tile is predicated (numbers: the
    ``five_blocks`` case, ``conv_five_blocks`` for AVX-512). AVX2's two-vector blocks keep
    one block a tile (``three_blocks``'s reason)."""
    func = _kernels(CASES["five_blocks"])[0].func
    assert RegisterTiled().configs(func, get_target("avx512"))[0].mu == 2
    assert RegisterTiled().configs(func, get_target("host"))[0].mu == 1
    script = RegisterTiled().apply(func, get_target("avx512")).mod["main"].script()
    assert 'T.sblock("acc_panels_update")' in script
    assert 'T.sblock("dst_panels")' in script


def test_register_tiled_cuts_partial_tiles_off():
    """19 x 37 x 40 on AVX-512 (8 x 32 tiles): the last 3 rows and 8 columns are tiled as
    kernels of their own, so the main tiles read no clamped row and store no predicated
    vector; k = 37 is unrolled by 16, its tail left to TVM's loop partitioning."""
    sch = RegisterTiled().apply(_kernels(ODD_CASES["mm_odd"])[0].func, get_target("avx512"))
    script = sch.mod["main"].script()
    for part in ("acc_rows", "acc_cols", "acc_rows_cols"):
        assert f'T.sblock("{part}_update")' in script
    update = script[script.index('T.sblock("acc_update")'):script.index('T.sblock("dst")')]
    start = script.index('T.sblock("dst")')
    main_dst = script[start:script.index('T.sblock("acc_', start)]
    assert "T.min" not in update and "T.where" not in main_dst
    assert "pragma_loop_partition_hint" in script and "T.unroll(16)" in script


# ---- bf16 convolution -------------------------------------------------------------------------

BF16_CONV = {"op": "conv2d", "dtype": "bfloat16", "shape": [2, 20, 5, 6], "channels": 24,
             "kernel": [3, 3], "pad": [1, 1], "src": "nChw16c", "weights": "OIhw16i16o2i",
             "dst": "nChw16c", "post_ops": [{"kind": "bias"}, RELU]}
BF16_CASES = {f"{policy}_{spatial}": {**BF16_CONV, "policy": policy, "spatial_pad": spatial}
              for policy in ("dst_fused", "dst_stage", "src", "on_handle", "tracked", "user")
              for spatial in ("fused", "stage")}
BF16_CASES["plain_strided"] = {"op": "conv2d", "dtype": "bfloat16", "shape": [1, 5, 9, 8],
                               "channels": 6, "kernel": [3, 3], "stride": [2, 2],
                               "pad": [1, 1], "src": "nchw", "weights": "oihw", "dst": "nchw",
                               "post_ops": [SIGMOID]}
BF16_CASES["blocked_16o"] = {**BF16_CONV, "weights": "OIhw16i16o", "post_ops": []}


@pytest.fixture(scope="module")
def bf16_lib(tmp_path_factory):
    d = tmp_path_factory.mktemp("bf16")
    spec = {"kernel": [{**entry, "name": n} for n, entry in BF16_CASES.items()]}
    bp.build(parse_spec(spec), "host", d, log=lambda m: None)
    return bp.load(d)


@pytest.mark.parametrize("case", BF16_CASES)
def test_bf16_conv_matches_numpy_under_every_policy(bf16_lib, case, rng):
    """bf16 x bf16 -> fp32 convolution, fp32 accumulation and post-ops, run on this CPU
    (RegisterTiled) under every padding policy, spatial padding fused and staged. Checked to
    float32's tolerance: bf16 products are exact in fp32, only the summation order differs."""
    entry = BF16_CASES[case]
    kernel = bf16_lib[case]
    assert [lay.dtype for _, _, lay, _ in kernel.signature.args] == [
        "bfloat16", "bfloat16", *["float32"] * (len(kernel.signature.args) - 2)]
    _check(kernel, {**entry, "dtype": "float32"}, entry.get("policy", "dst_fused"), rng)


def test_register_tiled_takes_bf16_convolutions():
    for target in ("host", "avx512"):
        for entry in (BF16_CONV, BF16_CASES["plain_strided"]):
            assert RegisterTiled().apply(_kernels(entry)[0].func, get_target(target)) is not None


def test_bf16_zero_propagation_is_derived():
    """bf16 sources are read as uint16 bits: zero bits reinterpret to +0.0, so a bias-free bf16
    convolution keeps the destination's padding zero by its arithmetic, as fp32 does."""
    assert _kernels(BF16_CASES["blocked_16o"])[0].contract["dst_writes"] == "full"
    assert _kernels(BF16_CONV)[0].contract["dst_writes"] == "select"   # bias


def test_window_wholly_in_the_padding(tmp_path, rng):
    """One input row, a 2-row kernel of dilation 2 and pad 1: every tap of the output row lies
    in the spatial padding, the simplifier folds the window's reads to 0, and the rules must
    still schedule a nest that reads no source (the output is the bias)."""
    from blockpad.schedules import schedule

    entry = {"op": "conv2d", "shape": [1, 4, 1, 18], "channels": 4, "kernel": [2, 3],
             "stride": [2, 2], "pad": [1, 2], "dilation": [2, 1], "src": "nChw4c",
             "weights": "OIhw4i4o", "dst": "nChw4c", "post_ops": [{"kind": "bias"}]}
    spec = parse_spec({"library": {}, "kernel": [{**entry, "name": "conv"}]})
    (kernel,) = make_kernels(spec.kernels[0])
    for target in ("host", "avx512", "neon", "cuda-sm80"):
        assert schedule(kernel.func, get_target(target)) is not None
    bp.build(spec, "host", tmp_path, log=lambda m: None)
    _check(bp.load(tmp_path)["conv"], entry, "dst_fused", rng)
