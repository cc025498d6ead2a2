"""blockpad's CUDA kernels next to PyTorch (cuBLAS, cuDNN) on a real GPU: results checked
against a float64 reference, then timed with CUDA events.

Built ahead of time where TVM and nvcc are installed, run where the GPU is (the run needs only
blockpad's runtime, PyTorch and a CUDA driver):

    python examples/cuda_bench.py build build/cuda_bench --target cuda-sm90
    python examples/cuda_bench.py run build/cuda_bench          # on the GPU host
"""

import argparse
import functools
import sys

import numpy as np

# fp16 and bf16 run on the tensor cores (wmma, fp32 accumulation), fp32 on the SIMT schedule
KERNELS = [
    {"name": "mm_f16_2048", "op": "matmul", "dtype": "float16", "shape": [2048, 2048],
     "n": 2048, "src": "ab", "weights": "ab", "dst": "ab"},
    {"name": "mm_f32_1024", "op": "matmul", "dtype": "float32", "shape": [1024, 1024],
     "n": 1024, "src": "ab", "weights": "ab", "dst": "ab"},
    {"name": "conv3x3_f16_c256_28", "op": "conv2d", "dtype": "float16", "shape": [16, 256, 28, 28],
     "channels": 256, "kernel": [3, 3], "pad": [1, 1], "src": "nChw16c",
     "weights": "OIhw16i16o", "dst": "nChw16c"},
    {"name": "conv1x1_f16_c256_56", "op": "conv2d", "dtype": "float16", "shape": [16, 256, 56, 56],
     "channels": 64, "kernel": [1, 1], "src": "nChw16c", "weights": "OIhw16i16o",
     "dst": "nChw16c"},
    {"name": "conv3x3_f32_c64_56", "op": "conv2d", "dtype": "float32", "shape": [4, 64, 56, 56],
     "channels": 64, "kernel": [3, 3], "pad": [1, 1], "src": "nChw16c",
     "weights": "OIhw16i16o", "dst": "nChw16c"},
]


def build(out, target):
    import blockpad as bp

    bp.build({"library": {"name": "cuda-bench", "policy": "dst_fused"}, "kernel": KERNELS},
             target, out)


def flops(k):
    if k["op"] == "matmul":
        return 2 * k["shape"][0] * k["shape"][1] * k["n"]
    n, c, h, w = k["shape"]
    kh, kw = k["kernel"]
    return 2 * n * k["channels"] * c * kh * kw * h * w    # stride 1, "same" padding


def timed(fn, reps=50):
    """Median ms of ``reps`` calls, each between CUDA events, after warm-up."""
    import torch

    for _ in range(5):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return float(np.median(times))


def to_blocked(torch, x, layout):
    """A logical NCHW / AB tensor in ``layout``'s physical shape (zero padding), on the GPU."""
    if layout.is_plain:
        return x.contiguous()
    if layout.tag == "nChw16c":
        n, c, h, w = x.shape
        cp = -(-c // 16) * 16
        xp = torch.nn.functional.pad(x, (0, 0, 0, 0, 0, cp - c))
        return xp.reshape(n, cp // 16, 16, h, w).permute(0, 1, 3, 4, 2).contiguous()
    if layout.tag == "OIhw16i16o":
        o, i, kh, kw = x.shape
        return x.reshape(o // 16, 16, i // 16, 16, kh, kw).permute(0, 2, 4, 5, 3, 1).contiguous()
    raise ValueError(f"no conversion for {layout}")


def from_blocked(x, layout, shape):
    if layout.is_plain:
        return x
    n, cb, h, w, b = x.shape
    return x.permute(0, 1, 4, 2, 3).reshape(n, cb * b, h, w)[:, :shape[1]]


def run(out):
    import torch

    import blockpad as bp

    lib = bp.load(out)
    dev = torch.device("cuda")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(f"{'kernel':24} {'max err':>9} {'blockpad ms':>11} {'TFLOP/s':>8} {'torch ms':>9} "
          f"{'TFLOP/s':>8} {'ratio':>6}")
    g = torch.Generator(device=dev).manual_seed(0)
    for k in KERNELS:
        sig = lib.kernels[k["name"]]
        (_, _, src_l, _), (_, _, w_l, _), (_, _, dst_l, _) = sig.args
        dt = getattr(torch, k["dtype"])
        x = torch.randn(*src_l.shape, generator=g, device=dev)
        terms = w_l.shape[0] if k["op"] == "matmul" else np.prod(w_l.shape[1:])
        w = torch.randn(*w_l.shape, generator=g, device=dev) / np.sqrt(terms)
        x, w = x.to(dt), w.to(dt)
        if k["op"] == "matmul":
            ref = (x.double() @ w.double())
            peer = functools.partial(torch.matmul, x, w)
        else:
            pad = k.get("pad", [0, 0])
            ref = torch.nn.functional.conv2d(x.double(), w.double(), padding=pad)
            xc = x.to(memory_format=torch.channels_last)
            wc = w.to(memory_format=torch.channels_last)
            peer = functools.partial(torch.nn.functional.conv2d, xc, wc, padding=pad)
        xs, ws = to_blocked(torch, x, src_l), to_blocked(torch, w, w_l)
        dst = torch.full(dst_l.physical_shape, float("nan"), device=dev,
                         dtype=getattr(torch, dst_l.dtype))
        kernel = lib[k["name"]]
        kernel(xs, ws, dst)
        torch.cuda.synchronize()
        got = from_blocked(dst, dst_l, ref.shape).double()
        err = float((got - ref).abs().max() / ref.abs().max())
        ms = timed(functools.partial(kernel, xs, ws, dst))
        pms = timed(peer)
        f = flops(k)
        print(f"{k['name']:24} {err:9.2e} {ms:11.3f} {f / ms / 1e9:8.1f} {pms:9.3f} "
              f"{f / pms / 1e9:8.1f} {pms / ms:6.2f}x")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", choices=["build", "run"])
    p.add_argument("dir")
    p.add_argument("--target", default="cuda-sm90")
    a = p.parse_args(argv)
    build(a.dir, a.target) if a.what == "build" else run(a.dir)


if __name__ == "__main__":
    sys.exit(main())
