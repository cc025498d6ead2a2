"""Whole models ahead of time (``blockpad.model_build`` -> ``bp.load``), and the reference
networks of ``blockpad.models`` checked against PyTorch and ONNX Runtime.

A built model folder must run in a fresh process with TVM's runtime alone: no compiler, no
``onnx`` package, no JIT (checked in a subprocess). The networks' full-size checks need PyTorch
(``pip install torch==2.13.0``) and are ``slow``; CI runs a small network built with
``onnx.helper`` end to end instead."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import blockpad as bp
from blockpad.codegen.targets import get_target
from blockpad.model_build import build_model, plan_kernels
from blockpad.runtime.library import describe
from blockpad.runtime.model import MODEL, WEIGHTS

from .conftest import needs_cross_compiler, run_in_threads
from .reference import conv_reference, softmax

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPE = (2, 13, 10, 10)
TORCH = "pip install torch==2.13.0"


def _weights(seed=0):
    rng = np.random.default_rng(seed)
    f = lambda *s: (rng.standard_normal(s) / np.sqrt(np.prod(s[1:]))).astype("float32")
    return {"w1": f(21, 13, 3, 3), "b1": f(21), "w2": f(21, 21, 1, 1), "w3": f(7, 21, 1, 1),
            "b3": f(7)}


def small_graph(p, policy="dst_fused"):
    """conv 3x3 stride 2 (13 -> 21) + bias -> relu -> conv 1x1 -> add -> sigmoid -> conv 1x1
    (21 -> 7) + bias -> softmax over channels: odd channel counts, every activation blocked
    with channel padding, a constant read plain (the biases), one reused twice."""
    g = bp.Graph(policy=policy, name="small")
    x = g.input("x", SHAPE)
    c = {k: g.constant(k, v) for k, v in p.items()}
    h = g.relu(g.conv2d(x, c["w1"], c["b1"], stride=2, pad=1, name="c1"), name="r1")
    s = g.sigmoid(g.add(g.conv2d(h, c["w2"], name="c2"), h, name="a"), name="s")
    g.output(g.softmax(g.conv2d(s, c["w3"], c["b3"], name="c3"), name="probs"))
    return g


def reference(x, p):
    conv = lambda x, w, stride=(1, 1), pad=(0, 0): conv_reference(
        x.astype(np.float64), w.astype(np.float64),
        {"stride": stride, "pad": pad, "dilation": (1, 1), "groups": 1})
    h = np.maximum(conv(x, p["w1"], (2, 2), (1, 1)) + p["b1"].reshape(1, -1, 1, 1), 0)
    s = 1 / (1 + np.exp(-(conv(h, p["w2"]) + h)))
    return softmax({"axis": 1}, conv(s, p["w3"]) + p["b3"].reshape(1, -1, 1, 1))


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    p = _weights()
    out = tmp_path_factory.mktemp("model") / "small"
    logs = []
    build_model(small_graph(p), "host", out, log=logs.append)
    return out, p, logs


def test_built_model_matches_numpy_in_process(built):
    out, p, logs = built
    assert any("steps and calls" in m for m in logs)          # progress is shown
    assert {MODEL, WEIGHTS, "kernels.so", "manifest.json"} <= set(os.listdir(out))
    model = bp.load(out)
    assert isinstance(model, bp.Model) and model.target == "host"
    x = np.random.default_rng(1).standard_normal(SHAPE).astype("float32")
    want = reference(x, p)
    np.testing.assert_allclose(model(x), want, atol=1e-5)
    res = model.run(x=x)
    assert not res.report.fallbacks and res.report.weight_reorders == 0   # packed at build
    np.testing.assert_allclose(res["probs"].numpy(), want, atol=1e-5)
    # the weights convolutions read blocked are held packed only: no plain copy
    doc = json.loads((out / MODEL).read_text())
    tags = {c["name"]: [e["layout"]["tag"] for e in c["layouts"]] for c in doc["constants"]}
    assert tags["w1"] == ["OIhw16i16o"] and tags["b1"] == ["a"]


FRESH = """
import json, sys, time
t0 = time.perf_counter()
import numpy as np
import blockpad as bp
model = bp.load(sys.argv[1])
x = np.load(sys.argv[2])

