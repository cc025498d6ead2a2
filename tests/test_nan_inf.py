"""NaN and +-inf give what PyTorch gives (oneDNN's behaviour too): every eltwise algorithm
(also as a convolution's post-op, whose accumulator a NaN source makes NaN), softmax and
log-softmax, max and average pooling, on blocked layouts whose vector loops run the special
values through the fast paths. Once a NaN is in, it stays: relu, clip and tanh used to turn it
into 0, alpha and 1, and max pooling dropped it from its window.

The references are numpy in float64, written to PyTorch's semantics (NaN-propagating max and
min, inf - inf = NaN inside softmax): CI has no PyTorch. ``test_references_match_torch``
checks them against PyTorch where it is installed."""

import math

import numpy as np
import pytest
from scipy.special import erf

import blockpad as bp
from blockpad import manifest
from blockpad.codegen.spec import parse_spec
from blockpad.runtime.library import Signature
from blockpad.testing import qemu

SHAPE = [2, 20, 4, 5]
ALGORITHMS = {   # name: (spec fields, numpy reference in float64)
    "relu": ({}, lambda t: np.maximum(t, 0)),
    "leaky_relu": ({"alpha": 0.1}, lambda t: np.where(t > 0, t, 0.1 * t)),
    "gelu_erf": ({}, lambda t: 0.5 * t * (1 + erf(t / math.sqrt(2)))),
    "gelu_tanh": ({}, lambda t: 0.5 * t * (1 + np.tanh(math.sqrt(2 / math.pi)
                                                        * (t + 0.044715 * t ** 3)))),
    "sigmoid": ({}, lambda t: 1 / (1 + np.exp(-t))),
    "exp": ({}, np.exp),
    "tanh": ({}, np.tanh),
    "clip": ({"alpha": -1.0, "beta": 2.0}, lambda t: np.clip(t, -1.0, 2.0)),
    "linear": ({"alpha": 2.0, "beta": 1.0}, lambda t: 2 * t + 1),
    "swish": ({"alpha": 1.0}, lambda t: t / (1 + np.exp(-t))),
}
TORCH_ELTWISE = {   # name: PyTorch's expression of it (for test_references_match_torch)
    "relu": "torch.relu(t)", "leaky_relu": "F.leaky_relu(t, 0.1)", "gelu_erf": "F.gelu(t)",
    "gelu_tanh": "F.gelu(t, approximate='tanh')", "sigmoid": "torch.sigmoid(t)",
    "exp": "torch.exp(t)", "tanh": "torch.tanh(t)", "clip": "torch.clamp(t, -1.0, 2.0)",
    "linear": "2 * t + 1", "swish": "F.silu(t)"}
BLK = {"src": "nChw16c", "dst": "nChw16c"}
KERNELS = [
    *({"op": "eltwise", "name": f"eltwise_{n}", "shape": SHAPE, **BLK,
       "algorithm": n.replace("leaky_", ""), **f} for n, (f, _) in ALGORITHMS.items()),
    *({"op": "conv2d", "name": f"conv_{n}", "shape": SHAPE, "channels": 16, "kernel": [1, 1],
       "src": "nChw16c", "weights": "OIhw16i16o", "dst": "nChw16c",
       "post_ops": [{"kind": "eltwise", "algorithm": n, **f}]}
      for n, (f, _) in ALGORITHMS.items() if n in ("relu", "clip", "tanh", "swish")),
    *({"op": "softmax", "name": f"softmax_{axis}_{log}", "shape": SHAPE, **BLK, "axis": axis,
       "log": log} for axis in (1, 3) for log in (False, True)),
    *({"op": "pool", "name": f"pool_{alg}", "shape": SHAPE, **BLK, "algorithm": alg,
       "kernel": [3, 3], "stride": [1, 2], "pad": [1, 1]} for alg in ("max", "avg")),
    {"op": "pool", "name": "pool_max_plain", "shape": SHAPE, "src": "nchw", "dst": "nchw",
     "algorithm": "max", "kernel": [2, 2]},
]


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    d = tmp_path_factory.mktemp("nan_inf")
    bp.build(parse_spec({"library": {"name": "nan-inf"}, "kernel": KERNELS}), "host", d,
             log=lambda m: None)
    return bp.load(d)


