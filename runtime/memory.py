"""A tensor in a blocked, padded layout: one flat buffer plus the layout that explains it."""

from __future__ import annotations

import ctypes
import functools
import math

import numpy as np

from blockpad.errors import ArgumentError, BlockpadError
from blockpad.layout import Layout, numpy_dtype

ALIGNMENT = 64  # bytes; what vector code likes and what TVM's own allocations give


def aligned_empty(n: int, dtype) -> np.ndarray:
    """An uninitialised 1-D array of ``n`` elements whose data starts on a 64-byte boundary."""
    dtype = np.dtype(dtype)
    raw = np.empty(n * dtype.itemsize + ALIGNMENT, np.uint8)
    start = -raw.ctypes.data % ALIGNMENT
    return raw[start:start + n * dtype.itemsize].view(dtype)


CLEAN, DIRTY, UNKNOWN = "clean", "dirty", "unknown"


class SubMemoryError(BlockpadError, ValueError):
    """A sub-memory whose padding state could not be kept correct, refused."""


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
        self._parent = None          # the memory a sub-memory is a view of
        self.buffer = _check_buffer(buffer, layout)
        self._gen = 0                # bumped whenever this memory's state is set as a whole
        self._state = state if layout.has_padding else CLEAN   # nothing to be dirty
        self.library = library
        self.pending = None          # Event of an asynchronous zero-pad still running

    @property
    def buffer(self) -> np.ndarray:
        """The flat buffer; a sub-memory's is a window of its parent's current buffer, so a
        parent's ``set_data_handle`` moves its views along."""
        p = self._parent
        if p is not None and self._root_buffer is not p.buffer:
            self._root_buffer = p.buffer
            self._buffer = p.buffer[self._origin:self._origin + self.layout.alloc_len]
        return self._buffer

    @buffer.setter
    def buffer(self, value) -> None:
        if self._parent is not None:
            # a view given a buffer of its own (a zero-pad had to copy a read-only parent's
            # window): it is no longer a view, and its state is its own from now on
            state = self.state
            self._parent = None
            self._state = state
        self._buffer = value

    # ---- padding state -------------------------------------------------------------------------
    @property
    def state(self) -> str:
        """``clean`` / ``dirty`` / ``unknown``. A sub-memory's padding is part of its parent's
        padding, so the two stay consistent: a parent made clean (zero-padded) makes its views
        clean; a parent written as a whole gives its views its own state; a view that gets dirty
        makes its parent, and every other view of it, dirty (they may overlap); a view made
        clean says nothing of the rest of the parent."""
        p = self._parent
        if p is None:
            return self._state
        whole = p._state
        if whole == CLEAN or self._gen != p._gen:
            return whole
        return self._state

    @state.setter
    def state(self, value: str) -> None:
        if not self.layout.has_padding:
            value = CLEAN
        p = self._parent
        if p is None:
            self._state = value
            self._gen += 1
            return
        if value != CLEAN:
            # part of the parent is no longer clean, and so may be any view overlapping this
            # one: they all fall back to the parent's state (bumped generation)
            if p._state != DIRTY:
                p._state = DIRTY if value == DIRTY else UNKNOWN
            p._gen += 1
        self._state = value
        self._gen = p._gen

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

        if self._parent is not None:
            raise ArgumentError("set_data_handle: this memory is a sub-memory (a view of its "
                                "parent's buffer); set the parent's handle instead")
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
        if self._parent is not None:
            self._parent.wait()
        if self.pending is not None:
            pending, self.pending = self.pending, None
            pending.wait()

    def cleanup(self):
        """Zero the padding now (seed 000 option 2.b's ``memory_cleanup``): for users who run
        their own kernels on blocked buffers and may have written into the padding."""
        from .padding import zero_pad

        self.wait()
        zero_pad(self, blocking=True)

    # ---- sub-memories --------------------------------------------------------------------------
    def submemory(self, dims, offsets) -> Memory:
        """A view of the region ``offsets .. offsets + dims`` (logical indices, oneDNN's
        ``submemory_desc``), sharing this memory's buffer and padding state (see ``state``).

        Seed 001's caveat: a view has padding of its own, and whoever zero-pads it writes there.
        A view is therefore made only where its padding is the parent's padding too, and
        refused otherwise (BlockpadError saying why): a region of whole outer dims (batch, a
        window of rows) is always fine; along a blocked dim it must start on a block boundary
        and end on one or at the parent's end, else zero-padding the view would wipe parent
        elements that sit in the view's last block."""
        root = self._parent or self
        base_off = self._view_origin()
        lay = self.layout
        dims = tuple(int(d) for d in dims)
        offsets = tuple(int(o) for o in offsets)
        if len(dims) != lay.rank or len(offsets) != lay.rank:
            raise ArgumentError(f"submemory: layout {lay} has {lay.rank} dims; got dims {dims} "
                                f"and offsets {offsets}")
        for d, (n, o) in enumerate(zip(dims, offsets)):
            if n <= 0 or o < 0 or o + n > lay.shape[d]:
                raise ArgumentError(f"submemory: dim {lay.dims[d]}: region {o}..{o + n} is not "
                                    f"inside 0..{lay.shape[d]}")
        for d, o in enumerate(offsets):
            block = lay.block_of(d)
            if o % block:
                raise SubMemoryError(
                    f"submemory: offset {o} along {lay.dims[d]} is inside a block of {block} "
                    f"of layout {lay.tag}: a view cannot start mid-block (its elements would "
                    f"not be laid out as {lay.tag}); use an offset that is a multiple of {block}")
        view = Layout(lay.tag, dims, lay.dtype, None, lay.physical_strides)
        origin = lay.offset(lay.to_physical(offsets)) - lay.elem_offset
        start = base_off + lay.elem_offset + origin
        if view.has_padding:
            parent_logical = lay.logical_offsets().reshape(-1) - lay.elem_offset
            clash = np.intersect1d(view.padding_offsets() + origin, parent_logical)
            if clash.size:
                bad = [d for d in range(lay.rank) if (offsets[d] + dims[d]) % lay.block_of(d)
                       and offsets[d] + dims[d] < lay.shape[d]]
                which = ", ".join(
                    f"{lay.dims[d]} {offsets[d] + dims[d]}.."
                    f"{min(lay.shape[d], offsets[d] + view.padded_shape[d]) - 1}"
                    for d in bad) or f"{clash.size} elements"
                raise SubMemoryError(
                    f"submemory: the view's padding would cover elements of the parent "
                    f"({which}): zero-padding the view, which its policy may do at any time, "
                    f"would destroy them (seed 001's sub-memory caveat). Along a blocked dim a "
                    f"view must end on a block boundary or at the parent's end")
        buf = root.buffer[start:start + view.alloc_len]
        mem = Memory(view, buf, library=self.library)
        mem._state = self.state if view.has_padding else CLEAN
        mem._parent, mem._origin, mem._root_buffer = root, start, root.buffer
        mem._gen = root._gen
        return mem

    def _view_origin(self) -> int:
        """Where this memory's buffer starts in its root's buffer (0 for a root)."""
        return self._origin if self._parent is not None else 0

    @property
    def parent(self):
        return self._parent

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
        """The buffer seen as the layout's physical dims and strides, as kernels take it. Kept
        while the buffer stays the same: making it costs more than a small kernel's run."""
        cache = self._buffer_cache()
        view = cache.get(storage)
        if view is None:
            view = cache[storage] = physical_view(self.buffer, self.layout, storage)
        return view

    def kernel_arg(self, storage=None):
        """``(tensor, lo, hi)``: the physical view as a compiled kernel takes it (a tvm_ffi
        Tensor, so a call does not convert it again through DLPack) and the byte addresses
        ``[lo, hi)`` it spans (for the overlap checks: numpy's own address lookup,
        ``ndarray.ctypes``, costs more than a small kernel). Kept while the buffer stays the
        same. A read-only buffer is exported through a writeable-flagged alias, because numpy
        refuses to export read-only arrays through DLPack: only kernels that do not write the
        argument get one (the caller checks)."""
        cache = self._buffer_cache()
        key = ("kernel", storage)
        arg = cache.get(key)
        if arg is None:
            view = self.physical_view(storage)
            if not view.flags.writeable:
                view = physical_view(_readable_alias(self.buffer), self.layout, storage)
            arg = cache[key] = _tensor_arg(view)
        return arg

    def _buffer_cache(self) -> dict:
        """Facts derived from the current buffer (views, kernel arguments), dropped when the
        buffer changes (``set_data_handle``, a zero-pad that copied a read-only buffer, a
        parent's new buffer under a sub-memory)."""
        buf = self.buffer
        cached = self.__dict__.get("_cache")
        if cached is None or cached[0] is not buf:
            cached = self._cache = (buf, {})
        return cached[1]

    def padding_is_zero(self) -> bool:
        """Whether every padding element is zero (docs/padding-contract.md, "Zero")."""
        return nonzero_padding(self) == 0

    def __repr__(self):
        return (f"Memory({self.layout}, {self.buffer.nbytes} bytes at 0x{self.buffer.ctypes.data:x}, "
                f"padding {self.state})")


