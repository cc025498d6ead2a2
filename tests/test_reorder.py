"""Generated reorder and zero_pad kernels against numpy, with dirty buffers and guard regions."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import blockpad as bp
from blockpad.codegen.spec import parse_spec

from .conftest import REORDER_SPEC, garbage, random_array
from .strategies import layouts, maybe_strided

GUARD = 64  # elements of sentinel on each side of every destination buffer


def guarded(layout):
    """A garbage-filled allocation with ``layout.alloc_len`` usable elements in the middle."""
    whole = garbage(layout.alloc_len + 2 * GUARD, layout.dtype)
    return whole, whole[GUARD:GUARD + layout.alloc_len]


def untouched(layout, whole):
    """Everything a kernel writing ``layout`` must leave alone: the guards, and the gaps between
    rows of a strided layout."""
    mask = np.ones(whole.size, bool)
    mask[GUARD + layout.logical_offsets().ravel()] = False
    mask[GUARD + layout.padding_offsets()] = False
    return whole.view(np.uint8).reshape(whole.size, -1)[mask]


def check_reorder(kernel, rng):
    (_, _, src, _), (_, _, dst, _) = kernel.signature.args
    x = random_array(src.shape, src.dtype, rng)
    src_mem = bp.Memory.from_numpy(x, src)
    src_mem.buffer[src.padding_offsets()] = garbage(1, src.dtype)[0]  # reorders never read padding
    whole, buf = guarded(dst)
    kernel(src_mem, buf)
    out = bp.Memory(dst, buf)
    assert np.array_equal(out.to_numpy().view(np.uint8), x.view(np.uint8)), kernel.name
    assert out.padding_is_zero(), f"{kernel.name}: destination padding not zeroed"
    assert np.all(untouched(dst, whole) == 0xFF), f"{kernel.name}: wrote outside the layout"


def check_zero_pad(kernel, rng):
    (_, _, lay, _), = kernel.signature.args
    x = random_array(lay.shape, lay.dtype, rng)
    whole, buf = guarded(lay)
    buf[lay.logical_offsets()] = x
    kernel(buf)
    out = bp.Memory(lay, buf)
    assert out.padding_is_zero(), f"{kernel.name}: padding not zeroed"
    assert np.array_equal(out.to_numpy().view(np.uint8), x.view(np.uint8)), \
        f"{kernel.name}: changed an element"
    assert np.all(untouched(lay, whole) == 0xFF), f"{kernel.name}: wrote outside the layout"


def _names(op):
    return [k.name for k in parse_spec(REORDER_SPEC).kernels if k.op == op]


@pytest.mark.parametrize("name", _names("reorder"))
def test_reorder(reorder_lib, name, rng):
    check_reorder(reorder_lib[name], rng)


@pytest.mark.parametrize("name", _names("zero_pad"))
def test_zero_pad(reorder_lib, name, rng):
    check_zero_pad(reorder_lib[name], rng)


def test_plain_blocked_plain_is_exact(reorder_lib, rng):
    x = rng.standard_normal((2, 30, 5, 7)).astype("float32")
    blocked = bp.Memory.empty(bp.Layout("nChw16c", (2, 30, 5, 7)))
    reorder_lib["reorder_nchw_nChw16c_f32_2x30x5x7"](x, blocked)
    back = np.empty_like(x)
    reorder_lib["reorder_nChw16c_nchw_f32_2x30x5x7"](blocked, back)
    assert np.array_equal(back, x)


def test_dlpack_and_flat_buffers(reorder_lib, rng):
    x = rng.standard_normal((2, 30, 5, 7)).astype("float32")
    lay = bp.Layout("nChw16c", (2, 30, 5, 7))

    class Producer:  # any object with __dlpack__, e.g. a torch tensor
        def __init__(self, a):
            self.a = a

        def __dlpack__(self, **kw):
            return self.a.__dlpack__(**kw)

        def __dlpack_device__(self):
            return self.a.__dlpack_device__()

    flat = np.zeros(lay.alloc_len + 5, "float32")  # a longer buffer is fine
    reorder_lib["reorder_nchw_nChw16c_f32_2x30x5x7"](Producer(x), flat)
    assert np.array_equal(bp.Memory(lay, flat).to_numpy(), x)
    phys = flat[: lay.alloc_len].reshape(lay.physical_shape)  # the physical shape works too
    back = np.empty_like(x)
    reorder_lib["reorder_nChw16c_nchw_f32_2x30x5x7"](phys, back)
    assert np.array_equal(back, x)


def test_misaligned_buffers_are_accepted(reorder_lib, rng):
    """numpy aligns to 16 bytes at best; kernels are built for element alignment only."""
    x = rng.standard_normal((2, 30, 5, 7)).astype("float32")
    lay = bp.Layout("nChw16c", (2, 30, 5, 7))
    src = np.empty(x.size + 1, "float32")[1:].reshape(x.shape)
    src[...] = x
    dst = np.full(lay.alloc_len + 3, np.nan, "float32")[3:]
    assert src.ctypes.data % 64 and dst.ctypes.data % 64
    reorder_lib["reorder_nchw_nChw16c_f32_2x30x5x7"](src, dst)
    assert np.array_equal(bp.Memory(lay, dst).to_numpy(), x)


# ---- random layouts, compiled on the spot -------------------------------------------------

@st.composite
def layout_pairs(draw):
    """A source and a destination of one shape and dtype; the destination may be strided."""
    src = draw(layouts(max_rank=4))
    dst = draw(layouts(max_rank=4).filter(lambda l: l.rank == src.rank))
    return src, draw(maybe_strided(bp.Layout(dst.tag, src.shape, src.dtype, dst.paddings)))


@settings(max_examples=3, deadline=None, derandomize=True,   # the first: the simplest pairs
          suppress_health_check=list(HealthCheck))
@given(st.lists(layout_pairs(), min_size=4, max_size=4))
def test_random_layout_pairs(tmp_path_factory, pairs):
    """Random layouts (blocks up to 16, nested blocks, halos, strided sources and
    destinations): four pairs per library, so that one build serves four checks."""
    kernels = []
    for i, (src, dst) in enumerate(pairs):
        kernels += [{"op": "reorder", "name": f"fwd{i}", "shape": list(src.shape),
                     "dtype": src.dtype, "src": _table(src), "dst": _table(dst)},
                    {"op": "zero_pad", "name": f"zp{i}", "shape": list(src.shape),
                     "dtype": src.dtype, "layout": _table(dst)}]
    out = tmp_path_factory.mktemp("random")
    bp.build({"kernel": kernels}, "host", out, log=lambda m: None)
    lib = bp.load(out)
    rng = np.random.default_rng(1)
    for i in range(len(pairs)):
        check_reorder(lib[f"fwd{i}"], rng)
        check_zero_pad(lib[f"zp{i}"], rng)


def test_block_16_and_strided_destinations_are_drawn():
    """The strategies reach what the property test must cover: blocks of 16 and destinations
    with gaps between rows."""
    from hypothesis import find

    pair = find(layout_pairs(), lambda p: "16" in p[1].tag
                and p[1].strides is not None)
    assert pair[1].strides is not None


def _table(layout):
    d = {"tag": layout.tag}
    d.update({k: v for k, v in layout.describe().items() if k in ("paddings", "strides")})
    return d
