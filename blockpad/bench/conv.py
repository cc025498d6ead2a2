"""``blockpad bench conv`` / ``blockpad bench matmul``: the kernels of examples/bench_host.toml
against PyTorch (NCHW, channels_last, mkldnn) and numpy, at 1 and 2 threads, as GFLOP/s, as a
fraction of the measured fp32 peak and as per-pair ratios (issue 5).

Each thread count runs in its own process: TVM's pool, PyTorch's OpenMP team and numpy's BLAS
all fix their thread counts when they start. At 1 thread every round times one batch of each
contender and of the peak kernel (``peak.Peak``) in turn, so the clock drift of this VM hits
them alike and the fraction of peak is against the peak of the same minutes. At more threads
each contender runs in a process of its own (blockpad's with the peak kernel): in one process
the pools that are not running still hold the cores (told to sleep, PyTorch's OpenMP team
wakes too slowly instead: channels_last 1x1 2048 -> 512 at 7x7 measured 45.8 GFLOP/s at 2
threads interleaved with blockpad, 77.5 at 1 thread). The spec is built
for ``host`` (AVX2, tuning records applied by the build) and, where this CPU has more, also
for the widest target it runs (``--target native``: ``avx512``, ``zen4``, ...): PyTorch's oneDNN
uses the widest vectors the CPU has, so that is the like-for-like comparison, while the host
build is what the issue's targets are stated for on AVX2 machines. Every
blockpad result is checked against a numpy reference (float64) before it is timed, and its
error (max |err| / max |reference|) is printed. Winograd rows (``F(mxm)``, issue 15) take their
weights through the library's transform kernel, outside the timing, and are rated in
effective GFLOP/s: the direct convolution's flops over their time (so their fraction of peak
may pass 100%), next to the same PyTorch contenders. Inverted-residual rows (``IR``: MobileNetV2's
1x1 expansion, depthwise 3x3 and 1x1 projection with the residual add, one blockpad kernel)
run against PyTorch executing the block's ops one by one (NCHW and channels_last), rated in the
three convolutions' flops.
PyTorch is a peer here, imported only inside the benchmark.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np

from .common import BLAS_SLEEPS, QUIET_POOLS, interleaved_rounds, table

SPEC = Path(__file__).resolve().parents[2] / "examples" / "bench_host.toml"
# the peers of each benchmark, by the names its tables use
PEERS = {"conv": ("torch nchw", "torch channels_last", "torch mkldnn"),
         "matmul": ("numpy", "torch")}
BUILD = Path("build")
TOLERANCE = 1e-4   # max |error| / max |reference|


def targets() -> list:
    """The blockpad targets compared: host, and the widest this CPU runs
    (``targets.native_target``: ``avx512`` or a superset, ``zen4`` on a Zen 4, whose
    convolutions reduce in one pass where ``avx512``'s take the Cascade Lake's passes)."""
    from blockpad.codegen.targets import native_target

    return list(dict.fromkeys(("host", native_target())))


def build_all(tgts) -> dict:
    """Build the bench spec for each target (nothing to do when up to date)."""
    import blockpad as bp

    out = {}
    for t in tgts:
        d = BUILD / f"bench_host_{t}"
        bp.build(str(SPEC), t, d)
        out[t] = str(d)
    return out


def main(what="conv", repeat=5, threads=None, quick=False, png=None):
    tgts = targets()
    dirs = build_all(tgts)
    counts = [threads] if threads else [1, 2]
    results = []
    for n in counts:
        rows = None
        for group in ["all"] if n == 1 else ["blockpad", *PEERS[what]]:
            part = _run_worker(what, dirs, repeat, quick, n, group)
            rows = part if rows is None else _merge(rows, part)
        report(what, n, rows, repeat)
        results += [{**r, "threads": n} for r in rows]
    report_scaling(results)
    plot(what, results, png or str(BUILD / f"bench_{what}.png"))
    return results


def _run_worker(what, dirs, repeat, quick, threads, group) -> list:
    """The rows of one worker process: ``group`` ``all`` (every contender, interleaved: its
    pools told to sleep), ``blockpad`` (blockpad's builds and the peak) or one peer's name (a
    process alone keeps its pools' default spin, as a user's would; only numpy's, which
    computes the references, sleeps where numpy is not the contender)."""
    n = str(threads)
    quiet = QUIET_POOLS if group == "all" else {} if group == "numpy" else BLAS_SLEEPS
    env = {**os.environ, "TVM_NUM_THREADS": n, "OMP_NUM_THREADS": n,
           "OPENBLAS_NUM_THREADS": n, "MKL_NUM_THREADS": n, **quiet}
    cmd = [sys.executable, "-m", "blockpad.bench.conv", what, json.dumps(dirs), str(repeat),
           str(int(quick)), group]
    print(f"{what}, {threads} thread(s): {group} ...", file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, check=False, env=env, capture_output=True, text=True)
    if proc.returncode:
        sys.stderr.write(proc.stderr)
        raise SystemExit(f"benchmark worker ({threads} threads, {group}) failed")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _merge(rows, part) -> list:
    """``rows`` (blockpad's process) with a peer's figures from its own process."""
    for r, p in zip(rows, part):
        assert r["kernel"] == p["kernel"], (r["kernel"], p["kernel"])
        r["gflops"].update(p["gflops"])
        if "bandwidth" in r and "bandwidth" in p:
            r["bandwidth"]["gbs"].update(p["bandwidth"]["gbs"])
    return rows


def report_scaling(results) -> None:
    """Per kernel and contender, GFLOP/s at the most threads over GFLOP/s at 1 thread (issue
    15's target: 2 threads >= 1.8x one), where both thread counts were run."""
    counts = sorted({r["threads"] for r in results})
    if len(counts) < 2 or counts[0] != 1:
        return
    n = counts[-1]
    at = {(r["kernel"], r["threads"]): r for r in results}
    names = [k for k in results[0]["gflops"] if not k.startswith("peak")]
    body = [[r["shape"], *[f"{r['gflops'][k] / at[(r['kernel'], 1)]['gflops'][k]:.2f}x"
                           if k in r["gflops"] else "-" for k in names]]
            for r in results if r["threads"] == n and (r["kernel"], 1) in at]
    print(f"\nthread scaling: GFLOP/s at {n} threads / at 1 thread (medians; target >= "
          f"{0.9 * n:.1f}x)")
    print(table(body, ["shape", *names]))


def report(what, threads, rows, repeat):
    peers = [k for k in rows[0]["gflops"] if not k.startswith(("blockpad", "peak"))]
    mine = [k for k in rows[0]["gflops"] if k.startswith("blockpad")]
    head = ["shape", *[f"{k} GF/s" for k in mine + peers]]
    head += [f"{k.split()[-1]} %peak" for k in mine]
    head += [f"{k.split()[-1]} %peak best" for k in mine]
    head += [f"{k.split()[-1]} / {'best torch' if what == 'conv' else 'numpy'}" for k in mine]
    head += [f"{k.split()[-1]} error" for k in mine]
    body = []
    for r in rows:   # an inverted residual has no mkldnn contender: "-"
        g = r["gflops"]
        base = max(g[k] for k in peers if k.startswith("torch") and k in g) \
            if what == "conv" else g["numpy"]
        body.append([r["shape"], *[f"{g[k]:.1f}" if k in g else "-" for k in mine + peers],
                     *[f"{100 * r['peak_fraction'][k]:.0f}%" for k in mine],
                     *[f"{100 * r['best_peak_fraction'][k]:.0f}%" for k in mine],
                     *[f"{g[k] / base:.2f}x" for k in mine],
                     *[f"{r['error'][k]:.1e}" for k in mine]])
    peaks = rows[0]["peak"]
    how = "interleaved rounds" if threads == 1 else \
        "rounds, each contender in its own process (the peak in blockpad's)"
    print(f"\n{what}, fp32, {threads} thread(s): median of {repeat} {how}; "
          f"measured peak in the same rounds " +
          ", ".join(f"{t} {v:.0f} GFLOP/s" for t, v in peaks.items()) +
          "; '%peak best': the kernel's fastest round against the peak's fastest (what an "
          "undisturbed machine gives; the medians carry the neighbours' load)")
    print(table(body, head))
    _report_bandwidth(threads, [r for r in rows if "bandwidth" in r], mine, peers)


def _report_bandwidth(threads, rows, mine, peers):
    """The memory-bound rows (depthwise) in GB/s of their least traffic (sources read once,
    destination written once), against a plain copy moving as many bytes in the same rounds;
    'FMA bound': the most the FMA units allow at the measured peak (a 3x3 depthwise does 9
    FMAs per element: on a core whose copy streams from cache faster than that, no kernel
    reaches the copy)."""
    if not rows:
        return
    head = ["shape", "MB moved", "copy GB/s", *[f"{k} GB/s" for k in mine + peers]]
    head += [f"{k.split()[-1]} / copy" for k in mine]
    head += [f"FMA bound {k.split()[-1]} / copy" for k in mine]
    body = []
    for r in rows:
        b = r["bandwidth"]
        body.append([r["shape"], f"{b['bytes'] / 1e6:.1f}", f"{b['copy']:.1f}",
                     *[f"{b['gbs'][k]:.1f}" for k in mine + peers],
                     *[f"{b['gbs'][k] / b['copy']:.0%}" for k in mine],
                     *[f"{b['fma_bound'][k.split()[-1]] / b['copy']:.0%}" for k in mine]])
    print(f"\nmemory-bound convolutions, {threads} thread(s): bandwidth against a plain copy "
          f"of the same bytes (medians; the copy timed in the rounds of blockpad's kernels)")
    print(table(body, head))


def plot(what, results, png):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    counts = sorted({r["threads"] for r in results})
    fig, axes = plt.subplots(1, len(counts), figsize=(7 * len(counts), 4.5), squeeze=False)
    for ax, n in zip(axes[0], counts):
        rows = [r for r in results if r["threads"] == n]
        names = [k for k in rows[0]["gflops"] if not k.startswith("peak")]
        x = np.arange(len(rows))
        w = 0.8 / len(names)
        for i, k in enumerate(names):
            ax.bar(x + i * w, [r["gflops"].get(k, 0.0) for r in rows], w, label=k)
        for t, v in rows[0]["peak"].items():
            ax.axhline(v, ls="--", lw=1, color="k" if t == "host" else "grey")
            ax.text(len(rows) - 0.5, v, f"{t} peak", va="bottom", ha="right", fontsize=8)
        ax.set_xticks(x + 0.4 - w / 2, [r["shape"] for r in rows], rotation=25, ha="right",
                      fontsize=7)
        ax.set_ylabel("GFLOP/s")
        ax.set_title(f"{what} fp32, {n} thread(s)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    print(f"\nplot: {png}")


# ---- the worker: one process, one thread count ----------------------------------------------

def _inputs(kernel, rng):
    """Random inputs of the kernel's logical tensors: a Winograd convolution's weights are
    the 3x3 ones its transform kernel takes (``_bound`` transforms them)."""
    sig = kernel.signature
    out = {name: rng.standard_normal(lay.shape).astype("float32")
           for name, role, lay, _ in sig.args if role == "in"}
    if "winograd" in sig.params:
        k, c = out["weights"].shape[:2]
        out["weights"] = rng.standard_normal((k, c, 3, 3)).astype("float32")
    return out


def _bound(lib, kernel, arrays):
    """The kernel bound to blocked memories of ``arrays`` (weights packed once, outside the
    timing, as in inference: a Winograd convolution's transformed by the library's
    ``__winograd_weights`` kernel) and its destination memory."""
    import blockpad as bp

    wino = kernel.signature.params.get("winograd")
    mems = []
    for name, role, lay, _ in kernel.signature.args:
        if role != "in":
            continue
        if name == "weights" and wino:
            mem = lib.memory(lay)
            lib[wino["weights_transform"]](arrays[name], mem)
        else:
            mem = bp.Memory.from_numpy(arrays[name], lay)
        mems.append(mem)
    dst = lib.memory(kernel.signature.args[-1].layout)
    return kernel.bind(*mems, dst), dst


def _conv_peers(params, arrays):
    import torch
    import torch.nn.functional as F
    import torch.utils.mkldnn

    groups = params.get("groups", 1)
    w = arrays["weights"]
    x, w = torch.from_numpy(arrays["src"]), torch.from_numpy(w.reshape(-1, *w.shape[-3:]))
    kw = {"stride": tuple(params["stride"]), "padding": tuple(params["pad"]), "groups": groups}
    cl = torch.channels_last
    xc, wc = x.contiguous(memory_format=cl), w.contiguous(memory_format=cl)
    conv = torch.nn.Conv2d(x.shape[1], w.shape[0], w.shape[2:], bias=False, **kw).eval()
    conv.weight.data.copy_(w)
    mk = torch.utils.mkldnn.to_mkldnn(conv)        # weights reordered once, blocked
    xm = x.to_mkldnn()
    torch.set_grad_enabled(False)
    return dict(zip(PEERS["conv"], (lambda: F.conv2d(x, w, **kw),
                                    lambda: F.conv2d(xc, wc, **kw), lambda: mk(xm))))


def _block_peers(params, arrays):
    """PyTorch running an inverted residual's ops (biases, relu6, the residual add) one by
    one, NCHW and channels_last: what a user of PyTorch eager gets."""
    import torch
    import torch.nn.functional as F

    torch.set_grad_enabled(False)
    t = {k: torch.from_numpy(v) for k, v in arrays.items()}
    wd = t["depthwise_weights"].reshape(-1, 1, *t["depthwise_weights"].shape[-2:])
    kh, kw = wd.shape[-2:]

    def block(x, w1, w2, dw):
        e = F.conv2d(x, w1, t["expand_bias"]).clamp_(0, 6)
        d = F.conv2d(e, dw, t["depthwise_bias"], stride=tuple(params["stride"]),
                     padding=(kh // 2, kw // 2), groups=dw.shape[0]).clamp_(0, 6)
        y = F.conv2d(d, w2, t["bias"])
        return y.add_(t["sum"]) if "sum" in t else y

    cl = torch.channels_last
    last = {k: t[k].contiguous(memory_format=cl) for k in ("src", "expand_weights", "weights")}
    dwc = wd.contiguous(memory_format=cl)
    if "sum" in t:
        t["sum"] = t["sum"].contiguous(memory_format=cl)   # NCHW adds it as well, at a copy
    return dict(zip(PEERS["conv"][:2], (   # NCHW and channels_last: no mkldnn
        lambda: block(t["src"], t["expand_weights"], t["weights"], wd),
        lambda: block(last["src"], last["expand_weights"], last["weights"], dwc))))


def _matmul_peers(arrays):
    import torch

    a, b = arrays["src"], arrays["weights"]
    ta, tb = torch.from_numpy(a), torch.from_numpy(b)
    return dict(zip(PEERS["matmul"], (lambda: a @ b, lambda: torch.mm(ta, tb))))


def _reference(op, params, arrays):
    if op == "conv2d":   # blockpad check's float64 convolution, not the graph's fallback
        from blockpad.check.reference import conv
        from blockpad.layout import pad_sides

        x = np.pad(arrays["src"].astype(np.float64), ((0, 0), (0, 0), *pad_sides(params["pad"])))
        return conv(x, arrays["weights"].astype(np.float64),
                    {"stride": params["stride"], "pad": (0, 0),
                     "dilation": params.get("dilation", (1, 1)),
                     "groups": params.get("groups", 1)})
    if op == "inverted_residual":   # blockpad check's: three float64 convolutions
        from blockpad.check.reference import inverted_residual

        return inverted_residual(params, arrays)[0]
    return arrays["src"].astype(np.float64) @ arrays["weights"].astype(np.float64)


def worker(what, dirs, repeat, quick, group="all"):
    """Time ``group``'s contenders (``all``, ``blockpad`` or one peer's name) on each kernel and
    print the rows as JSON. Every process draws the same inputs."""
    import blockpad as bp

    from .peak import Peak

    threads = int(os.environ["TVM_NUM_THREADS"])
    if group != "blockpad":   # blockpad's process never starts PyTorch's thread pool
        import torch

        torch.set_num_threads(threads)
    libs = {t: bp.load(d) for t, d in dirs.items()}
    op = "conv2d" if what == "conv" else "matmul"
    host = libs["host"]
    ops = (op, "inverted_residual") if op == "conv2d" else (op,)
    names = [n for n in host if host[n].signature.op in ops]   # conv2d: Winograd ones too
    if quick:
        names = names[:2]
    mine = group in ("all", "blockpad")
    peaks = {t: Peak(t, threads) for t in libs} if mine else {}
    rng = np.random.default_rng(0)
    rows = []
    for name in names:
        sig = host[name].signature
        params = sig.params
        arrays = _inputs(host[name], rng)
        kind = sig.op
        ref = _reference(kind, params, arrays)
        contenders, errors = {}, {}
        for t, lib in libs.items() if mine else ():
            call, dst = _bound(lib, lib[name], arrays)
            call()
            err = float(np.abs(dst.to_numpy() - ref).max() / np.abs(ref).max())
            if err > TOLERANCE:
                raise SystemExit(f"{name} ({t}): relative error {err:.1e} vs numpy")
            contenders[f"blockpad {t}"] = call
            errors[f"blockpad {t}"] = err
        if group != "blockpad":
            peers = _block_peers(params, arrays) if kind == "inverted_residual" else \
                _conv_peers(params, arrays) if op == "conv2d" else _matmul_peers(arrays)
            contenders.update((k, f) for k, f in peers.items() if group in ("all", k))
        for t, p in peaks.items():
            contenders[f"peak {t}"] = p
        moved = _bytes_moved(arrays, ref) if params.get("groups", 1) > 1 else 0
        if moved and mine:   # bound by memory traffic: a plain copy of as many bytes
            contenders["copy"] = _copy(moved, threads)
        rounds = interleaved_rounds(contenders, repeat) if contenders else {}   # no mkldnn IR
        copy = rounds.pop("copy", None)
        flops = _flops(kind, arrays, ref)

        def rate(k, secs):
            return (peaks[k[5:]].flops if k.startswith("peak") else flops) / secs / 1e9  # noqa: B023 (used in this iteration)
        gflops = {k: rate(k, statistics.median(t)) for k, t in rounds.items()}
        row = {"shape": _label(kind, arrays, params), "kernel": name, "gflops": gflops}
        if moved:
            row["bandwidth"] = {"gbs": {k: moved / statistics.median(t) / 1e9
                                        for k, t in rounds.items() if not k.startswith("peak")}}
        if mine:   # the fractions of peak and the copy: blockpad's process
            best = {k: rate(k, min(t)) for k, t in rounds.items()}
            peak = {t: gflops[f"peak {t}"] for t in peaks}
            row.update({"error": errors, "peak": peak,
                        "peak_fraction": {f"blockpad {t}": gflops[f"blockpad {t}"] / peak[t]
                                          for t in peaks},
                        "best_peak_fraction": {f"blockpad {t}": best[f"blockpad {t}"]
                                               / best[f"peak {t}"] for t in peaks}})
            if copy is not None:
                row["bandwidth"].update({
                    "bytes": moved, "copy": moved / statistics.median(copy) / 1e9,
                    # the fastest the FMA units allow: the flops at the measured peak
                    "fma_bound": {t: moved / (flops / (peak[t] * 1e9)) / 1e9 for t in peaks}})
        rows.append(row)
        print(f"{name}: done", file=sys.stderr, flush=True)
    print(json.dumps(rows))


def _flops(op, arrays, ref) -> float:
    """Multiply-adds x 2 of the direct computation: weights (K, C, kh, kw) or (G, K/G, C/G, kh,
    kw) per output element; an inverted residual's three convolutions."""
    if op == "inverted_residual":
        n, c, h, w = arrays["src"].shape
        e = arrays["expand_weights"].shape[0]
        taps = float(np.prod(arrays["depthwise_weights"].shape[-2:]))
        pixels = float(np.prod(ref.shape[2:]))
        return 2.0 * n * (e * c * h * w + e * pixels * taps + ref.shape[1] * e * pixels)
    if op == "conv2d":
        return 2 * float(np.prod(ref.shape)) * float(np.prod(arrays["weights"].shape[-3:]))
    return 2 * float(np.prod(ref.shape)) * arrays["src"].shape[1]


def _bytes_moved(arrays, ref) -> int:
    """Bytes a kernel must move at least: its sources read once, its destination written once
    (fp32)."""
    return 4 * (sum(a.size for a in arrays.values()) + ref.size)


def _copy(nbytes, threads):
    """A plain copy moving ``nbytes`` (half read, half written), on ``threads`` threads."""
    from concurrent.futures import ThreadPoolExecutor

    from .common import threaded_copy

    src = np.ones(nbytes // 8, np.float32)
    dst = np.empty_like(src)
    if threads == 1:
        return lambda: np.copyto(dst, src)
    return threaded_copy(dst, src, ThreadPoolExecutor(threads - 1), threads)


def _label(op, arrays, params):
    if op == "inverted_residual":
        _, c, h, w = arrays["src"].shape
        s = params["stride"][0]
        return f"IR C{c} E{arrays['expand_weights'].shape[0]} K{arrays['weights'].shape[0]} " \
            f"{h}x{w}" + (f" s{s}" if s > 1 else "")
    if op == "matmul":
        (m, k), n = arrays["src"].shape, arrays["weights"].shape[1]
        return f"{m}x{k}x{n}"
    _, c, h, w = arrays["src"].shape
    kh, kw = arrays["weights"].shape[-2:]
    k = arrays["weights"].shape[0] * (arrays["weights"].shape[1] if params.get("groups", 1) > 1
                                      else 1)
    s = params["stride"][0]
    m = params.get("winograd", {}).get("tile")
    kind = "dw " if params.get("groups", 1) == c == k else ""
    return f"{kind}C{c} K{k} {h}x{w} {kh}x{kw}" + (f" s{s}" if s > 1 else "") + \
        (f" F({m}x{m})" if m else "")


if __name__ == "__main__":
    worker(sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), bool(int(sys.argv[4])),
           sys.argv[5])
