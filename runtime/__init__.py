"""Running built libraries: loading and checking them, memory objects, calling kernels.

Nothing here imports TVM's compiler (``tvm`` itself takes a second to import): libraries are
loaded with ``tvm_ffi`` plus TVM's runtime library, so a deployed process starts fast. The
names below are imported on first use (``blockpad.lazy``): loading one library does not load
the graph."""

from blockpad.lazy import exports

_EXPORTS = {
    "KernelCache": ".cache", "KernelNotFound": ".cache", "Request": ".cache",
    "Graph": ".graph", "Report": ".graph", "Result": ".graph", "Results": ".graph",
    "Tensor": ".graph", "Library": ".library", "Memory": ".memory", "SubMemoryError": ".memory",
    "Model": ".model", "load": ".model", "Event": ".stream", "Stream": ".stream",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = exports(__name__, _EXPORTS)
