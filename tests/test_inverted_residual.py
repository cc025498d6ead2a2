"""The fused inverted residual (codegen/ops/inverted_residual.py, schedules/inverted_residual.py,
passes.fuse_inverted_residuals): the kernel against a float64 numpy block written here (1x1,
depthwise, 1x1, each with its own bias and activation) under the policies, over strides, a
5x5 window, channel counts that are not block multiples, a batch and plain layouts; what the
rule takes; what the spec refuses; and the Graph pass that finds the pattern."""

from __future__ import annotations

import re

import numpy as np
import pytest

import blockpad as bp
from blockpad import machine
from blockpad.codegen.spec import parse_spec
from blockpad.codegen.targets import get_target
from blockpad.errors import SpecError
from blockpad.schedules import RULES
from blockpad.schedules.inverted_residual import InvertedResidual
from blockpad.schedules.rule import first_match

from .conftest import (
    asm_functions,
    assert_padding_contract,
    kernel_instructions,
    policy_libraries,
    run_guarded,
    run_in_pool,
)
from .test_conv_matmul import _kernels

RELU6 = {"kind": "eltwise", "algorithm": "clip", "alpha": 0.0, "beta": 6.0}
SIGMOID = {"kind": "eltwise", "algorithm": "sigmoid"}


def block(c, e, k, hw, b=16, stride=1, residual=False, kernel=3, batch=1, plain=False,
          act=RELU6):
    d, w, dw = ("nchw", "oihw", "goihw") if plain else (f"nChw{b}c", f"OIhw{b}i{b}o",
                                                           f"Goihw{b}g")
    return {"op": "inverted_residual", "shape": [batch, c, *hw], "expanded": e, "channels": k,
            "kernel": [kernel, kernel], "stride": [stride, stride], "src": d,
            "expand_weights": w, "depthwise_weights": dw, "weights": w, "dst": d,
            "expand_post_ops": [act], "depthwise_post_ops": [act],
            "post_ops": [{"kind": "bias"}, *([{"kind": "sum"}] if residual else [])],
            **({"sum": d} if residual else {})}


CASES = {
    "s1_residual": block(16, 48, 16, (9, 12), residual=True),
    "s2_8c": block(8, 24, 16, (11, 13), b=8, stride=2),
    # C, E, K all pad their blocks; sigmoid(0) = 0.5 in the padded expanded channels, which
    # the projection's zero weight padding must cancel
    "tails": block(20, 60, 12, (7, 9), act=SIGMOID),
    "k5_batch": block(16, 32, 24, (6, 7), kernel=5, batch=2),
    "plain": block(6, 18, 6, (5, 6), plain=True, residual=True),
    # blocks that change on the way (the graph on Zen 4: MobileNetV2's 24 channels in
    # nChw8c, channel_blocks): the inner stages stay on blocks of 16 either way
    "to_8c": {**block(16, 48, 24, (9, 10), stride=2), "dst": "nChw8c", "weights": "OIhw16i8o"},
    "in_8c": {**block(24, 48, 24, (7, 9), residual=True), "src": "nChw8c", "dst": "nChw8c",
              "sum": "nChw8c", "expand_weights": "OIhw8i16o", "weights": "OIhw16i8o"},
    "from_8c": {**block(24, 40, 32, (6, 7)), "src": "nChw8c", "expand_weights": "OIhw8i16o"},
    # a destination of five dims blocked along w, not channels (blockpad check seed 4242 case
    # 56: the fused rule took it for channel blocks and computed the last channel wrong)
    "w_blocked": {**block(3, 18, 12, (8, 9), plain=True), "dst": "nchW16w",
                  "expand_weights": "oIhw8i", "depthwise_weights": "Goihw4g"},
}
POLICY_CASES = {"dst_stage": ["tails"], "src": ["tails", "s1_residual"], "tracked": ["s2_8c"]}
RUNS = [("dst_fused", c) for c in CASES] + [(p, c) for p, cs in POLICY_CASES.items() for c in cs]


@pytest.fixture(scope="module")
def libs(tmp_path_factory):
    return policy_libraries(tmp_path_factory, "ir", CASES, POLICY_CASES)


def _act(v, p):
    if p["algorithm"] == "clip":
        return np.clip(v, p["alpha"], p["beta"])
    return 1 / (1 + np.exp(-v))                  # sigmoid


