"""bf16 in a ``bp.Graph``: convolutions and matmuls run on kernels (no numpy fallback), and
their results stay bf16 from layer to layer, as oneDNN's bf16 primitives write them: the
kernels accumulate in float32 and round the destination to bf16 (``dst_dtype = "bfloat16"``,
round to nearest even). Checked against PyTorch in float64 with the same roundings between
layers."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch

import blockpad as bp
from blockpad import machine
from blockpad.codegen.ops import quant
from blockpad.codegen.targets import get_target
from blockpad.errors import SpecError
from blockpad.model_build import build_model, plan_kernels

BF16 = ml_dtypes.bfloat16
HAVE_BF16 = "avx512_bf16" in machine.cpu_features()


def _f64(a):
    return torch.tensor(np.asarray(a, np.float64))


def _bf16(t):   # float64 -> float32 -> bf16 (the kernels round their float32 sums once)
    return t.numpy().astype(np.float32).astype(BF16)


def _network(rng, cache=None):
    """Two bf16 convolutions and a matmul, and their input."""
    x = rng.standard_normal((2, 20, 9, 9)).astype(BF16)
    w1 = (rng.standard_normal((40, 20, 3, 3)) * 0.2).astype(BF16)
    b1 = rng.standard_normal(40).astype(np.float32)
    w2 = (rng.standard_normal((24, 40, 1, 1)) * 0.2).astype(BF16)
    wm = (rng.standard_normal((24 * 5 * 5, 10)) * 0.1).astype(BF16)
    g = bp.Graph() if cache is None else bp.Graph(cache=cache)
    t = g.input("x", x.shape, "bfloat16")
    y = g.conv2d(t, g.constant("w1", w1), g.constant("b1", b1), pad=1, post_ops=["bias", "relu"])
    y = g.conv2d(y, g.constant("w2", w2), stride=2)
    z = g.matmul(g.flatten(y), g.constant("wm", wm))
    g.output(y, z)
    return g, x, (w1, b1, w2, wm)


def _check(x, params, y, z):
    """``y`` and ``z`` against PyTorch in float64, rounded to bf16 where the kernels round."""
    w1, b1, w2, wm = params
    h = _bf16(torch.nn.functional.conv2d(_f64(x), _f64(w1), _f64(b1), padding=1).relu())
    want_y = _bf16(torch.nn.functional.conv2d(_f64(h), _f64(w2), stride=2))
    want_z = _bf16(_f64(want_y).reshape(2, -1) @ _f64(wm))
    for got, want in ((y, want_y), (z, want_z)):
        assert got.dtype == BF16 and got.shape == want.shape
        # one bf16 rounding apart at most (the float32 sums and float64's may round apart)
        diff = np.abs(got.astype(np.float64) - want.astype(np.float64))
        assert np.all(diff <= 2.0 ** -7 * np.abs(want.astype(np.float64)) + 1e-6), diff.max()


def test_bf16_graph_runs_kernels_and_keeps_bf16_between_layers(rng):
    g, x, params = _network(rng)
    res = g.run(x=x)
    plan = g.plan(x=x)
    assert plan.fallbacks == {}, plan.describe()
    dots = [st for st in plan.steps if st.label.startswith(("conv2d", "matmul"))]
    assert len(dots) == 3 and all(st.kernel is not None for st in dots), plan.describe()
    y, z = g.outputs
    _check(x, params, res[y].numpy(), res[z].numpy())


def test_bf16_weights_are_packed_in_pairs_where_the_target_has_vdpbf16ps(rng, tmp_path):
    """The graph packs bf16 weights for the target its cache builds for: in pairs of input
    channels (``OIhw8i16o2i``, ``BA16b2a``) where it has ``vdpbf16ps``, plain blocks where
    FMAs widen them (planned without compiling: ``plan_kernels``). A model built for
    avx512-bf16 loads with the same plan (the loader checks) and, where this CPU runs it,
    gives the same numbers."""
    g, x, params = _network(rng)
    for target, tags in (("avx512-bf16", ("OIhw8i16o2i", "BA16b2a")),
                         ("host", ("OIhw16i16o", "Ba16b"))):
        lines, _ = plan_kernels(g, lambda m: None, get_target(target))
        text = "\n".join(lines)
        assert all(t in text for t in tags), (target, text)
    out = tmp_path / "model"
    build_model(g, "avx512-bf16", out, log=lambda m: None)
    if HAVE_BF16:
        res = bp.load(out).run(x=x)
        _check(x, params, *(res[n].numpy() for n in g.outputs))


def test_a_bf16_model_calls_its_kernels_from_its_plan_function(rng, tmp_path):
    """Two bf16 convolutions built as a model: a plan function, whose bfloat16 DLTensors say
    bfloat16 (TVM's bfloat16 legalization, left out of its build, would have made them
    uint16, which the kernels refuse); where this CPU runs it, every run after the first is
    one native call, with PyTorch's numbers in float64 rounded to bf16 where the kernels round."""
    x = rng.standard_normal((2, 20, 9, 9)).astype(BF16)
    w1 = (rng.standard_normal((40, 20, 3, 3)) * 0.2).astype(BF16)
    b1 = rng.standard_normal(40).astype(np.float32)
    w2 = (rng.standard_normal((24, 40, 1, 1)) * 0.2).astype(BF16)
    g = bp.Graph()
    t = g.input("x", x.shape, "bfloat16")
    y = g.conv2d(t, g.constant("w1", w1), g.constant("b1", b1), pad=1, post_ops=["bias", "relu"])
    g.output(g.conv2d(y, g.constant("w2", w2), stride=2))
    logs = []
    build_model(g, "avx512-bf16", tmp_path / "model", log=logs.append)
    assert not [m for m in logs if m.startswith("no plan function")], logs
    assert (tmp_path / "model" / "plan.so").exists()
    if not HAVE_BF16:
        return
    model = bp.load(tmp_path / "model")
    runs = [model.run(x=x) for _ in range(3)]
    assert [r.report.native for r in runs] == [False, True, True]   # the first binds, checks
    h = _bf16(torch.nn.functional.conv2d(_f64(x), _f64(w1), _f64(b1), padding=1).relu())
    want = _bf16(torch.nn.functional.conv2d(_f64(h), _f64(w2), stride=2)).astype(np.float64)
    for r in runs:
        got = r[g.outputs[0]].numpy()
        assert got.dtype == BF16
        assert np.all(np.abs(got.astype(np.float64) - want) <= 2.0 ** -7 * np.abs(want) + 1e-6)


def test_bf16_kernels_write_float32_or_bf16_and_nothing_else():
    assert quant.dst_dtype("bfloat16", {}, "float32") == "float32"
    assert quant.dst_dtype("bfloat16", {"dst_dtype": "bfloat16"}) == "bfloat16"
    with pytest.raises(SpecError, match="bfloat16 kernel writes one of float32, bfloat16; got 'int8'"):
        quant.check("bfloat16", {"dst_dtype": "int8"})
    with pytest.raises(SpecError, match="dst_scale: quantization attributes need a uint8 or int8"):
        quant.check("bfloat16", {"dst_dtype": "bfloat16", "dst_scale": 2.0})
    with pytest.raises(SpecError, match="dst_dtype: quantization attributes need"):
        quant.check("float32", {"dst_dtype": "bfloat16"})
