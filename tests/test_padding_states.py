"""A source whose padding is not known to be zero is never used as if it were (seed 001 option
C): under every policy and on every call path (direct, bound, stream, graph) a ``dirty`` or
``unknown`` source of a kernel that requires clean sources is zero-padded first (a read-only
array it cannot zero is refused, saying how to clean it), and each destination's state says
what its padding holds. Also: a source passed again as the destination of an op with an
in-place form."""

import numpy as np
import pytest

import blockpad as bp
from blockpad.codegen.spec import parse_spec
from blockpad.layout import numpy_dtype
from blockpad.runtime import counters
from blockpad.runtime.stream import Stream
from blockpad.vocabulary import CLEAN_AFTER_CALL, POLICIES

from .reference import conv_reference, eltwise

C = 23                                      # 23 channels of 24: a 3x3 reduces over the whole
SRC = bp.Layout("nChw8c", (1, C, 4, 4))     # blocks, padding included (reduced_channels)
W = (6, C, 3, 3)
DST = ACT = bp.Layout("nChw8c", (1, 6, 4, 4))   # 6 of 8 channels: padding too
CONV = {"op": "conv2d", "shape": [1, C, 4, 4], "channels": 6, "kernel": [3, 3], "stride": [1, 1],
        "pad": [1, 1], "dilation": [1, 1], "groups": 1, "src": "nChw8c", "weights": "OIhw8i8o",
        "dst": "nChw8c"}
ELT = {"op": "eltwise", "shape": [1, 6, 4, 4], "src": "nChw8c", "dst": "nChw8c"}
PATHS = ("direct", "bound", "stream", "graph")


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    d = tmp_path_factory.mktemp("states")
    kernels = [{**CONV, "name": f"conv_{p}", "policy": p} for p in POLICIES] + [
        {"op": "reorder", "name": "pack_w", "shape": list(W), "src": "oihw",
         "dst": "OIhw8i8o"},
        {"op": "reorder", "name": "unpack", "shape": [1, 6, 4, 4], "src": "nChw8c",
         "dst": "nchw"},
        {**ELT, "name": "relu", "algorithm": "relu", "policy": "dst_fused"},
        {**ELT, "name": "relu_inplace", "algorithm": "relu", "policy": "dst_fused",
         "inplace": True},
        {**ELT, "name": "sigmoid", "algorithm": "sigmoid", "policy": "dst_fused"}]
    bp.build(parse_spec({"library": {"name": "states"}, "kernel": kernels}), "host", d,
             log=lambda m: None)
    return bp.load(d)


def _dirty_source(x, state):
    """``x`` packed into SRC with NaN in its channel padding; ``state`` dirty, or unknown (a
    caller's buffer wrapped as it is)."""
    buf = bp.Memory.from_numpy(x, SRC).buffer
    buf[SRC.padding_offsets()] = np.nan
    if state == "unknown":
        return bp.Memory.from_buffer(buf, SRC)
    mem = bp.Memory(SRC, buf, "dirty")
    return mem


def _packed_weights(w):
    wl = bp.Layout("OIhw8i8o", w.shape)
    return bp.Memory.from_numpy(w, wl)


def _run(lib, policy, path, src, w, dst):
    kernel = lib[f"conv_{policy}"]
    if path == "direct":
        kernel(src, _packed_weights(w), dst)
    elif path == "bound":
        call = kernel.bind(src, _packed_weights(w), dst)
        call()
        call()                                     # again: the source is clean by now
    elif path == "stream":
        stream = Stream("states")
        kernel(src, _packed_weights(w), dst, stream=stream)
        stream.wait()
    else:
        g = bp.Graph(policy=policy, libraries=[lib], block=8)   # the library's blocks
        g.output(g.conv2d(g.input("x", SRC.shape), g.constant("w", w), pad=1, name="y"))
        res = g.run(x=src)
        assert res.report.cache["compiles"] == 0   # the library's kernels, nothing else
        return res["y"].numpy()
    return dst.to_numpy()


@pytest.mark.parametrize("state", ["dirty", "unknown"])
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("policy", POLICIES)
def test_a_source_not_known_clean_is_zero_padded(lib, policy, path, state, rng):
    """The issue's case: NaN in a source's channel padding gave an all-NaN convolution (and a
    destination marked clean) under dst_fused; now every policy and path gives numpy's."""
    x = rng.standard_normal(SRC.shape).astype("float32")
    w = rng.standard_normal(W).astype("float32")
    src = _dirty_source(x, state)
    dst = bp.Memory.zeros(DST)
    got = _run(lib, policy, path, src, w, dst)
    want = conv_reference(x.astype(np.float64), w.astype(np.float64), CONV)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    if path != "graph":        # the graph runs on its own memory of the caller's buffer
        assert src.state == "clean" and src.padding_is_zero()
        if policy in CLEAN_AFTER_CALL:
            assert dst.state == "clean"
        if dst.state == "clean":
            assert dst.padding_is_zero()


