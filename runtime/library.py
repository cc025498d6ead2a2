"""``blockpad.load``: a built library whose kernels take Memory objects, numpy arrays or any
DLPack producer, checked against the signatures the manifest records."""

from __future__ import annotations

import os
from operator import is_not

import numpy as np

from blockpad import machine
from blockpad import manifest as mf
from blockpad.errors import ArgumentError, LoadError
from blockpad.layout import Layout, numpy_dtype
from blockpad.machine import gpu_requirement
from blockpad.manifest import KernelRecord
from blockpad.vocabulary import INPLACE_SOURCES, KERNEL_ZEROS, SEVEN_BIT_RANGE

from . import padding
from .loadable import check_loadable
from .memory import CLEAN, Memory, aligned_empty
from .tvm_runtime import load_module, pool_threads


class Signature:
    """What a kernel takes: its manifest record (``entry``: a ``manifest.KernelRecord``, or
    the JSON form a manifest holds) and the per-call facts derived from it once."""

    def __init__(self, entry: KernelRecord | dict):
        record = entry if isinstance(entry, KernelRecord) else KernelRecord.from_json(entry)
        self.record = record
        self.name = record.name
        self.op = record.op
        self.params = record.params
        self.padding = record.padding   # the padding contract; None for data movement
        self.args = list(record.args)   # ArgRecord: name, role, layout, storage
        self.requires_clean = bool(self.padding and self.padding["requires"] == "clean")
        # argument index pairs at least one of which the kernel writes: they must not overlap
        self.written_pairs = [(i, j) for i in range(len(self.args))
                              for j in range(i + 1, len(self.args))
                              if (self.args[i].role, self.args[j].role) != ("in", "in")]
        # per-call facts, derived once: a small kernel runs in about a microsecond, so the
        # call path must not rederive them
        self.written = [i for i, a in enumerate(self.args) if a.role != "in"]
        self.sources = [i for i, a in enumerate(self.args) if a.role != "out"]
        self.padded_sources = [i for i in self.sources if self.args[i].layout.has_padding]
        self.stage = self.padding.get("dst_stage") if self.padding else None
        # weight_bits = 7: the kernel's one-vpmaddubsw steps saturate on weights outside
        # [-64, 64], so every call (and bind) checks them
        self.seven_bit = next((i for i, a in enumerate(self.args) if a.name == "weights"), None) \
            if self.params.get("weight_bits", 8) == 7 else None

    def __repr__(self):
        args = ", ".join(f"{a.role} {a.name}: {a.layout}" for a in self.args)
        return f"{self.name}({args})"


