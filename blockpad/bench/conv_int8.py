"""``blockpad bench conv-int8``: int8 and bf16 against fp32 direct convolution on the same
layers (issue 13 item 2): a ResNet-50 3x3 layer and a 1x1 one, batch 1, blocked (``nChw16c``),
each as fp32 (``OIhw16i16o`` weights, FMAs), bf16 (float32 accumulation; ``OIhw8i16o2i``
weights for ``vdpbf16ps`` where the target has ``avx512_bf16``, else ``OIhw16i16o`` and FMAs
of the widened values), u8 and s8 sources (``OIhw4i16o4i`` weights, int32 accumulation, a unit
per-channel scale), built for one target: ``host`` gives AVX2's ``vpmaddubsw`` + ``vpmaddwd``
(schedules/x86_intrin.py), ``avx512-vnni`` ``vpdpbusd``, ``avx512-bf16`` both dot products.

Every int8 result is checked exactly against numpy's int64 convolution (full-range sources
and weights: the pairs that would saturate one ``vpmaddubsw``), fp32 and bf16 within 1e-4 of
float64 (bf16: of the bf16 inputs), before anything is timed. The variants run interleaved in
one process (``common.interleaved_rounds``); the figures are GFLOP/s for the floating types
and GOP/s for int8 (2 ops a multiply-add, as oneDNN's benchdnn counts them), and the ratio of
each to fp32's median.
"""

from __future__ import annotations

import os
import statistics
import tempfile

import numpy as np

from blockpad.vocabulary import QUANTIZED_DTYPES

from .common import interleaved_rounds, table

# (label, C, K, H = W, kernel, pad): ResNet-50's conv3_x 3x3 and a conv2_x 1x1 reduction
LAYERS = [("C128 K128 28x28 3x3", 128, 128, 28, 3, 1), ("C256 K64 56x56 1x1", 256, 64, 56, 1, 0)]
VARIANTS = [("fp32", "float32", "OIhw16i16o"), ("bf16", "bfloat16", "OIhw8i16o2i"),
            ("u8", "uint8", "OIhw4i16o4i"), ("s8", "int8", "OIhw4i16o4i")]
TOLERANCE = 1e-4


def spec(quick: bool, features) -> dict:
    """The layers' kernels for a target with ``features`` (bf16 takes the widening FMA
    path's weights where there is no ``avx512_bf16``)."""
    kernels = []
    for i, (_, c, k, hw, ks, pad) in enumerate(LAYERS[:1] if quick else LAYERS):
        for v, dtype, weights in VARIANTS:
            if v == "bf16" and "avx512_bf16" not in features:
                weights = "OIhw16i16o"
            kernels.append({"name": f"l{i}_{v}", "op": "conv2d", "dtype": dtype,
                            "shape": [1, c, hw, hw], "channels": k, "kernel": [ks, ks],
                            "pad": [pad, pad], "src": "nChw16c", "weights": weights,
                            "dst": "nChw16c"})
    return {"library": {"name": "bench_conv_int8"}, "kernel": kernels}


def main(repeat=5, threads=None, quick=False, target=None):
    if threads:   # before the first kernel call starts TVM's thread pool
        os.environ["TVM_NUM_THREADS"] = str(threads)
    import blockpad as bp
    from blockpad.codegen.spec import parse_spec
    from blockpad.codegen.targets import get_target, native_target

    target = target or native_target()
    out = os.path.join(tempfile.gettempdir(), f"blockpad_bench_conv_int8_{target}")
    bp.build(parse_spec(spec(quick, get_target(target).features)), target, out,
             log=lambda m: None)
    lib = bp.load(out)
    rng = np.random.default_rng(0)
    rows = []
    for i, (label, *_rest) in enumerate(LAYERS[:1] if quick else LAYERS):
        calls, ops = {}, 0.0
        for v, _, _ in VARIANTS:
            kernel = lib[f"l{i}_{v}"]
            calls[v], ops = _checked(kernel, rng)
        rounds = interleaved_rounds(calls, repeat)
        rate = {v: ops / statistics.median(t) / 1e9 for v, t in rounds.items()}
        rows.append([label, *[f"{rate[v]:.1f}" for v, _, _ in VARIANTS],
                     *[f"{rate[v] / rate['fp32']:.2f}x" for v, _, _ in VARIANTS[1:]]])
    n = os.environ.get("TVM_NUM_THREADS", "all")
    print(f"\nconvolution, batch 1, target {target}, {n} thread(s): median of {repeat} "
          f"interleaved rounds; int8 exact against numpy's int64 convolution")
    print(table(rows, ["layer", "fp32 GFLOP/s", "bf16 GFLOP/s", "u8 GOP/s", "s8 GOP/s",
                       *[f"{v} / fp32" for v, _, _ in VARIANTS[1:]]]))
    return rows


def _checked(kernel, rng):
    """The kernel bound to packed memories of random inputs (full-range integers, a unit
    scale) after one checked call: (call, ops per call)."""
    import blockpad as bp
    from blockpad.check.reference import conv
    from blockpad.layout import pad_sides

    sig = kernel.signature
    arrays, mems = {}, []
    for name, role, lay, _ in sig.args:
        if role != "in":
            continue
        dt = bp.layout.numpy_dtype(lay.dtype)
        if name == "scale":
            a = np.ones(lay.shape, dt)
        elif dt.kind in "iu":
            a = rng.integers(np.iinfo(dt).min, np.iinfo(dt).max + 1, lay.shape).astype(dt)
        else:
            a = rng.standard_normal(lay.shape).astype(dt)
        arrays[name] = a.astype(np.float32) if lay.dtype == "bfloat16" else a
        mems.append(bp.Memory.from_numpy(a, lay))
    dst = bp.Memory.empty(sig.args[-1][2])
    call = kernel.bind(*mems, dst)
    call()
    exact = sig.args[0][2].dtype in QUANTIZED_DTYPES
    wide = np.int64 if exact else np.float64
    p = sig.params
    x = np.pad(arrays["src"].astype(wide), ((0, 0), (0, 0), *pad_sides(p["pad"])))
    ref = conv(x, arrays["weights"].astype(wide),
               {"stride": p["stride"], "pad": (0, 0), "dilation": p.get("dilation", (1, 1)),
                "groups": p.get("groups", 1)})
    got = dst.to_numpy()
    if exact and not np.array_equal(got, ref.astype(got.dtype)):   # both round the integer once
        raise SystemExit(f"{kernel.name}: not the exact int32 result")
    err = float(np.abs(got - ref).max() / np.abs(ref).max())
    if err > TOLERANCE:
        raise SystemExit(f"{kernel.name}: relative error {err:.1e} against numpy")
    ops = 2.0 * np.prod(ref.shape) * np.prod(arrays["weights"].shape[1:])
    return call, ops
