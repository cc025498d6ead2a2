"""Autotuning: real MetaSchedule measurements (3 trials on tiny shapes) into a MetaSchedule
JSON database; builds that use the fastest record and are checked against numpy; resuming;
corrupt and stale logs; measuring through an RPC tracker and server on loopback."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
import tvm
from tvm.s_tir import meta_schedule as ms

import blockpad as bp
from blockpad.cli import main
from blockpad.codegen import tune as tn
from blockpad.codegen import tuning_records as tr
from blockpad.codegen.build import build, make_kernels
from blockpad.codegen.spec import parse_spec
from blockpad.codegen.targets import get_target
from blockpad.errors import SpecError
from blockpad.schedules import space

from .conftest import needs_cross_compiler
from .test_conv_matmul import conv_ref, inputs, reference

TRIALS = 3
CONV = {"name": "conv", "op": "conv2d", "shape": [1, 30, 6, 6], "channels": 20,
        "kernel": [3, 3], "pad": [1, 1], "src": "nChw16c", "weights": "OIhw16i16o",
        "dst": "nChw16c", "post_ops": [{"kind": "bias"}, {"kind": "eltwise", "algorithm": "relu"}]}
MATMUL = {"name": "mm", "op": "matmul", "shape": [12, 40], "n": 24, "src": "ab",
          "weights": "Ba16b", "dst": "ab"}
REORDER = {"name": "reorder", "op": "reorder", "shape": [1, 30, 4, 4], "src": "nchw",
           "dst": "nChw16c"}
SPEC = parse_spec({"library": {"name": "tune-test"}, "kernel": [CONV, MATMUL, REORDER]})
HOST = get_target("host")


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    """The spec tuned once for the module: (logs folder, tune results, printed lines)."""
    out = tmp_path_factory.mktemp("tuning_logs")
    lines = []
    results = tn.tune(SPEC, "host", TRIALS, out, log=lines.append)
    return out, results, lines


@pytest.fixture(scope="module")
def tuned_build(tuned, tmp_path_factory):
    out = tmp_path_factory.mktemp("tuned_build")
    lines = []
    result = build(SPEC, "host", out, tuning_logs=tuned[0], log=lines.append)
    return result, lines


def copy_logs(tuned, tmp_path):
    dst = tmp_path / "logs"
    shutil.copytree(tuned[0], dst)
    return dst


def kernel_func(name):
    req = next(r for r in SPEC.kernels if r.name == name)
    return make_kernels(req)[0].func


# ---- tuning -----------------------------------------------------------------------------------

def test_tune_measures_the_rule_variants_into_a_metaschedule_database(tuned):
    out, results, lines = tuned
    by_name = {r["kernel"]: r for r in results}
    for name in ("conv", "mm"):
        assert by_name[name]["measured"] == TRIALS and by_name[name]["failed"] == 0
        assert 0 < by_name[name]["best_us"] < 1e5
    assert by_name["reorder"]["skipped"] == tr.ONE_VARIANT
    assert any(line.startswith("[1/") and f"round {tr.ROUNDS}/{tr.ROUNDS} of {TRIALS} "
               "variants, best so far" in line for line in lines), lines
    assert any(line.startswith("[1/") and f"built {TRIALS}/{TRIALS} variants" in line
               for line in lines), lines
    # TVM's own database class opens the files; every record is this target's and replays
    db = ms.database.JSONDatabase(work_dir=str(out / "host"), allow_missing=False)
    records = db.get_all_tuning_records()
    assert len(records) == 2 * TRIALS * tr.ROUNDS     # every variant once per round
    host = HOST.tvm_target(num_cores=1)
    assert {tr.target_key(r.target) for r in records} == {tr.target_key(host)}
    best = space.workload(space.variants(kernel_func("conv"), HOST)[0])
    sch = db.query_schedule(best, records[0].target, workload_name="main")
    assert sch is not None     # MetaSchedule applies it: the variant, its root block annotated
    assert sch.get(sch.get_sblock("root")).annotations["blockpad.tuned"]


def test_variants_are_timed_in_single_calls_with_all_but_the_source_flushed(tuned):
    """A record holds ``COLD["repeat"]`` single calls (hot timing held one figure: the mean of
    calls repeated for 40 ms), and the runner's flush spares the first argument, which must be
    the source: the one a network hands over warm."""
    db = ms.database.JSONDatabase(work_dir=str(tuned[0] / "host"), allow_missing=False)
    assert {len(r.run_secs) for r in db.get_all_tuning_records()} == {tn.COLD["repeat"]}
    assert tn.COLD["number"] == 1 and tn.COLD["enable_cpu_cache_flush"]
    for req in SPEC.kernels:
        assert make_kernels(req)[0].func.params[0].name == "src", req.name


def test_rerun_skips_what_is_recorded_continues_to_more_trials_and_rebuilds(tuned, tmp_path):
    logs = copy_logs(tuned, tmp_path)
    records = logs / "host" / tr.DB_FILES[1]
    before = records.read_text().count("\n")
    lines = []
    again = tn.tune(SPEC, "host", TRIALS, logs, log=lines.append)
    assert [r["measured"] for r in again] == [0] * len(again)
    assert records.read_text().count("\n") == before
    assert any("already tuned" in line for line in lines)
    out = tmp_path / "lib"
    assert build(SPEC, "host", out, tuning_logs=logs, log=lambda m: None).rebuilt
    assert not build(SPEC, "host", out, tuning_logs=logs, log=lambda m: None).rebuilt
    more = tn.tune(SPEC, "host", TRIALS + 1, logs, log=lines.append)
    assert [r["measured"] for r in more[:2]] == [1, 1]
    assert records.read_text().count("\n") == before + 2 * tr.ROUNDS
    index = json.loads((logs / "host" / tr.INDEX).read_text())["kernels"]
    assert index["conv"]["trials"] == TRIALS + 1
    assert build(SPEC, "host", out, tuning_logs=logs, log=lambda m: None).rebuilt  # new records


def test_interrupted_write_is_cut_off_and_the_run_continues(tuned, tmp_path, capsys):
    """Through the command line: a run killed mid-append left half a line."""
    logs = copy_logs(tuned, tmp_path)
    records = logs / "host" / tr.DB_FILES[1]
    intact = records.read_text()
    records.write_text(intact + '[0,[[[],[]],[1.5e-0')
    assert main(["tune", str(_spec_file(tmp_path)), "--trials", str(TRIALS), "--out",
                 str(logs)]) == 0
    assert records.read_text() == intact
    err = capsys.readouterr().err
    assert "dropped a line cut short by an interrupted run" in err
    assert "[1/7] conv: already tuned" in err


def test_ctrl_c_keeps_every_finished_trial_and_a_rerun_measures_the_rest(tmp_path):
    """A real interrupt: SIGINT once the first round is recorded, while the second runs."""
    logs = tmp_path / "logs"
    cmd = [sys.executable, "-m", "blockpad", "tune", str(_spec_file(tmp_path, [CONV])),
           "--trials", "3", "--out", str(logs)]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    err = []
    for line in proc.stderr:
        err.append(line)
        if f"round 1/{tr.ROUNDS}" in line:
            proc.send_signal(signal.SIGINT)
            break
    _, rest = proc.communicate(timeout=120)
    assert proc.returncode == 130, "".join(err) + rest
    assert "interrupted; every finished trial is recorded" in rest
    assert "Traceback" not in rest, rest
    db = ms.database.JSONDatabase(work_dir=str(logs / "host"), allow_missing=False)
    kept = len(db)
    assert 3 <= kept < 3 * tr.ROUNDS
    again = tn.tune(parse_spec({"kernel": [CONV]}), "host", 4, logs, log=lambda m: None)
    assert again[0]["measured"] == 1
    assert len(ms.database.JSONDatabase(work_dir=str(logs / "host"))) == kept + tr.ROUNDS


def _spec_file(tmp_path, entries=(CONV, MATMUL, REORDER)):
    path = tmp_path / "spec.toml"
    lines = []
    for entry in entries:
        lines.append("[[kernel]]")
        for k, v in entry.items():
            lines.append(f"{k} = {_toml(v)}")
    path.write_text("\n".join(lines) + "\n")
    return path


def _toml(v):
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k} = {_toml(x)}" for k, x in v.items()) + "}"
    if isinstance(v, list):
        return "[" + ", ".join(_toml(x) for x in v) + "]"
    return json.dumps(v)


def test_corrupt_logs_stop_tuning_with_a_clear_error(tuned, tmp_path):
    logs = copy_logs(tuned, tmp_path)
    path = logs / "host" / tr.DB_FILES[1]
    line = path.read_text().count("\n") + 1
    with open(path, "a") as f:
        f.write("this is not json\n")
    with pytest.raises(bp.BuildError, match=f"line {line} is corrupt"):
        tn.tune(SPEC, "host", TRIALS, logs, log=lambda m: None)


@pytest.mark.parametrize("target,kwargs,match", [
    ("host", {"trials": 0}, "positive number of trials"),
    ("cuda-sm80", {}, "only CPU targets"),
    ("neon", {}, "--rpc-tracker"),
])
def test_tune_refuses_what_it_cannot_measure(target, kwargs, match, tmp_path):
    with pytest.raises(SpecError, match=match):
        tn.tune(SPEC, target, kwargs.get("trials", 2), tmp_path, log=lambda m: None)


@pytest.mark.parametrize("tracker,key", [("localhost", "k"), ("h:p", "k"), ("h:9190", None)])
def test_rpc_address_is_checked(tracker, key):
    with pytest.raises(SpecError, match="HOST:PORT"):
        tn.Rpc.parse(tracker, key)


# ---- builds that use the records --------------------------------------------------------------

def test_build_applies_the_fastest_record_and_says_which_kernels_are_tuned(tuned, tuned_build):
    result, lines = tuned_build
    kernels = {k["name"]: k for k in result.manifest["kernels"]}
    logs = tr.Logs(tuned[0], HOST)
    for name in ("conv", "mm"):
        assert kernels[name]["tuned"] is True
        variants = space.variants(kernel_func(name), HOST)
        times = [tr.variant_time(logs.records(space.workload(f))) for f in variants]
        measured = {i: m for i, m in enumerate(times) if m is not None}
        assert len(measured) == TRIALS
        fastest = min(measured, key=measured.get)
        assert kernels[name]["tuning"]["variant"] == fastest
        assert kernels[name]["tuning"]["time_us"] == pytest.approx(measured[fastest] * 1e6,
                                                                   abs=1e-3)
        with open(f"{result.out_dir}/source/{name}.tir.py") as f:
            assert f.read() == variants[fastest].script()
    untuned = [k for k in kernels if k not in ("conv", "mm")]   # the reorder, the zero pads
    assert "reorder" in untuned and len(untuned) > 1
    for name in untuned:
        assert kernels[name]["tuned"] is False
        assert kernels[name]["tuning"]["reason"] == f"not tuned: {tr.ONE_VARIANT}"
    assert any("2 of" in line and "kernels tuned: conv" in line for line in lines), lines
    assert any("reorder: default schedule (not tuned" in line for line in lines)


def test_an_interrupt_drops_only_the_orphaned_pools_join_error(monkeypatch):
    """After Ctrl-C, a MetaSchedule build pool cut short is deleted in its own thread and
    cannot join it (seen tuning a network, interrupted in a Winograd candidate's build): that
    error alone is not printed; any other unraisable error still is."""
    from types import SimpleNamespace

    from tvm.support.popen_pool import PopenPoolExecutor

    seen = []
    monkeypatch.setattr(sys, "unraisablehook", seen.append)
    tn._ignore_orphaned_pools()
    join = SimpleNamespace(exc_value=RuntimeError("cannot join current thread"),
                           object=PopenPoolExecutor.__del__)
    other = SimpleNamespace(exc_value=ValueError("boom"), object=PopenPoolExecutor.__del__)
    elsewhere = SimpleNamespace(exc_value=RuntimeError("cannot join current thread"),
                                object=print)
    for u in (join, other, elsewhere):
        sys.unraisablehook(u)
    assert seen == [other, elsewhere]


def test_a_long_tune_run_says_how_long_the_rest_will_take():
    assert tn.progress_label(1, 258, "k000", 0.0) == "[1/258] k000"
    assert tn.progress_label(2, 7, "mm", 5.0) == "[2/7] mm"   # short runs: as before
    assert tn.progress_label(11, 258, "k010", 60.0) == \
        "[11/258, 60 s so far, about 25 min left] k010"


def test_a_build_without_records_says_so_once():
    """A model of 46 kernels and no logs for its target printed 46 identical lines."""
    from blockpad.codegen.build import _log_tuning

    none = {"tuned": False, "reason": "no record (no tuning logs in /x/zen4)"}
    lines = []
    _log_tuning(lines.append, {f"k{i}": none for i in range(5)}, "/x/zen4")
    assert lines == ["tuning records (/x/zen4): 0 of 5 kernels tuned",
                     "  every kernel: default schedule (no record (no tuning logs in /x/zen4))"]
    lines.clear()
    other = {"tuned": False, "reason": "not tuned: one variant"}
    _log_tuning(lines.append, {"a": none, "b": other}, "/x/zen4")
    assert lines[1:] == ["  a: default schedule (no record (no tuning logs in /x/zen4))",
                         "  b: default schedule (not tuned: one variant)"]


def test_tuned_kernels_match_numpy(tuned_build, rng):
    lib = bp.load(tuned_build[0].out_dir)
    for entry in (CONV, MATMUL):
        kernel = lib[entry["name"]]
        arrays = inputs(kernel, rng)
        mems = [bp.Memory.from_numpy(arrays[n], lay) for n, _, lay, _ in kernel.signature.args[:-1]]
        dst = bp.Memory.zeros(kernel.signature.args[-1][2])
        kernel(*mems, dst)
        np.testing.assert_allclose(dst.to_numpy(), reference(entry, arrays), rtol=1e-4, atol=1e-4)


def test_corrupt_log_lines_warn_and_cost_only_themselves(tuned, tmp_path):
    logs = copy_logs(tuned, tmp_path)
    folder = logs / "host"
    workloads = folder / tr.DB_FILES[0]
    lines = workloads.read_text().splitlines()
    lines[0] = lines[0][: len(lines[0]) // 2]        # a workload line cut in half
    workloads.write_text("\n".join(lines) + "\n")
    records = folder / tr.DB_FILES[1]
    n = records.read_text().count("\n")
    with open(records, "a") as f:
        f.write("[99, []]\n{not json\n")
    messages = []
    result = build(SPEC, "host", tmp_path / "lib", tuning_logs=logs, log=messages.append)
    warnings = [m for m in messages if m.startswith("warning:")]
    assert any("database_workload.json: line 1 is corrupt" in w for w in warnings), warnings
    assert any(f"database_tuning_record.json: line {n + 1} is corrupt" in w for w in warnings)
    assert any(f"database_tuning_record.json: line {n + 2} is corrupt" in w for w in warnings)
    tuned_kernels = {k["name"] for k in result.manifest["kernels"] if k["tuned"]}
    assert tuned_kernels == {"conv", "mm"}    # line 1 was one conv variant: two remain


def test_unreadable_index_warns_and_falls_back(tuned, tmp_path):
    logs = copy_logs(tuned, tmp_path)
    (logs / "host" / tr.INDEX).write_text("{")
    messages = []
    result = build(SPEC, "host", tmp_path / "lib", tuning_logs=logs, log=messages.append)
    assert any("blockpad.json: unreadable" in m for m in messages)
    assert not any(k["tuned"] for k in result.manifest["kernels"])


@pytest.mark.parametrize("field,value,reason", [
    ("tvm_version", "0.19.0", "recorded with TVM 0.19.0, this is"),
    ("workload", "123", "workload hash mismatch: tuned 123, now"),
])
def test_stale_records_fall_back_with_the_reason(tuned, tmp_path, field, value, reason):
    logs = copy_logs(tuned, tmp_path)
    path = logs / "host" / tr.INDEX
    index = json.loads(path.read_text())
    index["kernels"]["conv"][field] = value
    path.write_text(json.dumps(index))
    choice = tr.Logs(logs, HOST).choose("conv", kernel_func("conv"), HOST.tvm_target())
    assert choice.func is None and choice.status["reason"].startswith(reason)


def test_records_of_variants_the_rules_no_longer_make_are_not_applied(tuned, monkeypatch):
    unmeasured = space.variants(kernel_func("conv"), HOST)[TRIALS:]
    monkeypatch.setattr(space, "variants", lambda func, target: unmeasured)
    choice = tr.Logs(tuned[0], HOST).choose("conv", kernel_func("conv"), HOST.tvm_target())
    assert choice.func is None
    assert choice.status["reason"] == (f"none of the {len(unmeasured)} variants the schedule "
                                       f"rules produce now was measured (the rules changed "
                                       f"since tuning)")


def test_records_of_another_target_are_never_applied(tuned):
    other = tvm.target.Target({**HOST.tvm, "mcpu": "haswell"})
    choice = tr.Logs(tuned[0], HOST).choose("conv", kernel_func("conv"), other)
    assert choice.func is None
    assert choice.status["reason"] == "records only for another target (x86-64-v3)"


def test_no_logs_means_the_default_schedule(tmp_path):
    choice = tr.Logs(tmp_path, HOST).choose("conv", kernel_func("conv"), HOST.tvm_target())
    assert choice.func is None and choice.status["reason"].startswith("no record (no tuning logs")


# ---- remote measurement -----------------------------------------------------------------------

def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def rpc_device():
    """A tracker and a server registered with it under key 'loopback', as on a device farm.
    Each runs in a session of its own, killed whole at the end: the server's session workers
    (``tvm.exec.popen_worker``) outlive a server that is only terminated."""
    tracker_port, server_port = _free_port(), _free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "tvm.exec.rpc_tracker", "--host",
                               "127.0.0.1", "--port", str(tracker_port), "--port-end",
                               str(tracker_port + 1)], start_new_session=True)]
    try:
        procs.append(subprocess.Popen([sys.executable, "-m", "tvm.exec.rpc_server", "--host",
                                       "127.0.0.1", "--port", str(server_port), "--port-end",
                                       str(server_port + 1), "--tracker",
                                       f"127.0.0.1:{tracker_port}", "--key", "loopback"],
                                      start_new_session=True))
        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                if "loopback" in tvm.rpc.connect_tracker("127.0.0.1", tracker_port).text_summary():
                    break
            except (ConnectionError, RuntimeError, OSError):
                pass
            time.sleep(1)
        else:
            pytest.fail("the RPC server did not register with the tracker in 120 s")
        yield tn.Rpc("127.0.0.1", tracker_port, "loopback")
    finally:
        for p in reversed(procs):
            os.killpg(p.pid, signal.SIGTERM)
            p.wait(timeout=30)


def test_tune_measures_through_an_rpc_tracker(rpc_device, tmp_path):
    spec = parse_spec({"kernel": [MATMUL]})
    results = tn.tune(spec, "host", 2, tmp_path, rpc=rpc_device, log=lambda m: None)
    assert results[0]["measured"] == 2 and results[0]["failed"] == 0
    records = ms.database.JSONDatabase(work_dir=str(tmp_path / "host")).get_all_tuning_records()
    assert len(records) == 2 * tr.ROUNDS and all(tr.record_time(r) < 1 for r in records)


@needs_cross_compiler("neon")
def test_cross_target_candidates_are_linked_for_the_device():
    """neon through RPC: the builder exports with the cross compiler (build-only: no device)."""
    neon = get_target("neon")
    func = space.variants(kernel_func("mm"), neon)[0]
    built = tn.make_builder(neon).build([ms.builder.BuilderInput(space.workload(func),
                                                                 neon.tvm_target(num_cores=4))])
    assert built[0].error_msg is None, built[0].error_msg
    with open(built[0].artifact_path, "rb") as f:
        header = f.read(20)
    assert header[:4] == b"\x7fELF" and int.from_bytes(header[18:20], "little") == 183  # aarch64
    shutil.rmtree(built[0].artifact_path.rsplit("/", 1)[0])


def _tiny_model(path, rng):
    """A 3x3 convolution (Winograd's), relu, a 1x1 convolution: ONNX, written to ``path``."""
    from onnx import TensorProto, helper, numpy_helper

    inits = {"w0": rng.standard_normal((20, 12, 3, 3)).astype(np.float32) * 0.2,
             "w1": rng.standard_normal((24, 20, 1, 1)).astype(np.float32) * 0.2}
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w0"], ["h"], pads=[1, 1, 1, 1]),
         helper.make_node("Relu", ["h"], ["r"]), helper.make_node("Conv", ["r", "w1"], ["y"])],
        "tiny", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 12, 6, 6])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(a, n) for n, a in inits.items()])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    path.write_bytes(m.SerializeToString())
    return inits


