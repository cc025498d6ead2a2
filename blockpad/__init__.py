"""blockpad: kernels for blocked, zero-padded tensor layouts, generated ahead of time with TVM.

Importing blockpad is cheap and does not import TVM's compiler: ``Layout``, ``Memory`` and
``load`` are all a deployed program needs. ``build`` (and the ops) load the compiler on first
use."""

from .errors import (ArgumentError, BlockpadError, BuildError, LayoutError, LoadError,
                     MissingCPUFeatureError, SpecError)
from .layout import Layout
from .runtime import Library, Memory, load

__version__ = "0.1.0"

__all__ = ["ArgumentError", "BlockpadError", "BuildError", "Layout", "LayoutError", "Library",
           "LoadError", "Memory", "MissingCPUFeatureError", "SpecError", "build", "load"]


def build(spec, target="host", out_dir="build", force=False, log=None):
    """Build a spec (TOML path or parsed Spec) for ``target`` into ``out_dir``; see codegen.build."""
    from .codegen.build import build as _build

    return _build(spec, target, out_dir, force=force, log=log)