def nonzero_padding(mem: Memory) -> int:
    """How many of ``mem``'s padding elements are not zero. Zero is a value: +0.0 and -0.0
    both count for floating types, as oneDNN's zero preservation has it. A kernel whose op maps
    0 to 0 (``linear`` with a negative scale, a leaky relu) computes -0.0 over zero padding,
    and any reader of that padding (a reduction over a whole block) gets the same numbers."""
    pad = mem.buffer[mem.layout.padding_offsets()]
    return int(np.count_nonzero(pad != 0))


def physical_view(buffer: np.ndarray, layout: Layout, storage=None) -> np.ndarray:
    buf = buffer if storage is None else buffer.view(numpy_dtype(storage))
    shape, strides = layout.physical_shape, layout.physical_strides
    if _row_major(shape, strides):   # a reshape: the same view for a tenth of as_strided's cost
        return buf[:math.prod(shape)].reshape(shape)
    return np.lib.stride_tricks.as_strided(buf, shape, [s * buf.itemsize for s in strides])


@functools.lru_cache(maxsize=256)
def _row_major(shape: tuple, strides: tuple) -> bool:
    """Whether element ``strides`` are those of a C-contiguous array of ``shape``."""
    step = 1
    for n, s in zip(reversed(shape), reversed(strides)):
        if n > 1 and s != step:
            return False
        step *= n
    return True


def _readable_alias(array: np.ndarray) -> np.ndarray:
    """A writeable-flagged alias of a read-only flat buffer (see ``Memory.kernel_arg``)."""
    raw = (ctypes.c_byte * max(array.nbytes, 1)).from_address(array.ctypes.data)
    return np.frombuffer(raw, array.dtype, array.size)


def _tensor_arg(view: np.ndarray):
    """``(tvm_ffi Tensor, lo, hi)`` for a physical view (non-negative strides)."""
    from .tvm_runtime import as_tensor

    tensor = as_tensor(view)
    lo = tensor.data_ptr()
    return tensor, lo, lo + _span(view.shape, view.strides, view.itemsize)


@functools.lru_cache(maxsize=256)
def _span(shape: tuple, strides: tuple, itemsize: int) -> int:
    """Bytes from the first to past the last element of a view (non-negative strides)."""
    if 0 in shape:
        return 0
    return sum((n - 1) * s for n, s in zip(shape, strides)) + itemsize


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
    if not buffer.flags.aligned:   # data % itemsize, without ndarray.ctypes's cost
        raise ArgumentError(f"buffer: data at 0x{buffer.ctypes.data:x} is not aligned to its "
                            f"{buffer.itemsize}-byte elements")
    return buffer
