"""``blockpad bench resnet``: a small ResNet block run by the graph runtime against PyTorch eager
(NCHW and channels_last): at 1 thread in one process, contenders interleaved round by round; at
more, each contender in a process of its own, their rounds still interleaved by the parent
(``_own_processes`` says why, ``common.run_children`` how).

    conv3x3 + BN (folded into weights and bias) -> relu -> conv3x3 + BN (folded) -> add(x)
    -> relu -> conv1x1 head -> softmax over channels

on odd channel counts (padded to whole blocks in ``nChw16c``). The graph keeps every
activation blocked between ops, reorders weights once, and reorders the result to plain only
when it is read (the timed call reads it, as PyTorch's result is read). PyTorch runs the same
ops eagerly; with ``channels_last`` it keeps activations NHWC between its oneDNN calls.

Also measured: a fresh process loading the block's kernels from the JIT cache directory and
running it once (deployment: no compiler, no compile).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

from blockpad.codegen.targets import native_target

from .common import (
    best_of_processes,
    child_command,
    child_rounds,
    interleaved,
    isolation,
    quiet_thread_pools,
    run_children,
    step_times,
    table,
)

EPS = 1e-5


def params(c=62, mid=62, classes=11, seed=0):
    """Weights of the block: two 3x3 convs with BN folded in, and a 1x1 head."""
    rng = np.random.default_rng(seed)

    def conv_bn(k, c_in, ksize):
        w = rng.standard_normal((k, c_in, ksize, ksize)) * np.sqrt(2 / (c_in * ksize * ksize))
        gamma, beta = rng.uniform(0.5, 1.5, k), rng.standard_normal(k) * 0.1
        mean, var = rng.standard_normal(k) * 0.1, rng.uniform(0.5, 1.5, k)
        scale = gamma / np.sqrt(var + EPS)
        return ((w * scale[:, None, None, None]).astype("float32"),
                (beta - mean * scale).astype("float32"))

    w1, b1 = conv_bn(mid, c, 3)
    w2, b2 = conv_bn(c, mid, 3)
    wh = (rng.standard_normal((classes, c, 1, 1)) / np.sqrt(c)).astype("float32")
    bh = (rng.standard_normal(classes) * 0.1).astype("float32")
    return {"w1": w1, "b1": b1, "w2": w2, "b2": b2, "wh": wh, "bh": bh}


def build_graph(shape, p, algorithm="auto", **options):
    """The block with the graph API; returns the Graph (output: ``probs``). ``algorithm``:
    the 3x3 convolutions' (``auto``: Winograd where the cost model says it pays, what a model
    built by ``blockpad build`` gets)."""
    import blockpad as bp

    g = bp.Graph(**options)
    x = g.input("x", shape)
    c = {k: g.constant(k, v) for k, v in p.items()}
    h = g.relu(g.conv2d(x, c["w1"], c["b1"], pad=1, name="conv1", algorithm=algorithm),
               name="relu1")
    h = g.conv2d(h, c["w2"], c["b2"], pad=1, name="conv2", algorithm=algorithm)
    h = g.relu(g.add(h, x, name="add"), name="relu2")
    logits = g.conv2d(h, c["wh"], c["bh"], name="head")
    g.output(g.softmax(logits, axis=1, name="probs"))
    return g


def reference(x, p):
    """The block in numpy (float64), on ``blockpad check``'s convolution: none of the code the
    graph runs, its numpy fallback included."""
    from blockpad.check.reference import conv

    def conv_bias(h, w, b, pad):
        entry = {"stride": (1, 1), "pad": (pad, pad), "dilation": (1, 1), "groups": 1}
        return conv(h, w.astype(np.float64), entry) + b.astype(np.float64).reshape(1, -1, 1, 1)

    x = x.astype(np.float64)
    h = np.maximum(conv_bias(x, p["w1"], p["b1"], 1), 0)
    h = np.maximum(conv_bias(h, p["w2"], p["b2"], 1) + x, 0)
    logits = conv_bias(h, p["wh"], p["bh"], 0)
    e = np.exp(logits - logits.max(1, keepdims=True))
    return e / e.sum(1, keepdims=True)


def torch_block(p, channels_last):
    import torch
    import torch.nn.functional as F

    fmt = torch.channels_last if channels_last else torch.contiguous_format
    t = {k: torch.from_numpy(v) for k, v in p.items()}
    for k in ("w1", "w2", "wh"):
        t[k] = t[k].contiguous(memory_format=fmt)

    def run(x):
        with torch.no_grad():
            h = F.relu(F.conv2d(x, t["w1"], t["b1"], padding=1))
            h = F.conv2d(h, t["w2"], t["b2"], padding=1)
            h = F.relu(h + x)
            return torch.softmax(F.conv2d(h, t["wh"], t["bh"]), dim=1).numpy()
    return run


FRESH = """
import json, sys, time
t0 = time.perf_counter()
import numpy as np
import blockpad as bp
from blockpad.bench.resnet import build_graph, params
shape = tuple(json.loads(sys.argv[1]))
x = np.random.default_rng(1).standard_normal(shape).astype("float32")
g = build_graph(shape, params(shape[1], shape[1]), sys.argv[3], policy=sys.argv[2])
t1 = time.perf_counter()
res = g.run(x=x)
res["probs"].numpy()
t2 = time.perf_counter()
print(json.dumps({"import_build_s": t1 - t0, "first_run_s": t2 - t1, "total_s": t2 - t0,
                  "compiles": res.report.cache["compiles"], "tvm": "tvm" in sys.modules}))