def reference(entry, a):
    """float64: the three convolutions of the block, each with its bias and activation."""
    x = a["src"].astype(np.float64)
    e = np.einsum("nchw,ec->nehw", x, a["expand_weights"][:, :, 0, 0])
    e = _act(e + a["expand_bias"][:, None, None], entry["expand_post_ops"][0])
    kh, kw = entry["kernel"]
    s = entry["stride"][0]
    ep = np.pad(e, ((0, 0), (0, 0), (kh // 2, kh // 2), (kw // 2, kw // 2)))
    oh, ow = (e.shape[2] - 1) // s + 1, (e.shape[3] - 1) // s + 1
    wd = a["depthwise_weights"][:, 0, 0]
    d = sum(ep[:, :, i:i + s * oh:s, j:j + s * ow:s] * wd[:, i, j][:, None, None]
            for i in range(kh) for j in range(kw))
    d = _act(d + a["depthwise_bias"][:, None, None], entry["depthwise_post_ops"][0])
    y = np.einsum("nehw,ke->nkhw", d, a["weights"][:, :, 0, 0]) + a["bias"][:, None, None]
    return y + a["sum"] if "sum" in a else y


@pytest.mark.parametrize("policy,case", RUNS)
def test_fused_block_matches_numpy(libs, policy, case, rng):
    """Numbers against the float64 block; the destination padding each policy promises (zero,
    or untouched NaN where the kernel writes the valid elements only); nothing written outside
    the destination; under ``src`` every source's padding holds NaN."""
    kernel, entry = libs[policy][case], CASES[case]
    arrays = {name: (rng.standard_normal(lay.shape) * (0.3 if "weights" in name else 1.0))
              .astype(lay.dtype) for name, _, lay, _ in kernel.signature.args[:-1]}
    dst, whole = run_guarded(kernel, arrays, policy)
    np.testing.assert_allclose(dst.to_numpy(), reference(entry, arrays), rtol=1e-5, atol=1e-5)
    assert_padding_contract(kernel, whole)


@pytest.mark.skipif("avx512f" not in machine.cpu_features(),
                    reason="this CPU has no avx512f: the AVX-512 build is checked by its code")
def test_avx512_build_matches_numpy(tmp_path, rng):
    """Where the CPU runs it, the AVX-512 build's numbers: zmm tiles under its accumulator
    limit, and ymm ones for 8-channel blocks (which fell to the generic rule)."""
    names = [n for n in CASES if n != "plain"]
    bp.build(parse_spec({"kernel": [{**CASES[n], "name": n} for n in names]}), "avx512",
             tmp_path, log=lambda m: None)
    lib = bp.load(tmp_path)
    for n in names:
        kernel = lib[n]
        arrays = {name: (rng.standard_normal(lay.shape) * (0.3 if "weights" in name else 1.0))
                  .astype(lay.dtype) for name, _, lay, _ in kernel.signature.args[:-1]}
        dst, whole = run_guarded(kernel, arrays, "dst_fused")
        np.testing.assert_allclose(dst.to_numpy(), reference(CASES[n], arrays), rtol=1e-5,
                                   atol=1e-5, err_msg=n)
        assert_padding_contract(kernel, whole)


@pytest.mark.parametrize("target", ["host", "avx512"])
@pytest.mark.parametrize("case", ["s1_residual", "s2_8c", "tails", "k5_batch"])
def test_rule_keeps_the_expansion_in_bands(case, target):
    """The build picks the fused rule for blocked blocks, and the expansion is computed inside
    the parallel loop (a band at a time), the depthwise and projection inside it too: no stage
    of the block is a pass of its own over the image."""
    func = _kernels(CASES[case])[0].func
    rule, sch = first_match(RULES["x86"], func, get_target(target))
    assert isinstance(rule, InvertedResidual)
    script = sch.mod["main"].script()
    # one parallel loop holds every stage (the other ones copy per-channel tensors)
    main = next(p for p in script.split("T.parallel")[1:] if 'T.sblock("dst")' in p)
    for stage in ("expand_update", "expanded", "depthwise_update", "depthwise_out",
                  "acc_update", "dst"):
        assert f'T.sblock("{stage}")' in main


@pytest.mark.parametrize("case", ["plain", "w_blocked"])
def test_rule_leaves_a_plain_block_to_the_generic_one(case):
    """The rule's tiles are channel blocks: a plain destination, or one blocked along w, is
    the generic rule's (its numbers: test_fused_block_matches_numpy)."""
    assert InvertedResidual().apply(_kernels(CASES[case])[0].func, get_target("host")) is None


@pytest.mark.parametrize("change,message", [
    ({"kernel": [2, 2]}, "odd sides"),
    ({"expand_post_ops": [{"kind": "bias"}]}, "eltwise post-ops only"),
    ({"dtype": "uint8"}, "dtype must be one of float32, float64"),
    ({"expanded": 0}, "expanded must be a positive integer"),
])
def test_spec_refuses(change, message):
    with pytest.raises(SpecError, match=message):
        parse_spec({"kernel": [{**CASES["tails"], **change}]})


# ---- the Graph pass ----------------------------------------------------------------------------

def _mobile_block(cache, rng, c, e, hw, stride=1, fuse=None, read_expanded=False):
    """MobileNetV2's block as a user (or the ONNX importer) writes it: three convolutions with
    biases and relu6, the residual add where the shapes allow."""
    g = bp.Graph(cache=cache, **({} if fuse is None else {"fuse": fuse}))
    x = g.input("x", (1, c, hw, hw))
    w = {n: g.constant(n, (rng.standard_normal(s) * 0.3).astype("float32")) for n, s in (
        ("w1", (e, c, 1, 1)), ("b1", (e,)), ("wd", (e, 1, 3, 3)), ("bd", (e,)),
        ("w2", (c, e, 1, 1)), ("b2", (c,)))}
    t = g.eltwise(g.conv2d(x, w["w1"], w["b1"]), "clip", 0.0, 6.0)
    d = g.eltwise(g.conv2d(t, w["wd"], w["bd"], stride=stride, pad=1, groups=e), "clip",
                  0.0, 6.0)
    y = g.conv2d(d, w["w2"], w["b2"])
    if stride == 1:
        y = g.add(y, x)
    g.output(y, *([t] if read_expanded else []))
    return g, y.name


def _block_reference(g, x, stride):
    a = g.constants
    entry = {"expand_post_ops": [RELU6], "depthwise_post_ops": [RELU6], "kernel": [3, 3],
             "stride": [stride]}
    arrays = {"src": x, "expand_weights": a["w1"], "expand_bias": a["b1"],
              "depthwise_weights": a["wd"][:, None], "depthwise_bias": a["bd"],
              "weights": a["w2"], "bias": a["b2"], **({"sum": x} if stride == 1 else {})}
    return reference(entry, arrays)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return bp.jit_cache(cache_dir=tmp_path_factory.getbasetemp() / "bp-jit")


@pytest.mark.parametrize("stride", [1, 2])
def test_graph_runs_the_block_as_one_kernel(cache, rng, stride):
    """The three convolutions, their relu6s and the residual add become one kernel; the result
    matches the float64 block and the unfused graph's."""
    x = rng.standard_normal((1, 16, 40, 40)).astype("float32")   # expanded: 600 KiB
    g, y = _mobile_block(cache, rng, 16, 96, 40, stride)
    res = g.run(x=x)
    names = [n.name for n in g.nodes if n.op == "conv2d"]
    assert res.report.fused[-1] == " + ".join(names)
    assert [s.label for s in g.plan(x=x).steps][1:] == [names[-1]]   # after the reorder in
    np.testing.assert_allclose(res[y].numpy(), _block_reference(g, x, stride), rtol=1e-4,
                               atol=1e-4)
    u, _ = _mobile_block(cache, np.random.default_rng(0), 16, 96, 40, stride,
                         fuse=("eltwise", "sum"))
    u.constants.update(g.constants)
    assert not any("+" in f and f.count("+") == 2 for f in u.run(x=x).report.fused)
    np.testing.assert_allclose(u.run(x=x)[y].numpy(), res[y].numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("why", ["expanded_read", "small", "not_asked"])
def test_graph_leaves_blocks_it_must_not_fuse(cache, rng, why):
    """An expanded tensor the caller reads, one that fits the cache anyway
    (``FUSE_EXPANDED_BYTES``), and a graph that asks for post-ops only keep three kernels."""
    hw = 8 if why == "small" else 40
    g, y = _mobile_block(cache, rng, 16, 96, hw, read_expanded=why == "expanded_read",
                         fuse=("eltwise", "sum") if why == "not_asked" else None)
    x = rng.standard_normal((1, 16, hw, hw)).astype("float32")
    res = g.run(x=x)
    assert all(f.count(" + ") == 1 for f in res.report.fused)
    np.testing.assert_allclose(res[y].numpy(), _block_reference(g, x, 1), rtol=1e-4, atol=1e-4)


def test_tuning_space_varies_the_bands():
    """``blockpad tune`` measures band heights on the device: the rule's default first, then
    distinct variants (one band, more bands, other buffer sizes)."""
    func = _kernels(block(16, 96, 16, (40, 40), residual=True))[0].func
    target = get_target("host")
    space = InvertedResidual().space(func, target)
    default = InvertedResidual().apply(func, target)
    assert len(space) >= 3
    assert space[0].mod["main"].script() == default.mod["main"].script()
    assert len({s.mod["main"].script() for s in space}) == len(space)


def test_one_thread_runs_the_image_in_one_band(tmp_path):
    """A 14x14 block is two bands by default (a task per core; each recomputes the other's
    halo rows); the build also compiles it in one band for a pool of one thread, and a
    process whose pool has one thread calls that one. Both processes' results against the
    float64 block, and equal to the bit: the bands only split the work."""
    entry = block(24, 72, 24, (14, 14), residual=True)
    bp.build(parse_spec({"kernel": [{**entry, "name": "ir"}]}), "host", tmp_path,
             log=lambda m: None)
    record, = (k for k in bp.load(tmp_path).manifest["kernels"] if k["name"] == "ir")
    assert record["threads"] == {"1": "ir__threads1"}
    got = {threads: run_in_pool(tmp_path, "ir", threads, weight_scale=0.3)
           for threads in (1, 2)}
    assert got[1][0] == "ir__threads1" and got[2][0] == "ir"
    for symbol, arrays in got.values():
        np.testing.assert_allclose(arrays["dst"], reference(entry, arrays), rtol=1e-5,
                                   atol=1e-5, err_msg=symbol)
    np.testing.assert_array_equal(got[1][1]["dst"], got[2][1]["dst"])


def test_the_one_thread_variant_is_one_band():
    """``for_threads(1)`` drops the two-band minimum only: one parallel task where the image
    fits the band buffer, the fewest bands the buffer allows where it does not (a 112x112
    block: 5 of 12 rows, where the default's 8 bands of 7 rows split evenly over two cores),
    nothing for more threads."""
    rule, target = InvertedResidual(), get_target("host")
    small = _kernels(block(24, 72, 24, (14, 14)))[0].func
    large = _kernels(block(16, 96, 24, (112, 112), stride=2))[0].func
    def bands(sch):   # the extent of the loop over batch x bands, the parallel tasks
        return re.findall(r"in T\.parallel\((\d+)\)", sch.mod["main"].script())

    assert bands(rule.apply(small, target)) == ["2"]
    assert bands(rule.for_threads(small, target, 1)) == ["1"]
    assert rule.for_threads(small, target, 2) is None
    assert bands(rule.apply(large, target)) == ["8"]
    assert bands(rule.for_threads(large, target, 1)) == ["5"]


def test_a_projection_into_8_channel_blocks_keeps_zmm_expansions(tmp_path):
    """An ``nChw8c`` destination on AVX-512 (compiled here whatever this CPU runs): the
    projection's FMAs on ymm, 24 channels as three of them rather than two zmm, the expansion's
    and the depthwise's still on zmm (their blocks are 16: channel_blocks.inner_block)."""
    bp.build(parse_spec({"kernel": [{**CASES["in_8c"], "shape": [1, 24, 14, 14],
                                      "name": "ir"}]}), "avx512", tmp_path, log=lambda m: None)
    code = kernel_instructions(asm_functions(tmp_path), "ir")
    fmas = [line for line in code if "vfmadd" in line]
    assert sum("%zmm" in line for line in fmas) >= 9 and sum("%ymm" in line for line in fmas) >= 3


@pytest.mark.parametrize("target,register", [("host", "ymm"), ("avx512", "zmm")])
def test_every_stage_runs_in_full_vectors(tmp_path, target, register):
    """Built for AVX2 and AVX-512 (compiled here whatever this CPU runs; the host build's
    numbers are checked above, the AVX-512 one computes the same TE with wider tiles): the
    expansion, depthwise and projection FMAs are vector FMAs on the target's widest registers,
    none scalar."""
    bp.build(parse_spec({"kernel": [{**block(24, 144, 24, (14, 14), residual=True),
                                      "name": "ir"}]}), target, tmp_path, log=lambda m: None)
    code = kernel_instructions(asm_functions(tmp_path), "ir")
    fmas = [line for line in code if "vfmadd" in line or "vfnmadd" in line]
    assert sum(f"%{register}" in line for line in fmas) >= 3 * 9   # taps, tiles, stages
    assert not [line for line in fmas if re.search(r"vf\w*(ss|sd)\b", line)]


def test_a_graph_refuses_a_hand_made_node(cache):
    """The node is the fusion pass's: added by hand without its attributes, a clear error."""
    g = bp.Graph(cache=cache)
    x = g.input("x", (1, 8, 4, 4))
    with pytest.raises(bp.errors.ArgumentError, match="made by the fusion pass"):
        g.add_op("inverted_residual", [x])
