"""``blockpad bench resnet``: a small ResNet block run by the graph runtime against PyTorch eager
(NCHW and channels_last), in one run, contenders interleaved.

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

import json
import os
import subprocess
import sys
import time

import numpy as np

from blockpad.codegen.targets import native_target

from .common import interleaved, quiet_thread_pools, step_times, table

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


def build_graph(shape, p, **options):
    """The block with the graph API; returns the Graph (output: ``probs``)."""
    import blockpad as bp

    g = bp.Graph(**options)
    x = g.input("x", shape)
    c = {k: g.constant(k, v) for k, v in p.items()}
    h = g.relu(g.conv2d(x, c["w1"], c["b1"], pad=1, name="conv1"), name="relu1")
    h = g.conv2d(h, c["w2"], c["b2"], pad=1, name="conv2")
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
g = build_graph(shape, params(shape[1]), policy=sys.argv[2])
t1 = time.perf_counter()
res = g.run(x=x)
res["probs"].numpy()
t2 = time.perf_counter()
print(json.dumps({"import_build_s": t1 - t0, "first_run_s": t2 - t1, "total_s": t2 - t0,
                  "compiles": res.report.cache["compiles"], "tvm": "tvm" in sys.modules}))
"""


def fresh_process(shape, policy, cache_dir):
    env = {**os.environ, "BLOCKPAD_CACHE_DIR": cache_dir, "BLOCKPAD_JIT": "0"}
    proc = subprocess.run([sys.executable, "-c", FRESH, json.dumps(list(shape)), policy],
                          capture_output=True, text=True, env=env, timeout=300)
    if proc.returncode:
        return None
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(repeat=7, threads=None, quick=False, policy="dst_fused", hw=None, target=None):
    if threads:
        os.environ["TVM_NUM_THREADS"] = str(threads)
    # kernels for the widest ISA this CPU runs unless told: PyTorch's oneDNN picks AVX-512
    # at run time where the CPU has it
    os.environ["BLOCKPAD_JIT_TARGET"] = target or os.environ.get("BLOCKPAD_JIT_TARGET") \
        or native_target()
    quiet_thread_pools()
    from blockpad.runtime.cache import default_cache
    from blockpad.runtime.tvm_runtime import default_threads

    threads = int(os.environ.get("TVM_NUM_THREADS", default_threads()))
    c = 30 if quick else 62
    hw = hw or (14 if quick else 56)
    shape = (1, c, hw, hw)
    p = params(c, c)
    x = np.random.default_rng(1).standard_normal(shape).astype("float32")
    g = build_graph(shape, p, policy=policy, weights="frozen")
    t0 = time.perf_counter()
    first = g.run(x=x)
    got = first["probs"].numpy()
    setup = time.perf_counter() - t0
    err = float(np.abs(got - reference(x, p)).max())
    print(f"\nbenchmark: ResNet block {list(shape)} (C={c}, padded to "
          f"{-(-c // 16) * 16} in nChw16c), policy {policy}, {threads} thread(s), kernels "
          f"for {os.environ['BLOCKPAD_JIT_TARGET']}")
    print(f"first run (plan + kernels from the cache, JIT on a miss): {setup:.2f} s; "
          f"max |error| vs numpy {err:.1e}")
    print(g.plan(x=x).describe())
    print(first.report)

    contenders = {"blockpad graph (nChw16c)": lambda: g.run(x=x)["probs"].numpy()}
    try:
        import torch
    except ImportError:
        torch = None
        print("\ntorch not installed: no PyTorch comparison")
    if torch is not None:
        torch.set_num_threads(threads)
        tx = torch.from_numpy(x)
        tx_cl = tx.contiguous(memory_format=torch.channels_last)
        nchw, cl = torch_block(p, False), torch_block(p, True)
        assert np.allclose(nchw(tx), got, atol=1e-4)
        contenders["torch eager NCHW"] = lambda: nchw(tx)
        contenders["torch eager channels_last"] = lambda: cl(tx_cl)
    t = interleaved(contenders, repeat)
    base = t["blockpad graph (nChw16c)"]
    rows = [[name, f"{1e3 * s:.3f}", f"{s / base:.2f}"] for name, s in t.items()]
    print(f"\nmedian of {repeat} interleaved rounds"
          + (f", PyTorch {torch.__version__}" if torch is not None else ""))
    print(table(rows, ["contender", "ms per call", "time / blockpad"]))
    if torch is not None:
        best = min(v for k, v in t.items() if k.startswith("torch"))
        print(f"blockpad speed-up over the faster PyTorch layout: {best / base:.2f}x "
              f"(target >= 1.3x; < 1 means slower)")
    steps = step_times(g, {"x": x})
    total = sum(steps.values())
    print("\nwhere the graph's time goes (one run, per step):")
    print(table([[k, f"{1e3 * v:.3f}", f"{100 * v / total:.0f}%"] for k, v in steps.items()],
                ["step", "ms", "share"]))
    fresh = fresh_process(shape, policy, default_cache().cache_dir)
    if fresh:
        print(f"\nfresh process, kernels from the cache directory, no compiler: import + build "
              f"the graph {1e3 * fresh['import_build_s']:.0f} ms, first run "
              f"{1e3 * fresh['first_run_s']:.0f} ms, total {1e3 * fresh['total_s']:.0f} ms "
              f"(compiles: {fresh['compiles']}, tvm imported: {fresh['tvm']})")
    return t


if __name__ == "__main__":
    main()
