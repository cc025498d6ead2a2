"""The machine's measured fp32 peak: a generated kernel that is nothing but independent FMA
chains, run on every thread of TVM's pool.

The fraction of peak the convolution and matmul benchmarks report is against this, not a
datasheet figure: a shared VM's clock drifts (2.5-3.3 GHz here) and its vendor's turbo tables
say nothing about what a guest gets. ``CHAINS`` accumulators, each ``acc = acc * a + a`` (one
``vfmadd`` per step, which LLVM cannot fold across steps), hide the FMA latency on both FMA
ports (4 cycles x 2 ports needs at least 8 in flight) without spilling the 16 ymm registers of
AVX2. The kernel is built for a blockpad target, so ``host`` measures the AVX2 peak that host
kernels can reach and ``avx512`` the zmm peak (what oneDNN uses where the CPU has it).

    python -m blockpad.bench.peak [--target host] [--threads N]
"""

from __future__ import annotations

import argparse
import os

import numpy as np

CHAINS = 12          # independent accumulators per thread
STEPS = 400000       # FMA steps per chain per call: ~1 ms per thread, long against a launch


def _kernel(lanes: int, tasks: int):
    from tvm.script import tirx as T

    vec = T.ramp(0, 1, lanes)

    @T.prim_func
    def peak(a: T.Buffer((lanes,), "float32"), out: T.Buffer((tasks, CHAINS, lanes), "float32")):
        T.func_attr({"tirx.noalias": True})
        for t in T.parallel(tasks):
            acc = T.alloc_buffer((CHAINS, lanes), "float32", scope="local")
            for j in T.unroll(CHAINS):
                acc[j, vec] = a[vec] + T.Cast("float32", t * CHAINS + j)
            for _ in range(STEPS):
                for j in T.unroll(CHAINS):
                    acc[j, vec] = acc[j, vec] * a[vec] + a[vec]
            for j in T.unroll(CHAINS):
                out[t, j, vec] = acc[j, vec]

    return peak


class Peak:
    """A compiled FMA-throughput kernel for ``target`` over ``threads`` tasks (one per thread
    of TVM's pool, which must have that many: set ``TVM_NUM_THREADS`` before the first
    parallel call). Calling it runs once; ``flops`` is what one call computes."""

    def __init__(self, target="host", threads=1):
        import tvm

        from blockpad.codegen.targets import get_target

        tgt = get_target(target)
        lanes = tgt.vector_bytes // 4
        lib = tvm.compile(tvm.IRModule({"main": _kernel(lanes, threads)}),
                          target=tgt.tvm_target())
        self._lib = lib       # keeps the module alive
        self._fn = lib["main"]
        a = np.full(lanes, 0.999, "float32")   # |acc| stays bounded: no denormals, no inf
        self._args = (tvm.runtime.tensor(a), tvm.runtime.tensor(
            np.zeros((threads, CHAINS, lanes), "float32")))
        self.flops = 2 * threads * CHAINS * lanes * STEPS
        self.target, self.threads = tgt.name, threads

    def __call__(self):
        self._fn(*self._args)


def measure(target="host", threads=1, repeat=7) -> float:
    """Median GFLOP/s of the peak kernel."""
    from .common import interleaved

    p = Peak(target, threads)
    return p.flops / interleaved({"peak": p}, repeat)["peak"] / 1e9


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="host")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    os.environ.setdefault("TVM_NUM_THREADS", str(args.threads))
    print(f"{args.target}: {measure(args.target, args.threads):.1f} GFLOP/s fp32 on "
          f"{args.threads} thread(s)")


if __name__ == "__main__":
    main()
