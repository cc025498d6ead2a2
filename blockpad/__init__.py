"""blockpad: kernels for blocked, zero-padded tensor layouts, generated ahead of time with TVM.

Importing blockpad is cheap and does not import TVM's compiler: ``Layout``, ``Memory`` and
``load`` are all a deployed program needs. ``build`` (and the ops) load the compiler on first
use; so does a ``Graph`` or ``KernelCache`` that meets a kernel no library or cache directory
holds (the JIT, ``blockpad.jit``, registered here as the default cache's compiler)."""

from .errors import (ArgumentError, BlockpadError, BuildError, LayoutError, LoadError,
                     MissingCPUFeatureError, SpecError)
from .layout import Layout
from .runtime import (Event, Graph, KernelCache, KernelNotFound, Library, Memory, Model, Report,
                      Stream, SubMemoryError, load)
from .runtime import cache as _cache
from . import jit as _jit

_cache.set_default_compiler(_jit.compile_kernels)

__version__ = "0.1.0"

__all__ = ["ArgumentError", "BlockpadError", "BuildError", "Event", "Graph", "KernelCache",
           "KernelNotFound", "Layout", "LayoutError", "Library", "LoadError", "Memory",
           "MissingCPUFeatureError", "Model", "Report", "SpecError", "Stream", "SubMemoryError", "build",
           "jit_cache", "load"]


def jit_cache(libraries=(), cache_dir=None, capacity=None, target="host") -> KernelCache:
    """A KernelCache over prebuilt ``libraries`` that compiles what they lack with the JIT
    (``blockpad.jit``) into ``cache_dir`` (default ``$BLOCKPAD_CACHE_DIR`` or
    ``~/.cache/blockpad``)."""
    kw = {"capacity": capacity} if capacity else {}
    return KernelCache(libraries, compiler=_jit.compile_kernels, cache_dir=cache_dir,
                       target=target, **kw)


def build(spec, target="host", out_dir="build", force=False, log=None, tuning_logs=None):
    """Build a spec (TOML path or parsed Spec) for ``target`` into ``out_dir``, with the tuning
    records of ``tuning_logs`` (default: the packaged ones); see codegen.build."""
    from .codegen.build import build as _build

    return _build(spec, target, out_dir, force=force, log=log, tuning_logs=tuning_logs)