class DLPackOnly:                       # a producer known to blockpad only through DLPack
    def __init__(self, a): self.a = a
    def __dlpack__(self, **kw): return self.a.__dlpack__(**kw)
    def __dlpack_device__(self): return self.a.__dlpack_device__()

y = model(DLPackOnly(x))
t1 = time.perf_counter()
np.save(sys.argv[3], y)
print(json.dumps({"first_s": t1 - t0, "modules": sorted(
    m for m in ("tvm", "onnx", "blockpad.onnx", "blockpad.codegen", "blockpad.model_build")
    if m in sys.modules)}))
"""


def _fresh(*args, env=None):
    proc = subprocess.run([sys.executable, "-c", FRESH, *map(str, args)], check=False,
                          capture_output=True,
                          text=True, timeout=300, cwd=ROOT,
                          env={**os.environ, "BLOCKPAD_JIT": "0", **(env or {})})
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_fresh_process_runs_the_model_without_compiler_or_onnx(built, tmp_path):
    out, p, _ = built
    x = np.random.default_rng(2).standard_normal(SHAPE).astype("float32")
    np.save(tmp_path / "x.npy", x)
    r = _fresh(out, tmp_path / "x.npy", tmp_path / "y.npy",
               env={"BLOCKPAD_CACHE_DIR": str(tmp_path / "empty-cache")})
    assert r["modules"] == []
    np.testing.assert_allclose(np.load(tmp_path / "y.npy"), reference(x, p), atol=1e-5)
    print(f"\nfresh process: import, load and first inference {1e3 * r['first_s']:.0f} ms")


def test_rebuilding_unchanged_does_nothing_and_a_change_rebuilds(built, tmp_path):
    out, p, _ = built
    stamp = {f: os.stat(out / f).st_mtime_ns for f in (MODEL, WEIGHTS, "kernels.so")}
    logs = []
    build_model(small_graph(p), "host", out, log=logs.append)
    assert any("up to date" in m and "nothing to do" in m for m in logs)
    assert stamp == {f: os.stat(out / f).st_mtime_ns for f in stamp}
    # new weights, same kernels: the weights are packed again, nothing is compiled
    q = {**p, "w2": -p["w2"]}
    copy = tmp_path / "copy"
    build_model(small_graph(p), "host", copy, log=lambda m: None)
    logs = []
    build_model(small_graph(q), "host", copy, log=logs.append)
    assert not any(m.startswith("compiling") for m in logs)
    x = np.random.default_rng(3).standard_normal(SHAPE).astype("float32")
    np.testing.assert_allclose(bp.load(copy)(x), reference(x, q), atol=1e-5)


def test_model_refuses_bad_inputs_and_damaged_folders(built, tmp_path):
    import shutil

    out, _, _ = built
    model = bp.load(out)
    with pytest.raises(bp.ArgumentError, match=r"input 'x' is \[2, 13, 10, 10\]"):
        model(np.zeros((1, 13, 10, 10), "float32"))
    with pytest.raises(bp.ArgumentError, match="takes 1 input"):
        model(np.zeros(SHAPE, "float32"), np.zeros(SHAPE, "float32"))
    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    raw = bytearray((bad / WEIGHTS).read_bytes())
    raw[100] ^= 1
    (bad / WEIGHTS).write_bytes(bytes(raw))
    with pytest.raises(bp.LoadError, match="does not match"):
        bp.load(bad)
    shutil.copy(out / WEIGHTS, bad / WEIGHTS)
    doc = json.loads((bad / MODEL).read_text())
    doc["plan"][0] += " (another runtime)"
    (bad / MODEL).write_text(json.dumps(doc))
    with pytest.raises(bp.LoadError, match="plans the model differently"):
        bp.load(bad)
    # the weights are read on a thread while the graph is planned: with both damaged, the
    # load's own error is the one reported; with the plan intact, the short file's
    (bad / WEIGHTS).write_bytes(bytes(raw[:-8]))
    with pytest.raises(bp.LoadError, match="plans the model differently"):
        bp.load(bad)
    shutil.copy(out / MODEL, bad / MODEL)
    with pytest.raises(bp.LoadError, match=rf"expected {len(raw)} bytes of weights"):
        bp.load(bad)


def test_a_built_model_makes_its_kernel_calls_in_one_function(built, tmp_path):
    """The build compiles the plan's kernel calls into ``plan.so``; from the second run on a
    run makes them in one call (``report.native``; the first binds and checks them from
    Python), with the first run's numbers to the bit (the same kernels on the same buffers)
    and numpy's; a new input array is read. A model whose recorded calls differ from what
    this runtime would make (the digest) runs them from Python, with the same numbers; a
    damaged ``plan.so`` is refused. The function takes the weights as one buffer (the loaded
    ``weights.bin``), not one per constant: here the arena's slots, the weights, the input and
    the result."""
    import shutil

    out, p, logs = built
    doc = json.loads((out / MODEL).read_text())
    assert doc["native"]["functions"] == {"": "blockpad_plan"} and (out / "plan.so").is_file()
    slots = len(bp.load(out).graph.plan(x=np.zeros(SHAPE, np.float32)).slots)
    assert f"over {slots + 3} buffers" in next(m for m in logs if "plan function" in m)
    model = bp.load(out)
    rng = np.random.default_rng(4)
    x = rng.standard_normal(SHAPE).astype("float32")
    first, second = model.run(x=x), model.run(x=x)
    assert not first.report.native and second.report.native
    assert model.graph.run_arrays({"x": x}) is None   # a blocked result: run's path reorders it
    np.testing.assert_array_equal(model(x), first["probs"].numpy())
    assert "by the plan function" in str(second.report)
    np.testing.assert_array_equal(second["probs"].numpy(), first["probs"].numpy())
    np.testing.assert_allclose(second["probs"].numpy(), reference(x, p), atol=1e-5)
    x2 = rng.standard_normal(SHAPE).astype("float32")
    third = model.run(x=x2)
    assert third.report.native
    np.testing.assert_allclose(third["probs"].numpy(), reference(x2, p), atol=1e-5)
    # a constant given new values lies outside the weights buffer: the calls, described
    # again, are not the build's, and run from Python
    p2 = {**p, "b3": 3 * p["b3"][::-1].copy()}
    model.graph.set_constant("b3", p2["b3"])
    runs = [model.run(x=x2) for _ in range(2)]
    assert not any(r.report.native for r in runs)
    np.testing.assert_allclose(runs[1]["probs"].numpy(), reference(x2, p2), atol=1e-5)
    other = tmp_path / "other"
    shutil.copytree(out, other)
    doc["native"]["digest"] = "0" * 64
    (other / MODEL).write_text(json.dumps(doc))
    again = bp.load(other)
    runs = [again.run(x=x) for _ in range(2)]
    assert not runs[1].report.native
    np.testing.assert_array_equal(runs[1]["probs"].numpy(), first["probs"].numpy())
    damaged = tmp_path / "damaged"   # a copy never loaded: rewriting a loaded library's
    shutil.copytree(out, damaged)    # file would change the code mapped from it
    raw = bytearray((damaged / "plan.so").read_bytes())
    raw[len(raw) // 2] ^= 1
    (damaged / "plan.so").write_bytes(bytes(raw))
    with pytest.raises(bp.LoadError, match="plan.so: content hash .* does not match"):
        bp.load(damaged)


def test_a_large_result_gets_a_new_buffer_each_native_run(tmp_path):
    """A result over ``OUTPUT_COPY_BYTES`` is written into a new buffer each run (the caller
    keeps it): the plan function is given that buffer, so each run's result is its own input's
    and an earlier one is not overwritten; a policy whose run zero-pads between calls
    (``on_handle``) gets no plan function, and says so."""
    rng = np.random.default_rng(6)
    w = (rng.standard_normal((20, 8, 3, 3)) * 0.2).astype("float32")
    shape = (1, 8, 130, 130)   # the result, 20 channels blocked to 32: 2.1 MiB
    g = bp.Graph(name="big")
    g.output(g.relu(g.conv2d(g.input("x", shape), g.constant("w", w), pad=1)))
    out = tmp_path / "big"
    build_model(g, "host", out, log=lambda m: None)
    model = bp.load(out)
    xs = [rng.standard_normal(shape).astype("float32") for _ in range(3)]
    runs = [model.run(x=x) for x in xs]
    assert [r.report.native for r in runs] == [False, True, True]
    for x, r in zip(xs, runs):
        want = np.maximum(conv_reference(x.astype(np.float64), w.astype(np.float64), {
            "stride": (1, 1), "pad": (1, 1), "dilation": (1, 1), "groups": 1}), 0)
        np.testing.assert_allclose(r[model.outputs[0]].numpy(), want, rtol=1e-4, atol=1e-4)
    logs = []
    g2 = bp.Graph(name="big", policy="on_handle")
    g2.output(g2.relu(g2.conv2d(g2.input("x", shape), g2.constant("w", w), pad=1)))
    build_model(g2, "host", tmp_path / "on_handle", log=logs.append)
    assert any(m.startswith("no plan function: policy 'on_handle'") for m in logs)
    assert json.loads((tmp_path / "on_handle" / MODEL).read_text())["native"] is None
    assert not (tmp_path / "on_handle" / "plan.so").exists()


POOL_RUN = """
import json, sys
import numpy as np
import blockpad as bp
model = bp.load(sys.argv[1])
x = np.load(sys.argv[2])
model(x)
res = model.run(x=x)
np.save(sys.argv[3], res[model.outputs[0]].numpy())
print(json.dumps({"native": res.report.native}))
"""


def test_the_plan_function_calls_the_kernels_a_pool_size_calls(tmp_path):
    """A MobileNetV2 block at 14x14 (32 -> 384, 294 KiB expanded: fused,
    ``FUSE_EXPANDED_BYTES``) runs as one kernel in two bands, with a one-band variant
    for a pool of one thread (``ScheduleRule.for_threads``): the build writes a plan function
    for each, and a process calls the one of its pool, natively from the second run; both
    against the float64 block, and equal to the bit (the variants only split the work)."""
    rng = np.random.default_rng(5)
    c, e = 32, 384
    w = {n: (rng.standard_normal(s) * 0.3).astype("float32") for n, s in (
        ("w1", (e, c, 1, 1)), ("b1", (e,)), ("wd", (e, 1, 3, 3)), ("bd", (e,)),
        ("w2", (c, e, 1, 1)), ("b2", (c,)))}
    g = bp.Graph(name="block")
    x = g.input("x", (1, c, 14, 14))
    k = {n: g.constant(n, v) for n, v in w.items()}
    t = g.eltwise(g.conv2d(x, k["w1"], k["b1"]), "clip", 0.0, 6.0)
    d = g.eltwise(g.conv2d(t, k["wd"], k["bd"], pad=1, groups=e), "clip", 0.0, 6.0)
    g.output(g.add(g.conv2d(d, k["w2"], k["b2"]), x))
    out = tmp_path / "block"
    build_model(g, "host", out, log=lambda m: None)
    doc = json.loads((out / MODEL).read_text())
    assert doc["native"]["functions"] == {"": "blockpad_plan", "1": "blockpad_plan__threads1"}
    xv = rng.standard_normal((1, c, 14, 14)).astype("float32")
    np.save(tmp_path / "x.npy", xv)
    conv = lambda a, wt, groups=1, pad=(0, 0): conv_reference(   # noqa: E731
        a.astype(np.float64), wt.astype(np.float64),
        {"stride": (1, 1), "pad": pad, "dilation": (1, 1), "groups": groups})
    hid = np.clip(conv(xv, w["w1"]) + w["b1"].reshape(1, -1, 1, 1), 0, 6)
    hid = np.clip(conv(hid, w["wd"], e, (1, 1)) + w["bd"].reshape(1, -1, 1, 1), 0, 6)
    want = conv(hid, w["w2"]) + w["b2"].reshape(1, -1, 1, 1) + xv
    got = {}
    for threads in (1, 2):
        proc = subprocess.run([sys.executable, "-c", POOL_RUN, str(out), str(tmp_path / "x.npy"),
                               str(tmp_path / f"y{threads}.npy")], capture_output=True,
                              text=True, timeout=300,
                              env={**os.environ, "TVM_NUM_THREADS": str(threads)})
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"native": True}
        got[threads] = np.load(tmp_path / f"y{threads}.npy")
        np.testing.assert_allclose(got[threads], want, rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(got[1], got[2])


@needs_cross_compiler("neon")
def test_a_built_model_keeps_the_algorithm_auto_picked(tmp_path, monkeypatch):
    """``algorithm="auto"`` is resolved when the model is built: its document names the
    pick (Winograd and its tile here), so a runtime whose cost model would now pick
    otherwise still loads the model and runs the kernels and packed weights it was built with
    (it refused to before: the planner read the weights in a layout the build had not
    packed)."""
    from blockpad import winograd

    rng = np.random.default_rng(4)
    c, hw = 48, 16
    tile = winograd.choose(1, c, c, hw, hw)
    assert tile is not None                                  # what the test relies on
    w = (rng.standard_normal((c, c, 3, 3)) * 0.1).astype("float32")
    g = bp.Graph(name="auto")
    g.output(g.conv2d(g.input("x", (1, c, hw, hw)), g.constant("w", w), pad=1, name="conv",
                      algorithm="auto"))
    out = tmp_path / "auto"
    build_model(g, "host", out, log=lambda m: None)
    attrs = json.loads((out / MODEL).read_text())["graph"]["nodes"][0]["attrs"]
    assert (attrs["algorithm"], attrs["winograd_tile"]) == ("winograd", tile)
    monkeypatch.setattr(winograd, "choose", lambda *a: None)  # a later cost model: direct
    x = rng.standard_normal((1, c, hw, hw)).astype("float32")
    want = conv_reference(x.astype(np.float64), w.astype(np.float64),
                          {"stride": (1, 1), "pad": (1, 1), "dilation": (1, 1), "groups": 1})
    np.testing.assert_allclose(bp.load(out)(x), want, rtol=1e-4, atol=1e-4)


def test_a_model_builds_for_a_machine_it_cannot_run_on(tmp_path):
    """Ahead of time means for another machine: the build checks its plan over the library's
    manifest, never loading code this CPU cannot run (an Arm library here); loading it here
    then fails, naming the architecture."""
    out = tmp_path / "arm"
    build_model(small_graph(_weights()), "neon", out, log=lambda m: None)
    doc = json.loads((out / MODEL).read_text())
    assert doc["target"] == "neon" and [line.split()[0] for line in doc["plan"]][1:] == \
        ["c1", "c2", "c3", "probs"]
    with pytest.raises(bp.LoadError, match="library is for aarch64"):
        bp.load(out)
    assert describe(out).target == "neon"   # the manifest the plan was checked over


def test_the_narrow_block_rule():
    """``channel_blocks.narrow_block``: 8 where 16 pads at least 1.2 times the channels 8
    pads, on Zen 4 only; whole blocks of 16 never narrow."""
    from blockpad.channel_blocks import narrow_block

    assert [c for c in range(1, 257) if narrow_block(c, "zen4")] == \
        [1, 2, 3, 4, 5, 6, 7, 8, 17, 18, 19, 20, 21, 22, 23, 24, 33, 34, 35, 36, 37, 38, 39, 40]
    assert not any(narrow_block(c, t) for c in range(1, 257) for t in ("host", "avx512", "amx"))


@pytest.mark.parametrize("target,narrow", [("zen4", True), ("avx512", False)])
def test_a_plan_keeps_few_channels_in_8_channel_blocks_where_ymm_is_as_fast(target, narrow):
    """``blockpad.channel_blocks``: on Zen 4 (AVX-512 FMAs run as two 256-bit halves) 24
    channels go in ``nChw8c`` (three ymm blocks, not two zmm blocks padded to 32), out of the
    fused block and of a plain convolution alike, and the next direct kernels (a depthwise
    one too) read them there, with no reorder (a Winograd kernel after a reorder); a Cascade
    Lake (two 512-bit FMA ports) keeps ``nChw16c``. Planned with the model build's probing
    cache: nothing is compiled."""
    rng = np.random.default_rng(0)
    w = lambda *shape: rng.standard_normal(shape).astype("float32")  # noqa: E731
    relu6 = {"kind": "eltwise", "algorithm": "clip", "alpha": 0.0, "beta": 6.0}
    g = bp.Graph(name="narrow")
    x = g.input("x", (1, 16, 40, 40))   # an expansion of 300 KB: fused (FUSE_EXPANDED_BYTES)
    e = g.conv2d(x, g.constant("we", w(48, 16, 1, 1)), g.constant("be", w(48)),
                 post_ops=["bias", relu6], name="expand")
    d = g.conv2d(e, g.constant("wd", w(48, 1, 3, 3)), g.constant("bd", w(48)), pad=1,
                 groups=48, post_ops=["bias", relu6], name="dw")
    p = g.conv2d(d, g.constant("wp", w(24, 48, 1, 1)), g.constant("bp", w(24)), name="project")
    q = g.conv2d(g.conv2d(p, g.constant("wq", w(24, 24, 1, 1)), name="conv24"),
                 g.constant("wd2", w(24, 1, 3, 3)), pad=1, groups=24, name="dw24")
    g.output(g.conv2d(q, g.constant("wr", w(32, 24, 3, 3)), pad=1, algorithm="winograd",
                      name="conv32"))
    lines, _ = plan_kernels(g, lambda m: None, get_target(target))
    plan = "\n".join(lines)
    b = "nChw8c" if narrow else "nChw16c"
    assert [line.split()[:3] for line in lines if line.startswith("reorder")][0] == \
        ["reorder", "x", "nchw->nChw16c"], plan
    fused = next(line for line in lines if line.startswith("project"))
    assert fused.endswith(f"-> {b} (kernel)") and "Goihw16g" in fused, plan
    assert next(line for line in lines if line.startswith("conv24")).split()[1] == f"{b},", plan
    assert f"{b}, Goihw{b[4:-1]}g -> {b}" in next(line for line in lines
                                                  if line.startswith("dw24")), plan
    # Winograd reads whole blocks of 16: 24 channels of nChw8c come to it reordered
    assert [line.split()[:3] for line in lines if line.startswith("reorder")][1:] == \
        ([["reorder", "dw24", "nChw8c->nChw16c"]] if narrow else []), plan
    assert "nChw16c, hwOi16o" in next(line for line in lines if line.startswith("conv32")), plan


def test_a_model_for_a_gpu_is_refused_before_anything_is_built(tmp_path):
    """A model's steps run on the CPU: GPU kernels in its library could never be called."""
    with pytest.raises(bp.ArgumentError, match="runs its steps on the CPU"):
        build_model(small_graph(_weights()), "cuda-sm80", tmp_path / "gpu", log=lambda m: None)
    assert not (tmp_path / "gpu").exists()


