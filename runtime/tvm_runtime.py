"""Loading a compiled module with TVM's runtime alone, without importing the ``tvm`` package.

``tvm_ffi.load_module`` opens the shared library; TVM's runtime library must be loaded first,
globally, because the module's parallel loops call ``TVMBackendParallelLaunch`` from it (without
it they jump through an empty slot)."""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import os
import sys

from blockpad.errors import ArgumentError, LoadError


def default_threads() -> int:
    """Every core this process may run on (TVM's own default is half of them)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def pool_threads() -> int:
    """The threads of TVM's pool, which runs a kernel's parallel loops: ``TVM_NUM_THREADS``
    (settled, to every core unless the caller chose, before any pool starts), read as TVM
    reads it."""
    _runtime()
    try:
        return max(1, int(os.environ["TVM_NUM_THREADS"]))
    except ValueError:
        raise LoadError(f"TVM_NUM_THREADS={os.environ['TVM_NUM_THREADS']!r}: expected a "
                        f"number of threads") from None


@functools.lru_cache(maxsize=1)
def _runtime():
    # The pool reads its size when it starts: settle it before anything can start it.
    os.environ.setdefault("TVM_NUM_THREADS", str(default_threads()))
    path = _runtime_path()
    if not os.path.isfile(path):
        raise LoadError(f"TVM's runtime library {path} is missing; reinstall apache-tvm")
    tvm_ffi = _import_tvm_ffi()   # loads libtvm_ffi.so, which the runtime library links against
    ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    return tvm_ffi


def _import_tvm_ffi():
    """``import tvm_ffi`` without the ``import torch`` it does first whenever torch is
    installed (a workaround for a Windows symbol clash): a second of start-up for a process that
    only runs kernels. A process that already imported torch keeps it; one that imports torch
    later is unaffected (kernels take torch tensors through DLPack either way)."""
    if "torch" in sys.modules or "tvm_ffi" in sys.modules:
        import tvm_ffi

        return tvm_ffi
    sys.modules["torch"] = None   # makes tvm_ffi's `import torch` raise ImportError
    try:
        import tvm_ffi
    finally:
        del sys.modules["torch"]
    return tvm_ffi


def _runtime_path() -> str:
    spec = importlib.util.find_spec("tvm")
    if spec is None or not spec.submodule_search_locations:
        raise LoadError("apache-tvm is not installed: `pip install blockpad[runtime]`")
    return os.path.join(spec.submodule_search_locations[0], "lib", "libtvm_runtime.so")


def load_module(path):
    return _runtime().load_module(path)


def as_tensor(array):
    """A host numpy array as the tvm_ffi Tensor a compiled function takes, sharing its memory
    and keeping it alive. Converted once, a tensor is passed to a call for a fifth of what
    converting a numpy array on every call costs.

    numpy cannot export ml_dtypes' bfloat16 through DLPack (BufferError: it knows no DLPack
    code for a user dtype): a bfloat16 array goes out as its uint16 bits and becomes a
    bfloat16 view of the same memory on the TVM side, which exists for row-major arrays only
    (the physical view of every layout without explicit strides)."""
    ffi = _runtime()
    if array.dtype.name != "bfloat16":
        return ffi.from_dlpack(array)
    if not array.flags.c_contiguous:
        raise ArgumentError(f"a bfloat16 argument must be a row-major array (layouts with "
                            f"explicit strides are not supported in bfloat16); got strides "
                            f"{array.strides} for shape {array.shape}")
    bits = ffi.from_dlpack(array.view("uint16"))
    return ffi.get_global_func("runtime.TVMTensorCreateView")(bits, array.shape, "bfloat16", 0)


@functools.lru_cache(maxsize=1)
def cuda_runtime():
    """Load TVM's CUDA runtime (``libtvm_runtime_cuda.so``) globally, once: it registers the
    loader of the CUDA device modules that cuda-target libraries embed, and the CUDA device API.
    Only for those libraries: it needs the CUDA driver (``libcuda.so.1``)."""
    tvm_ffi = _runtime()
    path = os.path.join(os.path.dirname(_runtime_path()), "libtvm_runtime_cuda.so")
    if not os.path.isfile(path):
        raise LoadError(f"TVM's CUDA runtime {path} is missing; this apache-tvm build cannot run "
                        f"CUDA libraries")
    try:
        ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    except OSError:
        _preload_cudart()   # it links libcudart.so.N: the CUDA runtime, from a pip wheel maybe
        try:
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        except OSError as e:
            raise LoadError(f"TVM's CUDA runtime {path} does not load ({e}); it needs the "
                            f"NVIDIA driver and the CUDA runtime library (the CUDA toolkit's, "
                            f"or `pip install nvidia-cuda-runtime`)") from None
    return tvm_ffi


def _preload_cudart():
    import glob

    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        for lib in sorted(glob.glob(os.path.join(root, "**", "libcudart.so.*"), recursive=True)):
            try:
                ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)
            except OSError:
                continue
