"""The x86 depthwise rule (schedules/depthwise.py): channel-blocked depthwise convolutions
against a float64 numpy convolution under the policies, over strides, dilation, asymmetric
pads, widths that whole register tiles do not cover, channel counts that are not block
multiples, batches and a pre-padded source; what the rule takes and what its hot loop holds."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
import tvm_ffi

import blockpad as bp
from blockpad.check.reference import ELTWISE, conv
from blockpad.codegen.spec import parse_spec
from blockpad.codegen.targets import get_target
from blockpad.layout import pad_sides
from blockpad.schedules import RULES
from blockpad.schedules.depthwise import Depthwise, configs
from blockpad.schedules.rule import first_match

from .conftest import assert_padding_contract, policy_libraries, run_guarded
from .test_conv_matmul import _kernels, inputs

RELU6 = {"kind": "eltwise", "algorithm": "clip", "alpha": 0.0, "beta": 6.0}


def dw(c, hw, block=16, **kw):
    return {"op": "conv2d", "shape": [1, c, *hw], "channels": c, "kernel": [3, 3],
            "pad": [1, 1], "groups": c, "src": f"nChw{block}c", "weights": f"Goihw{block}g",
            "dst": f"nChw{block}c", "post_ops": [{"kind": "bias"}, RELU6], **kw}


CASES = {
    "s1": dw(32, (9, 12)),                                     # 12 = 4 x 3 columns
    "s2": dw(48, (11, 13), stride=[2, 2]),                     # 6 x 7 outputs: clamped tile
    "c30_8c": dw(30, (7, 9), block=8),                         # channel padding, AVX2 lanes
    "dilated_asym": dw(16, (10, 11), dilation=[2, 2], pad=[[2, 1], [0, 2]]),
    "batch_5x5": {**dw(20, (6, 7), kernel=[5, 5], pad=[2, 2]), "shape": [2, 20, 6, 7]},
    "no_post_ops": {**dw(16, (5, 14)), "post_ops": []},
    "prepadded": {**dw(32, (6, 8)), "src": {"tag": "nChw16c",
                                            "paddings": {"h": [1, 1], "w": [1, 1]}}},
}
POLICY_CASES = {"dst_stage": ["s2", "c30_8c"], "src": ["s1", "c30_8c"],
                "tracked": ["dilated_asym", "c30_8c"]}
RUNS = [("dst_fused", c) for c in CASES] + [(p, c) for p, cs in POLICY_CASES.items() for c in cs]


@pytest.fixture(scope="module")
def libs(tmp_path_factory):
    return policy_libraries(tmp_path_factory, "dw", CASES, POLICY_CASES)


def reference(entry, arrays):
    """float64: blockpad check's direct convolution over the source padded per side, bias,
    the eltwise post-ops."""
    x = np.pad(arrays["src"].astype(np.float64), ((0, 0), (0, 0), *pad_sides(entry["pad"])))
    v = conv(x, arrays["weights"].astype(np.float64),
             {"stride": entry.get("stride", (1, 1)), "pad": (0, 0),
              "dilation": entry.get("dilation", (1, 1)), "groups": entry["groups"]})
    for p in entry["post_ops"]:
        v = v + arrays["bias"][:, None, None] if p["kind"] == "bias" else \
            ELTWISE[p["algorithm"]](v, p["alpha"], p["beta"])
    return v


@pytest.mark.parametrize("policy,case", RUNS)
def test_depthwise_matches_numpy(libs, policy, case, rng):
    """Numbers against a float64 convolution; the destination padding each policy promises
    (zero, or untouched NaN where the kernel writes the valid elements only); nothing written
    outside the destination; under ``src`` the sources' padding holds NaN."""
    kernel, entry = libs[policy][case], CASES[case]
    arrays = inputs(kernel, rng)
    dst, whole = run_guarded(kernel, arrays, policy)
    np.testing.assert_allclose(dst.to_numpy(), reference(entry, arrays), rtol=1e-5, atol=1e-5)
    assert_padding_contract(kernel, whole)


@pytest.mark.parametrize("case", ["s1", "s2", "c30_8c", "dilated_asym", "prepadded"])
def test_depthwise_rule_takes_blocked_depthwise(case):
    """The build picks the rule for every channel-blocked depthwise case (before
    register_tiled), and its hot loop has no branch and no copy of the source: spatial padding
    is a select of a clamped read (a masked load), or the source's own halo (nothing at all);
    staging the source's rows is a tuning variant only."""
    func = _kernels(CASES[case])[0].func
    rule, sch = first_match(RULES["x86"], func, get_target("host"))
    assert isinstance(rule, Depthwise)
    script = sch.mod["main"].script()
    update = script[script.index('T.sblock("acc_update")'):script.index('T.sblock("dst")')]
    assert "T.if_then_else" not in update and "T.where" not in update
    assert 'T.sblock("src_pad")' not in script
    assert ("T.Select" in update) == (case != "prepadded")
    staged = [s.mod["main"].script() for s in Depthwise().space(func, get_target("host"))]
    assert case == "prepadded" or any('T.sblock("src_pad")' in s for s in staged)


