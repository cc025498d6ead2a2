"""Grouped and depthwise convolutions in a Graph run blocked (Graph.conv_blocks/weight_tag):
a MobileNetV2 inverted residual block with odd channel counts stays on nChw<b>c from the
expansion through the depthwise layer to the projection, with no reorder between them; checked
against tests/reference.py's convolution."""

from __future__ import annotations

import numpy as np
import pytest

import blockpad as bp

from .reference import conv_reference


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return bp.jit_cache(cache_dir=tmp_path_factory.getbasetemp() / "bp-jit-grouped")


def ref_conv(x, w, stride=1, pad=0, groups=1):
    g = groups
    if g > 1:
        w = w.reshape(g, w.shape[0] // g, *w.shape[1:])
    return conv_reference(x.astype(np.float64), w.astype(np.float64),
                          {"stride": (stride, stride), "pad": (pad, pad), "dilation": (1, 1),
                           "groups": g})


def arr(rng, shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype("float32")


def _inverted_residual(g, x, rng, c_in, expand, c_out, stride, ref):
    """1x1 expand + relu, depthwise 3x3 (stride) + relu, 1x1 project; + x when the shapes
    match. Builds both the graph and its numpy twin (``ref`` maps the input array)."""
    w1, wd, w2 = (arr(rng, (expand, c_in, 1, 1), 0.3), arr(rng, (expand, 1, 3, 3), 0.3),
                  arr(rng, (c_out, expand, 1, 1), 0.3))
    h = g.relu(g.conv2d(x, g.constant(g._fresh("w"), w1)))
    h = g.relu(g.conv2d(h, g.constant(g._fresh("w"), wd), stride=stride, pad=1,
                        groups=expand))
    y = g.conv2d(h, g.constant(g._fresh("w"), w2))
    residual = stride == 1 and c_in == c_out

    def numpy(v):
        r = np.maximum(ref_conv(v, w1), 0)
        r = np.maximum(ref_conv(r, wd, stride, 1, expand), 0)
        r = ref_conv(r, w2)
        return r + v if residual else r
    return (g.add(y, x) if residual else y), (lambda v: numpy(ref(v)))


@pytest.mark.parametrize("policy", ["dst_fused", "src"])
def test_inverted_residual_blocks_stay_blocked(cache, policy):
    rng = np.random.default_rng(7)
    g = bp.Graph(policy=policy, cache=cache)
    x = g.input("x", (1, 12, 8, 8))
    y, ref = _inverted_residual(g, x, rng, 12, 72, 20, 2, lambda v: v)   # stride 2, 12 -> 20
    y, ref = _inverted_residual(g, y, rng, 20, 60, 20, 1, ref)           # stride 1, residual
    g.output(y)
    xv = arr(rng, (1, 12, 8, 8))
    res = g.run(x=xv)
    out = next(iter(res.values()))
    np.testing.assert_allclose(out.numpy(), ref(xv), rtol=1e-4, atol=1e-4)
    assert res.report.fallbacks == {}
    plan = g.plan(x=xv)
    reorders = [s.label for s in plan.steps if s.kind == "reorder"]
    assert reorders == ["reorder x nchw->nChw16c"]       # the input only: none between convs
    convs = [s for s in plan.steps if s.node is not None and s.node.op == "conv2d"]
    assert len(convs) == 6
    for s in convs:
        assert [b.layout.tag for b in s.reads[:2]][0] == "nChw16c"
        assert s.writes[0].layout.tag == "nChw16c"
    depthwise = [s for s in convs if s.node.attrs["groups"] > 1]
    assert [s.reads[1].layout.tag for s in depthwise] == ["Goihw16g"] * 2


def test_grouped_conv_with_channels_per_group_off_the_block(cache):
    """30 channels in 2 groups (15 a group, not a multiple of 16) -> 20: gOIhw16i16o weights."""
    rng = np.random.default_rng(3)
    w0, w = arr(rng, (30, 6, 1, 1), 0.3), arr(rng, (20, 15, 3, 3), 0.2)
    g = bp.Graph(cache=cache)
    x = g.input("x", (1, 6, 7, 7))
    h = g.conv2d(x, g.constant("w0", w0))
    y = g.conv2d(h, g.constant("w", w), pad=1, groups=2)
    g.output(y)
    xv = arr(rng, (1, 6, 7, 7))
    res = g.run(x=xv)
    np.testing.assert_allclose(next(iter(res.values())).numpy(),
                               ref_conv(ref_conv(xv, w0), w, pad=1, groups=2),
                               rtol=1e-4, atol=1e-4)
    steps = g.plan(x=xv).steps
    grouped = [s for s in steps if s.node is not None and s.node.attrs.get("groups") == 2]
    assert grouped[0].reads[1].layout.tag == "gOIhw16i16o"
    assert grouped[0].reads[0].layout.tag == grouped[0].writes[0].layout.tag == "nChw16c"
    # none: the first convolution reads the input's 6 channels plain, writing nChw16c
    # (test_graph.test_few_input_channels_are_read_plain)
    assert [s.kind for s in steps].count("reorder") == 0
