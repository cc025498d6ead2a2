"""Reorder and zero-pad, generated from the layouts' index maps: no code per layout pair."""

from __future__ import annotations

from tvm import te, tirx
from tvm.script.ir_builder import IRBuilder
from tvm.tirx.script import builder as T

from blockpad.errors import LayoutError
from blockpad.layout import Layout
from blockpad.vocabulary import DST

from ..kernel import Arg, KernelDef, finish, movement_storage, placeholder


def reorder(src: Layout, dst: Layout, name: str) -> KernelDef:
    """``dst`` = ``src`` relaid out; every padding element of ``dst`` is written zero."""
    if src.shape != dst.shape or src.dtype != dst.dtype:
        raise LayoutError(f"reorder: src and dst must hold the same logical tensor; got "
                          f"{src.shape} {src.dtype} and {dst.shape} {dst.dtype}")
    storage = movement_storage(src.dtype)
    zero = tirx.const(0, storage)
    s = placeholder(src, "src", storage)

    def element(*p):
        value = s[src.to_physical(dst.to_logical(p))]
        return tirx.if_then_else(dst.is_padding(p), zero, value) if dst.has_padding else value

    d = te.compute(dst.physical_shape, element, name=DST)
    args = [Arg("src", src, "in", storage), Arg("dst", dst, "out", storage)]
    return finish(te.create_prim_func([s, d]), name, "reorder", args)


def zero_pad(layout: Layout, name: str) -> KernelDef:
    """Write zero into the padding of ``layout``, in place, leaving its elements untouched.

    One block per padded region: along each padded dim, only the outer indices that hold
    padding are visited (the halo and the last, partial block), so the cost scales with the
    padding, not with the tensor."""
    storage = movement_storage(layout.dtype)
    with IRBuilder() as ib:
        with T.prim_func(s_tir=True):
            T.func_name(name)
            # one buffer, so trivially true; and a func without it in a module costs every
            # other kernel there its noalias (measured: the 3x3 convolutions of a library
            # with zero-pad kernels ran 2x slower, their accumulators spilled to memory)
            T.func_attr({"tirx.noalias": True})
            buf = T.match_buffer(T.arg("buf", T.handle()), layout.physical_shape, storage)
            regions = list(_padded_regions(layout))
            if not regions:
                T.evaluate(0)  # nothing is padding: a valid no-op keeps the kernel set uniform
            for n, (axis, start, stop) in enumerate(regions):
                extents = list(layout.physical_shape)
                extents[axis] = stop - start
                with T.grid(*extents) as loops:
                    loops = _as_list(loops)  # the builder unwraps one-element lists
                    with T.sblock(f"zero{n}"):
                        bound = _as_list(T.axis.remap("S" * len(extents), loops))
                        idx = [v + start if i == axis else v for i, v in enumerate(bound)]
                        pidx = [v + start if i == axis else v for i, v in enumerate(loops)]
                        T.where(layout.is_padding(pidx))
                        T.buffer_store(buf, tirx.const(0, storage), idx)
    args = [Arg("buf", layout, "inout", storage)]
    return finish(ib.get(), name, "zero_pad", args)


def _as_list(v):
    return list(v) if isinstance(v, (list, tuple)) or hasattr(v, "__len__") else [v]


def _padded_regions(layout: Layout):
    """(physical axis, start, stop) ranges of outer indices that contain padding."""
    for axis, p in enumerate(layout.physical):
        if p.block:
            continue
        before, after = (h // p.divisor for h in layout.paddings[p.dim])
        if before:
            yield axis, 0, before
        full = layout.shape[p.dim] // p.divisor
        if before + full < p.size:
            yield axis, before + full, p.size
