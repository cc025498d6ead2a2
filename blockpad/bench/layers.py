"""``blockpad bench layers``: a network layer by layer against ONNX Runtime.

Whole-network times say who is ahead; layer times say where. One process at 1 thread runs, round
after round in turn, ONNX Runtime with its profiler on (``SessionOptions.enable_profiling``:
each node's kernel time) and blockpad's plan with each step timed (``common.step_calls``), and
prints each blockpad step beside the ONNX Runtime nodes that compute the same layers, medians
over the rounds. Alternating in one process gives both the same minutes of this shared machine
and the same thread (at 1 thread neither runtime has workers that outlive a call).

Matching the two: ONNX Runtime fuses and renames. A node of its NCHWc transformer is named
after the tensor it produces in the source model with ``_nchwc`` appended (a convolution with
its relu fused: the relu's output); other nodes keep their source names. Either way the source
model's node that produced that tensor is found, and blockpad's step that runs that node (its
own step, or the fused step that took it in: ``Plan.fused``); a node blockpad folded away (a
batch norm into its convolution) goes to the step of its input's producer. ONNX Runtime's own
layout changes (``ReorderInput``/``ReorderOutput``) have no blockpad node: they are listed
apart. A quantized (QDQ) model's nodes are ONNX Runtime's fusions of a source node with the
DequantizeLinear / QuantizeLinear around it, named after that node with ``_token_<n>``
appended (``/conv1/Conv_token_1``: a QLinearConv); blockpad names its int8 steps after the
QuantizeLinear that closes them, so such a node goes to the step its output flows into
(``--int8``). Found this way (2026-11-28, Cascade Lake): ResNet-50's residual convolutions paid
for their separate sum and destination, and the strided 1x1 downsamples for their strided reads
(docs/performance.md)."""

from __future__ import annotations

import json
import os
import re
import statistics
import tempfile
import time

import numpy as np

from .common import step_calls, table

NCHWC = "_nchwc"
QDQ_FUSED = re.compile(r"_token_\d+$")   # ONNX Runtime's name for a node its QDQ fusion made


def ort_to_steps(source, fused: list, steps: list) -> callable:
    """A function from an ONNX Runtime node name to blockpad's step label (None: no blockpad
    node computes it). ``source``: the ONNX model (a ModelProto) both ran; ``fused``: the
    plan's fused groups (lists of node names), ``steps``: the plan's step labels."""
    producer = {out: n for n in source.graph.node for out in n.output}
    consumers: dict = {}
    for n in source.graph.node:
        for name in n.input:
            consumers.setdefault(name, []).append(n)
    names = {n.name: n for n in source.graph.node}
    labels = set(steps)
    step_of = {name: name for name in labels}
    for group in fused:
        label = next((m for m in group if m in labels), None)
        if label is not None:
            step_of.update(dict.fromkeys(group, label))

    def step(node):
        """The node's step: its own, or the one blockpad named after its output and the 8-bit
        type it pools (a max pool on quantized data: ``<output>_uint8``, blockpad/onnx.py)."""
        if node.name in step_of:
            return step_of[node.name]
        return next((step_of[f"{node.output[0]}_{dt}"] for dt in ("uint8", "int8")
                     if node.output and f"{node.output[0]}_{dt}" in step_of), None)

    def downstream(node):
        """The step the node's output flows into through nodes of one consumer each (a QDQ
        convolution: Conv -> Relu -> QuantizeLinear, the last one blockpad's step)."""
        for _ in range(4):
            after = consumers.get(node.output[0], []) if node.output else []
            if len(after) != 1:
                return None
            node = after[0]
            found = step(node)
            if found is not None:
                return found
        return None

    def lookup(ort_name: str):
        ort_name = QDQ_FUSED.sub("", ort_name)
        node = producer.get(ort_name[:-len(NCHWC)]) if ort_name.endswith(NCHWC) \
            else names.get(ort_name)
        if node is None:
            return None
        found = step(node) or downstream(node)
        if found is not None:
            return found
        for _ in range(8):   # a folded node (batch norm): its input's producer's step
            node = producer.get(node.input[0]) if node.input else None
            found = None if node is None else step(node)
            if node is None or found is not None:
                return found
        return None
    return lookup


