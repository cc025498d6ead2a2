"""Concatenation along one axis (ONNX ``Concat``; DenseNet's channel concat), any layouts:

    dst[..., j, ...] = src_i[..., j - offset_i, ...]   for offset_i <= j < offset_i + sizes[i]

Written over logical indices, so a blocked destination whose block straddles two sources (an
offset that is not a multiple of the block: 24 + 40 channels into ``nChw16c``) is no special
case: each lane reads the source its channel belongs to. The destination's padding is whatever
the plan says (derived: the last source's clean padding makes it zero), and sources' padding is
read only there, so blocked layouts never need a plain detour.

``shape`` is the first source's; ``sizes`` lists every source's extent along ``axis`` (the
first is ``shape[axis]``). Sources are arguments ``src0``, ``src1``, ... in order."""

from __future__ import annotations

import itertools

from tvm import tirx

from blockpad.errors import SpecError

from .common import OpDef, Source, materialize, plan_for

MAX_INPUTS = 128   # DenseNet-264 concatenates 65 values
TENSORS = (*(f"src{i}" for i in range(MAX_INPUTS)), "dst")
PARAMS = {"axis": 1, "sizes": None}


def signature(shape, dtype, params):
    shape, axis, sizes = tuple(shape), params["axis"], params["sizes"]
    if not isinstance(axis, int) or not 0 <= axis < len(shape):
        raise SpecError(f"concat: axis must be a dim of the {len(shape)}-d shape; got {axis!r}")
    if not isinstance(sizes, list) or not 1 <= len(sizes) <= MAX_INPUTS or \
            not all(isinstance(n, int) and n >= 1 for n in sizes) or sizes[0] != shape[axis]:
        raise SpecError(f"concat: sizes must list 1 to {MAX_INPUTS} positive extents along axis "
                        f"{axis}, the first the shape's ({shape[axis]}); got {sizes!r}")

    def at(n):
        return (*shape[:axis], n, *shape[axis + 1:])

    return {**{f"src{i}": (at(n), dtype) for i, n in enumerate(sizes)},
            "dst": (at(sum(sizes)), dtype)}


def make(layouts, name, policy, axis=1, sizes=None):
    dst = layouts["dst"]
    offsets = list(itertools.accumulate(sizes, initial=0))

    def opdef(mode):
        srcs = [Source(f"src{i}", layouts[f"src{i}"], mode) for i in range(len(sizes))]

        def value(*idx):
            def read(i):
                return srcs[i](*idx[:axis], idx[axis] - offsets[i], *idx[axis + 1:])

            v = read(len(srcs) - 1)
            for i in range(len(srcs) - 2, -1, -1):
                v = tirx.if_then_else(idx[axis] < offsets[i + 1], read(i), v)
            return v

        return OpDef("concat", srcs, value, params={"axis": axis, "sizes": list(sizes)})

    p = plan_for(policy, opdef("trusted"), dst)
    return materialize(opdef(p.reads), dst, p, name)
