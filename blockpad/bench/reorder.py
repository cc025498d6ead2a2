"""``blockpad bench reorder``: how fast are the generated nchw <-> nChw16c reorders?

A reorder only moves bytes, so its yardstick is the memory system: the table gives GB/s (bytes
read + bytes written, padding included, per second) for

* ``blockpad``  the generated kernel from ``blockpad.load``: the compiled function called on
                the physical views that ``lib[name](src, dst)`` hands it, and
  ``bp call``   the same through ``lib[name](src, dst)``, argument checks included (the
                difference is the Python wrapper's cost per call);
* ``numpy``     the same reorder in numpy into a preallocated output: ``np.copyto`` through a
                transposed view of the blocked array (full channel blocks in one copy, the
                partial last block in another, its padding lanes set to zero);
* ``copy``      ``np.copyto`` of a buffer of the same bytes, on one thread (numpy's), and
  ``copy Nt``   split over the N threads the kernels use: the bandwidth a reorder can hope for;
* ``torch``     ``x.to_mkldnn()`` / ``.to_dense()`` when torch is installed: oneDNN's reorder,
                allocating its output on each call; oneDNN picks the block for the CPU (16
                channels with AVX-512, 8 with AVX2), so its bytes differ a little from ours.

``bp/copy`` divides blockpad's GB/s by the faster copy, ``bp/numpy`` by numpy's. The contenders
are interleaved round by round (see ``common``): on a shared VM the clock drifts too much for
anything else. The kernels are built once into ``build/bench-reorder`` and reused while the
code generator is unchanged.
"""

from __future__ import annotations

import os
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from .common import interleaved, quiet_thread_pools, table, threaded_copy

SHAPES = [(1, 30, 56, 56), (1, 64, 56, 56), (2, 128, 56, 56), (8, 256, 56, 56)]
QUICK_SHAPES = 2  # --quick: the first two
BLOCK = 16
PLAIN, BLOCKED = "nchw", f"nChw{BLOCK}c"
BUILD_DIR = os.path.join("build", "bench-reorder")


def kernel_name(src, dst, shape):
    return f"{src}_to_{dst}_{'x'.join(map(str, shape))}"


def build_library():
    """Build (or reuse) every shape's kernels, both directions, fp32."""
    import blockpad
    from blockpad.codegen.spec import parse_spec

    kernels = [{"op": "reorder", "name": kernel_name(s, d, shape), "shape": list(shape),
                "dtype": "float32", "src": s, "dst": d}
               for shape in SHAPES for s, d in ((PLAIN, BLOCKED), (BLOCKED, PLAIN))]
    spec = parse_spec({"library": {"name": "bench-reorder"}, "kernel": kernels}, "bench")
    blockpad.build(spec, "host", BUILD_DIR)
    return blockpad.load(BUILD_DIR)


def numpy_reorder(plain, blocked, to_blocked):
    """The reorder in numpy, as ``np.copyto`` calls between views of the two arrays."""
    n, c, h, w = plain.shape
    full, tail = divmod(c, BLOCK)
    by_lane = blocked.transpose(0, 1, 4, 2, 3)               # (N, C/16, 16, H, W), a view
    pairs = [(plain[:, :full * BLOCK].reshape(n, full, BLOCK, h, w), by_lane[:, :full])]
    if tail:
        pairs.append((plain[:, full * BLOCK:], by_lane[:, full, :tail]))
    zero = by_lane[:, full, tail:] if tail and to_blocked else None
    assert all(np.shares_memory(p, plain) for p, _ in pairs)  # views, not copies
    pairs = [(b, p) if to_blocked else (p, b) for p, b in pairs]  # (dst, src)

    def run():
        for dst, src in pairs:
            np.copyto(dst, src)
        if zero is not None:
            zero[...] = 0

    return run


def torch_reorder(plain, to_blocked, threads):
    try:
        import torch
    except ImportError:
        return None
    torch.set_num_threads(threads)
    x = torch.from_numpy(plain)
    if to_blocked:
        return lambda: x.to_mkldnn()
    xm = x.to_mkldnn()
    return lambda: xm.to_dense()


