"""``blockpad bench mixed``: blockpad and PyTorch in one process, calling each other's kernels
in turn, as a user mixing the two does.

Both runtimes keep a pool of worker threads, and both pools by default spin for a while after
their work before they sleep: TVM's (``TVM_THREAD_POOL_SPIN_COUNT``) and PyTorch's OpenMP
team (``OMP_WAIT_POLICY``). A call into one runtime right after the other then shares the
cores with the other's spinning workers. The benchmark measures one 3x3 convolution of each
(64 -> 64 channels, 56x56, blockpad on ``nChw16c``, PyTorch channels_last, the same numbers
checked against each other) in four configurations, each in a process of its own since both
settings are read when the pools start:

* ``defaults``       both pools spin;
* ``TVM sleeps``     ``TVM_THREAD_POOL_SPIN_COUNT=0``;
* ``OpenMP sleeps``  ``OMP_WAIT_POLICY=PASSIVE``;
* ``both sleep``     both (``common.QUIET_POOLS``).

Per configuration, ms per call, the kernels called in turn (one call of each, alternately),
against each called alone in a process that never calls the other (``blockpad only``, ``torch
only``, default settings). The medians of ``repeat`` rounds of ``CALLS`` calls.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import numpy as np

from .common import QUIET_POOLS, run_child, table

SHAPE = (1, 64, 56, 56)
CONV = {"op": "conv2d", "name": "conv", "shape": list(SHAPE), "channels": 64, "kernel": [3, 3],
        "pad": [1, 1], "src": "nChw16c", "weights": "OIhw16i16o", "dst": "nChw16c"}
ALONE = ("blockpad only", "torch only")
CONFIGS = {"blockpad only": {}, "torch only": {}, "defaults": {},
           "TVM sleeps": {"TVM_THREAD_POOL_SPIN_COUNT": "0"},
           "OpenMP sleeps": {"OMP_WAIT_POLICY": "PASSIVE"}, "both sleep": QUIET_POOLS}
CALLS = 20   # calls per batch (alone) and pairs per batch (in turn)


def main(repeat=5, threads=None, target=None, log=print) -> dict:
    import blockpad
    from blockpad.codegen.targets import native_target

    threads = threads or os.cpu_count()
    target = target or native_target()
    out = os.path.join("build", "bench-mixed", target)
    blockpad.build({"library": {"name": "bench-mixed"}, "kernel": [CONV]}, target, out,
                   log=lambda m: None)
    results = {}
    with tempfile.TemporaryDirectory() as work:
        for name, env in CONFIGS.items():
            log(f"running {name} ({threads} threads) ...")
            env = {k: v for k, v in env.items() if k not in os.environ}
            results[name] = run_child("blockpad.bench.mixed", name, threads, work,
                                      ["--dir", out, "--repeat", str(repeat)], env=env)
    rows = []
    for name, r in results.items():
        if "error" in r:
            rows.append([name, r["error"], "", ""])
            continue
        bp_ms, pt_ms = r.get("blockpad"), r.get("torch")
        rows.append([name, _ms(bp_ms), _ms(pt_ms), "-" if name in ALONE else _ms(bp_ms + pt_ms)])
    log(f"\nblockpad ({target}) and PyTorch {_torch_version()} in one process, {threads} "
        f"threads: 3x3 conv 64->64 56x56, ms per call (median of {repeat} rounds); alone, "
        f"then called in turn")
    log(table(rows, ["configuration", "blockpad", "torch", "one of each"]))
    return results


def _ms(v) -> str:
    return "-" if v is None else f"{v:.3f}"


def _torch_version() -> str:
    import torch

    return torch.__version__


def child(args) -> dict:
    import torch

    import blockpad as bp

    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    x = rng.standard_normal(SHAPE, dtype=np.float32)
    w = rng.standard_normal((64, 64, 3, 3), dtype=np.float32) * 0.1
    kernel = bp.load(args.dir)["conv"]
    lays = {a.name: a.layout for a in kernel.signature.args}
    src = bp.Memory.from_numpy(x, lays["src"])
    dst = bp.Memory.zeros(lays["dst"])
    call = kernel.bind(src, bp.Memory.from_numpy(w, lays["weights"]), dst)
    conv = torch.nn.Conv2d(64, 64, 3, padding=1, bias=False).to(memory_format=torch.channels_last)
    conv.weight.data = torch.from_numpy(w).contiguous(memory_format=torch.channels_last)
    tx = torch.from_numpy(x).contiguous(memory_format=torch.channels_last)

    def torch_call():
        with torch.inference_mode():
            return conv(tx)

    call()
    want = torch_call().numpy()
    if not np.allclose(dst.to_numpy(), want, atol=1e-3 * np.abs(want).max()):
        raise AssertionError("blockpad's convolution differs from PyTorch's")
    name = args.child
    figures = {"blockpad": [], "torch": []}
    for _ in range(args.repeat):
        if name == "blockpad only":
            figures["blockpad"].append(_batch(call))
        elif name == "torch only":
            figures["torch"].append(_batch(torch_call))
        else:
            bp_s = pt_s = 0.0
            for _ in range(CALLS):
                t0 = time.perf_counter()
                call()
                t1 = time.perf_counter()
                torch_call()
                pt_s += time.perf_counter() - t1
                bp_s += t1 - t0
            figures["blockpad"].append(bp_s / CALLS)
            figures["torch"].append(pt_s / CALLS)
    np.save(args.output, want)
    return {k: 1e3 * statistics.median(v) for k, v in figures.items() if v}


def _batch(fn) -> float:
    t0 = time.perf_counter()
    for _ in range(CALLS):
        fn()
    return (time.perf_counter() - t0) / CALLS


def _cli():
    p = argparse.ArgumentParser()
    p.add_argument("--child", required=True)
    p.add_argument("--threads", type=int, required=True)
    p.add_argument("--dir", required=True)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--output", required=True)
    print(json.dumps(child(p.parse_args())))


if __name__ == "__main__":
    _cli()
