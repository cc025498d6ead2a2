"""Running built libraries: loading and checking them, memory objects, calling kernels.

Nothing here imports TVM's compiler (``tvm`` itself takes a second to import): libraries are
loaded with ``tvm_ffi`` plus TVM's runtime library, so a deployed process starts fast."""

from .cache import KernelCache, KernelNotFound, Request
from .graph import Graph, Report, Result, Results, Tensor
from .library import Library
from .memory import Memory, SubMemoryError
from .model import Model, load
from .stream import Event, Stream

__all__ = ["Event", "Graph", "KernelCache", "KernelNotFound", "Library", "Memory", "Model", "Report",
           "Request", "Result", "Results", "Stream", "SubMemoryError", "Tensor", "load"]
