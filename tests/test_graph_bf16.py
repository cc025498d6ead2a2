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
from blockpad.codegen.ops import quant
from blockpad.errors import SpecError

BF16 = ml_dtypes.bfloat16


def _f64(a):
    return torch.tensor(np.asarray(a, np.float64))


def _bf16(t):   # float64 -> float32 -> bf16 (the kernels round their float32 sums once)
    return t.numpy().astype(np.float32).astype(BF16)


def test_bf16_graph_runs_kernels_and_keeps_bf16_between_layers(rng):
    x = rng.standard_normal((2, 20, 9, 9)).astype(BF16)
    w1 = (rng.standard_normal((40, 20, 3, 3)) * 0.2).astype(BF16)
    b1 = rng.standard_normal(40).astype(np.float32)
    w2 = (rng.standard_normal((24, 40, 1, 1)) * 0.2).astype(BF16)
    wm = (rng.standard_normal((24 * 5 * 5, 10)) * 0.1).astype(BF16)
    g = bp.Graph()
    t = g.input("x", x.shape, "bfloat16")
    y = g.conv2d(t, g.constant("w1", w1), g.constant("b1", b1), pad=1, post_ops=["bias", "relu"])
    y = g.conv2d(y, g.constant("w2", w2), stride=2)
    z = g.matmul(g.flatten(y), g.constant("wm", wm))
    g.output(y, z)
    res = g.run(x=x)
    plan = g.plan(x=x)
    assert plan.fallbacks == {}, plan.describe()
    dots = [st for st in plan.steps if st.label.startswith(("conv2d", "matmul"))]
    assert len(dots) == 3 and all(st.kernel is not None for st in dots), plan.describe()

    h = _bf16(torch.nn.functional.conv2d(_f64(x), _f64(w1), _f64(b1), padding=1).relu())
    want_y = _bf16(torch.nn.functional.conv2d(_f64(h), _f64(w2), stride=2))
    want_z = _bf16(_f64(want_y).reshape(2, -1) @ _f64(wm))
    for got, want in ((res[y.name].numpy(), want_y), (res[z.name].numpy(), want_z)):
        assert got.dtype == BF16 and got.shape == want.shape
        # one bf16 rounding apart at most (the float32 sums and float64's may round apart)
        diff = np.abs(got.astype(np.float64) - want.astype(np.float64))
        assert np.all(diff <= 2.0 ** -7 * np.abs(want.astype(np.float64)) + 1e-6), diff.max()


def test_bf16_kernels_write_float32_or_bf16_and_nothing_else():
    assert quant.dst_dtype("bfloat16", {}, "float32") == "float32"
    assert quant.dst_dtype("bfloat16", {"dst_dtype": "bfloat16"}) == "bfloat16"
    with pytest.raises(SpecError, match="bfloat16 kernel writes one of float32, bfloat16; got 'int8'"):
        quant.check("bfloat16", {"dst_dtype": "int8"})
    with pytest.raises(SpecError, match="dst_scale: quantization attributes need a uint8 or int8"):
        quant.check("bfloat16", {"dst_dtype": "bfloat16", "dst_scale": 2.0})
    with pytest.raises(SpecError, match="dst_dtype: quantization attributes need"):
        quant.check("float32", {"dst_dtype": "bfloat16"})
