"""Graphs (issue 6): layout propagation, the in-place pass (seed 003), fallback, the padding
policy across a graph, the run report, weights, sub-memories and threads. Every graph is
compared with numpy references that do not come from runtime/graph/ops.py (tests/reference.py,
or written here).

Kernels come from one JIT cache directory shared by the test modules of a session (first use
compiles, later ones load)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import blockpad as bp
from blockpad.runtime import counters
from blockpad.runtime.cache import KernelCache
from blockpad.runtime.graph.passes import Node, inplace_pass
from blockpad.runtime.library import BoundCall
from blockpad.runtime.memory import SubMemoryError
from blockpad.vocabulary import KERNEL_ZEROS, POLICIES

from .conftest import run_in_threads
from .reference import conv_reference, softmax


def ref_conv(x, w, bias=None, pad=0):
    """The convolution from tests/reference.py (independent of runtime/graph/ops.py)."""
    out = conv_reference(x.astype(np.float64), w.astype(np.float64),
                         {"stride": (1, 1), "pad": (pad, pad), "dilation": (1, 1), "groups": 1})
    return out if bias is None else out + bias.reshape(1, -1, 1, 1)

S = (2, 30, 5, 7)          # channels pad to 32 in nChw16c
BLK = bp.Layout("nChw16c", S)
X = (1, 13, 6, 6)          # convolution tests: odd channel counts
MID = 31                  # a 3x3 over 31 channels reduces over the whole block of 32


@pytest.fixture(scope="session")
def cache(tmp_path_factory):
    return bp.jit_cache(cache_dir=tmp_path_factory.getbasetemp() / "bp-jit")


def sigmoid(x):
    return 1 / (1 + np.exp(-x))


def arr(rng, shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype("float32")


# ---- graphs without convolution: follow-the-input layouts, in place -----------------------

def _eltwise_chain(cache, policy="dst_fused", inplace=True):
    g = bp.Graph(policy=policy, cache=cache, inplace=inplace)
    x, y = g.input("x", S), g.input("y", S)
    a = g.sigmoid(x)
    b = g.relu(a)              # a is read twice (here and below): never overwritten
    c = g.add(b, y)
    e = g.linear(g.add(c, a), 2.0, 1.0)
    g.output(e)
    return g


def _eltwise_ref(x, y):
    a = sigmoid(x)
    return 2 * (np.maximum(a, 0) + y + a) + 1


def test_follow_input_layout_and_read_twice_is_never_overwritten(cache, rng):
    g = _eltwise_chain(cache)
    x, y = arr(rng, S), arr(rng, S)
    res = g.run(x=bp.Memory.from_numpy(x, BLK), y=y)          # x arrives blocked
    out = res["eltwise_2"]
    assert out.layout == BLK                                   # kept blocked, not reordered
    assert res.report.output_reorders == 0
    assert np.allclose(out.numpy(), _eltwise_ref(x, y), atol=1e-5)
    assert res.report.output_reorders == 1                     # reordered when read, once
    out.numpy()
    assert res.report.output_reorders == 1
    plan = g.plan(x=BLK, y=y)
    assert res.report.reorders == 1                            # y: nchw -> nChw16c, once
    # a (sigmoid's output) has two readers: relu may not overwrite it (rule 1)
    assert "eltwise_1" not in res.report.inplace
    assert any(op == "eltwise_1" and "rule 1" in why for op, _, why in plan.inplace_result.refused)
    assert set(res.report.inplace) == {"binary_0", "binary_1", "eltwise_2"}


def test_inplace_lowers_peak_memory_and_changes_nothing(cache, rng):
    x, y = arr(rng, S), arr(rng, S)
    xm = bp.Memory.from_numpy(x, BLK)
    on = _eltwise_chain(cache, inplace=True).run(x=xm, y=y)
    off = _eltwise_chain(cache, inplace=False).run(x=xm, y=y)
    assert off.report.inplace == [] and len(on.report.inplace) == 3
    assert on.report.peak_bytes < off.report.peak_bytes
    assert on.report.arena_bytes <= off.report.arena_bytes
    assert np.array_equal(on["eltwise_2"].numpy(), off["eltwise_2"].numpy())


def test_a_result_the_caller_reads_is_not_overwritten(cache, rng):
    g = bp.Graph(cache=cache)
    x = g.input("x", S)
    a = g.relu(x)
    b = g.sigmoid(a)           # would overwrite a in place, but a is a result
    c = g.tanh(b)              # b is not a result: c overwrites it
    d = g.exp(g.linear(c, 0.5))   # c (in b's buffer) is a result: not overwritten either
    g.output(a, c, d)
    xv = arr(rng, S)
    res = g.run(x=bp.Memory.from_numpy(xv, BLK))
    assert res.report.inplace == ["eltwise_2", "eltwise_4"]
    want_c = np.tanh(sigmoid(np.maximum(xv, 0)))
    assert np.array_equal(res["eltwise_0"].numpy(), np.maximum(xv, 0))
    assert np.allclose(res["eltwise_2"].numpy(), want_c, atol=1e-6)
    assert np.allclose(res["eltwise_4"].numpy(), np.exp(0.5 * want_c), atol=1e-6)


# ---- seed 003's examples ----------------------------------------------------------------------

def _top_k(k):
    def fn(x):
        idx = np.argsort(-x, axis=-1, kind="stable")[..., :k]
        return np.take_along_axis(x, idx, -1), idx.astype("int64")
    return fn


def test_seed_multi_output_example_8_patterns(cache, rng):
    """elementwise_add(a, b) -> c read by two top_k ops with two outputs each: the seed's 8
    patterns; add runs in place and the renaming reaches both top_k."""
    shape, k = (4, 30), 3
    outs = [((4, k), "float32"), ((4, k), "int64")]
    g = bp.Graph.from_ops([
        {"op": "eltwise", "inputs": ["x"], "outputs": ["a"], "algorithm": "tanh"},
        {"op": "eltwise", "inputs": ["y"], "outputs": ["b"], "algorithm": "sigmoid"},
        {"op": "binary", "name": "elementwise_add", "inputs": ["a", "b"], "outputs": ["c"]},
        {"op": "custom", "name": "top_k_left", "fn": _top_k(k), "inputs": ["c"],
         "outputs": ["d", "e"], "shapes": outs},
        {"op": "custom", "name": "top_k_right", "fn": _top_k(k), "inputs": ["c"],
         "outputs": ["g", "h"], "shapes": outs},
    ], inputs={"x": shape, "y": shape}, outputs=["d", "e", "g", "h"], cache=cache)
    x, y = arr(rng, shape), arr(rng, shape)
    plan = g.plan(x=x, y=y)
    patterns = [str(p) for p in plan.inplace_result.patterns if p.op == "elementwise_add"]
    assert sorted(patterns) == sorted(
        f"{i} -> elementwise_add -> c -> top_k_{side} -> {o}"
        for i in "ab" for side, pair in (("left", "de"), ("right", "gh")) for o in pair)
    assert len(patterns) == 8
    assert plan.inplace_result.inplace_ops == ["elementwise_add"]
    nodes = {n.name: n for n in plan.inplace_result.nodes}
    assert nodes["elementwise_add"].outputs == ["a"]
    assert nodes["top_k_left"].inputs == ["a"] and nodes["top_k_right"].inputs == ["a"]
    res = g.run(x=x, y=y)
    want = _top_k(k)(np.tanh(x) + sigmoid(y))
    for name, i in (("d", 0), ("e", 1), ("g", 0), ("h", 1)):
        assert np.allclose(res[name].numpy(), want[i], atol=1e-6), name


def test_binary_add_overwrites_whichever_operand_is_free(cache, rng):
    g = bp.Graph(cache=cache)
    x, y = g.input("x", S), g.input("y", S)
    a = g.relu(x)
    b = g.sigmoid(y)
    c = g.add(a, b)            # a is read again below: the add overwrites b instead
    g.output(g.mul(c, a))
    xv, yv = arr(rng, S), arr(rng, S)
    res = g.run(x=bp.Memory.from_numpy(xv, BLK), y=bp.Memory.from_numpy(yv, BLK))
    assert res.report.inplace == ["binary_0", "binary_1"]
    want = (np.maximum(xv, 0) + sigmoid(yv)) * np.maximum(xv, 0)
    assert np.allclose(res["binary_1"].numpy(), want, atol=1e-6)


def _capable(node):
    return [0] if node.op in ("eltwise", "softmax", "binary") else []


def test_seed_rule_2_unwanted_inplace():
    """softmax a -> b, then layer_norm reuses var a for its output (b -> a): making softmax
    in place would make layer_norm in place too, which it cannot be."""
    nodes = [Node("softmax", "softmax", ["a"], ["b"]),
             Node("layer_norm", "custom", ["b"], ["a"])]
    res = inplace_pass(nodes, _capable)
    assert res.applied == []
    assert "rule 2" in res.refused[0][2]
    # the same with an op that can run in place: both run in place (seed step 4)
    nodes[1] = Node("relu", "eltwise", ["b"], ["a"])
    res = inplace_pass(nodes, _capable)
    assert [n.inputs + n.outputs for n in res.nodes] == [["a", "a"], ["a", "a"]]
    assert sorted(res.inplace_ops) == ["relu", "softmax"]


def test_rule_1_and_renaming_through_an_inplace_chain():
    nodes = [Node("r1", "eltwise", ["t"], ["u"]),
             Node("r2", "eltwise", ["u"], ["v"]),
             Node("other", "custom", ["t"], ["w"]),
             Node("r3", "eltwise", ["v"], ["z"])]
    res = inplace_pass(nodes, _capable)
    names = {n.name: n for n in res.nodes}
    assert "r1" not in res.inplace_ops                         # t is also read by `other`
    assert names["r2"].outputs == ["u"] and names["r3"].inputs == ["u"]
    assert names["r3"].outputs == ["u"]                        # renaming goes on through r3
    assert nodes[1].outputs == ["v"]                           # the input list is not modified


def test_rule_1_counts_only_the_readers_that_run_after_the_op():
    """A reader before the op has read the input already (the plan runs the ops in order):
    a ResNet block's input, read by its first convolution, takes the block's result."""
    nodes = [Node("conv1", "custom", ["x"], ["h"]),
             Node("add", "binary", ["h", "x"], ["y"]),
             Node("late", "custom", ["h"], ["z"])]
    res = inplace_pass(nodes, lambda n: [1] if n.op == "binary" else [])
    assert res.inplace_ops == ["add"] and res.nodes[1].outputs == ["x"]
    nodes[2] = Node("late", "custom", ["x"], ["z"])     # x read again after the add: refused
    res = inplace_pass(nodes, lambda n: [1] if n.op == "binary" else [])
    assert res.applied == [] and "read by late (rule 1)" in res.refused[0][2]


def _bottleneck(cache, policy, inplace=True):
    """A ResNet identity block after a stem: the block input x (not a graph input) is read by
    the first convolution and by the sum the last one takes."""
    rng = np.random.default_rng(3)
    w0, w1, w2 = arr(rng, (16, X[1], 1, 1), 0.3), arr(rng, (MID, 16, 3, 3), 0.2), \
        arr(rng, (16, MID, 1, 1), 0.2)
    g = bp.Graph(policy=policy, cache=cache, inplace=inplace)
    x = g.relu(g.conv2d(g.input("x0", X), g.constant("w0", w0)))
    h = g.relu(g.conv2d(x, g.constant("w1", w1), pad=1))
    y = g.relu(g.add(g.conv2d(h, g.constant("w2", w2)), x))
    g.output(y)

    def ref(x0):
        x = np.maximum(ref_conv(x0, w0), 0)
        return np.maximum(ref_conv(np.maximum(ref_conv(x, w1, pad=1), 0), w2) + x, 0)
    return g, y, ref


@pytest.mark.parametrize("policy", POLICIES)
def test_conv_with_sum_runs_in_place_over_the_block_input(cache, policy, rng):
    g, y, ref = _bottleneck(cache, policy)
    x0 = arr(rng, X)
    res = g.run(x0=x0)
    assert np.allclose(res[y.name].numpy(), ref(x0), atol=1e-4)
    plan = g.plan(x0=x0)
    last = plan.steps[-1]
    assert last.kind == "kernel" and last.inplace and res.report.inplace == [last.label]
    assert "sum" in [a.name for a in last.kernel.signature.args if a.role == "inout"]
    off = _bottleneck(cache, policy, inplace=False)[0].run(x0=x0)
    assert off.report.inplace == [] and off.report.arena_bytes > res.report.arena_bytes
    assert np.array_equal(off[y.name].numpy(), res[y.name].numpy())


def test_softmax_graph_from_seed_runs(cache, rng):
    g = bp.Graph(cache=cache)
    x = g.input("x", S)
    g.output(g.softmax(g.relu(x), axis=1))
    xv = arr(rng, S)
    res = g.run(x=bp.Memory.from_numpy(xv, BLK))
    assert np.allclose(res["softmax_0"].numpy(), softmax({"axis": 1}, np.maximum(xv, 0)), atol=1e-6)


# ---- convolution blocks: layout propagation, weights, policies ---------------------------------

def _conv_block(cache, policy="dst_fused", weights=None, bias=True, **kw):
    rng = np.random.default_rng(1)
    w1 = weights[0] if weights else arr(rng, (MID, X[1], 3, 3), 0.2)
    w2 = weights[1] if weights else arr(rng, (X[1], MID, 3, 3), 0.2)
    b1 = arr(rng, (MID,))
    g = bp.Graph(policy=policy, cache=cache, **kw)
    x = g.input("x", X)
    cw1, cw2 = g.constant("w1", w1), g.constant("w2", w2)
    h = g.conv2d(x, cw1, g.constant("b1", b1) if bias else None, pad=1)
    h = g.relu(h)
    h = g.conv2d(h, cw2, pad=1)
    y = g.sigmoid(g.add(h, x))
    g.output(y)

    def ref(xv, w1=w1, w2=w2):
        h = np.maximum(ref_conv(xv, w1, b1 if bias else None, pad=1), 0)
        return sigmoid(ref_conv(h, w2, pad=1) + xv)
    return g, ref


@pytest.mark.parametrize("policy", POLICIES)
def test_conv_block_every_policy_matches_numpy(cache, policy, rng):
    g, ref = _conv_block(cache, policy)
    xv = arr(rng, X)
    for _ in range(2):                        # the second run reuses the arena and weights
        res = g.run(x=xv)
        assert np.allclose(res["eltwise_1"].numpy(), ref(xv), atol=1e-5)
    plan = g.plan(x=xv)
    kinds = [(s.kind, s.label) for s in plan.steps]
    assert kinds[0] == ("reorder", "reorder x nchw->nChw16c")
    assert sum(k == "reorder" for k, _ in kinds) == 1   # x once, shared by conv and add
    assert all(s.kernel is not None for s in plan.steps)
    assert res["eltwise_1"].layout.tag == "nChw16c"      # blocked until read
    assert res.report.weight_reorders == 0               # done once, in the first run
    assert res.report.fallbacks == {}
    # kernels that zero their destinations' padding keep every source clean, so the run calls
    # them without per-call checks (BoundCall.trusted); other policies check every call
    with g.runner(x=xv).arena() as exe:
        checked = sum(isinstance(c, BoundCall) for c in exe.calls)
    kernels = [s.kernel.signature for s in plan.steps if s.kernel is not None]
    staged = sum(bool(sig.stage) for sig in kernels)    # a destination stage to run after
    assert checked == (staged if policy in KERNEL_ZEROS else len(kernels))
    assert (staged > 0) == (policy == "dst_stage")


def test_tracked_skips_zero_pads_a_clean_producer_made_unnecessary(cache, rng):
    xv = arr(rng, X)
    counts = {}
    for policy, bias in (("tracked", False), ("tracked", True)):
        g, ref = _conv_block(cache, policy, bias=bias)
        g.run(x=xv)
        res = g.run(x=xv)
        assert np.allclose(res["eltwise_1"].numpy(), ref(xv), atol=1e-5)
        assert res.report.fallbacks == {}
        counts[policy, bias] = res.report.zero_pad_calls
    # no bias: reorder -> conv -> relu -> conv all leave clean padding: nothing to do
    assert counts["tracked", False] == 0
    # bias breaks zeros: relu inherits the dirt, the second conv needs it clean: one pass
    assert counts["tracked", True] == 1
    # on_handle zero-pads every padded buffer the graph binds (at "memory creation"), every
    # run; tracked none of them: its producers all leave clean padding
    x, y = arr(rng, S), arr(rng, S)
    for policy in ("on_handle", "tracked"):
        g = _eltwise_chain(cache, policy)
        res = g.run(x=bp.Memory.from_numpy(x, BLK), y=y)
        counts[policy] = res.report.zero_pad_calls, res.report.zero_pad_blocking
        assert np.allclose(res["eltwise_2"].numpy(), _eltwise_ref(x, y), atol=1e-5)
    assert counts["on_handle"] == (3, 3)       # sigmoid's and y's buffers, and the result's
    assert counts["tracked"] == (0, 0)


def test_weights_reordered_once_and_changes_are_not_served_stale(cache, rng):
    rng1 = np.random.default_rng(5)
    w1, w2 = arr(rng1, (MID, X[1], 3, 3), 0.2), arr(rng1, (X[1], MID, 3, 3), 0.2)
    g, ref = _conv_block(cache, weights=(w1, w2))          # weights="check" (default)
    xv = arr(rng, X)
    first = g.run(x=xv)
    assert first.report.weight_reorders == 2
    assert g.run(x=xv).report.weight_reorders == 0
    w1 *= -1.0                                              # the caller changes a weight in place
    res = g.run(x=xv)
    assert res.report.weight_reorders == 1                  # detected (a byte compare per run)
    assert np.allclose(res["eltwise_1"].numpy(), ref(xv, w1, w2), atol=1e-5)


def test_frozen_weights_refresh_explicitly(cache, rng):
    rng1 = np.random.default_rng(6)
    w1, w2 = arr(rng1, (MID, X[1], 3, 3), 0.2), arr(rng1, (X[1], MID, 3, 3), 0.2)
    g, ref = _frozen_block(cache, w1, w2)
    xv = arr(rng, X)
    before = g.run(x=xv)["eltwise_1"].numpy()
    w1 *= -1.0                                   # frozen: a snapshot was taken
    res = g.run(x=xv)
    assert res.report.weight_reorders == 0
    assert np.array_equal(res["eltwise_1"].numpy(), before)
    g.set_constant("w1", w1)                     # the documented refresh
    res = g.run(x=xv)
    assert res.report.weight_reorders == 1
    assert np.allclose(res["eltwise_1"].numpy(), ref(xv, w1, w2), atol=1e-5)


def test_owned_constants_are_read_only_and_never_compared(cache, rng):
    """``constant(..., owned=True)`` (what the ONNX importer gives): the array turns read-only,
    so nothing can change it behind the graph's back, and under weights="check" it is neither
    copied nor compared before each run; set_constant still replaces it (the caller's array
    from then on, checked again)."""
    rng1 = np.random.default_rng(8)
    w = arr(rng1, (MID, X[1], 3, 3), 0.2)
    g = bp.Graph(cache=cache)
    x = g.input("x", X)
    g.output(g.conv2d(x, g.constant("w", w, owned=True), pad=1))
    xv = arr(rng, X)
    assert np.allclose(g.run(x=xv)["conv2d_0"].numpy(), ref_conv(xv, w, pad=1), atol=1e-5)
    with pytest.raises(ValueError, match="read-only"):
        w[0] = 0.0
    assert g.weight_cache._kept == {}
    w2 = -w
    g.set_constant("w", w2)
    assert np.allclose(g.run(x=xv)["conv2d_0"].numpy(), ref_conv(xv, w2, pad=1), atol=1e-5)
    w2 *= 2.0                                     # the caller's array now: a change is seen
    res = g.run(x=xv)
    assert res.report.weight_reorders == 1
    assert np.allclose(res["conv2d_0"].numpy(), ref_conv(xv, w2, pad=1), atol=1e-5)


def test_a_constant_read_as_it_is_follows_set_constant(cache, rng):
    """A bias is read by its convolution as it is (no prepared layout): the run binds it once
    and again only after set_constant gave the graph another array."""
    rng1 = np.random.default_rng(7)
    w1, w2 = arr(rng1, (MID, X[1], 3, 3), 0.2), arr(rng1, (X[1], MID, 3, 3), 0.2)
    g, _ = _frozen_block(cache, w1, w2)
    xv = arr(rng, X)
    g.run(x=xv)
    b1 = arr(rng1, (MID,))
    g.set_constant("b1", b1)
    h = np.maximum(ref_conv(xv, w1, b1, pad=1), 0)
    want = sigmoid(ref_conv(h, w2, pad=1) + xv)
    for _ in range(2):   # and stays bound to it
        assert np.allclose(g.run(x=xv)["eltwise_1"].numpy(), want, atol=1e-5)


def _frozen_block(cache, w1, w2):
    b1 = arr(np.random.default_rng(1), (MID,))
    g = bp.Graph(cache=cache, weights="frozen")
    x = g.input("x", X)
    h = g.relu(g.conv2d(x, g.constant("w1", w1), g.constant("b1", b1), pad=1))
    g.output(g.sigmoid(g.add(g.conv2d(h, g.constant("w2", w2), pad=1), x)))

    def ref(xv, w1, w2):
        h = np.maximum(ref_conv(xv, w1, b1, pad=1), 0)
        return sigmoid(ref_conv(h, w2, pad=1) + xv)
    return g, ref


@pytest.mark.parametrize("policy", ["on_handle", "src", "tracked"])
def test_read_only_inputs_and_weights_are_never_written(cache, policy, rng):
    g, ref = _conv_block(cache, policy)
    xv = arr(rng, X)
    xv.setflags(write=False)
    for c in g.constants.values():
        c.setflags(write=False)
    saved = {k: v.copy() for k, v in g.constants.items()}
    res = g.run(x=xv)
    assert np.allclose(res["eltwise_1"].numpy(), ref(xv), atol=1e-5)
    assert all(np.array_equal(g.constants[k], v) for k, v in saved.items())
    # a blocked, read-only input with dirty padding: the graph copies, never writes it
    xm = bp.Memory.from_numpy(arr(rng, S), BLK)
    xm.buffer[BLK.padding_offsets()] = np.nan
    xm.state = "dirty"
    xm.buffer.setflags(write=False)
    before = xm.buffer.copy()
    g2 = bp.Graph(policy=policy, cache=cache)
    t = g2.input("x", S)
    g2.output(g2.conv2d(t, g2.constant("w", arr(rng, (7, 30, 1, 1)))))
    out = g2.run(x=xm)
    assert np.array_equal(xm.buffer, before, equal_nan=True)
    w = g2.constants["w"]
    assert np.allclose(out["conv2d_0"].numpy(), ref_conv(xm.to_numpy(), w), atol=1e-4)


def test_post_op_fusion_changes_nothing_but_the_kernel_count(cache, rng):
    xv = arr(rng, X)
    fused_g, ref = _conv_block(cache)             # the default: eltwise and sum post-ops
    plain_g, _ = _conv_block(cache, fuse=False)
    eltwise_g, _ = _conv_block(cache, fuse=("eltwise",))
    assert eltwise_g.run(x=xv).report.fused == ["conv2d_0 + eltwise_0"]
    fused, unfused = fused_g.run(x=xv), plain_g.run(x=xv)
    assert fused.report.fused == ["conv2d_0 + eltwise_0", "conv2d_1 + binary_0",
                                  "conv2d_1 + eltwise_1"]
    assert [s.label for s in fused_g.plan(x=xv).steps] == [
        "reorder x nchw->nChw16c", "conv2d_0", "conv2d_1"]
    assert fused.report.kernels == 3 and unfused.report.kernels == 6
    assert fused.report.peak_bytes <= unfused.report.peak_bytes   # in place already saved it
    for res in (fused, unfused):
        assert np.allclose(res["eltwise_1"].numpy(), ref(xv), atol=1e-5)
    # x is read by conv2d_0 and, as the sum post-op, by conv2d_1: one reorder serves both
    assert fused.report.reorders == 1



@pytest.mark.parametrize("conv_first", [True, False])
def test_a_quantized_convolution_takes_a_quantized_add_and_packs_dot_product_weights(
        cache, rng, conv_first):
    """A post-op runs on a convolution's value before it is requantized, so a relu of the
    uint8 result ``q`` (standing for ``s (q - z)``) is not the relu post-op, and the graph
    leaves it alone; a quantized add of an 8-bit tensor fuses as the ``quantized_add``
    post-op, which rounds the convolution's value first (either operand order: the fmas
    round in QLinearAdd's order). Fused, unfused and a numpy reference (``qlinear``) agree to
    the bit, on 20 channels (12 padded ones per 32) and a padded 3x3 window."""
    from blockpad import qlinear

    scales, zps = [0.011, 0.023, 0.031], [128, 3, 100]

    def graph(fuse):
        g = bp.Graph(cache=cache, fuse=fuse)
        x = g.input("x", (1, 20, 5, 5), "uint8")
        w = g.constant("w", rng_w)
        y = g.conv2d(x, w, pad=1, scale=g.constant("s", sv), src_zero_point=3,
                     dst_zero_point=128, dst_dtype="uint8")
        a, b = (y, x) if conv_first else (x, y)
        g.output(g.relu(g.quantized_add(a, b, scales if conv_first else scales[1::-1] + scales[2:],
                                        zps if conv_first else zps[1::-1] + zps[2:])))
        return g

    rng_w = rng.integers(-64, 64, (20, 20, 3, 3)).astype("int8")
    sv = rng.uniform(0.002, 0.02, 20).astype("float32")
    xv = rng.integers(0, 256, (1, 20, 5, 5)).astype("uint8")
    g = graph(True)
    fused, unfused = g.run(x=xv), graph(False).run(x=xv)
    assert fused.report.fused == ["conv2d_0 + binary_0"] and unfused.report.fused == []
    # int8 weights are packed for the dot-product instructions (16 outputs x 4 input channels
    # a register), not OIhw16i16o, which no dot-product rule takes
    assert "OIhw4i16o4i" in g.plan(x=xv).describe()
    acc = qlinear.conv_acc(xv, 3, rng_w, None, (1, 1), ((1, 1), (1, 1)), (1, 1), 1)
    q = qlinear.saturate(np.rint(acc.astype("float32") * sv[:, None, None]).astype(np.int64)
                         + 128, "uint8")
    params = qlinear.add_params(scales[0], zps[0], scales[1], zps[1], scales[2], zps[2])
    want = qlinear.add(q, xv, params, "uint8") if conv_first else \
        qlinear.add(xv, q, qlinear.add_params(scales[1], zps[1], scales[0], zps[0],
                                              scales[2], zps[2]), "uint8")
    want = np.maximum(want, 0)
    for res in (fused, unfused):
        assert np.array_equal(res["eltwise_0"].numpy(), want)


def test_seven_bit_constant_weights_take_the_seven_bit_kernel_and_stay_exact(cache, rng):
    """An int8 convolution whose constant weights lie in [-64, 64] gets a weight_bits = 7
    kernel (one vpmaddubsw a step); new weights outside that range given by set_constant plan
    the graph again (a full-range kernel), and the same change made in place under
    weights="check" is refused before the kernel could saturate. Results equal the numpy
    reference throughout."""
    from blockpad.runtime.graph.ops import GRAPH_OPS

    w7 = rng.integers(-64, 65, (16, 16, 3, 3)).astype("int8")
    g = bp.Graph(cache=cache)
    x = g.input("x", (1, 16, 6, 6), "uint8")
    y = g.conv2d(x, g.constant("w", w7), pad=1, scale=g.constant("s", np.full(16, 0.01, "float32")),
                 src_zero_point=5, dst_zero_point=3, dst_dtype="uint8")
    g.output(y)
    xv = rng.integers(0, 256, (1, 16, 6, 6)).astype("uint8")

    def check(res, w):
        node = g.nodes[0]
        want = GRAPH_OPS["conv2d"].reference(node, [xv, w, np.full(16, 0.01, "float32")])[0]
        assert np.array_equal(res["conv2d_0"].numpy(), want)

    def bits():
        return g.plan(x=xv).steps[-1].kernel.signature.params.get("weight_bits", 8)

    check(g.run(x=xv), w7)
    assert bits() == 7
    wide = w7.copy()
    wide[0, 0, 0, 0] = -128
    g.constants["w"][...] = wide                 # in place, weights="check": refused
    with pytest.raises(bp.ArgumentError, match=r"\[-64, 64\].*set_constant"):
        g.run(x=xv)
    g.set_constant("w", wide)                    # the documented way: planned again
    check(g.run(x=xv), wide)
    assert bits() == 8

# ---- fallback ---------------------------------------------------------------------------------

class _NoBlocked:
    """A compiler that cannot make blocked kernels of one op (an unsupported combination, found
    only when the kernel is asked for) and compiles everything else."""

    def __init__(self, op):
        from blockpad.jit import compile_kernels, fingerprint

        self.op, self._compile, self.fingerprint = op, compile_kernels, fingerprint

    def __call__(self, entries, policy, target, out_dir):
        for e in entries:
            tags = [v["tag"] for v in e.values() if isinstance(v, dict) and "tag" in v]
            if e["op"] == self.op and any(t != t.lower() for t in tags):
                raise bp.SpecError(f"{self.op}: no blocked kernel for {tags}")
        return self._compile(entries, policy, target, out_dir)


def test_fallback_to_plain_when_no_blocked_kernel(cache, tmp_path, rng):
    fallback_cache = KernelCache(compiler=_NoBlocked("eltwise"), cache_dir=tmp_path)
    g, ref = _conv_block(fallback_cache, fuse=False)
    xv = arr(rng, X)
    res = g.run(x=xv)
    assert np.allclose(res["eltwise_1"].numpy(), ref(xv), atol=1e-5)
    assert res.report.fallbacks == {"eltwise_0": "plain", "eltwise_1": "plain"}
    labels = [s.label for s in g.plan(x=xv).steps]
    assert "reorder conv2d_0 nChw16c->nchw" in labels        # to plain for the relu, and back
    assert res["eltwise_1"].layout.is_plain


@pytest.mark.filterwarnings("ignore::blockpad.errors.FallbackWarning")   # the fallback is the point
def test_fallback_to_numpy_without_any_kernel(tmp_path, rng):
    """No compiler and nothing prebuilt: every op runs its numpy reference; still right."""
    g = bp.Graph(cache=KernelCache(compiler=None, cache_dir=tmp_path))
    x, y = g.input("x", S), g.input("y", S)
    g.output(g.softmax(g.add(g.relu(x), y)))
    xv, yv = arr(rng, S), arr(rng, S)
    with pytest.warns(bp.FallbackWarning, match=r"eltwise_0 \(eltwise\): no kernel in any layout"):
        res = g.run(x=xv, y=yv)
    assert set(res.report.fallbacks.values()) == {"numpy"}
    assert np.allclose(res["softmax_0"].numpy(), softmax({"axis": 1}, np.maximum(xv, 0) + yv),
                       atol=1e-6)


def test_fallback_uses_a_prebuilt_plain_library(tmp_path, rng):
    """A deployed process: no compiler, a library with plain kernels only; the graph asks for
    blocked ones first and falls back to what the library has."""
    from blockpad.codegen.spec import parse_spec

    spec = {"kernel": [
        {"op": "eltwise", "name": "relu", "shape": list(S), "src": "nchw", "dst": "nchw"},
        {"op": "binary", "name": "add", "shape": list(S), "src0": "nchw", "src1": "nchw",
         "dst": "nchw", "inplace": True}]}
    bp.build(parse_spec(spec), "host", tmp_path / "lib", log=lambda m: None)
    lib = bp.load(tmp_path / "lib")
    cache = KernelCache([lib], compiler=None, cache_dir=tmp_path / "none")
    g = bp.Graph(cache=cache)
    x, y = g.input("x", S), g.input("y", S)
    g.output(g.add(g.relu(x), y))
    xv, yv = arr(rng, S), arr(rng, S)
    res = g.run(x=bp.Memory.from_numpy(xv, BLK), y=yv)
    assert np.allclose(res["binary_0"].numpy(), np.maximum(xv, 0) + yv)
    # relu falls back to plain (x reordered to nchw, by numpy: the library has no reorder);
    # add then follows its now plain inputs, in place as the library's kernel allows
    assert res.report.fallbacks == {"eltwise_0": "plain"}
    assert res.report.reorders == 1
    assert res.report.inplace == ["binary_0"]
    assert cache.stats().library_hits == 2 and cache.stats().compiles == 0


# ---- graphs feeding graphs, views, threads ------------------------------------------------------

def test_a_blocked_result_feeds_another_graph_without_reorders(cache, rng):
    g1 = bp.Graph(cache=cache)
    t = g1.input("x", X)
    g1.output(g1.conv2d(t, g1.constant("w", arr(rng, (S[1], X[1], 1, 1)))))
    g2 = bp.Graph(cache=cache)
    u = g2.input("h", (1, S[1], 6, 6))
    g2.output(g2.relu(u))
    xv = arr(rng, X)
    h = g1.run(x=xv)["conv2d_0"]
    assert h.layout.tag == "nChw16c"
    res = g2.run(h=h.memory)
    assert res.report.reorders == 0 and res["eltwise_0"].layout.tag == "nChw16c"
    assert np.allclose(res["eltwise_0"].numpy(), np.maximum(h.numpy(), 0))


def test_submemory_views_share_state_or_are_refused(rng):
    x = arr(rng, (4, 30, 3, 5))
    lay = bp.Layout("nChw16c", x.shape)
    m = bp.Memory.from_numpy(x, lay)
    batch = m.submemory((2, 30, 3, 5), (1, 0, 0, 0))         # along the batch: fine
    assert np.array_equal(batch.to_numpy(), x[1:3])
    window = m.submemory((4, 30, 2, 3), (0, 0, 1, 2))        # a window of rows and columns
    assert np.array_equal(window.to_numpy(), x[:, :, 1:3, 2:5])
    tail = m.submemory((4, 14, 3, 5), (0, 16, 0, 0))         # the last channel block
    assert np.array_equal(tail.to_numpy(), x[:, 16:])
    with pytest.raises(SubMemoryError, match="mid-block"):
        m.submemory((4, 10, 3, 5), (0, 5, 0, 0))
    with pytest.raises(SubMemoryError, match=r"c 20\.\.29"):
        m.submemory((4, 20, 3, 5), (0, 0, 0, 0))              # its padding = parent's data
    assert batch.state == window.state == "clean"
    batch.state = "dirty"                                     # a kernel dirtied the view
    assert m.state == "dirty" and window.state == "dirty"     # parent and overlapping views
    tail.buffer[tail.layout.padding_offsets()] = 7.0
    tail.cleanup()                                            # zero-pads the view only
    assert tail.state == "clean" and m.state == "dirty"       # says nothing of the rest
    m.cleanup()
    assert m.padding_is_zero() and batch.state == window.state == "clean"
    assert np.array_equal(m.to_numpy(), x)
    with pytest.raises(bp.ArgumentError, match="sub-memory"):
        batch.set_data_handle(batch.buffer)


def test_threads_share_one_graph_library_and_cache(cache, rng):
    g, ref = _conv_block(cache)
    g2 = _eltwise_chain(cache)
    inputs = [arr(np.random.default_rng(i), X) for i in range(4)]
    pairs = [(arr(np.random.default_rng(10 + i), S), arr(np.random.default_rng(20 + i), S))
             for i in range(4)]
    g.run(x=inputs[0])
    zero_pads = g.run(x=inputs[0]).report.zero_pad_calls   # what one run does, alone

    def work(i):
        for _ in range(5):
            res = g.run(x=inputs[i])
            assert np.allclose(res["eltwise_1"].numpy(), ref(inputs[i]), atol=1e-5)
            assert res.report.zero_pad_calls == zero_pads   # not the other threads' too
            xv, yv = pairs[i]
            r2 = g2.run(x=bp.Memory.from_numpy(xv, BLK), y=yv)
            assert np.allclose(r2["eltwise_2"].numpy(), _eltwise_ref(xv, yv), atol=1e-5)

    run_in_threads(work, range(4))


def test_report_is_printable_and_counts_zero_pads(cache, rng):
    g = _eltwise_chain(cache, "dst_stage")
    counters.reset()
    res = g.run(x=bp.Memory.from_numpy(arr(rng, S), BLK), y=arr(rng, S))
    text = str(res.report)
    for word in ("reorders", "in place", "zero-pads", "peak", "kernel cache"):
        assert word in text
    assert res.report.zero_pad_calls == counters.snapshot().calls > 0
    assert res.report.zero_pad_bytes > 0


def test_counter_scopes_see_their_own_thread_and_its_streams(rng):
    lay = bp.Layout("nChw16c", (1, 30, 2, 2))
    mems = [bp.Memory.zeros(lay) for _ in range(3)]
    stream, other = bp.Stream("scoped"), threading.Thread(target=mems[2].cleanup)
    with counters.scope() as outer:
        mems[0].cleanup()
        with counters.scope() as inner:
            stream.submit(mems[1].cleanup).wait()   # on the stream's worker, for this scope
        other.start()
        other.join()                                 # another thread: in neither scope
    assert (outer.calls, inner.calls) == (2, 1)
    assert inner.bytes == 2 * 2 * 2 * 4 and outer.bytes == 2 * inner.bytes


# ---- post-op fusion keeps the program's order (a name may be written again) ------------------

def _reused_name_graph(cache, fuse, sum_post_op):
    """y = relu(x); c = conv(x); z = y + x (reads the first y); y = relu(c) or c + t (writes y
    again): fusing the second write into the convolution must not move it above z."""
    w = arr(np.random.default_rng(3), (8, 8, 1, 1))
    g = bp.Graph(policy="tracked", cache=cache, fuse=fuse)
    x, t = g.input("x", (1, 8, 4, 4)), g.input("t", (1, 8, 4, 4))
    g.relu(x, name="y")
    c = g.conv2d(x, g.constant("w", w), name="c")
    g.add("y", x, name="z")
    if sum_post_op:
        g.add(c, t, out="y")
    else:
        g.eltwise(c, "relu", out="y")
    g.output("z", "y")

    def ref(xv, tv):
        cv = ref_conv(xv, w)
        return xv + np.maximum(xv, 0), cv + tv if sum_post_op else np.maximum(cv, 0)
    return g, ref


@pytest.mark.parametrize("sum_post_op", [False, True])
def test_fusion_never_moves_a_write_above_a_reader_of_the_name(cache, rng, sum_post_op):
    fuse = ("eltwise", "sum")
    xv, tv = arr(rng, (1, 8, 4, 4)), arr(rng, (1, 8, 4, 4))
    g, ref = _reused_name_graph(cache, fuse, sum_post_op)
    res = g.run(x=xv, t=tv)
    assert res.report.fused == ["c + " + ("binary_0" if sum_post_op else "eltwise_0")]
    z, y = ref(xv, tv)
    assert np.allclose(res["z"].numpy(), z, atol=1e-5)
    assert np.allclose(res["y"].numpy(), y, atol=1e-5)


def test_fusion_order_in_a_framework_program_with_reused_names(cache, rng):
    """from_ops: ``a`` is written twice, with different shapes (8 channels, then 4)."""
    w = arr(np.random.default_rng(4), (4, 8, 1, 1))
    ops = [{"op": "eltwise", "inputs": ["x"], "outputs": ["a"], "algorithm": "relu"},
           {"op": "conv2d", "inputs": ["x", "w"], "outputs": ["c"]},
           {"op": "binary", "inputs": ["a", "x"], "outputs": ["b"], "algorithm": "add"},
           {"op": "eltwise", "inputs": ["c"], "outputs": ["a"], "algorithm": "sigmoid"}]
    g = bp.Graph.from_ops(ops, inputs={"x": (1, 8, 4, 4)}, constants={"w": w},
                          outputs=["b", "a"], cache=cache, policy="dst_fused")
    xv = arr(rng, (1, 8, 4, 4))
    res = g.run(x=xv)
    assert res.report.fused == ["conv2d_1 + eltwise_3"]
    assert res["a"].shape == (1, 4, 4, 4)
    assert np.allclose(res["b"].numpy(), np.maximum(xv, 0) + xv, atol=1e-5)
    assert np.allclose(res["a"].numpy(), sigmoid(ref_conv(xv, w)), atol=1e-5)


# ---- weights="check" cannot be fooled; the API says what it does -----------------------------

def test_weight_edits_that_keep_adler32_are_still_detected(cache, rng):
    """Negating four consecutive float32 weights signed +, -, -, + moves the sign bytes by
    +128, -128, -128, +128 at offsets 3, 7, 11, 15: adler32 does not change, the bytes do."""
    import zlib

    w = np.abs(arr(np.random.default_rng(7), (8, 8, 2, 2))) + 0.1
    w[0, 0] *= np.array([[1, -1], [-1, 1]], "float32")       # the first 2x2 filter: + - - +
    g = bp.Graph(policy="dst_fused", cache=cache)
    g.output(g.conv2d(g.input("x", (1, 8, 5, 5)), g.constant("w", w)))
    xv = arr(rng, (1, 8, 5, 5))
    g.run(x=xv)
    before = zlib.adler32(w.tobytes())
    w[0, 0] *= -1.0
    assert zlib.adler32(w.tobytes()) == before              # the edit adler32 cannot see
    res = g.run(x=xv)
    assert res.report.weight_reorders == 1
    assert np.allclose(res["conv2d_0"].numpy(), ref_conv(xv, w), atol=1e-4)


def test_sum_tensor_without_a_sum_post_op_is_an_error(cache):
    g = bp.Graph(cache=cache)
    x, t = g.input("x", (1, 8, 4, 4)), g.input("t", (1, 8, 4, 4))
    w = g.constant("w", np.ones((8, 8, 1, 1), "float32"))
    with pytest.raises(bp.ArgumentError, match="post_ops has no 'sum' entry"):
        g.conv2d(x, w, sum=t)
    with pytest.raises(bp.ArgumentError, match="needs the tensor to add"):
        g.conv2d(x, w, post_ops=["sum"])


def test_an_input_returned_as_a_result_is_a_copy(cache, rng):
    g = bp.Graph(cache=cache)
    x = g.input("x", S)
    g.output(x, g.relu(x))
    xv = arr(rng, S)
    keep = xv.copy()
    res = g.run(x=xv)
    out = res["x"].numpy()
    assert np.array_equal(out, keep)
    out[...] = 5.0                                  # writing the result leaves the input alone
    assert np.array_equal(xv, keep)
    assert np.allclose(res["eltwise_0"].numpy(), np.maximum(keep, 0))


def test_results_of_earlier_runs_keep_their_values(cache, rng):
    """A small result is written into a buffer the arena keeps and copied out, and an input
    array given again is bound again as it was (neither remakes the kernels' arguments): a
    result held from one run must not change with the next, and new contents of the same
    input array must be read."""
    from blockpad.runtime.graph.execution import OUTPUT_COPY_BYTES
    g = bp.Graph(cache=cache)
    x = g.input("x", S)
    g.output(g.relu(x))
    assert 4 * int(np.prod(S)) <= OUTPUT_COPY_BYTES   # the copied kind of output
    xv = arr(rng, S)
    first = g.run(x=xv)
    first_plain = g(x=xv)
    want = np.maximum(xv, 0)
    xv[...] = -xv                                   # the same array, new contents
    second = g.run(x=xv)
    assert np.array_equal(second["eltwise_0"].numpy(), np.maximum(xv, 0))
    assert np.array_equal(first["eltwise_0"].numpy(), want)
    assert np.array_equal(first_plain, want)
    assert first.report.kernels == second.report.kernels > 0   # filled when read
    xf = np.asfortranarray(arr(rng, S))              # copied to be read: copied again each run
    before = g(x=xf)
    xf[...] = -xf
    assert np.array_equal(g(x=xf), np.maximum(xf, 0)) and np.array_equal(before, np.maximum(-xf, 0))


def test_every_op_method_takes_out(cache, rng):
    g = bp.Graph(cache=cache, inplace=False)
    x = g.input("x", (1, 8, 4, 4))
    w = g.constant("w", arr(np.random.default_rng(8), (8, 8, 1, 1)))
    steps = [lambda: g.relu(x, out="v"), lambda: g.gelu("v", out="v"),
             lambda: g.sigmoid("v", out="v"), lambda: g.tanh("v", out="v"),
             lambda: g.exp("v", out="v"), lambda: g.linear("v", 0.5, 1.0, out="v"),
             lambda: g.add("v", x, out="v"), lambda: g.mul("v", x, out="v"),
             lambda: g.eltwise("v", "clip", -1.0, 1.0, out="v"),
             lambda: g.binary("v", x, "add", out="v"), lambda: g.softmax("v", out="v"),
             lambda: g.log_softmax("v", out="v"), lambda: g.conv2d("v", w, out="v"),
             lambda: g.custom(lambda a: a * 2, ["v"], [((1, 8, 4, 4), "float32")], out="v")]
    for step in steps:
        assert step().name == "v"
    g.output("v")
    xv = arr(rng, (1, 8, 4, 4))
    from scipy.special import erf
    v = np.maximum(xv, 0).astype(np.float64)
    v = 0.5 * v * (1 + erf(v / np.sqrt(2)))
    v = np.exp(np.tanh(1 / (1 + np.exp(-v))))
    v = (0.5 * v + 1.0 + xv) * xv
    v = np.clip(v, -1.0, 1.0) + xv
    v = softmax({"axis": 1}, v)
    v = softmax({"axis": 1, "log": True}, v)
    v = ref_conv(v, g.constants["w"]) * 2
    assert np.allclose(g(x=xv), v, atol=1e-4)


def test_report_separates_planning_and_compiling_from_running(cache, rng):
    g = bp.Graph(cache=cache)
    g.output(g.relu(g.input("x", S), name="r"))
    first = g.run(x=arr(rng, S)).report
    again = g.run(x=arr(rng, S)).report
    for r in (first, again):
        assert r.seconds == pytest.approx(r.plan_seconds + r.run_seconds)
        assert r.run_seconds > 0
        assert "planning and compiling" in str(r)
    assert again.plan_seconds < first.plan_seconds      # the plan was made once


# ---- the user policy in a graph: clean= flags, a stream (seed 001 options B and C) -----------

def _user_chain(cache, policy="user"):
    """x -> sigmoid -> relu -> linear -> + x, not in place: a and d share an arena slot (a is
    dead when d is made), b has one of its own, the result is a fresh buffer every run."""
    g = bp.Graph(policy=policy, cache=cache, inplace=False)
    x = g.input("x", S)
    g.output(g.add(g.linear(g.relu(g.sigmoid(x)), 2.0, 1.0), x, name="out"))
    return g


def test_user_policy_graph_takes_clean_flags_and_a_stream(cache, rng):
    xv = arr(rng, S)
    packed = bp.Memory.from_numpy(xv, BLK).buffer
    want = 2 * np.maximum(sigmoid(xv), 0) + 1 + xv

    def run(g, **kw):
        res = g.run(x=bp.Memory.from_buffer(packed, BLK), **kw)   # state unknown, every run
        assert np.allclose(res["out"].numpy(), want, atol=1e-5)
        return res.report

    g = _user_chain(cache)
    plan = g.plan(x=BLK)
    slots = {s.label: s.writes[0].storage.slot for s in plan.steps}
    assert slots["eltwise_0"] == slots["eltwise_2"] != slots["eltwise_1"]
    first, again = run(g), run(g)
    assert first.zero_pad_calls == 5          # x, the three intermediates, the result
    # relu's buffer and the result's (a small result: kept, the caller gets a copy) kept
    # their zeros: said clean
    assert again.zero_pad_calls == 3
    assert run(g, clean=["x"]).zero_pad_calls == 2          # the caller vouches for x
    stream = bp.Stream("graph")
    queued = run(g, stream=stream)
    assert queued.zero_pad_calls == 3 and queued.zero_pad_blocking == 0
    assert again.zero_pad_blocking == 3
    on_handle = _user_chain(cache, "on_handle")
    assert run(on_handle).zero_pad_calls == run(on_handle).zero_pad_calls == 5   # every run
    with pytest.raises(bp.ArgumentError, match="stream= queues the user policy"):
        on_handle.run(x=xv, stream=stream)
    with pytest.raises(bp.ArgumentError, match="clean= names inputs"):
        g.run(x=xv, clean=["y"])


@pytest.mark.parametrize("policy", ["dst_fused", "tracked"])
def test_few_input_channels_are_read_plain(cache, policy, rng):
    """An image's 3 channels (at most half a block) go into the first convolution plain, with
    ``Ohwi16o`` weights and a blocked destination: no reorder of the input, no reduction over
    a block of zeros; the next convolution stays blocked. 13 channels keep the blocked source
    (test_conv_block_every_policy_matches_numpy)."""
    w1, w2 = arr(rng, (24, 3, 3, 3), 0.3), arr(rng, (16, 24, 3, 3), 0.2)
    g = bp.Graph(policy=policy, cache=cache)
    x = g.input("x", (1, 3, 11, 9))
    h = g.relu(g.conv2d(x, g.constant("w1", w1), stride=2, pad=1))
    g.output(g.conv2d(h, g.constant("w2", w2), pad=1))
    xv = arr(rng, (1, 3, 11, 9))
    res = g.run(x=xv)
    want = ref_conv(np.maximum(ref_conv(xv, w1, pad=1)[:, :, ::2, ::2], 0), w2, pad=1)
    assert np.allclose(res["conv2d_1"].numpy(), want, atol=1e-4)
    steps = g.plan(x=xv).steps
    assert [s.kind for s in steps] == ["kernel", "kernel"]
    assert [b.layout.tag for b in steps[0].reads[:2]] == ["nchw", "Ohwi16o"]
    assert steps[0].writes[0].layout.tag == steps[1].reads[0].layout.tag == "nChw16c"
    assert res.report.fallbacks == {}


def test_arena_slots_are_the_same_every_time_a_graph_is_planned(cache):
    """Two equal buffers freed by one step, then two new ones of that size: which slot each
    takes must not depend on where Python put the storage objects (a set iterates by address).
    A built model's plan function names the slots (``graph/native.py``): planned differently
    at load, its calls' digest differed and the model ran from Python. Planned 20 times, one
    assignment."""
    from blockpad.runtime.graph.planning import Plan

    g = bp.Graph(cache=cache, inplace=False)
    x = g.input("x", (1, 16, 8, 8))
    c = g.add(g.relu(x), g.sigmoid(x))      # both freed by the add
    g.output(g.add(g.relu(c), g.sigmoid(c)))
    lay = bp.Layout("nchw", (1, 16, 8, 8))
    slots = {tuple(b.storage.slot for b in Plan(g, {"x": lay}).bufs) for _ in range(20)}
    assert len(slots) == 1, slots
