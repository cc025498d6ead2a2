"""A tensor in a blocked, padded layout: one flat buffer plus the layout that explains it."""

from __future__ import annotations

import numpy as np

from blockpad.errors import ArgumentError
from blockpad.layout import Layout, numpy_dtype

ALIGNMENT = 64  # bytes; what vector code likes and what TVM's own allocations give


def aligned_empty(n: int, dtype) -> np.ndarray:
    """An uninitialised 1-D array of ``n`` elements whose data starts on a 64-byte boundary."""
    dtype = np.dtype(dtype)
    raw = np.empty(n * dtype.itemsize + ALIGNMENT, np.uint8)
    start = -raw.ctypes.data % ALIGNMENT
    return raw[start:start + n * dtype.itemsize].view(dtype)


CLEAN, DIRTY, UNKNOWN = "clean", "dirty", "unknown"


class Memory:
    """``layout`` + a flat buffer of at least ``layout.alloc_len`` elements + the state of its
    padding (``clean``: zero, ``dirty``: anything, ``unknown``).

    ``Memory.empty``/``zeros``/``from_numpy`` zero the padding at creation (clean); a memory made
    by ``Library.memory`` follows that library's padding policy instead, and so does its
    ``set_data_handle``. ``from_buffer`` wraps a caller's buffer as it is (state unknown)."""

    def __init__(self, layout: Layout, buffer: np.ndarray, state: str = UNKNOWN, library=None):
        if not isinstance(layout, Layout):
            raise ArgumentError(f"layout: expected a blockpad.Layout; got {type(layout).__name__}")
        self.layout = layout
        self.buffer = _check_buffer(buffer, layout)
        self.state = state if layout.has_padding else CLEAN   # nothing to be dirty
        self.library = library
        self.pending = None          # Event of an asynchronous zero-pad still running

    @property
    def policy(self):
        return self.library.policy if self.library is not None else None

    def set_data_handle(self, buffer, clean: bool = False, stream=None):
        """Point this memory at another buffer, as the library's policy says (seed 000/001):

        * ``on_handle``: zero-pad now, on this thread (oneDNN's historical behaviour);
        * ``user``: nothing if ``clean``; otherwise zero-pad on ``stream`` (returns the Event to
          wait on) or, without a stream, now;
        * the others: no work; the state becomes ``clean`` if the caller says so, else
          ``unknown`` (``tracked`` zero-pads it later, only if a kernel needs it clean).

        A read-only buffer is never written: if it must be zero-padded it is copied first."""
        from .padding import zero_pad

        self.wait()
        self.buffer = _check_buffer(np.asarray(buffer), self.layout)
        self.state = CLEAN if clean or not self.layout.has_padding else UNKNOWN
        policy = self.policy
        if policy == "on_handle" or (policy == "user" and not clean):
            if stream is not None and policy == "user":
                self.pending = stream.submit(zero_pad, self, False)
                return self.pending
            zero_pad(self, blocking=True)
        return None

    def wait(self):
        """Wait for an asynchronous zero-pad of this memory, if one is running."""
        if self.pending is not None:
            pending, self.pending = self.pending, None
            pending.wait()

    def cleanup(self):
        """Zero the padding now (seed 000 option 2.b's ``memory_cleanup``): for users who run
        their own kernels on blocked buffers and may have written into the padding."""
        from .padding import zero_pad

        self.wait()
        zero_pad(self, blocking=True)

    @classmethod
    def empty(cls, layout: Layout) -> Memory:
        """Uninitialised elements, zero padding."""
        buf = aligned_empty(layout.alloc_len, numpy_dtype(layout.dtype))
        buf[layout.padding_offsets()] = 0
        return cls(layout, buf, CLEAN)

    @classmethod
    def zeros(cls, layout: Layout) -> Memory:
        buf = aligned_empty(layout.alloc_len, numpy_dtype(layout.dtype))
        buf[...] = 0
        return cls(layout, buf, CLEAN)

    @classmethod
    def from_numpy(cls, array, layout: Layout) -> Memory:
        """Pack a plain array of the logical shape into ``layout``; padding is zero."""
        array = np.asarray(array)
        want = numpy_dtype(layout.dtype)
        if array.shape != layout.shape:
            raise ArgumentError(f"from_numpy: expected an array of the logical shape "
                                f"{layout.shape}; got shape {array.shape}")
        if array.dtype != want:
            raise ArgumentError(f"from_numpy: expected dtype {layout.dtype}; got {array.dtype} "
                                f"(convert with .astype first: blockpad never casts silently)")
        mem = cls.zeros(layout)
        mem.buffer[layout.logical_offsets()] = array
        return mem

    @classmethod
    def from_buffer(cls, buffer, layout: Layout) -> Memory:
        """Wrap an existing flat buffer without copying (its padding is left as it is)."""
        return cls(layout, np.asarray(buffer))

    def to_numpy(self) -> np.ndarray:
        """The plain logical array (a copy)."""
        return self.buffer[self.layout.logical_offsets()]

    def physical_view(self, storage=None) -> np.ndarray:
        """The buffer seen as the layout's physical dims and strides, as kernels take it."""
        return physical_view(self.buffer, self.layout, storage)

    def padding_is_zero(self) -> bool:
        pad = self.buffer[self.layout.padding_offsets()]
        return bool(np.all(pad.view(np.uint8) == 0)) if pad.size else True

    def __repr__(self):
        return (f"Memory({self.layout}, {self.buffer.nbytes} bytes at 0x{self.buffer.ctypes.data:x}, "
                f"padding {self.state})")


def physical_view(buffer: np.ndarray, layout: Layout, storage=None) -> np.ndarray:
    buf = buffer if storage is None else buffer.view(numpy_dtype(storage))
    return np.lib.stride_tricks.as_strided(
        buf, layout.physical_shape, [s * buf.itemsize for s in layout.physical_strides])


def _check_buffer(buffer, layout: Layout) -> np.ndarray:
    if not isinstance(buffer, np.ndarray):
        raise ArgumentError(f"buffer: expected a numpy array; got {type(buffer).__name__}")
    want = numpy_dtype(layout.dtype)
    if buffer.dtype != want:
        raise ArgumentError(f"buffer: expected dtype {layout.dtype}; got {buffer.dtype}")
    if buffer.ndim != 1 or buffer.strides[0] != buffer.itemsize:
        raise ArgumentError(f"buffer: expected a contiguous 1-D array; got shape {buffer.shape} "
                            f"strides {buffer.strides}")
    if buffer.size < layout.alloc_len:
        raise ArgumentError(f"buffer: layout {layout} needs {layout.alloc_len} elements; "
                            f"got {buffer.size}")
    if buffer.ctypes.data % buffer.itemsize:
        raise ArgumentError(f"buffer: data at 0x{buffer.ctypes.data:x} is not aligned to its "
                            f"{buffer.itemsize}-byte elements")
    return buffer