class Kernel:
    """One kernel of a library: checks its arguments, honours its padding contract, runs it."""

    def __init__(self, signature: Signature, func, library):
        self.signature = signature
        self._func = func
        self._library = library
        self._gpu = library.device == "cuda"

    @property
    def name(self):
        return self.signature.name

    def __call__(self, *args, stream=None):
        """Run on Memory objects, numpy arrays or DLPack tensors. With ``stream`` the call is
        queued on it and an Event is returned; without, it runs now."""
        sig = self.signature
        if len(args) != len(sig.args):
            raise ArgumentError(f"{sig.name}: expected {len(sig.args)} arguments "
                                f"({', '.join(a.name for a in sig.args)}); got {len(args)}")
        if self._gpu:
            return self._run_on_gpu(args, stream)
        mems = self._memories(args)
        views = [m.kernel_arg(a.storage) for m, a in zip(mems, sig.args)]
        inplace = self._inplace_form(mems, [v[1:] for v in views])
        if inplace is not None:
            return inplace(*args[:-1], stream=stream)
        bufs = [m.buffer for m in mems]

        def tensors():   # the views made for the overlap check, unless a zero-pad copied
            if any(map(is_not, (m.buffer for m in mems), bufs)):
                return [m.kernel_arg(a.storage)[0] for m, a in zip(mems, sig.args)]
            return [v[0] for v in views]
        if stream is not None:
            return stream.submit(self._run, mems, tensors)
        self._run(mems, tensors)
        return None

    def _memories(self, args) -> list:
        """The arguments as Memory objects of the kernel's layouts (``_as_memory``). A Memory
        whose layout is the signature's own object (``Library.memory``, or one a call already
        matched) needs only the writeable check."""
        sig = self.signature
        mems = []
        for value, arg in zip(args, sig.args):
            if isinstance(value, Memory) and value.layout is arg.layout and \
                    (arg.role == "in" or value.buffer.flags.writeable):
                mems.append(value)
            else:
                mems.append(_as_memory(value, sig.name, arg.name, arg.role, arg.layout, arg.storage,
                                       sig.requires_clean))
        if sig.seven_bit is not None:
            w = mems[sig.seven_bit]
            check_seven_bit(w.buffer, w.layout, f"{sig.name}: argument 'weights'")
        return mems

    def _run_on_gpu(self, args, stream):
        """A CUDA library's kernel on GPU tensors (any DLPack producer: PyTorch, CuPy, JAX),
        zero-copy. The launch is asynchronous on the device's default stream, ordered with the
        producer's work on that stream. Padding state lives on ``Memory`` objects, which are
        host buffers: a GPU library honours only the policies that need no state, ``dst_fused``
        and ``dst_stage`` (whose stage is a GPU kernel of the same library)."""
        sig = self.signature
        if stream is not None:
            raise ArgumentError(f"{sig.name}: blockpad streams order host work; a GPU kernel "
                                f"runs on the CUDA stream of its tensors (call without stream=)")
        contract = sig.padding
        if contract and contract["policy"] not in KERNEL_ZEROS:
            raise ArgumentError(f"{sig.name}: policy {contract['policy']!r} keeps padding state "
                                f"in blockpad.Memory objects, which GPU tensors do not carry; "
                                f"build GPU libraries with policy dst_fused or dst_stage")
        tensors = [_as_gpu_tensor(value, f"{sig.name}: argument {arg.name!r}", arg.role,
                                  arg.layout, arg.storage)
                   for value, arg in zip(args, sig.args)]
        _check_no_alias(sig, _ranges_overlap([(t.data_ptr(),
                                                t.data_ptr() + t.numel() * _itemsize(arg.storage))
                                               for t, arg in zip(tensors, sig.args)]))
        self.run_raw(tensors)
        stage = contract.get("dst_stage") if contract else None
        if stage:
            for t, arg in zip(tensors, sig.args):
                if arg.role != "in":
                    self._library[stage].run_raw([t])
        return None

    def _run(self, mems, tensors=None):
        """Honour the padding contract around one call. ``tensors``: a function giving the
        compiled function's arguments for ``mems`` (a BoundCall's cache); default: each
        memory's ``kernel_arg``, asked after the sources' zero-pads (which may replace a
        read-only buffer by a copy)."""
        sig = self.signature
        for m in mems:
            m.wait()
        if sig.requires_clean:
            padding.before_call(sig.padding, [mems[i] for i in sig.padded_sources])
        if tensors is None:
            self._func(*[m.kernel_arg(a.storage)[0] for m, a in zip(mems, sig.args)])
        else:
            self._func(*tensors())
        stage = self._library[sig.stage] if sig.stage else None
        sources = [mems[i] for i in sig.sources]
        for i in sig.written:
            padding.after_call(sig.padding, sources, mems[i], stage)

    def bind(self, *args) -> BoundCall:
        """Check the arguments once and return a call that runs the kernel on them again and
        again (oneDNN's primitive + argument map): no per-call argument checks or view making,
        the padding contract still honoured on every call. A ``weight_bits = 7`` kernel's
        weights are checked here and when a memory is pointed at another buffer, not when its
        bytes are rewritten in place."""
        sig = self.signature
        if len(args) != len(sig.args):
            raise ArgumentError(f"{sig.name}: expected {len(sig.args)} arguments "
                                f"({', '.join(a.name for a in sig.args)}); got {len(args)}")
        if self._gpu:
            raise ArgumentError(f"{sig.name}: bind() holds host memories; call a GPU kernel "
                                f"directly with GPU tensors")
        mems = self._memories(args)
        inplace = self._inplace_form(mems)
        if inplace is not None:
            return inplace.bind(*args[:-1])
        return BoundCall(self, mems)

    def _inplace_form(self, mems, spans=None):
        """Refuse overlapping arguments (kernels are compiled assuming none), except one case:
        a source passed again as the destination of an op the library also has built with
        ``inplace = true``, whose in-place kernel is returned to run instead. Otherwise the
        error says how to get one. ``spans``: the arguments' byte ranges, if made already."""
        sig = self.signature
        if not sig.written_pairs:
            return None
        if spans is None:
            spans = [m.kernel_arg(a.storage)[1:] for m, a in zip(mems, sig.args)]
        overlap = _ranges_overlap(spans)
        for i, j in sig.written_pairs:
            if not overlap(i, j):
                continue
            a, b = sig.args[i], sig.args[j]
            same = a.layout == b.layout and spans[i][0] == spans[j][0]
            if same and b.role == "out" and j == len(sig.args) - 1:
                twin = self._library.inplace_form(sig, i)
                if twin is not None:
                    return twin
                if INPLACE_SOURCES.get(sig.op) == a.name:
                    raise ArgumentError(
                        f"{sig.name}: {a.name!r} is also passed as {b.name!r}; "
                        f"this kernel needs separate buffers. To compute in place, build the "
                        f"kernel with `inplace = true` in its spec entry ({a.name} "
                        f"becomes an inout argument, passed once) and load that library: "
                        f"calls like this one then run it")
            _check_no_alias(sig, overlap)
        return None

    def run_raw(self, views):
        """Call the compiled function on prepared views: no checks, no padding work."""
        self._func(*views)

    def __repr__(self):
        return f"<blockpad kernel {self.signature!r}>"