@pytest.mark.parametrize("fastest", ["direct", "winograd2", "winograd6"])
def test_a_model_build_pins_the_candidate_the_records_time_fastest(tmp_path, monkeypatch,
                                                                   fastest):
    """Whatever the cost model says, the auto convolution is pinned to the recorded fastest
    candidate (direct included: its request keeps the default Winograd tile parameter, which
    once pinned Winograd F(4x4) for a direct pick). The records are stood in for."""
    pytest.importorskip("onnx", reason="pip install onnx (the [onnx] extra)")
    from blockpad.model_build import _graph, _record_pins

    _tiny_model(tmp_path / "tiny.onnx", np.random.default_rng(0))
    monkeypatch.setattr(tr.Logs, "_index", lambda self: {"recorded": {}})
    monkeypatch.setattr(tr.Logs, "seconds", lambda self, name, func, target:
                        1e-6 if name.endswith(f"__auto_{fastest}") else 1e-3)
    g = _graph(str(tmp_path / "tiny.onnx"), "auto")
    pins, picks = _record_pins(g, lambda m: None, get_target("host"), tmp_path)
    first = next(n.name for n in g.nodes if n.op == "conv2d")
    tile = None if fastest == "direct" else int(fastest[len("winograd"):])
    assert pins == {first: {"algorithm": "winograd" if tile else "direct", "winograd_tile": tile}}
    assert picks[first]["chosen"] == fastest and picks[first]["by"] == "tuning records"