def aligned(shape):
    from blockpad.runtime.memory import aligned_empty

    return aligned_empty(int(np.prod(shape)), np.float32).reshape(shape)


def bench_shape(lib, shape, to_blocked, repeat, threads, pool):
    from blockpad import Layout, Memory

    plain_l, blocked_l = Layout(PLAIN, shape), Layout(BLOCKED, shape)
    plain, blocked = aligned(plain_l.physical_shape), aligned(blocked_l.physical_shape)
    plain[...] = np.random.default_rng(0).standard_normal(shape, np.float32)
    packed = Memory.from_numpy(plain, blocked_l).physical_view()  # the layout's own index maps
    blocked[...] = packed
    src, dst = (plain, blocked) if to_blocked else (blocked, plain)
    expected = dst.copy()
    kern = lib[kernel_name(PLAIN, BLOCKED, shape) if to_blocked else
               kernel_name(BLOCKED, PLAIN, shape)]
    raw = getattr(kern, "_func", kern)  # the compiled function kern(src, dst) calls

    nbytes = src.nbytes + dst.nbytes
    half = nbytes // 2 // 4
    copy_src, copy_dst = aligned((half,)), aligned((half,))
    copy_src[...] = 1
    contenders = {
        "blockpad": lambda: raw(src, dst),
        "bp call": lambda: kern(src, dst),
        "numpy": numpy_reorder(plain, blocked, to_blocked),
        "copy": lambda: np.copyto(copy_dst, copy_src),
    }
    if threads > 1:
        contenders[f"copy {threads}t"] = threaded_copy(copy_dst, copy_src, pool, threads)
    torch_fn = torch_reorder(plain, to_blocked, threads)
    if torch_fn is not None:
        contenders["torch"] = torch_fn

    for name in ("blockpad", "numpy"):  # both must give what the index maps say
        dst[...] = np.nan
        contenders[name]()
        if not np.array_equal(dst, expected):
            raise AssertionError(f"{name}: wrong result for {shape}")
    seconds = interleaved(contenders, repeat)
    return {name: nbytes / t / 1e9 for name, t in seconds.items()}


def main(repeat=5, threads=None, quick=False):
    quiet_thread_pools(threads)   # read when the thread pools start
    lib = build_library()
    import tvm_ffi

    threads = tvm_ffi.get_global_func("runtime.NumThreads")()
    try:
        import torch  # noqa: F401

        torch_note = f"torch {torch.__version__}"
    except ImportError:
        torch_note = "torch not installed"
    print(f"blockpad bench reorder: fp32, kernels on {threads} thread{'s' * (threads > 1)} "
          f"({os.cpu_count()} CPUs), {repeat} rounds, median GB/s = (read + written bytes) / "
          f"time; {torch_note}")

    shapes = SHAPES[:QUICK_SHAPES] if quick else SHAPES
    names = ["blockpad", "bp call", "numpy", "copy"]
    names += [f"copy {threads}t"] if threads > 1 else []
    names += ["torch"] if torch_note != "torch not installed" else []
    rows = []
    with ThreadPoolExecutor(threads) as pool:
        for shape in shapes:
            for to_blocked in (True, False):
                gbs = bench_shape(lib, shape, to_blocked, repeat, threads, pool)
                copy = max(gbs[n] for n in names if n.startswith("copy"))
                direction = f"{PLAIN} -> {BLOCKED}" if to_blocked else f"{BLOCKED} -> {PLAIN}"
                rows.append(["x".join(map(str, shape)), direction,
                             *(f"{gbs[n]:.1f}" for n in names),
                             f"{gbs['blockpad'] / copy:.2f}",
                             f"{gbs['blockpad'] / gbs['numpy']:.2f}"])
                print(f"  {rows[-1][0]} {direction}: done", file=sys.stderr, flush=True)
    print(table(rows, ["shape", "direction", *names, "bp/copy", "bp/numpy"]))
    print("bp/copy: blockpad / the faster copy; bp call: blockpad through lib[name](...), "
          "whose argument checks cost the difference")