def fits_seven_bit(weights) -> bool:
    """Every value in [-64, 64] (``weight_bits = 7``)."""
    lo, hi = SEVEN_BIT_RANGE
    return weights.size == 0 or (int(weights.min()) >= lo and int(weights.max()) <= hi)


def check_seven_bit(buffer, layout: Layout, what) -> None:
    """A ``weight_bits = 7`` kernel's promise: every weight (and the padding, which the kernel
    reads as zeros) lies in [-64, 64]. One pass over the weights, a small part of the
    convolution's work; ``bind`` checks once, as it checks everything else. A layout with gaps
    between dims (explicit strides) is checked at its elements only: the kernel never reads the
    gaps, which may hold anything (``blockpad check`` fills them with a guard pattern, and a
    whole-buffer check refused those calls)."""
    weights = buffer
    if layout.strides is not None:
        weights = buffer[np.concatenate([layout.logical_offsets().reshape(-1),
                                         layout.padding_offsets()])]
    if not fits_seven_bit(weights):
        raise ArgumentError(f"{what}: the kernel was built with weight_bits = 7 (every weight in "
                            f"[-64, 64]); got weights in [{int(weights.min())}, "
                            f"{int(weights.max())}] (rebuild with weight_bits = 8 for "
                            f"full-range int8 weights)")


class BoundCall:
    """A kernel bound to Memory arguments; calling it runs the kernel. The compiled function's
    arguments are made once and remade only if a memory's buffer changed
    (``set_data_handle``, or a zero-pad that had to copy a read-only buffer)."""

    def __init__(self, kernel: Kernel, mems):
        self.kernel = kernel
        self.mems = mems
        self._storages = [a.storage for a in kernel.signature.args]
        self._buffers = [None] * len(mems)
        self._tensors = None

    def _current_tensors(self):
        bufs = [m.buffer for m in self.mems]
        if any(map(is_not, bufs, self._buffers)):
            if self._tensors is not None:   # bind() checked the first buffers
                self._check_overlap()
                sig = self.kernel.signature
                i = sig.seven_bit
                if i is not None and bufs[i] is not self._buffers[i]:   # new weights
                    check_seven_bit(bufs[i], self.mems[i].layout, f"{sig.name}: argument 'weights'")
            self._tensors = [m.kernel_arg(s)[0] for m, s in zip(self.mems, self._storages)]
            self._buffers = bufs
        return self._tensors

    def _check_overlap(self):
        """A memory pointed at another buffer may now overlap another argument: refused as a
        direct call would refuse it (a call bound to separate buffers cannot turn in place)."""
        spans = [m.kernel_arg(s)[1:] for m, s in zip(self.mems, self._storages)]
        _check_no_alias(self.kernel.signature, _ranges_overlap(spans))

    def __call__(self):
        self.kernel._run(self.mems, self._current_tensors)

    def trusted(self):
        """This call for a caller that keeps the padding contract by construction, as a graph
        under a policy whose kernels zero their destinations' padding keeps it (every source
        clean: its producer wrote it so, or the run zero-padded it first, and no stream work
        pending): the kernel on the current arguments, its destinations marked clean, without
        the per-call waits, state checks and contract lookups. Those cost ~4 us a call with
        the interpreter's data out of cache after each kernel: int8 MobileNetV2, 58 calls,
        4.81 -> 4.56 ms a run at 1 thread. A kernel whose contract is anything else (a
        destination stage, padding preserved or inherited) or that has a sub-memory among
        its arguments keeps the checked call (``self``)."""
        sig = self.kernel.signature
        produces = sig.padding["produces"] if sig.padding else CLEAN
        if sig.stage or produces != CLEAN or any(m.parent is not None for m in self.mems):
            return self
        func, tensors = self.kernel._func, self._current_tensors
        written = [self.mems[i] for i in sig.written]

        def call():
            func(*tensors())
            for m in written:
                m.state = CLEAN
        return call

    def __repr__(self):
        return f"<bound {self.kernel!r}>"