@pytest.fixture(scope="module")
def x():
    """Normal values with NaN, +inf, -inf, and values past exp's range, spread over lanes."""
    v = np.random.default_rng(7).standard_normal(SHAPE).astype("float32")
    flat = v.reshape(-1)
    for i, special in enumerate((np.nan, np.inf, -np.inf, 100.0, -100.0)):
        flat[i::13] = special
    return v


def _run(lib, name, *inputs):
    k = lib[name]
    args = [bp.Memory.from_numpy(a, lay[2]) for a, lay in zip(inputs, k.signature.args)]
    dst = k.signature.args[-1][2]
    out = bp.Memory.from_numpy(np.zeros(dst.shape, "float32"), dst)
    k(*args, out)
    return out.to_numpy()


def _check(got, want):
    """``want`` (float64) rounded to the kernels' float32 first: exp(100) is inf there."""
    with np.errstate(over="ignore"):
        want = np.asarray(want, np.float64).astype(np.float32).astype(np.float64)
    assert np.array_equal(np.isnan(got), np.isnan(want)), \
        f"NaN at {np.argwhere(np.isnan(got) != np.isnan(want))[:4].tolist()}"
    np.testing.assert_allclose(got[~np.isnan(got)], want[~np.isnan(want)], rtol=2e-5, atol=1e-6)


@pytest.mark.parametrize("name", list(ALGORITHMS))
def test_eltwise(lib, x, name):
    with np.errstate(all="ignore"):
        _check(_run(lib, f"eltwise_{name}", x), ALGORITHMS[name][1](x.astype(np.float64)))


@pytest.mark.parametrize("name", ["relu", "clip", "tanh"])
def test_conv_post_op(lib, x, name):
    """A 1x1 convolution: an output whose window holds a NaN or both infinities is NaN, and
    the post-op keeps it so."""
    w = np.random.default_rng(1).standard_normal((16, 20, 1, 1)).astype("float32")
    with np.errstate(all="ignore"):
        want = ALGORITHMS[name][1](_conv1x1(x, w))
    _check(_run(lib, f"conv_{name}", x, w), want)


def _conv1x1(x, w):
    return np.einsum("nchw,kc->nkhw", x.astype(np.float64), w[:, :, 0, 0].astype(np.float64))


def _softmax(t, axis, log):
    m = np.max(t, axis=axis, keepdims=True)          # NaN or +inf in a row: NaN throughout
    e = np.exp(t - m)
    s = np.sum(e, axis=axis, keepdims=True)
    return t - m - np.log(s) if log else e / s


def _pool(t, alg, kernel, stride, pad):
    """Windows over a frame of -inf (max) or of excluded cells (avg, count_include_pad off)."""
    n, c, h, w = t.shape
    (kh, kw), (sh, sw), (ph, pw) = kernel, stride, pad
    oh, ow = (h + 2 * ph - kh) // sh + 1, (w + 2 * pw - kw) // sw + 1
    frame = np.pad(t, ((0, 0), (0, 0), (ph, ph), (pw, pw)), constant_values=np.nan)
    cells = np.stack([frame[:, :, i:i + sh * oh:sh, j:j + sw * ow:sw]
                      for i in range(kh) for j in range(kw)])
    inside = np.stack([np.pad(np.ones((h, w)), ((ph, ph), (pw, pw)))[i:i + sh * oh:sh,
                                                                      j:j + sw * ow:sw]
                       for i in range(kh) for j in range(kw)])[:, None, None] > 0
    if alg == "max":
        return np.max(np.where(inside, cells, -np.inf), axis=0)
    return np.sum(np.where(inside, cells, 0), axis=0) / np.sum(inside, axis=0)


