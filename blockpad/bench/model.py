"""``blockpad bench model --model resnet50``: a whole network (``blockpad.models``, random
weights, exported to ONNX) built ahead of time by blockpad and run against PyTorch eager (NCHW
and channels_last) and ONNX Runtime (default session options: every graph optimisation), at
1 thread and at every core.

Each contender runs in its own process: in one process PyTorch's OpenMP workers keep spinning
after each call and slow down whoever runs next. The processes stay alive side by side and
the parent runs the rounds, one batch of each in turn (``common.run_children``), so that a
slow spell of a shared machine falls on all of them. Each process checks its output against
PyTorch's, reports ms per inference (median of its rounds), its peak resident memory, and
(blockpad) the time from process start to the first result of a prebuilt model and a
per-layer breakdown. The figures and a PNG are written under ``build/bench_model/``.

Needs PyTorch (the networks are torch.nn) and onnxruntime; blockpad's own run needs neither.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np

from blockpad.codegen.targets import native_target
from blockpad.runtime.graph.execution import BIND_LABEL

from .common import (
    best_of_processes,
    child_command,
    child_rounds,
    hot_step_times,
    isolation,
    run_children,
    spawned_at,
    spread,
    step_times,
    table,
)

CONTENDERS = ("blockpad", "torch NCHW", "torch channels_last", "onnxruntime")
OUT = os.path.join("build", "bench_model")


def _status_mib(field) -> float:
    """``VmRSS`` (resident now) or ``VmHWM`` (its peak) of this process, in MiB. Not
    ``getrusage``: Linux carries ``ru_maxrss`` across exec, so a child would report its
    parent's peak."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


# ---- one contender, in its own process ---------------------------------------------------------

def _contender(name, args, x):
    """``(run, setup)``: a function making one inference (returning numpy), and the network."""
    if name == "blockpad":
        import blockpad as bp

        model = bp.load(args.dir)
        return (lambda: model(x)), model
    if name == "onnxruntime":
        import onnxruntime as ort

        opts = ort.SessionOptions()        # defaults (ORT_ENABLE_ALL) but for the thread count
        opts.intra_op_num_threads = args.threads
        sess = ort.InferenceSession(args.onnx, opts, providers=["CPUExecutionProvider"])
        feed = {sess.get_inputs()[0].name: x}
        return (lambda: sess.run(None, feed)[0]), sess
    import torch

    from blockpad import models

    torch.set_num_threads(args.threads)
    net = models.network(args.model, args.seed)
    tx = torch.from_numpy(x)
    if name == "torch channels_last":
        net = net.to(memory_format=torch.channels_last)
        tx = tx.contiguous(memory_format=torch.channels_last)

    def run():
        with torch.inference_mode():
            return net(tx).numpy()
    return run, net


def child(args) -> dict:
    """Run one contender (``args.child``) and return its figures. ``first_s``: from the
    parent's spawn (``spawned_at``) to the first result: interpreter start, imports,
    loading and the first inference."""
    x = np.load(args.input)
    rss0 = _status_mib("VmRSS")
    run, net = _contender(args.child, args, x)
    rss_loaded = _status_mib("VmRSS")
    y = run()
    first = time.time() - spawned_at()
    np.save(args.output, y)
    times = child_rounds(run, args.repeat)
    out = {"ms": 1e3 * statistics.median(times), "ms_min": 1e3 * min(times),
           "first_s": first, "rss_before_mib": rss0, "rss_loaded_mib": rss_loaded,
           "peak_mib": _status_mib("VmHWM")}
    if args.child == "blockpad":
        report = net.run(x).report
        inputs = {next(iter(net.inputs)): x}
        steps, hot = step_times(net.graph, inputs), hot_step_times(net.graph, inputs)
        ops = {n.name: _kind(net.graph, n) for n in net.graph.nodes}
        for fused in report.fused:   # an inverted residual runs as its projection's step
            names = fused.split(" + ")
            if len(names) == 3:
                ops[names[-1]] = "inverted residual"
        out.update(steps={k: 1e3 * v for k, v in steps.items()},
                   hot={k: 1e3 * v for k, v in hot.items()}, ops=ops,
                   arena_mib=report.arena_bytes / 2 ** 20,
                   weights_mib=report.weight_bytes / 2 ** 20,
                   fallbacks=report.fallbacks)
    return out


def _kind(g, node) -> str:
    """What the breakdown files a node under: its op, and for a convolution its kind
    (depthwise, 1x1, the kernel size), which differ by an order of magnitude in flops per byte
    and run on different schedules."""
    if node.op != "conv2d":
        return node.op
    shape = g.constants[node.inputs[1]].shape   # (K, C/G, kh, kw) or (G, K/G, C/G, kh, kw)
    if node.attrs.get("groups", 1) > 1:
        return "conv2d depthwise" if shape[-3] == 1 else "conv2d grouped"
    kh, kw = shape[-2:]
    return f"conv2d {kh}x{kw}"


