"""``blockpad bench calls``: what calling a kernel from Python costs, next to a PyTorch op.

The kernels are tiny (1x3x4x4: a reorder nchw -> nChw8c, and a relu over nChw8c under the
``tracked`` policy, whose call checks and sets padding states), so their run is a microsecond
and the rest is the call path. Per call, in microseconds:

* ``raw``     the compiled function on prepared tvm_ffi tensors: TVM's own floor;
* ``bound``   a ``Kernel.bind(...)`` call: the padding contract, no argument checks;
* ``Memory``  ``lib[name](src, dst)`` on Memory objects: every check (layouts, read-only,
              overlap, in-place routing) and the padding contract;
* ``numpy``   the same on numpy arrays (a physical-shaped destination), which wraps each in a
              Memory on every call;
* ``torch``   the PyTorch op doing the same work on the same tensor (``torch.relu``,
              ``x.to_mkldnn()`` for the reorder), one thread, when torch is installed.

Each figure is the best over ``repeat`` interleaved rounds (see ``common``): the cost of the
call itself, with the least disturbance from other work on the machine. Kernels are built once
into ``build/bench-calls``.
"""

from __future__ import annotations

import os

import numpy as np

from .common import interleaved_rounds, quiet_thread_pools, table

SHAPE = [1, 3, 4, 4]
BUILD_DIR = os.path.join("build", "bench-calls")
KERNELS = [
    {"op": "reorder", "name": "reorder", "shape": SHAPE, "dtype": "float32", "src": "nchw",
     "dst": "nChw8c"},
    {"op": "eltwise", "name": "relu", "shape": SHAPE, "dtype": "float32", "src": "nChw8c",
     "dst": "nChw8c", "algorithm": "relu", "policy": "tracked"},
]


def build_library():
    import blockpad

    blockpad.build({"library": {"name": "bench-calls"}, "kernel": KERNELS}, "host", BUILD_DIR,
                   log=lambda m: None)
    return blockpad.load(BUILD_DIR)


def contenders(lib, name) -> dict:
    """``{label: fn}`` for one kernel, after checking every path gives numpy's result."""
    from blockpad import Memory

    kernel = lib[name]
    (_, _, src_l, src_s), (_, _, dst_l, dst_s) = kernel.signature.args
    x = np.random.default_rng(0).standard_normal(SHAPE).astype(np.float32)
    src = Memory.from_numpy(x, src_l)
    dst = lib.memory(dst_l)
    src_array = src.physical_view().copy()
    dst_array = np.empty(dst_l.physical_shape, np.float32)
    want = np.maximum(x, 0) if name == "relu" else x
    fns = {"raw": _raw(kernel, src.kernel_arg(src_s)[0], dst.kernel_arg(dst_s)[0]),
           "bound": kernel.bind(src, dst),
           "Memory": lambda: kernel(src, dst),
           "numpy": lambda: kernel(src_array, dst_array)}
    for label, fn in fns.items():
        dst.buffer[...] = np.nan
        dst_array[...] = np.nan
        fn()
        got = Memory(dst_l, dst_array.reshape(-1)) if label == "numpy" else dst
        if not np.array_equal(got.to_numpy(), want):
            raise AssertionError(f"{name} {label}: wrong result")
    torch_fn = _torch_op(name, x)
    if torch_fn is not None:
        fns["torch"] = torch_fn
    return fns


def _raw(kernel, *tensors):
    func = kernel._func   # the compiled function every path ends in
    return lambda: func(*tensors)


def _torch_op(name, x):
    try:
        import torch
    except ImportError:
        return None
    torch.set_num_threads(1)
    t = torch.from_numpy(x)
    return (lambda: torch.relu(t)) if name == "relu" else (lambda: t.to_mkldnn())


def main(repeat=5, threads=None):
    quiet_thread_pools(threads)
    lib = build_library()
    try:
        import torch

        note = f"torch {torch.__version__}, 1 thread"
    except ImportError:
        note = "torch not installed: pip install torch for its column"
    print(f"blockpad bench calls: {'x'.join(map(str, SHAPE))} fp32 kernels, us per call, best "
          f"of {repeat} interleaved rounds; {note}")
    rows, names = [], None
    for name in ("reorder", "relu"):
        fns = contenders(lib, name)
        names = names or list(fns)
        best = {k: min(v) for k, v in interleaved_rounds(fns, repeat).items()}
        rows.append([name, *(f"{best[k] * 1e6:.1f}" for k in names)])
    print(table(rows, ["kernel", *names]))
    print("raw: the compiled function alone; bound: Kernel.bind(...)(); Memory / numpy: "
          "lib[name](src, dst) on Memory objects / numpy arrays, every check included")