def test_a_model_is_tuned_by_the_kernels_its_plan_calls(tmp_path):
    """``blockpad tune model.onnx``: the kernels the model's plan calls, named as its build
    names them, an ``auto`` convolution with its algorithm open (every candidate is timed);
    building the model then picks that convolution's algorithm by the records and applies them,
    and a build made before them is not "up to date" once they exist."""
    pytest.importorskip("onnx", reason="pip install onnx (the [onnx] extra)")
    from blockpad.model_build import build_model, model_spec

    rng = np.random.default_rng(0)
    path = tmp_path / "tiny.onnx"
    inits = _tiny_model(path, rng)

    spec = model_spec(str(path), log=lambda m: None)
    out, logs = tmp_path / "model", tmp_path / "logs"
    build_model(str(path), "host", out, log=lambda m: None)
    built = json.loads((out / "manifest.json").read_text())["kernels"]
    assert [k.name for k in spec.kernels] == [k["name"] for k in built if k["op"] != "zero_pad"]
    open_ = [k for k in spec.kernels if dict(k.params).get("algorithm") == "auto"]
    assert [dict(k.params)["kernel"] for k in open_] == [[3, 3]]   # the 3x3 is Winograd's
    assert not any(k["tuned"] for k in built)
    assert main(["tune", str(path), "--target", "host", "--trials", "2", "--out",
                 str(logs)]) in (0, None)
    lines = []
    build_model(str(path), "host", out, tuning_logs=logs, log=lines.append)
    assert not any("up to date" in line for line in lines), lines
    tuned = {k["name"] for k in json.loads((out / "manifest.json").read_text())["kernels"]
             if k["tuned"]}
    convs = {k.name for k in spec.kernels if k.op == "conv2d"}
    assert convs and convs <= tuned
    picked = [line for line in lines if "by tuning records" in line]
    assert len(picked) == 1, lines
    label = picked[0].split("auto picked ")[1].split()[0]
    times = {t.split()[0]: float(t.split()[1])      # every candidate timed: no "-"
             for t in picked[0].split("(", 1)[1].rstrip(")").split(", ")}
    assert len(times) > 1 and label == min(times, key=times.get)
    doc = json.loads((out / "model.json").read_text())
    first = next(n for n in doc["graph"]["nodes"] if n["op"] == "conv2d")
    assert doc["auto_picks"][first["name"]]["chosen"] == label   # the 3x3 runs what was picked
    assert (first["attrs"]["algorithm"], first["attrs"].get("winograd_tile")) == \
        (("direct", None) if label == "direct" else ("winograd", int(label[len("winograd"):])))
    x = rng.standard_normal((1, 12, 6, 6)).astype(np.float32)
    want = conv_ref(np.maximum(conv_ref(x, inits["w0"], pad=(1, 1)), 0), inits["w1"])
    got = bp.load(out)(x)
    assert np.allclose(got, want, atol=1e-4 * np.abs(want).max())

