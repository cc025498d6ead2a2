"""The benchmarks' process bookkeeping, and one contender run as a child process the way the
benchmarks at more than one thread run each."""

import json
import os
import subprocess
import sys
import time

import numpy as np

from blockpad.bench import common, resnet
from blockpad.bench.common import best_of_processes, isolation, spread


def test_best_of_processes_keeps_each_contenders_fastest_process():
    ms = {("a", 1): [5.0, 3.0, 4.0], ("b", 1): [2.0, 6.0, 9.0], ("a", 2): [{"error": "x"}, 1.5,
                                                                           2.5],
          ("b", 2): [7.0, {"error": "y"}, 8.0]}
    calls = []

    def spawn(names, t):
        calls.append((names, t))
        got = {}
        for name in names:
            v = ms[(name, t)][sum(1 for _, tt in calls if tt == t) - 1]
            got[name] = v if isinstance(v, dict) else {"ms": v}
        return got

    got = best_of_processes(spawn, ("a", "b"), [1, 2], 3, log=lambda m: None)
    # every contender of a thread count spawned together (their rounds interleave), 3 times
    assert calls == [(("a", "b"), 1), (("a", "b"), 2)] * 3
    assert {k: v["ms"] for k, v in got.items()} == {("a", 1): 3.0, ("b", 1): 2.0,
                                                    ("a", 2): 1.5, ("b", 2): 7.0}
    assert "best of 3 sets" in isolation(3) and "best of" not in isolation(1)
    # every process's median is kept beside the best one's, failed ones left out
    assert got[("a", 2)]["process_ms"] == [1.5, 2.5] and spread(got[("a", 2)]) == "1.50-2.50"
    assert got[("b", 1)]["process_ms"] == [2.0, 6.0, 9.0]
    assert spread({"ms": 1.0, "process_ms": [1.0]}) == ""


FAKE_CHILD = """
import json, sys, time
from blockpad.bench.common import child_rounds, spawned_at
if sys.argv[1] == "broken":
    raise SystemExit("broken: cannot load its model")
started = spawned_at()
times = child_rounds(lambda: time.sleep(0.002), 3)
print(json.dumps({"ms": 1e3 * min(times), "rounds": len(times), "started": started}))
"""


def test_children_stay_alive_and_the_parent_interleaves_their_rounds(tmp_path, monkeypatch):
    """``run_children``: each contender in a process of its own, all alive at once; the
    parent asks each for one round in turn (each round one contender later), a child that
    fails is an error and the others go on; a child's start time is the parent's spawn."""
    asked = []
    reply = common._reply

    def spy(proc, word, ask=None):
        if ask is not None:
            asked.append(proc.args[-1])
        return reply(proc, word, ask)

    monkeypatch.setattr(common, "_reply", spy)
    before = time.time()
    commands = {name: ([sys.executable, "-c", FAKE_CHILD, name], dict(os.environ),
                       str(tmp_path / f"{name}.npy")) for name in ("a", "broken", "b")}
    got = common.run_children(commands, 3, 1)
    assert asked == ["a", "b", "b", "a", "a", "b"]
    assert got["broken"] == {"error": "broken: cannot load its model"}
    for name in ("a", "b"):
        assert got[name]["rounds"] == 3 and got[name]["ms"] >= 2.0
        assert before <= got[name]["started"] <= time.time()
        assert got[name]["y"] == commands[name][2]


def test_resnet_block_child_process_runs_the_graph(tmp_path):
    """``bench resnet`` at more than one thread times each contender in a process of its own:
    the child builds the block (Winograd where ``auto`` picks it), saves its output for the
    parent's check and prints its median; its output is the block's (float64 reference)."""
    out = tmp_path / "y.npy"
    proc = subprocess.run(
        [sys.executable, "-m", "blockpad.bench.resnet", "--child", resnet.BLOCKPAD, "--threads",
         "1", "--repeat", "1", "--hw", "0", "--policy", "dst_fused", "--algorithm", "auto",
         "--quick", "--output", str(out)], capture_output=True, text=True, check=True)
    assert json.loads(proc.stdout.strip().splitlines()[-1])["ms"] > 0
    shape, p, x = resnet._setup(quick=True, hw=0)
    want = resnet.reference(x, p)
    assert np.abs(np.load(out) - want).max() <= 1e-4 * np.abs(want).max()


def test_hot_step_times_time_every_step_of_the_plan():
    """The breakdown's two columns cover the same steps: in the network's order and hot."""
    import blockpad as bp
    from blockpad.bench.common import hot_step_times, step_times

    g = bp.Graph()
    x = g.input("x", (1, 20, 5, 5))
    g.output(g.relu(g.relu(x, name="r1"), name="r2"))
    inputs = {"x": np.random.default_rng(0).standard_normal((1, 20, 5, 5)).astype("float32")}
    hot, order = hot_step_times(g, inputs), step_times(g, inputs)
    assert set(hot) == set(order) and {"r1", "r2"} <= set(hot)
    assert all(v > 0 for v in hot.values())


def test_bench_model_builds_the_tuned_model_beside_the_untuned_one(tmp_path, monkeypatch):
    """``bench model --tuning-logs DIR`` reaches the build, which goes to a folder of its own."""
    from blockpad import models
    from blockpad.bench import model
    from blockpad.cli import main

    builds = []
    monkeypatch.setattr(model, "OUT", str(tmp_path))
    monkeypatch.setattr("blockpad.model_build.build_model",
                        lambda src, target, out, **kw: builds.append((out, kw["tuning_logs"])))
    monkeypatch.setattr(models, "export_onnx", lambda name, path, *a: open(path, "w").close())
    untuned = model.prepare("resnet18", 1, 8, 0, "host", log=lambda m: None)
    tuned = model.prepare("resnet18", 1, 8, 0, "host", log=lambda m: None, tuning_logs="/logs")
    assert builds == [(untuned["dir"], None), (tuned["dir"], "/logs")]
    assert tuned["dir"] == untuned["dir"] + "_tuned"

    seen = {}
    monkeypatch.setattr(model, "main", lambda *a, **kw: seen.update(kw))
    main(["bench", "model", "--model", "resnet18", "--tuning-logs", "/logs"])
    assert seen["tuning_logs"] == "/logs"


def test_bench_rejects_an_unknown_network_before_making_anything(tmp_path, monkeypatch, capsys):
    """``--model`` is checked by the command line (the list is ``models.NETWORKS``): an unknown
    name stops there, naming the choices, before a folder is made or anything exported."""
    import pytest

    from blockpad.bench import model
    from blockpad.cli import main

    monkeypatch.setattr(model, "OUT", str(tmp_path))
    with pytest.raises(SystemExit) as stop:
        main(["bench", "model", "--model", "resnet51"])
    assert stop.value.code == 2 and "resnet50_pruned" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