def compare(onnx_path: str, model_dir: str, x: np.ndarray, rounds: int = 10) -> dict:
    """Median ms per blockpad step and per ONNX Runtime node over ``rounds`` alternating
    rounds at 1 thread (the caller sets ``TVM_NUM_THREADS=1`` before TVM starts):
    ``{"steps": [(label, bp_ms, ort_ms or None)], "ort_only": {node: ms}, "totals": {...}}``."""
    import onnx
    import onnxruntime as ort

    import blockpad as bp

    model = bp.load(model_dir)
    inputs = {next(iter(model.inputs)): x}
    with tempfile.TemporaryDirectory() as tmp:
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = 1
        opts.enable_profiling = True
        opts.profile_file_prefix = os.path.join(tmp, "ort")
        sess = ort.InferenceSession(onnx_path, opts, providers=["CPUExecutionProvider"])
        feed = {sess.get_inputs()[0].name: x}
        bp_ms, whole = {}, {"blockpad": [], "onnxruntime": []}
        with step_calls(model.graph, inputs) as steps:
            for _ in range(rounds + 1):     # the first round warms both up and is dropped
                t0 = time.perf_counter()
                sess.run(None, feed)
                whole["onnxruntime"].append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                for label, call in steps:
                    t1 = time.perf_counter()
                    call()
                    bp_ms.setdefault(label, []).append(1e3 * (time.perf_counter() - t1))
                whole["blockpad"].append(time.perf_counter() - t0)
            labels = [label for label, _ in steps]
        with open(sess.end_profiling()) as f:
            events = json.load(f)
    ort_ms: dict = {}
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
            ort_ms.setdefault(e["name"][:-len("_kernel_time")], []).append(e["dur"] / 1e3)
    to_step = ort_to_steps(onnx.load(onnx_path, load_external_data=False),
                           model.graph.plan(**inputs).fused, labels)
    per_step: dict = {}
    ort_only = {}
    for name, times in ort_ms.items():
        med = statistics.median(times[1:] or times)
        label = to_step(name)
        if label is None:
            ort_only[name] = med
        else:
            per_step[label] = per_step.get(label, 0.0) + med
    rows = [(label, statistics.median(bp_ms[label][1:]), per_step.get(label)) for label in labels]
    return {"steps": rows, "ort_only": ort_only,
            "totals": {k: 1e3 * statistics.median(v[1:]) for k, v in whole.items()}}


def report(name: str, result: dict, top: int = 12) -> None:
    rows = result["steps"]
    both = [(label, b, o) for label, b, o in rows if o is not None]
    print(f"bench layers: {name}, 1 thread, ONNX Runtime (profiled) and blockpad (each step "
          f"timed) alternating in one process; medians; ratio = ONNX Runtime / blockpad "
          f"(> 1: blockpad faster)")
    print(table([[label, f"{b:.3f}", "-" if o is None else f"{o:.3f}",
                  "-" if o is None else f"{o / b:.2f}"] for label, b, o in rows],
                ["blockpad step", "blockpad ms", "ONNX Runtime ms", "ratio"]))
    lost = sorted(both, key=lambda r: r[2] - r[1])[:top]
    behind = ", ".join(f"{label} {b - o:.3f}" for label, b, o in lost if b > o)
    print(f"\nwhere blockpad loses most (ms behind): {behind or 'nowhere'}")
    t = result["totals"]
    only = result["ort_only"]
    unmatched = ", ".join(f"{name} {ms:.3f}" for name, ms in
                          sorted(only.items(), key=lambda kv: -kv[1])[:6])
    print(f"matched layers: blockpad {sum(b for _, b, _ in both):.2f} ms, ONNX Runtime "
          f"{sum(o for _, _, o in both):.2f} ms; ONNX Runtime's nodes no blockpad step matches "
          f"({len(only)}: its reorders, or ops blockpad renamed): {sum(only.values()):.2f} ms"
          f"{f' ({unmatched})' if unmatched else ''}; whole runs (profiler on for ONNX "
          f"Runtime): blockpad {t['blockpad']:.2f} ms, ONNX Runtime {t['onnxruntime']:.2f} ms")


def main(model="resnet50", rounds=10, target=None, seed=0, int8=False):
    """``int8``: the network's quantized QDQ form (``bench int8``'s), blockpad's int8 build
    against ONNX Runtime's QLinearConv / QLinearAdd nodes."""
    from blockpad.codegen.targets import native_target

    from . import int8 as quantized
    from .common import quiet_thread_pools
    from .model import prepare

    quiet_thread_pools(1)    # before TVM's pool starts: both runtimes at 1 thread
    target = target or native_target()
    if int8:
        paths = quantized.prepare(model, 1, 224, seed, target)
        onnx_path, built, name = paths["int8"], paths["int8_dir"], f"{model} int8 (QDQ)"
    else:
        paths = prepare(model, 1, 224, seed, target)
        onnx_path, built, name = paths["onnx"], paths["dir"], model
    x = np.load(paths["input"])
    report(name, compare(onnx_path, built, x, rounds))
