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
from blockpad.model_build import build_model
from blockpad.runtime.model import MODEL, WEIGHTS

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
    m for m in ("tvm", "onnx", "blockpad.codegen", "blockpad.model_build")
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


def test_prepacked_constant_is_never_read_in_another_layout():
    w = np.ones((4, 4, 1, 1), "float32")
    lay = bp.Layout("OIhw8i8o", w.shape)
    g = bp.Graph(layouts="plain")                   # plain convolutions read oihw weights
    x = g.input("x", (1, 4, 3, 3))
    g.output(g.conv2d(x, g.prepacked("w", w.shape, "float32", [bp.Memory.from_numpy(w, lay)])))
    with pytest.raises(bp.ArgumentError, match="prepacked constant"):
        g.run(x=np.zeros((1, 4, 3, 3), "float32"))