class Library:
    """The kernels of one built library; ``lib[name](...)`` calls one."""

    def __init__(self, path: str, manifest: dict, module):
        self.path = path
        self.manifest = manifest
        self.target = manifest["target"]["name"]
        self.policy = manifest.get("policy")
        # where the kernels compute: a CUDA library takes GPU tensors, not host memories
        self.device = "cuda" if gpu_requirement(manifest["target"]["features"]) else "cpu"
        self._module = module
        self.kernels = {r.name: Signature(r) for r in mf.kernel_records(manifest)}
        self._cache = {}
        self._zero_pads = {s.args[0].layout: name for name, s in self.kernels.items()
                           if s.op == "zero_pad"}

    def __getitem__(self, name) -> Kernel:
        if name not in self.kernels:
            raise KeyError(f"{name!r}: this library has kernels {', '.join(sorted(self.kernels))}")
        if name not in self._cache:
            self._cache[name] = Kernel(self.kernels[name], self._function(name), self)
        return self._cache[name]

    @property
    def module(self):
        """The loaded shared library (a tvm_ffi Module), None for a described one; a built
        model's plan function imports it to find the kernels (graph/native.py)."""
        return self._module

    def symbol(self, name) -> str:
        """The compiled function that runs kernel ``name`` in this process: its variant for
        a pool of this many threads, if the build scheduled one (``KernelRecord.threads``)."""
        threads = self.kernels[name].record.threads
        return threads.get(pool_threads(), name) if threads else name

    def _function(self, name):
        if self._module is None:
            return _unloaded(self, name)
        symbol = self.symbol(name)
        try:
            return self._module[symbol]
        except AttributeError:
            raise LoadError(f"{self.path}: kernel {name}: the library has no function {symbol} "
                            f"(its manifest names it for a pool of {pool_threads()} threads); "
                            f"rebuild the library") from None

    def inplace_form(self, sig: Signature, source: int):
        """The kernel computing ``sig`` in place over its argument ``source`` (built with
        ``inplace = true``: same op, parameters, layouts and policy), or None."""
        want = {**sig.params, "inplace": True}
        args = [(a.name, "inout" if k == source else a.role, a.layout)
                for k, a in enumerate(sig.args[:-1])]
        for name, s in self.kernels.items():
            if s.op == sig.op and s.params == want and s.padding == sig.padding and \
                    [(a.name, a.role, a.layout) for a in s.args] == args:
                return self[name]
        return None

    def zero_pad_kernel(self, layout: Layout):
        """The generated zero-pad kernel for ``layout``, or None if the library has none."""
        name = self._zero_pads.get(layout)
        return self[name] if name else None

    def memory(self, layout: Layout, buffer=None, clean: bool = False, stream=None) -> Memory:
        """A memory that follows this library's padding policy, as if made by
        ``Memory.set_data_handle(buffer, clean, stream)`` (see there): under ``on_handle`` and
        ``user`` a new memory is zero-padded now, as oneDNN's memory constructor did; under the
        other policies its padding is left alone (state ``unknown`` unless ``clean``)."""
        if buffer is None:
            buffer = aligned_empty(layout.alloc_len, numpy_dtype(layout.dtype))
        mem = Memory(layout, np.asarray(buffer), library=self)
        mem.set_data_handle(mem.buffer, clean=clean, stream=stream)
        return mem

    def __contains__(self, name):
        return name in self.kernels

    def __iter__(self):
        return iter(self.kernels)

    def __repr__(self):
        return f"<blockpad library {self.path} target={self.target} kernels={len(self.kernels)}>"


