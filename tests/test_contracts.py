"""Padding contracts hold on every call: a kernel whose manifest says ``requires: any`` gives
numpy's numbers run on its own (no runtime zero-pad) whatever its sources' padding and halo
hold, and one that reads them says ``requires: clean``, so the runtime cleans a dirty source
first. Cases: convolutions and average pooling over a pre-padded halo (read unguarded, so the
halo must be clean), staged spatial padding over blocked and haloed sources, under every
policy."""

import numpy as np
import pytest

import blockpad as bp
from blockpad.codegen.spec import parse_spec
from blockpad.vocabulary import POLICIES

from .reference import conv_reference, pool

HALO = {"tag": "nchw", "paddings": {"h": [1, 1], "w": [1, 1]}}
CONV = {"op": "conv2d", "kernel": [3, 3], "weights": "oihw", "dst": "nchw"}
CASES = {
    # issue 16's reproduction: a 3x3 all-ones filter over 1..9 in a halo of stale values
    "conv_halo": {**CONV, "shape": [1, 1, 3, 3], "channels": 1, "pad": [1, 1], "src": HALO},
    "avg_halo": {"op": "pool", "shape": [1, 1, 3, 3], "algorithm": "avg", "kernel": [3, 3],
                 "stride": [1, 1], "pad": [1, 1], "src": HALO, "dst": "nchw"},
    "max_halo": {"op": "pool", "shape": [1, 1, 3, 3], "algorithm": "max", "kernel": [3, 3],
                 "stride": [1, 1], "pad": [1, 1], "src": HALO, "dst": "nchw"},
    # the halo covers h only: the staged copy reads it for h, pads w itself
    "stage_blocked_halo": {**CONV, "shape": [1, 3, 5, 7], "channels": 4, "pad": [1, 2],
                           "spatial_pad": "stage", "dst": "nChw8c",
                           "src": {"tag": "nChw8c", "paddings": {"h": [1, 1]}}},
    # the source's tag blocks w: the staged copy's halo is rounded up to whole blocks
    "stage_w_blocked": {**CONV, "shape": [1, 3, 5, 8], "channels": 4, "pad": [1, 1],
                        "spatial_pad": "stage", "src": "nchW4w"},
    "stage_h_blocked_tail": {**CONV, "shape": [1, 3, 5, 7], "channels": 4, "pad": [2, 1],
                             "spatial_pad": "stage", "src": "ncHw4h"},
}
NAMES = [f"{case}_{policy}" for case in CASES for policy in POLICIES]


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    d = tmp_path_factory.mktemp("contracts")
    kernels = [{**CASES[case], "name": f"{case}_{policy}", "policy": policy}
               for case in CASES for policy in POLICIES]
    bp.build(parse_spec({"library": {"name": "contracts"}, "kernel": kernels}), "host", d,
             log=lambda m: None)
    return bp.load(d)


def _reference(entry, x, w):
    if entry["op"] == "pool":
        return pool(entry, x.astype(np.float64))
    params = {"stride": [1, 1], "dilation": [1, 1], "groups": 1, **entry}
    return conv_reference(x.astype(np.float64), w.astype(np.float64), params)


def _inputs(kernel, rng, stale):
    """A source Memory with ``stale`` in all of its padding and halo (marked dirty), the
    weights (None for pooling) and a destination full of NaN."""
    args = kernel.signature.args
    lay = args[0][2]
    x = rng.integers(1, 10, lay.shape).astype("float32")
    src = bp.Memory.from_numpy(x, lay)
    src.buffer[lay.padding_offsets()] = stale
    src.state = "dirty"
    w = rng.standard_normal(args[1][2].shape).astype("float32") if len(args) == 3 else None
    dst = bp.Memory.from_numpy(np.full(args[-1][2].shape, np.nan, "float32"), args[-1][2])
    return x, src, w, dst


@pytest.mark.parametrize("name", [n for n in NAMES if n.endswith(("_tracked", "_src"))])
@pytest.mark.parametrize("stale", [np.nan, np.inf, 100.0])
def test_dirty_sources_under_the_policies_that_accept_them(lib, name, stale, rng):
    """``tracked`` and ``src`` take dirty sources: the kernel masks its reads, or its contract
    requires them clean and the runtime zero-pads them in place first."""
    kernel = lib[name]
    entry = CASES[name.rsplit("_", 1)[0]]
    x, src, w, dst = _inputs(kernel, rng, stale)
    kernel(*[a for a in (src, w, dst) if a is not None])
    np.testing.assert_allclose(dst.to_numpy(), _reference(entry, x, w), rtol=1e-5, atol=1e-5)
    if kernel.signature.padding["requires"] == "clean":
        assert src.state == "clean" and src.padding_is_zero()


def test_requires_any_means_the_kernel_never_reads_padding(lib, rng):
    """Run alone, without the runtime's zero-pads: a kernel recorded as accepting dirty sources
    must not let their padding or halo into a valid result."""
    wrong, checked = [], 0
    for name in NAMES:
        kernel = lib[name]
        if kernel.signature.padding["requires"] != "any":
            continue        # the runtime cleans its sources: tested above
        entry = CASES[name.rsplit("_", 1)[0]]
        x, src, w, dst = _inputs(kernel, rng, np.nan)
        views = [src.physical_view()] + ([w] if w is not None else []) + [dst.physical_view()]
        kernel.run_raw(views)
        checked += 1
        if not np.allclose(dst.to_numpy(), _reference(entry, x, w), rtol=1e-5, atol=1e-5):
            wrong.append(name)
    assert checked >= 8 and wrong == []


def test_halo_readers_require_clean_sources(lib):
    """Derived from the TE (common.reads_padding): the convolution and the average read the
    halo unguarded under ``tracked``; the max reads it as -inf (guarded); a staged copy of a
    halo reads it too; a staged copy that pads the image itself reads no padding."""
    requires = {n: lib.kernels[n].padding["requires"] for n in NAMES}
    assert requires["conv_halo_tracked"] == requires["avg_halo_tracked"] == "clean"
    assert requires["stage_blocked_halo_tracked"] == "clean"
    assert requires["max_halo_tracked"] == "any"
    assert requires["stage_w_blocked_tracked"] == requires["stage_h_blocked_tail_tracked"] == "any"
    assert requires["conv_halo_src"] == requires["avg_halo_src"] == "any"   # masked reads


def test_issue_reproduction(lib):
    """x = 1..9 in a halo of stale values, state dirty, 3x3 ones: the sums of each window."""
    lay = lib["conv_halo_tracked"].signature.args[0][2]
    src = bp.Memory.from_numpy(np.arange(1, 10, dtype="float32").reshape(1, 1, 3, 3), lay)
    src.buffer[lay.padding_offsets()] = 100 + np.arange(len(lay.padding_offsets()))
    src.state = "dirty"
    out = np.zeros((1, 1, 3, 3), "float32")
    lib["conv_halo_tracked"](src, np.ones((1, 1, 3, 3), "float32"), out)
    assert out.ravel().tolist() == [12, 21, 16, 27, 45, 33, 24, 39, 28]