def _command(name, threads, paths, args) -> tuple:
    """``child_command`` of one contender. Its thread pools keep their default spin:
    ``QUIET_POOLS`` (sleeping workers) is for contenders sharing a process, and a sleeping pool
    pays a wake-up per kernel launch (MobileNetV2, 2 threads: 19.5 ms with TVM's spin count 0,
    11.6 ms with the default)."""
    return child_command("blockpad.bench.model", name, threads, paths["work"],
                         ["--model", args.model, "--repeat", str(args.repeat), "--seed",
                          str(args.seed), "--dir", paths["dir"], "--onnx", paths["onnx"],
                          "--input", paths["input"]],
                         env={"BLOCKPAD_JIT": "0"})


# ---- the driver -------------------------------------------------------------------------------

def prepare(name, batch, hw, seed, target, log=print, conv_algorithm="auto",
            tuning_logs=None) -> dict:
    """Export the network to ONNX and build it with blockpad (both skipped when up to date);
    ``conv_algorithm``: ``build_model``'s (``direct``: no Winograd, for comparison);
    ``tuning_logs``: ``blockpad tune``'s records to build with, into a folder of its own
    (``_tuned``) so that the untuned build stays beside it."""
    from blockpad import models
    from blockpad.model_build import build_model

    work = os.path.join(OUT, f"{name}_b{batch}_{hw}")
    os.makedirs(work, exist_ok=True)
    onnx_path = os.path.join(work, f"{name}.onnx")
    if not os.path.isfile(onnx_path):
        log(f"exporting {name} to {onnx_path}")
        models.export_onnx(name, onnx_path, batch, hw, seed)
    x_path = os.path.join(work, "x.npy")
    np.save(x_path, models.sample_input(batch, hw))
    model_dir = os.path.join(work, f"blockpad_{target}" +
                             ("" if conv_algorithm == "auto" else f"_{conv_algorithm}") +
                             tuned_suffix(tuning_logs))
    t0 = time.perf_counter()
    build_model(onnx_path, target, model_dir, log=log, conv_algorithm=conv_algorithm,
                tuning_logs=tuning_logs)
    log(f"blockpad build: {time.perf_counter() - t0:.1f} s")
    return {"work": work, "onnx": onnx_path, "input": x_path, "dir": model_dir}


def main(model="resnet50", batch=1, hw=224, repeat=5, threads=None, target=None, seed=0,
         conv_algorithm="auto", processes=1, tuning_logs=None):
    from blockpad.runtime.tvm_runtime import default_threads

    target = target or native_target()
    paths = prepare(model, batch, hw, seed, target, conv_algorithm=conv_algorithm,
                    tuning_logs=tuning_logs)
    cores = default_threads()
    counts = [threads] if threads else sorted({1, cores})
    args = argparse.Namespace(model=model, repeat=repeat, seed=seed)
    def spawn(names, t):
        return run_children({n: _command(n, t, paths, args) for n in names}, repeat, t)
    results = best_of_processes(spawn, CONTENDERS, counts, processes)
    _report(model, batch, hw, target, counts, results, conv_algorithm, processes, tuning_logs)


def tuned_by(tuning_logs) -> str:
    """What the report says of the kernels' schedules."""
    return "untuned" if tuning_logs is None else f"tuned by the records in {tuning_logs}"


def tuned_suffix(tuning_logs) -> str:
    """What a tuned build's folder and plot add to the untuned one's name, so both stay."""
    return "" if tuning_logs is None else "_tuned"


def _report(model, batch, hw, target, counts, results, conv_algorithm="auto", processes=1,
            tuning_logs=None):
    ref = next((np.load(r["y"]) for (n, _), r in results.items()
                if n == "torch NCHW" and "y" in r), None)
    print(f"\nbenchmark: {model}, batch {batch}, {hw}x{hw}, fp32; blockpad kernels for {target} "
          f"(convolutions: {conv_algorithm}; {tuned_by(tuning_logs)}); {isolation(processes)}")
    rows = []
    for (name, t), r in results.items():
        if "error" in r:
            rows.append([name, t, "failed: " + r["error"][:60], "", "", "", "", ""])
            continue
        err = "-"
        if ref is not None:
            y = np.load(r["y"])
            err = f"{np.abs(y - ref).max() / np.abs(ref).max():.1e}"
        best = min(v["ms"] for (n, tt), v in results.items()
                   if tt == t and n != "blockpad" and "ms" in v)
        rows.append([name, t, f"{r['ms']:.2f}", f"{r['ms_min']:.2f}", spread(r),
                     f"{best / r['ms']:.2f}" if name == "blockpad" else "",
                     f"{r['peak_mib']:.0f}", err])
    print(table(rows, ["contender", "threads", "ms (median)", "ms (fastest)",
                       "processes' medians", "speed-up vs best other", "peak RSS MiB",
                       "err / max|logit|"]))
    for t in counts:
        b = results.get(("blockpad", t), {})
        if "first_s" in b:
            print(f"blockpad at {t} thread(s): fresh process (import, load the prebuilt model, "
                  f"first inference) {1e3 * b['first_s']:.0f} ms = one inference "
                  f"{b['ms']:.0f} ms + {1e3 * b['first_s'] - b['ms']:.0f} ms (target < 1000); "
                  f"arena {b['arena_mib']:.1f} MiB, packed weights {b['weights_mib']:.1f} MiB, "
                  f"RSS growth over the first inference "
                  f"{b['peak_mib'] - b['rss_loaded_mib']:.0f} MiB")
        tc = results.get(("torch NCHW", t), {})
        if "peak_mib" in tc:
            print(f"torch NCHW at {t} thread(s): RSS growth over the first inference "
                  f"{tc['peak_mib'] - tc['rss_loaded_mib']:.0f} MiB")
    runs = {t: results[("blockpad", t)] for t in counts
            if "steps" in results.get(("blockpad", t), {})}
    if runs:
        _breakdown(runs)
    b = results.get(("blockpad", counts[0]), {})
    _plot(model, batch, hw, target, counts, results, b.get("steps"), b.get("ops", {}),
          tuning_logs)