def load(path) -> Library:
    """Load a library built by ``blockpad build``, after checking it can run here."""
    path = os.fspath(path)
    manifest = mf.read(path)
    lib_path = check_loadable(path, manifest)
    if "amx_tile" in manifest["target"].get("features", ()):
        machine.request_amx()   # before any call: a tile instruction without it is SIGILL
    try:
        module = load_module(lib_path)
    except Exception as e:  # noqa: BLE001 - the loader's own error type is an FFI detail
        raise LoadError(f"{lib_path}: TVM could not load it: {e}") from e
    return Library(path, manifest, module)


def describe(path) -> Library:
    """A built library as its manifest states it, its code not loaded: what the model build
    plans over, so that a model builds for a target this machine cannot run (another ISA,
    another architecture, a GPU). Its kernels refuse to run."""
    path = os.fspath(path)
    return Library(path, mf.read(path), None)


def _unloaded(library: Library, name: str):
    def refuse(*_):
        raise LoadError(f"{library.path}: kernel {name} was described, not loaded (target "
                        f"{library.target!r}); load the library with blockpad.load to run it")
    return refuse


def _as_memory(value, kernel, name, role, layout: Layout, storage,
               requires_clean=False) -> Memory:
    """Turn one argument into a Memory of the kernel's layout (zero-copy for arrays that fit).
    An array carries no padding state: where the kernel requires clean sources its padding is
    zeroed before the call (padding.before_call), which a read-only array cannot have."""
    where = f"{kernel}: argument {name!r}"
    if isinstance(value, Memory):
        if value.layout != layout:
            raise ArgumentError(f"{where}: expected layout {layout}; got {value.layout}")
        if role != "in" and not value.buffer.flags.writeable:
            raise ArgumentError(f"{where}: the kernel writes it, but its buffer is read-only")
        return value
    array = _as_numpy(value, where)
    want = numpy_dtype(layout.dtype)
    if array.dtype != want:
        raise ArgumentError(f"{where}: expected dtype {layout.dtype}; got {array.dtype}")
    if role != "in" and not array.flags.writeable:
        raise ArgumentError(f"{where}: the kernel writes it, but the array is read-only")
    if requires_clean and role != "out" and layout.has_padding and not array.flags.writeable:
        raise ArgumentError(
            f"{where}: layout {layout} has padding, whose content an array does not say, and "
            f"this kernel requires it zero; blockpad zeroes it before the call, but this array "
            f"is read-only. Pass a writeable array, or a Memory: bp.Memory(layout, buf, "
            f"state='clean') if its padding is zero, else mem.cleanup() zeroes it (copying a "
            f"read-only buffer)")
    if not array.flags.c_contiguous:
        raise ArgumentError(f"{where}: expected a C-contiguous array; got strides "
                            f"{array.strides} for shape {array.shape} (np.ascontiguousarray "
                            f"makes one)")
    if not array.flags.aligned:   # data % itemsize, without ndarray.ctypes's cost
        if role != "in":
            raise ArgumentError(f"{where}: data at 0x{array.ctypes.data:x} is not aligned to its "
                                f"{array.itemsize}-byte elements")
        array = np.array(array)  # an unaligned input is copied, never handed to vector code
    fits = ((array.shape == layout.shape and layout.is_plain)
            or (array.shape == layout.physical_shape and layout.strides is None))
    if fits:
        return Memory(layout, array.reshape(-1))
    if array.ndim == 1:
        if array.size < layout.alloc_len:
            raise ArgumentError(f"{where}: layout {layout} needs a buffer of {layout.alloc_len} "
                                f"elements; got {array.size}")
        return Memory(layout, array)
    accepted = [f"a flat buffer of >= {layout.alloc_len} elements"]
    if layout.strides is None:
        accepted.insert(0, f"physical shape {layout.physical_shape}")
    if layout.is_plain:
        accepted.insert(0, f"logical shape {layout.shape}")
    raise ArgumentError(f"{where}: layout {layout} takes {' or '.join(accepted)} (or a Memory); "
                        f"got shape {array.shape}")