def test_prepacked_constant_is_never_read_in_another_layout():
    w = np.ones((4, 4, 1, 1), "float32")
    lay = bp.Layout("OIhw8i8o", w.shape)
    g = bp.Graph(layouts="plain")                   # plain convolutions read oihw weights
    x = g.input("x", (1, 4, 3, 3))
    g.output(g.conv2d(x, g.prepacked("w", w.shape, "float32", [bp.Memory.from_numpy(w, lay)])))
    with pytest.raises(bp.ArgumentError, match="prepacked constant"):
        g.run(x=np.zeros((1, 4, 3, 3), "float32"))


# ---- the reference networks -----------------------------------------------------------------

# torchvision's own parameter counts (its weights' "num_params"): the architectures match
PARAMS = {"resnet18": 11689512, "resnet50": 25557032, "mobilenet_v2": 3504872,
          "efficientnet_b0": 5288548, "densenet121": 7978856}


def test_models_import_without_torch():
    code = ("import sys; sys.modules['torch'] = None\n"
            "import blockpad.models as m\n"
            "try:\n    m.network('resnet18')\nexcept m.BlockpadError as e:\n    print(e)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=False, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert TORCH in proc.stdout


def test_networks_have_torchvisions_shapes_and_the_pruned_one_is_pruned():
    torch = pytest.importorskip("torch", reason=TORCH)
    from blockpad import models

    for name, count in PARAMS.items():
        net = models.network(name)
        assert sum(p.numel() for p in net.parameters()) == count, name
    full = [m.out_channels for m in models.network("resnet50").modules()
            if isinstance(m, torch.nn.Conv2d)]
    cut = [m.out_channels for m in models.network("resnet50_pruned").modules()
           if isinstance(m, torch.nn.Conv2d)]
    assert len(full) == len(cut) == 53
    assert all(0.6 * f - 1 <= c <= 0.9 * f + 1 for f, c in zip(full, cut))
    widths = set(cut)                                  # almost none a whole number of blocks
    assert sum(c % 16 == 0 for c in widths) <= len(widths) // 8
    again = [m.out_channels for m in models.network("resnet50_pruned").modules()
             if isinstance(m, torch.nn.Conv2d)]
    assert again == cut                                             # seeded


def _relative_error(got, want):
    return float(np.abs(got - want).max() / np.abs(want).max())


HW = 64


@pytest.fixture(scope="module")
def small_resnet(tmp_path_factory):
    """ResNet-18 at 64x64, batch 2, written with onnx.helper (no torch), built with the CLI:
    at this size the cost model runs layer1's 3x3 convolutions (16x16) as Winograd F(4x4) and
    layer2's (8x8) as F(2x2), so the build packs Winograd-domain weights."""
    pytest.importorskip("onnx", reason="pip install onnx")
    import onnx

    from blockpad import cli
    from blockpad.models import onnx_resnet

    if not hasattr(bp.Graph, "from_onnx"):
        pytest.skip("this blockpad has no ONNX importer (Graph.from_onnx)")
    work = tmp_path_factory.mktemp("resnet18")
    path = work / "resnet18.onnx"
    onnx.save(onnx_resnet.resnet18(batch=2, hw=HW), path)
    assert cli.main(["build", str(path), "--target", "native", "--out", str(work / "bp")]) == 0
    return path, work / "bp"


def test_small_resnet18_from_onnx_matches_onnxruntime(small_resnet, tmp_path, capsys):
    ort = pytest.importorskip("onnxruntime", reason="pip install onnxruntime")
    path, out = small_resnet
    x = np.random.default_rng(4).standard_normal((2, 3, HW, HW)).astype("float32")
    want = ort.InferenceSession(str(path)).run(None, {"input": x})[0]
    model = bp.load(out)
    doc = json.loads((out / MODEL).read_text())
    wino = {e["layout"]["tag"] for c in doc["constants"] for e in c["layouts"]} & {"hwOi16o"}
    assert wino, "no convolution of the model runs as Winograd"
    err = _relative_error(model(x), want)
    with capsys.disabled():
        print(f"\nResNet-18 {HW}x{HW} batch 2 (Winograd where it pays) vs ONNX Runtime: "
              f"max |err| / max |logit| = {err:.1e}")
    assert err <= 1e-4
    assert not model.run(x).report.fallbacks
    # from the second run: the plan function, and the call's own path (run_arrays: plain
    # logits copied out of the arena, no Results); each call's array is the caller's
    y = model(x)
    assert model.run(x).report.native and model.graph.run_arrays({"input": x}) is not None
    x2 = np.random.default_rng(5).standard_normal(x.shape).astype("float32")
    y2 = model(x2)
    assert _relative_error(y, want) <= 1e-4
    assert _relative_error(y2, ort.InferenceSession(str(path)).run(None, {"input": x2})[0]) <= 1e-4
    np.testing.assert_array_equal(model(np.asfortranarray(x)), y)   # not row-major: run's path
    # a fresh process: neither the compiler nor the onnx package
    np.save(tmp_path / "x.npy", x)
    r = _fresh(out, tmp_path / "x.npy", tmp_path / "y.npy",
               env={"BLOCKPAD_CACHE_DIR": str(tmp_path / "empty-cache")})
    assert r["modules"] == []
    assert _relative_error(np.load(tmp_path / "y.npy"), want) <= 1e-4
    capsys.readouterr()
    from blockpad import cli

    assert cli.main(["build", str(path), "--target", "native", "--out", str(out)]) == 0
    assert "nothing to do" in capsys.readouterr().err


def test_threads_call_a_built_model_at_once(small_resnet):
    """Four threads calling one model: each run takes an arena of its own (a thread that finds
    none idle binds a new one from Python, which makes its calls natively from then on), and
    each result is its input's, equal to the bit to the same input's serial result."""
    model = bp.load(small_resnet[1])
    xs = [np.random.default_rng(10 + i).standard_normal((2, 3, HW, HW)).astype("float32")
          for i in range(4)]
    serial = [model(x) for x in xs]

    def work(i):
        for _ in range(4):
            np.testing.assert_array_equal(model(xs[i]), serial[i])

    run_in_threads(work, range(4))
    assert len(model.graph.runner(input=xs[0])._pool) >= 1


# Every network at batch 1 and 2 compiles some 600 distinct kernels (DenseNet-121 alone 220 s a
# batch size on a 2-core machine): the suite runs three networks at batch 1 (batch 2 end to end
# is test_small_resnet18_from_onnx_matches_onnxruntime's), BLOCKPAD_ALL_NETWORKS=1 all twelve.
ALL_NETWORKS = os.environ.get("BLOCKPAD_ALL_NETWORKS") == "1"
FULL_ONLY = pytest.mark.skipif(not ALL_NETWORKS, reason="BLOCKPAD_ALL_NETWORKS=1 runs every "
                               "network at batch 1 and 2 (about 15 minutes on 2 cores)")
NETWORKS = [pytest.param(name, batch, marks=() if (batch == 1 and name in (
    "resnet50", "mobilenet_v2", "efficientnet_b0")) else FULL_ONLY, id=f"{name}-{batch}")
    for name in ("resnet18", "resnet50", "mobilenet_v2", "efficientnet_b0", "densenet121",
                 "resnet50_pruned") for batch in (1, 2)]


@pytest.mark.slow
@pytest.mark.parametrize("name,batch", NETWORKS)
def test_network_matches_pytorch_and_onnxruntime(name, batch, tmp_path):
    """Full size (224x224; ``BLOCKPAD_MODELS_HW`` for a smaller image), fp32: the largest
    error at most 1e-4 of the largest logit against both PyTorch and ONNX Runtime."""
    torch = pytest.importorskip("torch", reason=TORCH)
    ort = pytest.importorskip("onnxruntime", reason="pip install onnxruntime")
    if not hasattr(bp.Graph, "from_onnx"):
        pytest.skip("this blockpad has no ONNX importer (Graph.from_onnx)")
    from blockpad import models

    hw = int(os.environ.get("BLOCKPAD_MODELS_HW", "224"))
    path = tmp_path / f"{name}.onnx"
    net = models.export_onnx(name, path, batch, hw)
    x = models.sample_input(batch, hw)
    with torch.inference_mode():
        want = net(torch.from_numpy(x)).numpy()
    from_ort = ort.InferenceSession(str(path)).run(None, {"input": x})[0]
    build_model(path, "native", tmp_path / "bp", log=lambda m: None)
    got = bp.load(tmp_path / "bp")(torch.from_numpy(x))        # a DLPack tensor in
    assert got.shape == want.shape
    assert _relative_error(got, want) <= 1e-4
    assert _relative_error(got, from_ort) <= 1e-4