# the reference for each single-source kernel, in float64
REFERENCE = {
    **{f"eltwise_{n}": f for n, (_, f) in ALGORITHMS.items()},
    **{f"softmax_{axis}_{log}": (lambda t, a=axis, lg=log: _softmax(t, a, lg))
       for axis in (1, 3) for log in (False, True)},
    "pool_max": lambda t: _pool(t, "max", (3, 3), (1, 2), (1, 1)),
    "pool_avg": lambda t: _pool(t, "avg", (3, 3), (1, 2), (1, 1)),
    "pool_max_plain": lambda t: _pool(t, "max", (2, 2), (2, 2), (0, 0)),
}
# PyTorch's expression of each (float64 tensors), for test_references_match_torch
TORCH = {
    **{f"eltwise_{n}": e for n, e in TORCH_ELTWISE.items()},
    **{f"softmax_{axis}_{log}": f"F.{'log_softmax' if log else 'softmax'}(t, {axis})"
       for axis in (1, 3) for log in (False, True)},
    "pool_max": "F.max_pool2d(t, 3, (1, 2), 1)",
    "pool_avg": "F.avg_pool2d(t, 3, (1, 2), 1, count_include_pad=False)",
    "pool_max_plain": "F.max_pool2d(t, 2)",
}


def _reference(name, x):
    with np.errstate(all="ignore"):
        return REFERENCE[name](x.astype(np.float64))


def test_references_match_torch(x):
    """The numpy references give PyTorch's results, special values included."""
    torch = pytest.importorskip("torch", reason="pip install torch==2.13.0 (CPU wheel)")
    F = torch.nn.functional   # noqa: F841 (used by the expressions)
    t = torch.from_numpy(x.astype(np.float64))
    for name, expr in TORCH.items():
        with np.errstate(over="ignore"):
            ours = _reference(name, x).astype(np.float32)
        _check(ours, eval(expr, {"torch": torch, "F": F, "t": t}).numpy())


@pytest.mark.parametrize("name", [n for n in REFERENCE if not n.startswith("eltwise")])
def test_softmax_and_pool(lib, x, name):
    """A softmax row holding a NaN or +inf is NaN throughout (inf - inf), -inf gives 0 / -inf;
    a pooling window holding a NaN is NaN."""
    _check(_run(lib, name, x), _reference(name, x))


@pytest.mark.skipif(bool(qemu.missing_tools()), reason="runs aarch64 code under qemu, and this "
                    "machine lacks: " + "; ".join(qemu.missing_tools()))
def test_neon_under_qemu(tmp_path, x):
    """The same kernels for Arm NEON (other vector instructions: fmax/fmaxnm, bsl)."""
    names = list(REFERENCE)
    bp.build(parse_spec({"library": {"name": "nan-inf-neon"},
                         "kernel": [k for k in KERNELS if k["name"] in names]}), "neon",
             tmp_path, log=lambda m: None)
    sigs = {k["name"]: Signature(k) for k in manifest.read(tmp_path)["kernels"]}
    outs, calls = {}, []
    for name in names:
        src, dst = sigs[name].args[0][2], sigs[name].args[-1][2]
        outs[name] = bp.Memory.from_numpy(np.zeros(dst.shape, "float32"), dst)
        calls.append((name, [bp.Memory.from_numpy(x, src), outs[name]]))
    qemu.run_many(tmp_path, calls)
    for name in names:
        _check(outs[name].to_numpy(), _reference(name, x))


def test_nan_anywhere_in_a_max_window(lib):
    """Each position of a 2x2 window in turn: the accumulator's and the incoming element's."""
    for i in range(4):
        x = np.ones(SHAPE, "float32")
        x[:, :, i // 2::2, i % 2::2] = np.nan
        assert np.isnan(_run(lib, "pool_max_plain", x)).all()
