"""``blockpad bench winograd``: the Winograd cost model's rates, measured on this machine.

``algorithm = "auto"`` picks direct or a Winograd tile per 3x3 convolution by a cost model
(``blockpad.winograd.estimate``): work of four kinds (the direct kernel's flops, the Winograd
GEMM's flops, the transforms' operations, the transformed weights' bytes), each at a rate of
the target (``blockpad.winograd.RATES``). Rates measured on one machine pick badly on another:
the AVX2 machine's slow memory made the default model keep 7x7 layers direct, where on Zen 4
F(2x2) is 0.44 ms faster at 1 thread on ResNet-50's 512 channels.

This benchmark builds the 3x3 stride-1 layers of the bench networks (``SHAPES``) for
``--target`` in every variant (direct, F(2x2), F(4x4), F(6x6)) and times each kernel at one
thread and at all cores (``--threads``), each count in its own process, the variants
interleaved round by round. Before each call the caches are flushed (a 96 MiB buffer written)
and the source and destination read back in: in a network the weights come from memory (a
ResNet-50's are 100 MB) while the layer before leaves the activations in cache. The rates are
then fitted by least squares on relative errors (a thread count's time counted as that many
threads' share of one-thread work, since one plan serves every pool size), and it prints each
layer's times, what the target's current model and the fitted one pick against the fastest
variant, and the fitted rates as an entry for ``RATES``. Operands are random: the kernels'
results are checked by the tests (tests/test_winograd.py), not here.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np

from blockpad import winograd as wino

from .common import run_child, table

#: (input channels, output channels, height = width) of 3x3 stride-1 layers: ResNet-18/50's
#: four stages, a channel-pruned ResNet-50's (ragged counts), DenseNet-121's growth convolution
SHAPES = [(64, 64, 56), (128, 128, 28), (256, 256, 14), (512, 512, 7),
          (45, 50, 56), (100, 90, 28), (200, 180, 14), (349, 330, 7),
          (128, 32, 56), (128, 32, 28), (128, 32, 14), (128, 32, 7)]
QUICK = [(64, 64, 28), (256, 256, 7)]
VARIANTS = (None,) + wino.TILES    # direct, then m of F(m x m, 3x3)
KINDS = ("direct", "gemm", "transform", "weights")
FLUSH_BYTES = 96 << 20


def _label(m) -> str:
    return "direct" if m is None else f"F({m}x{m})"


def build_all(target: str, shapes, out_root: str) -> dict:
    """``{variant: library dir}``: one library per variant holding every shape (``s<i>``)."""
    import blockpad

    dirs = {}
    for m in VARIANTS:
        kernels = []
        for i, (c, k, hw) in enumerate(shapes):
            kern = {"name": f"s{i}", "op": "conv2d", "shape": [1, c, hw, hw], "channels": k,
                    "kernel": [3, 3], "pad": [1, 1], "src": "nChw16c", "dst": "nChw16c",
                    "post_ops": [{"kind": "bias"}, {"kind": "eltwise", "algorithm": "relu"}]}
            if m is None:
                kern["weights"] = "OIhw16i16o"
            else:
                kern.update(algorithm="winograd", winograd_tile=m, weights="hwOi16o")
            kernels.append(kern)
        out = dirs[m] = os.path.join(out_root, target, _label(m).replace("(", "").replace(
            ")", ""))
        print(f"building {len(kernels)} {_label(m)} kernels for {target} ...", file=sys.stderr,
              flush=True)
        blockpad.build({"library": {"name": f"bench-winograd-{m or 0}", "policy": "dst_fused"},
                        "kernel": kernels}, target, out, log=lambda msg: None)
    return dirs


def time_kernels(dirs: list, count: int, rounds: int) -> list:
    """``[[seconds per variant] per shape]``: medians over ``rounds``, the caches flushed
    before each call (see the module docstring)."""
    import blockpad as bp

    libs = [bp.load(d) for d in dirs]
    flush = np.ones(FLUSH_BYTES // 4, dtype=np.float32)
    out = []
    for i in range(count):
        name = f"s{i}"
        calls = []
        for lib in libs:
            rng = np.random.default_rng(i)
            args = lib.kernels[name].args
            mems = [bp.Memory.from_numpy(rng.standard_normal(a.layout.shape).astype("float32"),
                                         a.layout) for a in args[:-1]]
            mems.append(bp.Memory.empty(args[-1].layout))
            calls.append((lib[name], mems))
        times = [[] for _ in calls]
        for fn, mems in calls:
            fn(*mems)
        for _ in range(rounds):
            for t, (fn, mems) in zip(times, calls):
                flush += 1.0
                mems[0].buffer.sum()
                mems[-1].buffer.sum()
                t0 = time.perf_counter()
                fn(*mems)
                t.append(time.perf_counter() - t0)
        out.append([statistics.median(t) for t in times])
    return out


def fit(shapes, times: dict) -> dict | None:
    """Rates (``KINDS``) fitted to ``times`` (``{threads: [[seconds per variant] per
    shape]}``) by least squares on relative errors; None where a rate comes out non-positive
    (times too noisy, or a variant missing for a kind)."""
    rows = []
    for threads, per_shape in times.items():
        for (c, k, hw), secs in zip(shapes, per_shape):
            for m, t in zip(VARIANTS, secs):
                work = wino.costs(1, c, k, hw, hw, m)
                rows.append([work.get(kind, 0) / (threads * t) for kind in KINDS])
    a = np.array(rows, dtype=float)
    scale = a.max(axis=0)
    if not (scale > 0).all():
        return None
    inverse = np.linalg.lstsq(a / scale, np.ones(len(rows)), rcond=None)[0] / scale
    if not (inverse > 0).all():
        return None
    return {kind: float(f"{1 / v:.3g}") for kind, v in zip(KINDS, inverse)}


def picks(shapes, times: dict, rates: dict) -> tuple:
    """``([pick per shape], {threads: ms lost against the fastest allowed variant})`` of the
    cost model with ``rates``."""
    chosen = [wino.choose(1, c, k, hw, hw, rates) for c, k, hw in shapes]
    lost = {}
    for threads, per_shape in times.items():
        total = 0.0
        for (c, _, _), secs, m in zip(shapes, per_shape, chosen):
            total += secs[VARIANTS.index(m)] - secs[VARIANTS.index(_fastest(c, secs))]
        lost[threads] = total * 1e3
    return chosen, lost


def _fastest(c: int, secs) -> int | None:
    """The variant ``auto`` may pick for ``c`` input channels with the least of ``secs``."""
    return min((None, *wino.candidates(c)), key=lambda m: secs[VARIANTS.index(m)])


def main(target=None, repeat=15, threads=None, quick=False):
    from blockpad.codegen.targets import native_target

    target = target or native_target()
    shapes = QUICK if quick else SHAPES
    counts = sorted({1, threads or os.cpu_count() or 1})
    dirs = build_all(target, shapes, os.path.join("build", "bench-winograd"))
    times = {}
    with tempfile.TemporaryDirectory() as work:
        for t in counts:
            print(f"timing {len(shapes)} layers x {len(VARIANTS)} variants at {t} thread(s) "
                  "...", file=sys.stderr, flush=True)
            r = run_child("blockpad.bench.winograd", "blockpad", t, work,
                          ["--dirs", *(dirs[m] for m in VARIANTS), "--count", str(len(shapes)),
                           "--repeat", str(repeat)])
            if "error" in r:
                raise SystemExit(f"bench winograd: the {t}-thread process failed: {r['error']}")
            times[t] = r["times"]
    report(target, shapes, times)


def report(target, shapes, times):
    fitted = fit(shapes, times)
    current = wino.target_rates(target)
    now, now_lost = picks(shapes, times, current)
    new, new_lost = picks(shapes, times, fitted) if fitted else (None, None)
    header = ["layer (C -> K @ HxW)"] + [f"{_label(m)} ms @{t}t" for t in times
                                        for m in VARIANTS] + ["fastest", "model", "fitted"]
    rows = []
    for i, (c, k, hw) in enumerate(shapes):
        best = {t: _fastest(c, per[i]) for t, per in times.items()}
        rows.append([f"{c} -> {k} @ {hw}x{hw}"]
                    + [f"{per[i][j] * 1e3:.3f}" for per in times.values()
                       for j in range(len(VARIANTS))]
                    + [" / ".join(_label(b) for b in best.values()), _label(now[i]),
                       _label(new[i]) if new else "-"])
    counts = " / ".join(f"{t}" for t in times)
    print(f"\nbench winograd: 3x3 stride-1 layers for {target}, caches flushed before each "
          f"call, medians; fastest at {counts} thread(s)")
    print(table(rows, header))
    print(f"\nthe current model for {target} ({_rates_text(current)}) loses "
          + ", ".join(f"{ms:.3f} ms at {t} thread(s)" for t, ms in now_lost.items()))
    if fitted is None:
        print("the fit failed (a rate came out non-positive): the times are too noisy; run "
              "again with more --repeat")
        return
    print(f"fitted rates ({_rates_text(fitted)}) lose "
          + ", ".join(f"{ms:.3f} ms at {t} thread(s)" for t, ms in new_lost.items()))
    print(f'an entry for blockpad/winograd.py RATES: "{target}": {json.dumps(fitted)}')


def _rates_text(rates: dict) -> str:
    return ", ".join(f"{k} {v / 1e9:.3g} G/s" for k, v in rates.items())


def _child(argv):
    p = argparse.ArgumentParser()
    p.add_argument("--child")
    p.add_argument("--threads", type=int)
    p.add_argument("--dirs", nargs="+")
    p.add_argument("--count", type=int)
    p.add_argument("--repeat", type=int)
    p.add_argument("--output")
    a = p.parse_args(argv)
    # TVM's pool spins between calls as in a network (no quiet_thread_pools: its workers
    # sleeping at once made each of a Winograd kernel's three parallel stages wake them)
    os.environ["TVM_NUM_THREADS"] = str(a.threads)
    print(json.dumps({"times": time_kernels(a.dirs, a.count, a.repeat)}))


if __name__ == "__main__":
    _child(sys.argv[1:])