"""


def fresh_process(shape, policy, algorithm, cache_dir):
    env = {**os.environ, "BLOCKPAD_CACHE_DIR": cache_dir, "BLOCKPAD_JIT": "0"}
    proc = subprocess.run([sys.executable, "-c", FRESH, json.dumps(list(shape)), policy,
                           algorithm],
                          capture_output=True, text=True, env=env, timeout=300)
    if proc.returncode:
        return None
    return json.loads(proc.stdout.strip().splitlines()[-1])


BLOCKPAD = "blockpad graph (nChw16c)"
TORCH = {"torch eager NCHW": False, "torch eager channels_last": True}   # name -> channels_last


def _torch_contenders(p, x, threads) -> dict:
    """PyTorch's contenders (name -> a call returning the block's output), none without it."""
    try:
        import torch
    except ImportError:
        return {}
    torch.set_num_threads(threads)
    out = {}
    for name, cl in TORCH.items():
        tx = torch.from_numpy(x)
        tx = tx.contiguous(memory_format=torch.channels_last) if cl else tx
        out[name] = functools.partial(torch_block(p, cl), tx)
    return out


def _setup(quick, hw):
    c, hw = (30, hw or 14) if quick else (62, hw or 56)
    shape = (1, c, hw, hw)
    p = params(c, c)
    return shape, p, np.random.default_rng(1).standard_normal(shape).astype("float32")


def main(repeat=7, threads=None, quick=False, policy="dst_fused", hw=None, target=None,
         algorithm="auto", processes=1):
    if threads:
        os.environ["TVM_NUM_THREADS"] = str(threads)
    # kernels for the widest ISA this CPU runs unless told: PyTorch's oneDNN picks AVX-512
    # at run time where the CPU has it
    os.environ["BLOCKPAD_JIT_TARGET"] = target or os.environ.get("BLOCKPAD_JIT_TARGET") \
        or native_target()
    from blockpad.runtime.cache import default_cache
    from blockpad.runtime.tvm_runtime import default_threads

    threads = int(os.environ.get("TVM_NUM_THREADS", default_threads()))
    if threads == 1:
        quiet_thread_pools()   # contenders share this process (at 1 thread, nobody spins)
    shape, p, x = _setup(quick, hw)
    c = shape[1]
    g = build_graph(shape, p, algorithm, policy=policy, weights="frozen")
    t0 = time.perf_counter()
    first = g.run(x=x)
    got = first["probs"].numpy()
    setup = time.perf_counter() - t0
    err = float(np.abs(got - reference(x, p)).max())
    print(f"\nbenchmark: ResNet block {list(shape)} (C={c}, padded to "
          f"{-(-c // 16) * 16} in nChw16c), policy {policy}, 3x3 convolutions {algorithm}, "
          f"{threads} thread(s), kernels for {os.environ['BLOCKPAD_JIT_TARGET']}")
    print(f"first run (plan + kernels from the cache, JIT on a miss): {setup:.2f} s; "
          f"max |error| vs numpy {err:.1e}")
    print(g.plan(x=x).describe())
    print(first.report)

    if threads == 1:
        contenders = {BLOCKPAD: lambda: g.run(x=x)["probs"].numpy(),
                      **_torch_contenders(p, x, threads)}
        for name, run in list(contenders.items())[1:]:
            assert np.allclose(run(), got, atol=1e-4), name
        t = interleaved(contenders, repeat)
        how = f"median of {repeat} interleaved rounds"
    else:
        t = _own_processes(quick, hw, policy, algorithm, threads, repeat, got, processes)
        how = f"{isolation(processes)}, median of {repeat} rounds each"
    if len(t) == 1:
        print("\ntorch not installed: no PyTorch comparison")
    base = t[BLOCKPAD]
    rows = [[name, f"{1e3 * s:.3f}", f"{s / base:.2f}"] for name, s in t.items()]
    print(f"\n{how}")
    print(table(rows, ["contender", "ms per call", "time / blockpad"]))
    if len(t) > 1:
        best = min(v for k, v in t.items() if k.startswith("torch"))
        print(f"blockpad speed-up over the faster PyTorch layout: {best / base:.2f}x "
              f"(target >= 1.3x; < 1 means slower)")
    steps = step_times(g, {"x": x})
    total = sum(steps.values())
    print("\nwhere the graph's time goes (one run, per step):")
    print(table([[k, f"{1e3 * v:.3f}", f"{100 * v / total:.0f}%"] for k, v in steps.items()],
                ["step", "ms", "share"]))
    fresh = fresh_process(shape, policy, algorithm, default_cache().cache_dir)
    if fresh:
        print(f"\nfresh process, kernels from the cache directory, no compiler: import + build "
              f"the graph {1e3 * fresh['import_build_s']:.0f} ms, first run "
              f"{1e3 * fresh['first_run_s']:.0f} ms, total {1e3 * fresh['total_s']:.0f} ms "
              f"(compiles: {fresh['compiles']}, tvm imported: {fresh['tvm']})")
    return t


def _own_processes(quick, hw, policy, algorithm, threads, repeat, got, processes) -> dict:
    """name -> median seconds per call, each contender timed in a process of its own, its
    output checked against ``got``. At more than one thread a shared process measures the
    thread pools, not the block: PyTorch's idle OpenMP workers spin and take the cores from
    the graph's next call (2 threads: the block 1.31 ms alone, 3.2 ms interleaved with
    PyTorch, even with both pools told to sleep)."""
    import tempfile

    names = [BLOCKPAD, *TORCH] if importlib.util.find_spec("torch") else [BLOCKPAD]
    args = ["--repeat", str(repeat), "--policy", policy, "--algorithm", algorithm,
            "--hw", str(hw or 0), *(["--quick"] if quick else [])]
    out = {}
    with tempfile.TemporaryDirectory() as work:
        def spawn(contenders, t):
            return run_children({n: child_command("blockpad.bench.resnet", n, t, work, args)
                                 for n in contenders}, repeat, t)
        for (name, _), r in best_of_processes(spawn, names, [threads], processes).items():
            if "error" in r:
                raise RuntimeError(f"bench resnet: {name} failed: {r['error']}")
            if not np.allclose(np.load(r["y"]), got, atol=1e-4):
                raise AssertionError(f"bench resnet: {name} disagrees with blockpad's graph")
            out[name] = r["ms"] / 1e3
    return out


def _child(args) -> dict:
    """One contender in this process: its output saved to ``args.output``, its median."""
    shape, p, x = _setup(args.quick, args.hw)
    if args.child == BLOCKPAD:
        g = build_graph(shape, p, args.algorithm, policy=args.policy, weights="frozen")
        run = lambda: g.run(x=x)["probs"].numpy()   # noqa: E731
    else:
        run = _torch_contenders(p, x, args.threads)[args.child]
    np.save(args.output, run())
    return {"ms": 1e3 * statistics.median(child_rounds(run, args.repeat))}


def _cli():
    import argparse

    ap = argparse.ArgumentParser(description="one contender of blockpad bench resnet")
    ap.add_argument("--child", choices=[BLOCKPAD, *TORCH], required=True)
    for k in ("threads", "repeat", "hw"):
        ap.add_argument(f"--{k}", type=int, required=True)
    for k in ("policy", "algorithm", "output"):
        ap.add_argument(f"--{k}", required=True)
    ap.add_argument("--quick", action="store_true")
    print(json.dumps(_child(ap.parse_args())))


if __name__ == "__main__":
    _cli()
