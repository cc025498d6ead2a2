"""The machine's measured fp32 peak: a generated kernel that is nothing but independent FMA
chains, run on every thread of TVM's pool (``--dtype int8``: ``vpdpbusd`` chains instead, the
int8 peak of an AVX-512 VNNI machine; ``--dtype bfloat16``: ``vdpbf16ps`` chains).

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
``--dtype bfloat16``: ``vdpbf16ps`` chains (32 bf16 products into 16 float32 lanes a step),
the bf16 peak of an AVX-512 BF16 machine, in GFLOP/s counted the same way.

    python -m blockpad.bench.peak [--target host|native|...] [--threads N] [--dtype int8|bfloat16]

(``--target`` left out: ``host`` for float32, ``native`` for int8 and bfloat16.)
"""

from __future__ import annotations

import argparse
import os
from typing import NamedTuple

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


def _kernel_dot(tasks: int, dtype: str):
    """``CHAINS`` chains of AVX-512 dot products per task: ``vpdpbusd`` (int8: 64 u8 x s8
    products into 16 int32 lanes) or ``vdpbf16ps`` (bf16: 32 products into 16 float32 lanes,
    reached as blockpad's kernels reach it, ``schedules.x86_intrin``)."""
    from tvm.script import tirx as T

    from blockpad.schedules import x86_intrin as xi

    vec = T.ramp(0, 1, 16)
    fn, ir = xi.vdpbf16ps_fn(16)
    kind = _DOT_PEAKS[dtype]
    acc_dt, a_dt, b_dt, n = kind.acc, kind.operand, kind.weights, kind.elements

    def step(acc, a, b):
        if dtype == "int8":
            return T.call_llvm_pure_intrin(
                T.llvm_lookup_intrinsic_id("llvm.x86.avx512.vpdpbusd.512"), acc,
                a.vload([0], "uint8x64"), b.vload([0], "int8x64"), dtype="int32x16")
        return T.call_extern("float32x16", fn, acc, a.vload([0], "int32x16"),
                             b.vload([0], "int32x16"))

    @T.prim_func
    def peak(a: T.Buffer((n,), a_dt), b: T.Buffer((n,), b_dt),
             out: T.Buffer((tasks, CHAINS, 16), acc_dt)):
        T.func_attr({"tirx.noalias": True})
        with T.attr(0, "pragma_import_llvm", ir):
            for t in T.parallel(tasks):
                acc = T.alloc_buffer((CHAINS, 16), acc_dt, scope="local")
                for j in T.unroll(CHAINS):
                    acc[j, vec] = T.broadcast(T.Cast(acc_dt, t * CHAINS + j), 16)
                for _ in range(STEPS):
                    for j in T.unroll(CHAINS):
                        acc[j, vec] = step(acc[j, vec], a, b)
                for j in T.unroll(CHAINS):
                    out[t, j, vec] = acc[j, vec]

    return peak


class _DotPeak(NamedTuple):
    """A dot-product peak kernel: the CPU feature and instruction it needs, the targets that
    have it, ops a step (a multiply and an add per product), the accumulator type, and the
    element type and count of its two register operands (bf16 pairs as int32 dwords)."""

    feature: str
    instr: str
    targets: str
    per_step: int
    acc: str
    operand: str
    weights: str
    elements: int


_DOT_PEAKS = {"int8": _DotPeak("avx512_vnni", "vpdpbusd", "avx512-vnni, avx512-bf16, amx",
                               2 * 64, "int32", "uint8", "int8", 64),
              "bfloat16": _DotPeak("avx512_bf16", "vdpbf16ps", "avx512-bf16, amx", 2 * 32,
                                   "float32", "int32", "int32", 16)}


class Peak:
    """A compiled FMA-throughput kernel (``dtype`` float32), ``vpdpbusd``-throughput kernel
    (int8, on a target with ``avx512_vnni``) or ``vdpbf16ps`` one (bfloat16) for ``target``
    over ``threads`` tasks (one per thread of TVM's pool, which must have that many: set
    ``TVM_NUM_THREADS`` before the first parallel call). Calling it runs once; ``flops`` is
    what one call computes (int8, bf16: a multiply and an add per product)."""

    def __init__(self, target="host", threads=1, dtype="float32"):
        import tvm

        from blockpad.codegen.targets import get_target
        from blockpad.errors import SpecError

        tgt = get_target(target)
        if dtype in _DOT_PEAKS:
            kind = _DOT_PEAKS[dtype]
            if kind.feature not in tgt.features:
                raise SpecError(f"the {dtype} peak runs {kind.instr}: expected a target with "
                                f"{kind.feature} ({kind.targets}); got {target!r}")
            func, lanes, per_step = _kernel_dot(threads, dtype), 16, kind.per_step
            # int8: ones (int32 wraps harmlessly: only the time matters); bf16: pairs of 0,
            # so the sums stay 0, no denormals
            fill = 1 if dtype == "int8" else 0
            args = (np.full(kind.elements, fill, kind.operand),
                    np.full(kind.elements, fill, kind.weights),
                    np.zeros((threads, CHAINS, 16), kind.acc))
        elif dtype == "float32":
            lanes = tgt.vector_bytes // 4
            func = _kernel(lanes, threads)
            args = (np.full(lanes, 0.999, "float32"),   # |acc| stays bounded: no denormals
                    np.zeros((threads, CHAINS, lanes), "float32"))
            per_step = 2 * lanes
        else:
            raise SpecError(f"peak dtype: expected 'float32', 'int8' or 'bfloat16'; got "
                            f"{dtype!r}")
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


def resolve_target(target: str | None, dtype: str) -> str:
    """``--target`` as given, ``native`` the widest target this CPU runs; left out: ``host``
    for float32 (the AVX2 peak host kernels reach) and ``native`` for int8 and bfloat16, whose
    instructions only the wider targets have (a bare ``--dtype int8`` failed on ``host``)."""
    if target is None:
        target = "host" if dtype == "float32" else "native"
    if target == "native":
        from blockpad.codegen.targets import native_target
        target = native_target()
    return target


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=None,
                    help="a blockpad target, or native (the widest this CPU runs); default: "
                         "host for float32 (the AVX2 peak), native for int8 and bfloat16")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", choices=("float32", "int8", "bfloat16"), default="float32")
    args = ap.parse_args(argv)
    args.target = resolve_target(args.target, args.dtype)
    os.environ.setdefault("TVM_NUM_THREADS", str(args.threads))
    fig = measure(args.target, args.threads, dtype=args.dtype)
    unit = {"int8": "GOP/s int8 (vpdpbusd)", "bfloat16": "GFLOP/s bf16 (vdpbf16ps)"}.get(
        args.dtype, "GFLOP/s fp32")
    print(f"{args.target}: {fig:.1f} {unit} on {args.threads} thread(s)")


if __name__ == "__main__":
    main()
