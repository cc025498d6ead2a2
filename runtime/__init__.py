"""Running built libraries: loading and checking them, memory objects, calling kernels.

Nothing here imports TVM's compiler (``tvm`` itself takes a second to import): libraries are
loaded with ``tvm_ffi`` plus TVM's runtime library, so a deployed process starts fast."""

from .library import Library, load
from .memory import Memory

__all__ = ["Library", "Memory", "load"]