def _as_numpy(value, where) -> np.ndarray:
    if isinstance(value, np.ndarray):
        return value
    if hasattr(value, "__dlpack__"):
        try:
            return np.from_dlpack(value)
        except (TypeError, RuntimeError, BufferError, ValueError) as e:
            raise ArgumentError(f"{where}: DLPack tensor not readable as a CPU array ({e})") from e
    raise ArgumentError(f"{where}: expected a Memory, numpy array or DLPack tensor; got "
                        f"{type(value).__name__}")


_GPU_DEVICES = {2: "cuda", 13: "cuda managed"}   # DLPack device types a CUDA kernel can read
_DLPACK_DEVICES = {1: "cpu", 3: "cuda host (pinned)", 4: "opencl", 7: "vulkan", 8: "metal",
                   10: "rocm"}


def _as_gpu_tensor(value, where, role, layout: Layout, storage):
    """Check one argument of a GPU kernel and return it as a tvm_ffi Tensor (no copy)."""
    import tvm_ffi

    if not hasattr(value, "__dlpack__") or not hasattr(value, "__dlpack_device__"):
        raise ArgumentError(f"{where}: this library runs on a CUDA GPU; expected a CUDA tensor "
                            f"(DLPack: torch, CuPy, JAX); got {type(value).__name__}")
    kind = int(value.__dlpack_device__()[0])
    if kind not in _GPU_DEVICES:
        raise ArgumentError(f"{where}: this library runs on a CUDA GPU; expected a tensor in "
                            f"CUDA device memory; got one on "
                            f"{_DLPACK_DEVICES.get(kind, f'DLPack device type {kind}')}")
    tensor = tvm_ffi.from_dlpack(value, require_alignment=0, require_contiguous=False)
    if str(tensor.dtype) not in (layout.dtype, storage):
        bits = f" (as its {storage} bits)" if storage != layout.dtype else ""
        raise ArgumentError(f"{where}: expected dtype {layout.dtype}{bits}; got {tensor.dtype}")
    if str(tensor.dtype) != storage:
        raise ArgumentError(f"{where}: this kernel moves {layout.dtype} as {storage}; pass a "
                            f"{storage} view of the tensor (torch: .view(torch.{storage}))")
    shape = tuple(tensor.shape)
    if layout.strides is not None or shape not in (
            layout.physical_shape, layout.shape if layout.is_plain else None):
        accepted = f"physical shape {layout.physical_shape}"
        if layout.is_plain:
            accepted = f"logical shape {layout.shape} or {accepted}"
        raise ArgumentError(f"{where}: layout {layout} takes a GPU tensor of {accepted}; got "
                            f"shape {shape}")
    if not tensor.is_contiguous():
        raise ArgumentError(f"{where}: expected a contiguous tensor; got strides "
                            f"{tuple(tensor.strides)} (.contiguous() makes one)")
    if tensor.data_ptr() % _itemsize(storage):
        raise ArgumentError(f"{where}: data at 0x{tensor.data_ptr():x} is not aligned to its "
                            f"{_itemsize(storage)}-byte elements")
    return tensor


def _itemsize(dtype: str) -> int:
    return numpy_dtype(dtype).itemsize


def _check_no_alias(sig: Signature, overlap):
    """Kernels are compiled assuming their buffers do not overlap; refuse aliasing outright.
    ``overlap(i, j)``: whether arguments ``i`` and ``j`` share memory."""
    for i, j in sig.written_pairs:
        if overlap(i, j):
            raise ArgumentError(f"{sig.name}: arguments {sig.args[i].name!r} and "
                                f"{sig.args[j].name!r} overlap in memory; this kernel needs "
                                f"separate buffers")


def _ranges_overlap(ranges):
    """From ``(lo, hi)`` byte address ranges."""
    return lambda i, j: ranges[i][0] < ranges[j][1] and ranges[j][0] < ranges[i][1]
