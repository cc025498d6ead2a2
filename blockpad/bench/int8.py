"""``blockpad bench int8``: int8 ResNet-50 and MobileNetV2 (batch 1) for blockpad, against ONNX
Runtime's int8 and blockpad's own fp32, at 1 thread and at every core.

The networks are ``blockpad.models``' (random weights, exported by PyTorch), quantized by
``blockpad.models.quantized.quantize`` (QDQ, per-channel 7-bit weights, uint8 activations
calibrated on random inputs). Contenders, each in its own process (``bench model``'s reasons;
their rounds interleaved, ``common.run_children``):

* ``blockpad int8``: the QDQ model built ahead of time (``blockpad build``: its kernels, plan
  and packed weights), loaded by ``bp.load`` in the child, as ``bench model`` runs fp32;
* ``onnxruntime int8``: the same QDQ model, default session options (it fuses the QDQ groups
  into its integer kernels);
* ``blockpad fp32``: the float model built ahead of time, as ``bench model`` runs it.

Each process reports ms per inference (median of its rounds); blockpad int8's output is
compared with ONNX Runtime's (the share of logits that differ: 0 when the import is exact).
Needs PyTorch and onnxruntime.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np

from .common import (
    best_of_processes,
    child_command,
    child_rounds,
    hot_step_times,
    isolation,
    run_children,
    spread,
    step_times,
    table,
)

MODELS = ("resnet50", "mobilenet_v2")
INT8 = ("blockpad int8", "onnxruntime int8")
OUT = os.path.join("build", "bench_int8")


def _contender(name, args, x):
    """``(run, model)``: a function making one inference (numpy in, numpy out), and the loaded
    ``bp.Model`` (blockpad; None for ONNX Runtime)."""
    if name == "onnxruntime int8":
        import onnxruntime as ort

        opts = ort.SessionOptions()
        opts.intra_op_num_threads = args.threads
        sess = ort.InferenceSession(args.onnx, opts, providers=["CPUExecutionProvider"])
        feed = {sess.get_inputs()[0].name: x}
        return (lambda: sess.run(None, feed)[0]), None
    import blockpad as bp

    model = bp.load(args.dir)
    return (lambda: model(x)), model


def child(args) -> dict:
    x = np.load(args.input)
    run, model = _contender(args.child, args, x)
    np.save(args.output, run())
    times = child_rounds(run, args.repeat)
    out = {"ms": 1e3 * statistics.median(times), "ms_min": 1e3 * min(times)}
    if model is not None:   # where blockpad's time goes: each step of the plan, in plan order
        out["fallbacks"] = model.run(x).report.fallbacks
        inputs = {next(iter(model.inputs)): x}
        out["steps"] = {k: 1e3 * v for k, v in step_times(model.graph, inputs).items()}
        out["hot"] = {k: 1e3 * v for k, v in hot_step_times(model.graph, inputs).items()}
    return out


def _command(name, threads, paths, args) -> tuple:
    return child_command("blockpad.bench.int8", name, threads, paths["work"],
                         ["--repeat", str(args.repeat), "--onnx", paths["int8"], "--dir",
                          paths["int8_dir"], "--input", paths["input"]])


def prepare(name, batch, hw, seed, target, log=print, tuning_logs=None) -> dict:
    """The fp32 model built ahead of time (``bench model``'s ``prepare``), its quantized QDQ
    form, and that built ahead of time too; both with ``tuning_logs``' records where given."""
    import onnx

    from blockpad.model_build import build_model
    from blockpad.models import quantized

    from . import model

    paths = model.prepare(name, batch, hw, seed, target, log, tuning_logs=tuning_logs)
    int8 = os.path.join(paths["work"], f"{name}_int8_qdq.onnx")
    if not os.path.isfile(int8):
        log(f"quantizing {paths['onnx']} (QDQ, calibrated on random inputs)")
        onnx.save(quantized.quantize(onnx.load(paths["onnx"]), "qdq", seed=seed), int8)
    t0 = time.perf_counter()
    int8_dir = os.path.join(paths["work"],
                            f"blockpad_int8_{target}{model.tuned_suffix(tuning_logs)}")
    build_model(int8, target, int8_dir, log=log, tuning_logs=tuning_logs)
    log(f"blockpad int8 build: {time.perf_counter() - t0:.1f} s")
    return {**paths, "int8": int8, "int8_dir": int8_dir}


def main(models=MODELS, batch=1, hw=224, repeat=5, threads=None, target=None, seed=0,
         processes=1, tuning_logs=None):
    from blockpad.codegen.targets import native_target
    from blockpad.runtime.tvm_runtime import default_threads

    from . import model as fp32

    target = target or native_target()
    cores = default_threads()
    counts = [threads] if threads else sorted({1, cores})
    for name in models:
        paths = prepare(name, batch, hw, seed, target, tuning_logs=tuning_logs)
        args = argparse.Namespace(model=name, repeat=repeat, seed=seed)
        def spawn(names, t, paths=paths, args=args):
            return run_children({c: fp32._command("blockpad", t, paths, args)
                                 if c == "blockpad fp32" else _command(c, t, paths, args)
                                 for c in names}, repeat, t)
        results = best_of_processes(spawn, (*INT8, "blockpad fp32"), counts, processes)
        _report(name, batch, hw, target, counts, results, processes, tuning_logs)


def _report(name, batch, hw, target, counts, results, processes=1, tuning_logs=None):
    from .model import tuned_by

    print(f"\nbench int8: {name}, batch {batch}, {hw}x{hw}; blockpad kernels for {target} "
          f"({tuned_by(tuning_logs)}); {isolation(processes)}")
    rows = []
    for t in counts:
        r = {c: results[(c, t)] for c in (*INT8, "blockpad fp32")}
        ref = np.load(r["onnxruntime int8"]["y"]) if "y" in r["onnxruntime int8"] else None
        for c, v in r.items():
            if "error" in v:
                rows.append([c, t, "failed: " + v["error"][:70], "", "", "", ""])
                continue
            diff = "-"
            if ref is not None and c == "blockpad int8":
                diff = f"{np.mean(np.load(v['y']) != ref):.1%}"
            ratio = {other: r[other]["ms"] / v["ms"] for other in r
                     if other != c and "ms" in r[other]}
            rows.append([c, t, f"{v['ms']:.2f}", f"{v['ms_min']:.2f}", spread(v),
                         ", ".join(f"{k}: {x:.2f}x" for k, x in ratio.items())
                         if c == "blockpad int8" else "", diff])
    print(table(rows, ["contender", "threads", "ms (median)", "ms (fastest)",
                       "processes' medians", "blockpad int8 speed-up over",
                       "logits != ORT int8"]))
    slow = {k for t in counts for k in results[("blockpad int8", t)].get("fallbacks", {})}
    if slow:
        print(f"blockpad int8 ran {len(slow)} steps on numpy (no kernel): {sorted(slow)[:8]}")
    _report_steps(counts, results)


def _report_steps(counts, results, top=12):
    """blockpad int8's slowest steps at each thread count (a step is named by the value it
    writes: a convolution by the QuantizeLinear of its output)."""
    for t in counts:
        steps = results[("blockpad int8", t)].get("steps")
        if not steps:
            continue
        total = sum(steps.values())
        hot = results[("blockpad int8", t)].get("hot", {})
        print(f"\nblockpad int8 at {t} thread(s): {len(steps)} steps, {total:.2f} ms in steps "
              f"({sum(hot.values()):.2f} ms hot: each called again right after itself) against "
              f"{results[('blockpad int8', t)]['ms']:.2f} ms per inference; the "
              f"{min(top, len(steps))} slowest:")
        rows = [[k, f"{v:.3f}", f"{hot.get(k, float('nan')):.3f}", f"{v / total:.1%}"]
                for k, v in sorted(steps.items(), key=lambda kv: -kv[1])[:top]]
        print(table(rows, ["step", "ms", "ms hot", "share"]))


def _cli():
    p = argparse.ArgumentParser()
    p.add_argument("--child", required=True, choices=INT8)
    p.add_argument("--threads", type=int, required=True)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--onnx", required=True)
    p.add_argument("--dir", required=True)
    p.add_argument("--input", required=True)
    p.add_argument("--output", required=True)
    print(json.dumps(child(p.parse_args())))


if __name__ == "__main__":
    _cli()
