"""blockpad: kernels for blocked, zero-padded tensor layouts, generated ahead of time with TVM.

Importing blockpad is cheap and does not import TVM's compiler: ``Layout``, ``Memory`` and
``load`` are all a deployed program needs. ``build`` (and the ops) load the compiler on first
use; so does a ``Graph`` or ``KernelCache`` that meets a kernel no library or cache directory
holds (the JIT, ``blockpad.jit``, registered here as the default cache's compiler). The public
names are imported on first use (``blockpad.lazy``): ``import blockpad`` loads the errors, the
JIT's entry point and the kernel cache, not the graph or the model loader."""

from . import jit as _jit
from .errors import (
    ArgumentError,
    BlockpadError,
    BuildError,
    FallbackWarning,
    LayoutError,
    LoadError,
    MissingCPUFeatureError,
    SpecError,
)
from .lazy import exports
from .runtime import cache as _cache
from .version import __version__

_cache.set_default_compiler(_jit.compile_kernels)

_EXPORTS = {"Layout": ".layout", **{name: ".runtime" for name in (
    "Event", "Graph", "KernelCache", "KernelNotFound", "Library", "Memory", "Model", "Report",
    "Stream", "SubMemoryError", "load")}}
__getattr__, __dir__ = exports(__name__, _EXPORTS)

__all__ = ["ArgumentError", "BlockpadError", "BuildError", "Event", "FallbackWarning", "Graph",
           "KernelCache",
           "KernelNotFound", "Layout", "LayoutError", "Library", "LoadError", "Memory",
           "MissingCPUFeatureError", "Model", "Report", "SpecError", "Stream", "SubMemoryError",
           "__version__", "build", "jit_cache", "load"]


def jit_cache(libraries=(), cache_dir=None, capacity=None, target="host") -> _cache.KernelCache:
    """A KernelCache over prebuilt ``libraries`` that compiles what they lack with the JIT
    (``blockpad.jit``) into ``cache_dir`` (default ``$BLOCKPAD_CACHE_DIR`` or
    ``~/.cache/blockpad``)."""
    kw = {"capacity": capacity} if capacity else {}
    return _cache.KernelCache(libraries, compiler=_jit.compile_kernels, cache_dir=cache_dir,
                       target=target, **kw)


def build(spec, target="host", out_dir="build", force=False, log=None, tuning_logs=None):
    """Build a spec (TOML path or parsed Spec) for ``target`` into ``out_dir``, with the tuning
    records of ``tuning_logs`` (default: the packaged ones); see codegen.build."""
    from .codegen.build import build as _build

    return _build(spec, target, out_dir, force=force, log=log, tuning_logs=tuning_logs)