@pytest.mark.parametrize("entry", [
    {"op": "conv2d", "shape": [1, 32, 7, 7], "channels": 32, "kernel": [1, 1],
     "src": "nChw16c", "weights": "OIhw16i16o", "dst": "nChw16c"},
    {"op": "conv2d", "shape": [1, 32, 7, 7], "channels": 32, "kernel": [3, 3], "pad": [1, 1],
     "groups": 2, "src": "nChw16c", "weights": "gOIhw16i16o", "dst": "nChw16c"},
    {**dw(16, (7, 7)), "src": "nchw", "weights": "goihw", "dst": "nchw"},
    {**dw(16, (7, 7)), "dtype": "uint8", "post_ops": [{"kind": "bias"}]},
], ids=["1x1", "grouped", "plain", "u8"])
def test_depthwise_rule_leaves_other_convolutions(entry):
    assert Depthwise().apply(_kernels(entry)[0].func, get_target("host")) is None


# a channel multiplier (2 groups of 7 outputs) between a channels-last blocked source and a
# 4-channel-blocked destination: staged rows would span a varying number of channels per task,
# a loop LLVM cannot vectorize (blockpad check seed 20261130 case 37 failed to build)
MULTIPLIER = {"op": "conv2d", "shape": [1, 2, 9, 5], "channels": 14, "groups": 2,
              "kernel": [5, 3], "stride": [1, 3], "pad": [5, 0], "dilation": [2, 2],
              "src": "nhwC16c", "weights": "Goihw8g", "dst": "nChw4c", "post_ops": []}


def test_a_channel_multiplier_reads_clamped_and_never_stages(tmp_path, rng):
    """The rule takes it reading the source clamped; the staged variant, whose copy loop LLVM
    could not vectorize, is not offered (no vectorized loop of varying extent); the result
    equals numpy's."""
    func = _kernels(MULTIPLIER)[0].func
    assert isinstance(first_match(RULES["x86"], func, get_target("host"))[0], Depthwise)
    assert all('T.sblock("src_pad")' not in s.mod["main"].script()
               for s in Depthwise().space(func, get_target("host")))
    bp.build(parse_spec({"kernel": [{**MULTIPLIER, "name": "k"}]}), "host", tmp_path,
             log=lambda m: None)
    kernel = bp.load(tmp_path)["k"]
    arrays = inputs(kernel, rng)
    mems = [bp.Memory.from_numpy(arrays[name], lay)
            for name, _, lay, _ in kernel.signature.args[:-1]]
    dst = kernel.signature.args[-1][2]
    out = bp.Memory(dst, np.full(dst.alloc_len, np.nan, np.float32))
    kernel(*mems, out)
    np.testing.assert_allclose(out.to_numpy(), reference(MULTIPLIER, arrays), rtol=1e-5,
                               atol=1e-5)


@pytest.mark.parametrize("case", ["s2", "batch_5x5"])
def test_depthwise_space_variants_all_compute_the_same(case, rng):
    """Every variant of the tuning space (tile widths, rows per task, the staged source) is a
    complete schedule giving the default's numbers; the default comes first and is
    ``apply``'s."""
    func = _kernels(CASES[case])[0].func
    target = get_target("host")
    rule = Depthwise()
    space = rule.space(func, target)
    assert len(space) >= 3 and len(configs(func, target)) + 1 >= len(space)
    assert 'T.sblock("src_pad")' in space[-1].mod["main"].script()
    assert tvm_ffi.structural_equal(space[0].mod, rule.apply(func, target).mod)
    args = [tvm.runtime.tensor(rng.standard_normal([int(s) for s in p.ty.shape])
                               .astype(str(p.ty.dtype))) for p in func.params[:-1]]
    out_shape = [int(s) for s in func.params[-1].ty.shape]
    results = []
    for sch in space:
        out = tvm.runtime.tensor(np.zeros(out_shape, "float32"))
        tvm.compile(sch.mod, target=target.tvm_target())["main"](*args, out)
        results.append(out.numpy())
    for r in results[1:]:
        np.testing.assert_allclose(r, results[0], rtol=1e-5, atol=1e-5)


def test_tile_widths_cover_rows_with_least_waste():
    from blockpad.schedules.depthwise import _tile_width

    assert [_tile_width(w, 7) for w in (112, 56, 28, 14, 7, 3)] == [7, 7, 7, 7, 7, 3]
    assert [_tile_width(w, 8) for w in (112, 56, 28, 14, 7)] == [8, 8, 7, 7, 7]
