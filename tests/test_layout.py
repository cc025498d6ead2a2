"""Layout: tags, padding, strides, alloc_len and the index maps (pure Python, no TVM)."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import blockpad as bp
from blockpad.layout import Layout

from .strategies import layouts


@pytest.mark.parametrize("tag, shape, padded, physical", [
    ("nchw", (2, 30, 5, 7), (2, 30, 5, 7), (2, 30, 5, 7)),
    ("nhwc", (2, 30, 5, 7), (2, 30, 5, 7), (2, 5, 7, 30)),
    ("nChw8c", (2, 30, 5, 7), (2, 32, 5, 7), (2, 4, 5, 7, 8)),
    ("nChw16c", (2, 30, 5, 7), (2, 32, 5, 7), (2, 2, 5, 7, 16)),
    ("OIhw16i16o", (20, 30, 3, 3), (32, 32, 3, 3), (2, 2, 3, 3, 16, 16)),
    ("OIhw4i16o4i", (20, 30, 3, 3), (32, 32, 3, 3), (2, 2, 3, 3, 4, 16, 4)),
    ("ab", (3, 5), (3, 5), (3, 5)),
    ("AB16b16a", (33, 17), (48, 32), (3, 2, 16, 16)),
    ("aBcd16b", (1, 3, 2, 2), (1, 16, 2, 2), (1, 1, 2, 2, 16)),
    ("goihw", (2, 3, 4, 5, 5), (2, 3, 4, 5, 5), (2, 3, 4, 5, 5)),
    ("abcdef", (1, 2, 3, 4, 5, 6), (1, 2, 3, 4, 5, 6), (1, 2, 3, 4, 5, 6)),
])
def test_tags(tag, shape, padded, physical):
    lay = Layout(tag, shape)
    assert lay.padded_shape == padded
    assert lay.physical_shape == physical
    assert lay.alloc_len == math.prod(physical)


def test_issue_example():
    lay = bp.Layout("nChw16c", shape=(2, 30, 5, 7), dtype="float32")
    assert lay.padded_shape == (2, 32, 5, 7)
    assert lay.alloc_len == 2 * 32 * 5 * 7


def test_acl_padding_matches_seed_002():
    # seed 002: NCHW {2,2,5,5} float with padding right 1, bottom 1 -> strides (in bytes)
    # 4, 24, 144, 288 and 576 bytes in all; with left/top the first element moves.
    lay = Layout("nchw", (2, 2, 5, 5)).acl(left=0, right=1, top=0, bottom=1)
    assert [s * 4 for s in lay.physical_strides] == [288, 144, 24, 4]
    assert lay.alloc_len * 4 == 576
    shifted = Layout("nchw", (2, 2, 5, 5)).acl(left=2, right=1, top=1, bottom=1)
    assert shifted.elem_offset == 2 * 1 + 1 * shifted.physical_strides[2]
    assert shifted.logical_offsets()[0, 0, 0, 0] == shifted.elem_offset


@pytest.mark.parametrize("tag, message", [
    ("nChw", r"upper case \(blocked\) but has no block"),
    ("nchw16c", "written C"),
    ("nxhw", "mix families"),
    ("nchwc", "appears twice"),
    ("", "expected letters"),
    ("nc-hw", "expected letters"),
    ("acd", "without gaps"),
    ("nChw0c", "must be positive"),
])
def test_bad_tags(tag, message):
    with pytest.raises(bp.LayoutError, match=message):
        Layout(tag, (1, 2, 3, 4))


@pytest.mark.parametrize("kwargs, message", [
    ({"tag": "nchw", "shape": (1, 2, 3)}, "has 4 dims"),
    ({"tag": "nchw", "shape": (1, 0, 3, 3)}, "must be positive"),
    ({"tag": "nchw", "shape": (1, 2, 3, 3), "dtype": "complex64"}, "dtype"),
    ({"tag": "nchw", "shape": (1, 2, 3, 3), "strides": (18, 9, 2, 1)}, r"physical dim 2 \(h\) has stride 2"),
    ({"tag": "nchw", "shape": (1, 2, 3, 3), "strides": (18, 9, 3)}, "4 physical dims"),
    ({"tag": "nchw", "shape": (1, 2, 3, 3), "strides": (18, 9, 3, 0)}, "positive stride"),
    ({"tag": "nChw16c", "shape": (1, 2, 3, 3), "paddings": {"c": (1, 0)}}, "multiple of 16"),
    ({"tag": "nchw", "shape": (1, 2, 3, 3), "paddings": {"x": (1, 0)}}, "unknown dim"),
    ({"tag": "nchw", "shape": (1, 2, 3, 3), "paddings": {"h": (-1, 0)}}, "non-negative"),
    ({"tag": "abcdefa", "shape": (1,) * 7}, "twice"),
])
def test_invalid_layouts_name_the_problem(kwargs, message):
    with pytest.raises(bp.LayoutError, match=message):
        Layout(**kwargs)


def test_from_blocks_and_describe_round_trip():
    lay = Layout.from_blocks((5, 33), "int8", order=(1, 0), blocks=[(0, 4), (1, 16)])
    assert lay.tag == "BA4a16b"
    assert lay.physical_shape == (3, 2, 4, 16)
    assert Layout.from_dict(lay.describe()) == lay
    halo = Layout("nchw", (1, 2, 3, 4)).with_padding(h=(1, 1))
    assert Layout.from_dict(halo.describe()) == halo


# ---- properties over random layouts --------------------------------------------------------

def _all_physical_offsets(lay):
    grid = np.indices(lay.physical_shape).reshape(len(lay.physical_shape), -1)
    return np.asarray(lay.offset(list(grid))).ravel()


@settings(max_examples=200, deadline=None)
@given(layouts())
def test_alloc_len_is_exact_and_offsets_disjoint(lay):
    offsets = _all_physical_offsets(lay)
    assert offsets.max() + 1 == lay.alloc_len          # exact: last element is the last one
    assert len(np.unique(offsets)) == offsets.size     # no two physical elements share memory
    logical = lay.logical_offsets().ravel()
    pad = lay.padding_offsets()
    assert logical.size == math.prod(lay.shape)
    assert len(np.intersect1d(logical, pad)) == 0
    assert logical.size + pad.size == offsets.size     # every element is logical or padding
    assert logical.min() == lay.elem_offset


@settings(max_examples=200, deadline=None)
@given(layouts(), st.data())
def test_index_maps_are_inverse(lay, data):
    idx = tuple(data.draw(st.integers(0, n - 1)) for n in lay.shape)
    phys = lay.to_physical(idx)
    assert all(0 <= p < n for p, n in zip(phys, lay.physical_shape))
    assert lay.to_logical(phys) == idx
    assert not lay.is_padding(phys)
    pidx = tuple(data.draw(st.integers(0, n - 1)) for n in lay.physical_shape)
    logical = lay.to_logical(pidx)
    inside = all(0 <= x < n for x, n in zip(logical, lay.shape))
    assert lay.is_padding(pidx) == (not inside)
    if inside:
        assert lay.to_physical(logical) == pidx


@settings(max_examples=100, deadline=None)
@given(layouts())
def test_memory_round_trip_in_numpy(lay):
    rng = np.random.default_rng(0)
    x = rng.integers(-100, 100, size=lay.shape).astype(bp.layout.numpy_dtype(lay.dtype))
    mem = bp.Memory.from_numpy(x, lay)
    assert mem.buffer.size == lay.alloc_len
    assert mem.buffer.ctypes.data % 64 == 0
    assert np.array_equal(mem.to_numpy(), x)
    assert mem.padding_is_zero()
