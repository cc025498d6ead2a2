"""Loading a compiled module with TVM's runtime alone, without importing the ``tvm`` package.

``tvm_ffi.load_module`` opens the shared library; TVM's runtime library must be loaded first,
globally, because the module's parallel loops call ``TVMBackendParallelLaunch`` from it (without
it they jump through an empty slot)."""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import os

from blockpad.errors import LoadError


def default_threads() -> int:
    """Every core this process may run on (TVM's own default is half of them)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


@functools.lru_cache(maxsize=1)
def _runtime():
    # The pool reads its size when it starts: settle it before anything can start it.
    os.environ.setdefault("TVM_NUM_THREADS", str(default_threads()))
    spec = importlib.util.find_spec("tvm")
    if spec is None or not spec.submodule_search_locations:
        raise LoadError("apache-tvm is not installed: `pip install blockpad[runtime]`")
    path = os.path.join(spec.submodule_search_locations[0], "lib", "libtvm_runtime.so")
    if not os.path.isfile(path):
        raise LoadError(f"TVM's runtime library {path} is missing; reinstall apache-tvm")
    import tvm_ffi  # loads libtvm_ffi.so, which the runtime library links against

    ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    return tvm_ffi


def load_module(path):
    return _runtime().load_module(path)