def _op_of(label, ops):
    if label in ops:
        return ops[label]
    return label.split()[0] if label.startswith(("reorder", BIND_LABEL)) else "other"


def _by_op(steps, ops) -> dict:
    """op -> (ms, steps) summed over the plan's steps."""
    by_op = {}
    for label, ms in steps.items():
        t, n = by_op.get(_op_of(label, ops), (0.0, 0))
        by_op[_op_of(label, ops)] = (t + ms, n + 1)
    return by_op


def _breakdown(runs: dict):
    """Per-op time of blockpad's plan at each thread count (``runs``: threads -> the child's
    figures), with the scaling of each op, then the slowest steps at the first count."""
    counts = sorted(runs)
    b = runs[counts[0]]
    steps, ops = b["steps"], b["ops"]
    total = sum(steps.values())
    print(f"\nblockpad per layer at {counts[0]} thread(s): {len(steps)} steps, {total:.2f} ms "
          f"in steps (each timed alone, in plan order; a mean of 5 runs) against {b['ms']:.2f} "
          f"ms per inference (a median, timed whole), by op:")
    by = {t: _by_op(runs[t]["steps"], runs[t]["ops"]) for t in counts}
    head = ["op", "steps", *[f"ms at {t}" for t in counts], "share"]
    head += [f"{t} vs {counts[0]} thread(s)" for t in counts[1:]]
    rows = []
    for k, (v, n) in sorted(by[counts[0]].items(), key=lambda kv: -kv[1][0]):
        other = [by[t].get(k, (float("nan"), 0))[0] for t in counts[1:]]
        rows.append([k, n, f"{v:.2f}", *[f"{o:.2f}" for o in other], f"{100 * v / total:.0f}%",
                     *[f"{v / o:.2f}x" for o in other]])
    print(table(rows, head))
    hot = b.get("hot", {})
    print(f"\nthe 15 slowest steps ('hot': the step called again right after itself, its data "
          f"in cache; in steps {sum(hot.values()):.2f} ms hot against {total:.2f} ms in the "
          f"network's order):")
    top = sorted(steps.items(), key=lambda kv: -kv[1])[:15]
    print(table([[k[:60], ops.get(k, ""), f"{v:.3f}", f"{hot.get(k, float('nan')):.3f}",
                  f"{100 * v / total:.1f}%"] for k, v in top],
                ["step", "op", "ms", "ms hot", "share"]))
    if b.get("fallbacks"):
        print(f"fallbacks: {b['fallbacks']}")


def _plot(model, batch, hw, target, counts, results, steps, ops, tuning_logs=None):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    ax = axes[0]
    width = 0.8 / len(CONTENDERS)
    for i, name in enumerate(CONTENDERS):
        ms = [results.get((name, t), {}).get("ms", 0) for t in counts]
        ax.bar([j + i * width for j in range(len(counts))], ms, width, label=name)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(counts))])
    ax.set_xticklabels([f"{t} thread(s)" for t in counts])
    ax.set_ylabel("ms per inference (lower is better)")
    ax.set_title(f"{model}, batch {batch}, {hw}x{hw} (blockpad: {target}, "
                 f"{'untuned' if tuning_logs is None else 'tuned'})")
    ax.legend()
    if steps:
        items = sorted(_by_op(steps, ops).items(), key=lambda kv: -kv[1][0])
        axes[1].barh([k for k, _ in items], [v for _, (v, _n) in items])
        axes[1].invert_yaxis()
        axes[1].set_xlabel(f"ms at {counts[0]} thread(s)")
        axes[1].set_title("blockpad's time by op")
    fig.tight_layout()
    path = os.path.join(OUT, f"bench_model_{model}{tuned_suffix(tuning_logs)}.png")
    fig.savefig(path, dpi=110)
    print(f"\nplot: {path}")


def _cli():
    ap = argparse.ArgumentParser()
    ap.add_argument("--child", choices=CONTENDERS, required=True)
    for k in ("model", "dir", "onnx", "input", "output"):
        ap.add_argument(f"--{k}", required=True)
    for k in ("threads", "repeat", "seed"):
        ap.add_argument(f"--{k}", type=int, required=True)
    args = ap.parse_args()
    print(json.dumps(child(args)))


if __name__ == "__main__":
    _cli()
