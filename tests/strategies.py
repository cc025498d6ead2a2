"""Hypothesis strategies shared by the tests."""

from hypothesis import strategies as st

from blockpad.layout import Layout


@st.composite
def layouts(draw, max_rank=4):
    rank = draw(st.integers(1, max_rank))
    shape = tuple(draw(st.lists(st.integers(1, 9), min_size=rank, max_size=rank)))
    order = draw(st.permutations(range(rank)))
    blocked = draw(st.lists(st.integers(0, rank - 1), max_size=2, unique=True))
    blocks = []
    for d in blocked:
        for _ in range(draw(st.integers(1, 2))):   # nested blocks like 4i16o4i
            blocks.append((d, draw(st.sampled_from([2, 3, 4, 8, 16]))))
    blocks = draw(st.permutations(blocks))
    lay = Layout.from_blocks(shape, draw(st.sampled_from(["float32", "int8", "bfloat16"])),
                             order, blocks)
    pads = {}
    for d in draw(st.lists(st.integers(0, rank - 1), max_size=2, unique=True)):
        b = lay.block_of(d)
        pads[d] = (b * draw(st.integers(0, 2)), b * draw(st.integers(0, 2)))
    lay = Layout(lay.tag, shape, lay.dtype, pads)
    return draw(maybe_strided(lay))


@st.composite
def maybe_strided(draw, lay):
    """``lay`` as it is, or with some strides grown: gaps between rows are legal, and a
    kernel must write none of them."""
    if not draw(st.booleans()):
        return lay
    strides, inner = [], 1
    for size in reversed(lay.physical_shape):
        strides.append(inner)
        inner = inner * size + draw(st.integers(0, 3))
    return lay.with_strides(tuple(reversed(strides)))
