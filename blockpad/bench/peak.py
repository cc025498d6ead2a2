"""The machine's measured fp32 peak: a generated kernel that is nothing but independent FMA
chains, run on every thread of TVM's pool (``--dtype int8``: ``vpdpbusd`` chains instead, the
int8 peak of an AVX-512 VNNI machine).

The fraction of peak the convolution and matmul benchmarks report is against this, not a
datasheet figure: a shared VM's clock drifts (2.5-3.3 GHz here) and its vendor's turbo tables
say nothing about what a guest gets. ``CHAINS`` accumulators, each ``acc = acc * a + a`` (one
``vfmadd`` per step, which LLVM cannot fold across steps), hide the FMA latency on both FMA
ports (4 cycles x 2 ports needs at least 8 in flight) without spilling the 16 ymm registers of
AVX2. The kernel is built for a blockpad target, so ``host`` measures the AVX2 peak that host
kernels can reach and ``avx512`` the zmm peak (what oneDNN uses where the CPU has it).

The int8 kernel is the same with each step one ``vpdpbusd`` (64 u8 x s8 products summed into
16 int32 lanes): what blockpad's ``Vnni`` rule, oneDNN's and ONNX Runtime's VNNI kernels issue.
Its figure is in GOP/s, counting a multiply and an add per byte product as the fp32 figure
counts an FMA, so the two are comparable (a VNNI machine's int8 peak is about 4x its fp32 one).

    python -m blockpad.bench.peak [--target host] [--threads N] [--dtype int8]
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


def _kernel_int8(tasks: int):
    from tvm.script import tirx as T

    vec = T.ramp(0, 1, 16)
    dot = "llvm.x86.avx512.vpdpbusd.512"

    @T.prim_func
    def peak(a: T.Buffer((64,), "uint8"), b: T.Buffer((64,), "int8"),
             out: T.Buffer((tasks, CHAINS, 16), "int32")):
        T.func_attr({"tirx.noalias": True})
        for t in T.parallel(tasks):
            acc = T.alloc_buffer((CHAINS, 16), "int32", scope="local")
            for j in T.unroll(CHAINS):
                acc[j, vec] = T.broadcast(t * CHAINS + j, 16)
            for _ in range(STEPS):
                for j in T.unroll(CHAINS):
                    acc[j, vec] = T.call_llvm_pure_intrin(
                        T.llvm_lookup_intrinsic_id(dot), acc[j, vec], a.vload([0], "uint8x64"),
                        b.vload([0], "int8x64"), dtype="int32x16")
            for j in T.unroll(CHAINS):
                out[t, j, vec] = acc[j, vec]

    return peak


class Peak:
    """A compiled FMA-throughput kernel (``dtype`` float32) or ``vpdpbusd``-throughput kernel
    (int8, on a target with ``avx512_vnni``) for ``target`` over ``threads`` tasks (one per
    thread of TVM's pool, which must have that many: set ``TVM_NUM_THREADS`` before the first
    parallel call). Calling it runs once; ``flops`` is what one call computes (int8: a
    multiply and an add per byte product)."""

    def __init__(self, target="host", threads=1, dtype="float32"):
        import tvm

        from blockpad.codegen.targets import get_target
        from blockpad.errors import SpecError

        tgt = get_target(target)
        if dtype == "int8":
            if "avx512_vnni" not in tgt.features:
                raise SpecError(f"the int8 peak runs vpdpbusd: expected a target with "
                                f"avx512_vnni (avx512-vnni, amx); got {target!r}")
            func, lanes = _kernel_int8(threads), 16
            a = np.full(64, 1, "uint8")      # int32 wraps harmlessly: only the time matters
            args = (a, np.full(64, 1, "int8"), np.zeros((threads, CHAINS, 16), "int32"))
            per_step = 2 * 64
        elif dtype == "float32":
            lanes = tgt.vector_bytes // 4
            func = _kernel(lanes, threads)
            args = (np.full(lanes, 0.999, "float32"),   # |acc| stays bounded: no denormals
                    np.zeros((threads, CHAINS, lanes), "float32"))
            per_step = 2 * lanes
        else:
            raise SpecError(f"peak dtype: expected 'float32' or 'int8'; got {dtype!r}")
        lib = tvm.compile(tvm.IRModule({"main": func}), target=tgt.tvm_target())
        self._lib = lib       # keeps the module alive
        self._fn = lib["main"]
        self._args = tuple(tvm.runtime.tensor(v) for v in args)
        self.flops = threads * CHAINS * per_step * STEPS
        self.target, self.threads = tgt.name, threads

    def __call__(self):
        self._fn(*self._args)


def measure(target="host", threads=1, repeat=7, dtype="float32") -> float:
    """Median GFLOP/s (int8: GOP/s) of the peak kernel."""
    from .common import interleaved

    p = Peak(target, threads, dtype)
    return p.flops / interleaved({"peak": p}, repeat)["peak"] / 1e9


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="host")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", choices=("float32", "int8"), default="float32")
    args = ap.parse_args(argv)
    os.environ.setdefault("TVM_NUM_THREADS", str(args.threads))
    fig = measure(args.target, args.threads, dtype=args.dtype)
    unit = "GOP/s int8 (vpdpbusd)" if args.dtype == "int8" else "GFLOP/s fp32"
    print(f"{args.target}: {fig:.1f} {unit} on {args.threads} thread(s)")


if __name__ == "__main__":
    main()