@pytest.mark.parametrize("policy", POLICIES)
def test_destination_state_is_what_the_kernel_left(lib, policy, rng):
    """A destination that starts dirty (NaN padding): a kernel that writes its padding leaves
    it clean (or dirty, if it writes non-zeros there), one that preserves padding leaves it
    dirty; a state ``clean`` always means zero padding."""
    x = rng.standard_normal(SRC.shape).astype("float32")
    w = rng.standard_normal(W).astype("float32")
    dst = bp.Memory(DST, np.full(DST.alloc_len, np.nan, "float32"), "dirty", library=None)
    lib[f"conv_{policy}"](bp.Memory.from_numpy(x, SRC), _packed_weights(w), dst)
    contract = lib.kernels[f"conv_{policy}"].padding
    if contract["produces"] == "preserved":
        assert dst.state == "dirty" and np.isnan(dst.buffer[DST.padding_offsets()]).all()
    elif contract["produces"] in ("clean", "inherit"):
        assert dst.state == "clean" and dst.padding_is_zero()
    else:
        assert dst.state == "dirty"


def test_a_clean_source_costs_no_zero_pad(lib, rng):
    x = rng.standard_normal(SRC.shape).astype("float32")
    w = _packed_weights(rng.standard_normal(W).astype("float32"))
    src, dst = bp.Memory.from_numpy(x, SRC), bp.Memory.zeros(DST)
    call = lib["conv_dst_fused"].bind(src, w, dst)
    with counters.scope() as stats:
        call()
        call()
    assert stats.calls == 0
    src.buffer[SRC.padding_offsets()] = np.nan     # a user's own kernel spoiled it, and says so
    src.state = "dirty"
    with counters.scope() as stats:
        call()
        call()
    assert stats.calls == 1 and src.state == "clean"


def test_a_physical_array_is_zero_padded_or_refused_when_read_only(lib, rng):
    """An array carries no state: its padding is zeroed before a kernel that requires clean
    sources; a read-only one cannot be, and the error says what to do."""
    x = rng.standard_normal(SRC.shape).astype("float32")
    w = rng.standard_normal(W).astype("float32")
    raw = _dirty_source(x, "unknown").buffer[:SRC.alloc_len].reshape(SRC.physical_shape)
    dst = bp.Memory.zeros(DST)
    lib["conv_dst_fused"](raw, _packed_weights(w), dst)
    want = conv_reference(x.astype(np.float64), w.astype(np.float64), CONV)
    np.testing.assert_allclose(dst.to_numpy(), want, rtol=1e-5, atol=1e-5)
    assert not np.isnan(raw).any()
    raw[:, :, :, :, 3:] = np.nan
    raw.setflags(write=False)
    with pytest.raises(bp.ArgumentError, match=r"argument 'src'.*read-only.*state='clean'"):
        lib["conv_dst_fused"](raw, _packed_weights(w), dst)


# ---- in place on ordinary calls -----------------------------------------------------------

def test_same_memory_as_source_and_destination_runs_the_inplace_kernel(lib, rng):
    x = rng.standard_normal(ACT.shape).astype("float32")
    mem = bp.Memory.from_numpy(x, ACT)
    assert lib["relu"](mem, mem) is None                   # routed to relu_inplace
    np.testing.assert_array_equal(mem.to_numpy(), eltwise({"algorithm": "relu"}, x))
    mem2 = bp.Memory.from_numpy(x, ACT)
    lib["relu"].bind(mem2, mem2)()
    np.testing.assert_array_equal(mem2.to_numpy(), mem.to_numpy())


def test_same_memory_without_an_inplace_kernel_names_the_spec_option(lib, rng):
    mem = bp.Memory.from_numpy(rng.standard_normal(ACT.shape).astype("float32"), ACT)
    with pytest.raises(bp.ArgumentError, match=r"'src' is also passed as 'dst'.*inplace = true"):
        lib["sigmoid"](mem, mem)
    big = np.zeros(ACT.alloc_len + 8, "float32")
    part = bp.Memory(ACT, big[8:])                        # overlapping, not the same memory
    with pytest.raises(bp.ArgumentError, match="overlap in memory"):
        lib["sigmoid"](bp.Memory(ACT, big, "clean"), part)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_negative_zero_padding_is_zero_and_anything_else_is_not(dtype):
    """Zero is a value (docs/padding-contract.md, "Zero"): a zero-preserving op such as linear
    with a negative scale leaves -0.0 in padding, which every reader treats as 0."""
    lay = bp.Layout("nChw8c", shape=(1, 3, 2, 2), dtype=dtype)
    mem = bp.Memory(lay, np.zeros(lay.alloc_len, numpy_dtype(dtype)))
    pad = lay.padding_offsets()
    mem.buffer[pad] = -0.0
    assert mem.padding_is_zero()
    mem.buffer[pad[-1]] = np.finfo(np.float16).smallest_subnormal
    assert not mem.padding_is_zero()
    mem.buffer[pad[-1]] = np.nan
    assert not mem.padding_is_zero()
