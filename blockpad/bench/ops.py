"""``blockpad bench ops``: what padding costs, per op and policy, and memory-bound ops against
PyTorch, all measured in one run with interleaved contenders.

1. Per op, the same kernel on 1x250x56x56 (channels padded to 256) under ``dst_fused`` and
   ``dst_stage`` (the stage kernel included), against 1x256x56x56 that needs no padding: the
   padded tensors are the same size, so the ratio is the cost of handling the padding.
2. gelu and channel softmax on 1x256x56x56 fp32 against PyTorch (NCHW, ``dim=1``; a new output
   per call and ``out=``) and a numpy copy of the same bytes (no kernel can beat it): blocked
   layouts make the channel reduction contiguous.
"""

from __future__ import annotations

import os

import numpy as np

from blockpad.codegen.targets import native_target

from .common import interleaved, quiet_thread_pools, table, threaded_copy

HW = 56
BENCHMARKS = {   # name -> spec fields (src/dst nChw16c)
    "relu": {"op": "eltwise", "algorithm": "relu"},
    "gelu_erf": {"op": "eltwise", "algorithm": "gelu_erf"},
    "sigmoid": {"op": "eltwise", "algorithm": "sigmoid"},
    "linear": {"op": "eltwise", "algorithm": "linear", "alpha": 2.0, "beta": 1.0},
    "softmax": {"op": "softmax"},
}


def _spec(channels):
    kernels = []
    for name, fields in BENCHMARKS.items():
        for policy, c in (("nopad", channels[0]), ("dst_fused", channels[1]),
                          ("dst_stage", channels[1])):
            kernels.append({**fields, "name": f"{name}_{policy}", "shape": [1, c, HW, HW],
                            "src": "nChw16c", "dst": "nChw16c",
                            "policy": "dst_fused" if policy == "nopad" else policy})
    return {"library": {"name": "bench-ops"}, "kernel": kernels}


def main(repeat=7, threads=None, target=None, out_dir="build/bench-ops"):
    quiet_thread_pools(threads)
    import blockpad as bp
    from blockpad.codegen.spec import parse_spec
    from blockpad.runtime.tvm_runtime import default_threads

    target = target or native_target()
    lib = bp.load(bp.build(parse_spec(_spec((256, 250))), target, f"{out_dir}-{target}").out_dir)
    threads = int(os.environ.get("TVM_NUM_THREADS", default_threads()))
    rng = np.random.default_rng(0)
    print(f"\nbenchmark: padding cost per op, target {target}, {threads} thread(s); median of "
          f"{repeat} interleaved rounds")
    rows = []
    for name in BENCHMARKS:
        calls = {}
        for variant in ("nopad", "dst_fused", "dst_stage"):
            k = lib[f"{name}_{variant}"]
            src_l, dst_l = k.signature.args[0].layout, k.signature.args[-1].layout
            src = bp.Memory.from_numpy(rng.standard_normal(src_l.shape).astype("float32"), src_l)
            dst = bp.Memory.empty(dst_l)
            calls[variant] = (lambda k=k, s=src, d=dst: k(s, d))
        t = interleaved(calls, repeat)
        rows.append([name, *(f"{1e6 * t[v]:.0f}" for v in t),
                     f"{t['dst_fused'] / t['nopad']:.3f}", f"{t['dst_stage'] / t['nopad']:.3f}"])
    print(table(rows, ["op", "C=256 us", "dst_fused C=250 us", "dst_stage C=250 us",
                       "fused/nopad", "stage/nopad"]))
    _vs_torch(lib, target, threads, repeat, rng)


def _vs_torch(lib, target, threads, repeat, rng):
    """gelu and channel softmax against PyTorch, both as users call it (a new output tensor per
    call) and into a preallocated output (``out=``, as blockpad's kernels write), next to the
    floor for any kernel that reads and writes these bytes once: numpy copying them."""
    from concurrent.futures import ThreadPoolExecutor

    import blockpad as bp

    try:
        import torch
    except ImportError:
        print("\ntorch not installed: `pip install torch==2.13.0` for the PyTorch comparison")
        return
    torch.set_num_threads(threads)
    x = rng.standard_normal((1, 256, HW, HW)).astype("float32")
    lay = bp.Layout("nChw16c", x.shape)
    src, dst = bp.Memory.from_numpy(x, lay), bp.Memory.empty(lay)
    tx, ty = torch.from_numpy(x), torch.empty(x.shape)
    softmax_out = torch.ops.aten._softmax.out
    with ThreadPoolExecutor(threads) as pool:
        contenders = {
            "blockpad gelu (nChw16c)": lambda: lib["gelu_erf_nopad"](src, dst),
            "torch gelu (NCHW)": lambda: torch.nn.functional.gelu(tx),
            "torch gelu (NCHW, out=)": lambda: torch._C._nn.gelu(tx, out=ty),
            "blockpad softmax c (nChw16c)": lambda: lib["softmax_nopad"](src, dst),
            "torch softmax dim=1 (NCHW)": lambda: torch.softmax(tx, dim=1),
            "torch softmax dim=1 (NCHW, out=)": lambda: softmax_out(tx, 1, False, out=ty),
            "copy (numpy, the floor)": threaded_copy(np.empty_like(x), x, pool, threads),
        }
        t = interleaved(contenders, repeat)
    nbytes = 2 * x.nbytes
    rows = [[n, f"{1e6 * s:.0f}", f"{nbytes / s / 1e9:.1f}"] for n, s in t.items()]
    print(f"\nbenchmark: memory-bound ops on 1x256x56x56 fp32 vs PyTorch {torch.__version__}, "
          f"blockpad target {target}, {threads} thread(s)")
    print(table(rows, ["contender", "us", "GB/s"]))
    floor = t["copy (numpy, the floor)"]
    for op, target_ratio in (("gelu", 2), ("softmax", 3)):
        ours, *peers = (v for k, v in t.items() if k.split()[1] == op)
        print(f"{op}: blockpad / torch = {peers[0] / ours:.2f}x, {peers[1] / ours:.2f}x against "
              f"out= (speed-up); {target_ratio}x needs {1e6 * peers[0] / target_ratio:.0f} us "
              f"and {1e6 * peers[1] / target_ratio:.0f} us, a copy of the same bytes takes "
              f"{1e6 * floor:.0f} us")
