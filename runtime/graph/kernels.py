"""The kernels a graph runs besides its ops': reorders between layouts, the Winograd transform
of constant weights, and the zero-pad kernels its memories ask for. Weights, execution and
results all relayout memories, so this is the one place that knows how (a kernel from the
cache, else numpy)."""

from __future__ import annotations

from blockpad import winograd

from ..cache import Request
from ..memory import CLEAN, Memory


class MemoryRuntime:
    """What the graph's memories see as their library: the policy, and zero-pad kernels from
    the cache (``padding.zero_pad`` asks it for one)."""

    def __init__(self, policy, cache):
        self.policy = policy
        self._cache = cache
        self._zero_pads = {}

    def zero_pad_kernel(self, layout):
        if layout not in self._zero_pads:
            self._zero_pads[layout] = self._cache.zero_pad_kernel(layout)
        return self._zero_pads[layout]


def reorder_request(src, dst) -> Request:
    """The request for the kernel that relays ``src`` (a Layout) out as ``dst``."""
    return Request.make("reorder", [("src", src), ("dst", dst)])


def reorder(cache, src: Memory, dst: Memory) -> None:
    """dst = src relaid out, with the cache's reorder kernel (numpy if it has none)."""
    kernel = cache.find(reorder_request(src.layout, dst.layout))
    if kernel is not None:
        kernel(src, dst)
    else:
        numpy_reorder(src, dst)


def numpy_reorder(src: Memory, dst: Memory) -> None:
    """dst = src relaid out by numpy, its padding zeroed: the fallback of every reorder."""
    write_logical(dst, src.to_numpy())


def write_logical(dst: Memory, array) -> None:
    """Store the logical ``array`` into ``dst`` and zero its padding (it is then clean)."""
    dst.buffer[dst.layout.logical_offsets()] = array
    if dst.layout.has_padding:
        dst.buffer[dst.layout.padding_offsets()] = 0
    dst.state = CLEAN


def winograd_weights(cache, src: Memory, dst: Memory) -> None:
    """dst = the Winograd-domain transform of 3x3 weights ``src``, with the library's (or a
    compiled) ``winograd_weights`` kernel; in float64 numpy if there is none."""
    m = dst.layout.shape[2] - 2
    kernel = cache.find(Request.make("winograd_weights", [("src", src.layout), ("dst", dst.layout)],
                                     {"winograd_tile": m}, shape=src.layout.shape))
    if kernel is not None:
        kernel(src, dst)
        return
    u = winograd.transform(src.to_numpy(), m)
    write_logical(dst, u.astype(dst.buffer.dtype))
