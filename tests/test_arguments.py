"""Bad input to kernels gets a clear blockpad error naming what was expected and what came."""

import numpy as np
import pytest

import blockpad as bp

FWD = "reorder_nchw_nChw16c_f32_2x30x5x7"
LAY = bp.Layout("nChw16c", (2, 30, 5, 7))


@pytest.fixture
def x():
    return np.random.default_rng(0).standard_normal((2, 30, 5, 7)).astype("float32")


@pytest.fixture
def fwd(reorder_lib):
    return reorder_lib[FWD]


def test_wrong_shape(fwd, x):
    with pytest.raises(bp.ArgumentError,
                       match=r"argument 'src'.*logical shape \(2, 30, 5, 7\).*got shape \(2, 30, 7, 5\)"):
        fwd(x.reshape(2, 30, 7, 5), bp.Memory.empty(LAY))


def test_wrong_dtype(fwd, x):
    with pytest.raises(bp.ArgumentError, match="expected dtype float32; got float64"):
        fwd(x.astype("float64"), bp.Memory.empty(LAY))


def test_wrong_layout_memory(fwd, x):
    other = bp.Memory.empty(bp.Layout("nChw8c", (2, 30, 5, 7)))
    with pytest.raises(bp.ArgumentError, match=r"expected layout nChw16c\[2, 30, 5, 7\] float32; got nChw8c"):
        fwd(x, other)


def test_short_buffer(fwd, x):
    with pytest.raises(bp.ArgumentError, match=f"needs a buffer of {LAY.alloc_len} elements; got {LAY.alloc_len - 1}"):
        fwd(x, np.zeros(LAY.alloc_len - 1, "float32"))


def test_non_contiguous(fwd, x):
    with pytest.raises(bp.ArgumentError, match="expected a C-contiguous array"):
        fwd(np.asfortranarray(x), bp.Memory.empty(LAY))


def test_read_only_destination(fwd, x):
    dst = np.zeros(LAY.alloc_len, "float32")
    dst.setflags(write=False)
    with pytest.raises(bp.ArgumentError, match="writes it, but the array is read-only"):
        fwd(x, dst)


def test_read_only_source_is_fine_and_untouched(fwd, x):
    x.setflags(write=False)
    before = x.copy()
    mem = bp.Memory.empty(LAY)
    fwd(x, mem)
    assert np.array_equal(x, before) and np.array_equal(mem.to_numpy(), x)


def test_element_misaligned(fwd, x):
    raw = np.zeros(LAY.alloc_len * 4 + 1, np.uint8)[1:]
    dst = raw.view("float32")
    with pytest.raises(bp.ArgumentError, match="not aligned to its 4-byte elements"):
        fwd(x, dst)
    src_raw = np.zeros(x.nbytes + 2, np.uint8)[2:]
    src = src_raw.view("float32").reshape(x.shape)
    src[...] = x
    mem = bp.Memory.empty(LAY)
    fwd(src, mem)   # an unaligned input is copied first
    assert np.array_equal(mem.to_numpy(), x)


def test_wrong_argument_count(fwd, x):
    with pytest.raises(bp.ArgumentError, match=r"expected 2 arguments \(src, dst\); got 1"):
        fwd(x)


def test_not_an_array(fwd):
    with pytest.raises(bp.ArgumentError, match="expected a Memory, numpy array or DLPack tensor; got list"):
        fwd([1, 2, 3], bp.Memory.empty(LAY))


def test_overlapping_arguments(reorder_lib):
    lay = bp.Layout("nchw", (2, 30, 5, 7))
    buf = np.zeros(LAY.alloc_len, "float32")
    with pytest.raises(bp.ArgumentError, match="overlap in memory"):
        reorder_lib[FWD](buf[: lay.alloc_len].reshape(lay.shape), buf)


def test_bound_call_rechecks_overlap_after_set_data_handle(reorder_lib, x):
    """A bound call whose memories are pointed at overlapping buffers is refused, as a direct
    call on them would be, and the destination is not written."""
    src = bp.Memory.from_numpy(x, bp.Layout("nchw", (2, 30, 5, 7)))
    dst = bp.Memory.empty(LAY)
    call = reorder_lib[FWD].bind(src, dst)
    call()
    np.testing.assert_array_equal(dst.to_numpy(), x)
    shared = bp.runtime.memory.aligned_empty(LAY.alloc_len, "float32")
    src.set_data_handle(shared[: x.size], clean=True)
    dst.set_data_handle(shared, clean=True)
    with pytest.raises(bp.ArgumentError, match="overlap in memory"):
        call()
    dst.set_data_handle(np.zeros(LAY.alloc_len, "float32"))
    call()
    np.testing.assert_array_equal(dst.to_numpy(), shared[: x.size].reshape(x.shape))


def test_unknown_kernel(reorder_lib):
    with pytest.raises(KeyError, match="this library has kernels"):
        reorder_lib["nope"]


def test_memory_from_numpy_errors():
    with pytest.raises(bp.ArgumentError, match=r"expected an array of the logical shape \(2, 30, 5, 7\)"):
        bp.Memory.from_numpy(np.zeros((2, 32, 5, 7), "float32"), LAY)
    with pytest.raises(bp.ArgumentError, match="expected dtype float32; got int32"):
        bp.Memory.from_numpy(np.zeros((2, 30, 5, 7), "int32"), LAY)
    with pytest.raises(bp.ArgumentError, match=f"needs {LAY.alloc_len} elements"):
        bp.Memory.from_buffer(np.zeros(10, "float32"), LAY)


def test_kernels_lists_signatures(reorder_lib):
    sig = reorder_lib.kernels[FWD]
    assert [(name, role) for name, role, *_ in sig.args] == [("src", "in"), ("dst", "out")]
    assert "nChw16c" in repr(sig)
