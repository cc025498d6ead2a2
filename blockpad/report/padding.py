"""``blockpad report padding``: seed 000's Appendix A, run for real under every policy.

A framework passes data between kernels by handle and wraps the handles in fresh memory objects
before every call (the seed's p0/p1 example). The chain here is

    pack (nchw -> nChw16c) -> conv 3x3 -> relu -> conv 3x3 -> sigmoid -> softmax -> unpack

on awkward channel counts, so every blocked tensor carries channel padding. Each policy's
library is built from the same spec; the runtime's counters say how many zero-pads ran, how many
bytes they wrote, how long they took and how many blocked the caller; the result is compared
with numpy. The seed predicted the counts for n memory creations: n, 0, 0, n/2, [0, n/2],
[0, n]; where the code does something else the table says so and why.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass

import numpy as np

import blockpad as bp
from blockpad.codegen.spec import parse_spec
from blockpad.runtime import counters
from blockpad.runtime.stream import Stream
from blockpad.vocabulary import POLICIES

SEED = {"on_handle": "n", "dst_fused": "0", "dst_stage": "0", "src": "n/2",
        "tracked": "[0, n/2]", "user": "[0, n]"}


def seed_range(policy, n):
    """The seed's predicted zero-pad calls for ``n`` memory creations, as (low, high)."""
    return {"on_handle": (n, n), "dst_fused": (0, 0), "dst_stage": (0, 0), "src": (n // 2, n // 2),
            "tracked": (0, n // 2), "user": (0, n)}[policy]


@dataclass
class Row:
    policy: str
    zero_pad_calls: int      # per run of the chain
    bytes_zeroed: int
    time_share: float        # zero-pad time / chain time
    blocking_calls: int
    results_match: bool
    chain_ms: float
    seed_prediction: str
    as_seed_predicted: bool
    note: str


def chain(c_in=30, c_mid=60, hw=28):
    """The spec entries of the chain and its steps (kernel, input handles, output handle)."""
    act = lambda c: [1, c, hw, hw]
    conv = lambda name, ci, co: {"op": "conv2d", "name": name, "shape": act(ci), "channels": co,
                                 "kernel": [3, 3], "pad": [1, 1], "src": "nChw16c",
                                 "weights": "OIhw16i16o", "dst": "nChw16c"}
    kernels = [
        {"op": "reorder", "name": "pack", "shape": act(c_in), "src": "nchw", "dst": "nChw16c"},
        conv("conv1", c_in, c_mid),
        {"op": "eltwise", "name": "relu", "shape": act(c_mid), "src": "nChw16c", "dst": "nChw16c"},
        conv("conv2", c_mid, c_in),
        {"op": "eltwise", "name": "sigmoid", "algorithm": "sigmoid", "shape": act(c_in),
         "src": "nChw16c", "dst": "nChw16c"},
        {"op": "softmax", "name": "softmax", "shape": act(c_in), "src": "nChw16c", "dst": "nChw16c"},
        {"op": "reorder", "name": "unpack", "shape": act(c_in), "src": "nChw16c", "dst": "nchw"},
    ]
    steps = [("pack", ["x"], "h0"), ("conv1", ["h0", "w1"], "h1"), ("relu", ["h1"], "h2"),
             ("conv2", ["h2", "w2"], "h3"), ("sigmoid", ["h3"], "h4"),
             ("softmax", ["h4"], "h5"), ("unpack", ["h5"], "y")]
    return kernels, steps


def reference(x, w1, w2):
    def conv(a, w):
        n, c, h, wd = a.shape
        p = np.pad(a, ((0, 0), (0, 0), (1, 1), (1, 1)))
        out = np.zeros((n, w.shape[0], h, wd), np.float64)
        for kh in range(3):
            for kw in range(3):
                out += np.einsum("nchw,kc->nkhw", p[:, :, kh:kh + h, kw:kw + wd], w[:, :, kh, kw])
        return out
    a = 1 / (1 + np.exp(-conv(np.maximum(conv(x, w1), 0), w2)))
    e = np.exp(a - a.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def run(build_root="build/report-padding", iterations=10, hw=28, log=print) -> list[Row]:
    kernels, steps = chain(hw=hw)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 30, hw, hw)).astype("float32")
    w1 = (rng.standard_normal((60, 30, 3, 3)) / 16).astype("float32")
    w2 = (rng.standard_normal((30, 60, 3, 3)) / 24).astype("float32")
    want = reference(x, w1, w2)
    rows = []
    for policy in POLICIES:
        spec = parse_spec({"library": {"name": f"chain-{policy}", "policy": policy}, "kernel": kernels})
        lib = bp.load(bp.build(spec, "host", f"{build_root}/{policy}", log=log).out_dir)
        handles = _handles(lib, steps, x, w1, w2)
        _run_chain(lib, steps, handles, Stream(policy))            # warm up
        counters.reset()
        start = time.perf_counter()
        for _ in range(iterations):
            _run_chain(lib, steps, handles, Stream(policy))
        total = time.perf_counter() - start
        stats = counters.snapshot()
        match = bool(np.allclose(handles["y"], want, rtol=1e-4, atol=1e-5))
        n = _padded_memory_wraps(lib, steps)
        calls = stats.calls // iterations
        low, high = seed_range(policy, n)
        rows.append(Row(policy, calls, stats.bytes // iterations, stats.seconds / total,
                        stats.blocking_calls // iterations, match, 1e3 * total / iterations,
                        f"{SEED[policy]} = {low}" if low == high else f"{SEED[policy]} = [{low}, {high}]",
                        low <= calls <= high, _note(policy, calls, n)))
    return rows


def _handles(lib, steps, x, w1, w2):
    """The framework's buffers: plain numpy for the user's tensors, flat blocked buffers for the
    intermediates (their padding starts as garbage), weights reordered once and kept clean."""
    handles = {"x": x, "y": np.empty_like(x)}
    weights = {"w1": w1, "w2": w2}
    for name, inputs, out in steps:
        sig = lib.kernels[name]
        for (_arg, _role, layout, _), handle in zip(sig.args, [*inputs, out]):
            if handle in weights:
                handles[handle] = bp.Memory.from_numpy(weights[handle], layout)
            elif handle not in handles:
                buf = bp.runtime.memory.aligned_empty(layout.alloc_len, np.float32)
                buf[:] = np.nan
                handles[handle] = buf
    return handles


def _run_chain(lib, steps, handles, stream):
    """Appendix A: before every kernel, wrap its handles in fresh memory objects. The
    framework tells the library a handle is clean when the memory that last wrote it ended
    clean: the state a memory descriptor would carry under option 4, and what option 5 asks a
    diligent user to pass to set_data_handle."""
    known_clean = {"x": True}
    for name, inputs, out in steps:
        sig = lib.kernels[name]
        mems = []
        for (_arg, _role, layout, _), handle in zip(sig.args, [*inputs, out]):
            h = handles[handle]
            if isinstance(h, bp.Memory):          # a weight, reordered once and kept
                mems.append(h)
                continue
            mems.append(lib.memory(layout, h.reshape(-1), clean=known_clean.get(handle, False),
                                   stream=stream))
        lib[name](*mems)
        known_clean[out] = mems[-1].state == "clean"
    stream.wait()


def _padded_memory_wraps(lib, steps):
    """n of the seed: memory objects over padded layouts created per run of the chain."""
    return sum(1 for name, inputs, out in steps
               for (arg, role, layout, _), h in zip(lib.kernels[name].args, [*inputs, out])
               if layout.has_padding and not h.startswith("w"))


def _note(policy, calls, n):
    if policy == "on_handle":
        return "every padded memory zeroed when wrapped" if calls == n else f"expected {n}"
    if policy == "dst_stage":
        return ("blockpad computes the valid region only and runs a zero-pad stage per kernel "
                "with a padded destination; the seed's option 2 zeroes inside the kernel (that "
                "is dst_fused here)")
    if policy == "src":
        return ("only kernels that reduce over padded channels (the convs) zero-pad their padded "
                "sources, weights included; eltwise and softmax mask their reads instead")
    if policy == "tracked":
        return ("zero-pads only a dirty source of a kernel that needs it clean" if calls else
                "every kernel needing a clean source got one: nothing to zero-pad")
    if policy == "user":
        return "destinations of fresh handles zeroed asynchronously on a stream; clean ones skipped"
    return "explicit zero stores only where the op does not keep zeros (sigmoid, softmax)"


def render(rows) -> str:
    head = (f"{'policy':10} {'zero-pads':>9} {'bytes':>9} {'time share':>10} {'blocking':>8} "
            f"{'match':>5} {'chain ms':>8}  {'seed 000 predicts':18} {'as seed?':8} note")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r.policy:10} {r.zero_pad_calls:>9} {r.bytes_zeroed:>9} "
                     f"{100 * r.time_share:>9.1f}% {r.blocking_calls:>8} "
                     f"{'yes' if r.results_match else 'NO':>5} {r.chain_ms:>8.2f}  "
                     f"{r.seed_prediction:18} {'yes' if r.as_seed_predicted else 'differs':8} "
                     f"{r.note}")
    return "\n".join(lines)


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    names = [r.policy for r in rows]
    for ax, (title, values) in zip(axes, [
            ("zero-pad calls per chain", [r.zero_pad_calls for r in rows]),
            ("KiB zeroed per chain", [r.bytes_zeroed / 1024 for r in rows]),
            ("zero-pad share of chain time (%)", [100 * r.time_share for r in rows])]):
        ax.bar(names, values, color=["#c44" if not r.results_match else "#48a" for r in rows])
        ax.set_title(title)
        ax.tick_params(axis="x", rotation=35)
    fig.suptitle("seed 000 Appendix A, measured: pack -> conv -> relu -> conv -> sigmoid -> "
                 "softmax -> unpack (C=30/60, nChw16c)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(json_path=None, png_path="report_padding.png", iterations=10, hw=28,
         build_root="build/report-padding"):
    rows = run(build_root, iterations, hw, log=lambda m: None)
    print(render(rows))
    if json_path:
        with open(json_path, "w") as f:
            json.dump([asdict(r) for r in rows], f, indent=1)
        print(f"rows written to {json_path}")
    if png_path:
        plot(rows, png_path)
        print(f"plot written to {png_path}")
    return rows
