"""``blockpad check``: a fixed-seed sample of random cases on the host (what CI runs of the
checker), and the checker's own machinery: cases are a function of (seed, case), every drawn
spec is valid, each kind of fault a kernel can commit is caught, a crashing case is pinned down
without losing the rest of its batch, and a failure's spec reads back and builds."""

from __future__ import annotations

import ctypes
import json
import sys
import tomllib

import numpy as np
import pytest

import blockpad as bp
from blockpad import machine
from blockpad.check import driver, execute, generate, replay, shrink
from blockpad.cli import main
from blockpad.codegen.spec import parse_spec
from blockpad.testing import qemu
from blockpad.vocabulary import BINARY_OPERANDS, BINARY_POST_OPS, QUANTIZED_ADD

SAMPLE_SEED = 16
SAMPLE_CASES = 16
NEEDS_QEMU = pytest.mark.skipif(bool(qemu.missing_tools()), reason="aarch64 toolchain / "
                                "emulator not installed: " + "; ".join(qemu.missing_tools()))


def test_fixed_seed_sample_on_host(tmp_path, capsys):
    """The CI sample: random ops, layouts, policies and dtypes, built as one library, every case
    right, no crash, no guard byte written."""
    assert main(["check", "--target", "host", "--seed", str(SAMPLE_SEED), "--cases",
                 str(SAMPLE_CASES), "--batch", str(SAMPLE_CASES), "--out",
                 str(tmp_path / "failures")]) == 0, capsys.readouterr().out
    out = capsys.readouterr().out
    assert f"{SAMPLE_CASES} cases on host (seed {SAMPLE_SEED}): {SAMPLE_CASES} ok, 0 wrong, " \
           f"0 crashes; 0 guard bytes written" in out
    assert not (tmp_path / "failures").exists()


@NEEDS_QEMU
def test_fixed_seed_sample_on_neon_under_qemu(tmp_path):
    summary = driver.check("neon", cases=4, seed=SAMPLE_SEED, batch=4,
                           out=str(tmp_path / "failures"), log=lambda m: None)
    assert (summary.checked, summary.failed, summary.guard_bytes) == (4, 0, 0), summary.failures


# ---- the generator -----------------------------------------------------------------------------

def test_cases_are_a_function_of_seed_and_number():
    assert generate.case(3, 17, "host") == generate.case(3, 17, "host")
    assert generate.case(3, 17, "host") != generate.case(3, 18, "host")
    assert generate.case(3, 17, "host") != generate.case(4, 17, "host")
    only = {generate.case(0, k, "host", ("pool", "softmax"))["op"] for k in range(30)}
    assert only == {"pool", "softmax"}


@pytest.mark.parametrize("target", ["host", "neon"])
def test_every_drawn_case_is_a_valid_spec(target):
    """The generator draws only what the spec accepts (parse time checks shapes, layouts,
    parameters), and covers every op, policy, in place and post-op kinds."""
    entries = [generate.case(0, k, target) for k in range(300)]
    spec = parse_spec({"kernel": entries})
    assert len(spec.kernels) == 300
    assert {e["op"] for e in entries} == set(generate.CHECKED_OPS)
    assert {e["policy"] for e in entries if "policy" in e} == set(generate.POLICIES)
    assert any(e.get("inplace") for e in entries)
    chains = [e.get("post_ops", []) for e in entries]
    assert {p["kind"] for c in chains for p in c} == \
        {"bias", "eltwise", "sum", "binary", QUANTIZED_ADD}
    assert all(c[-1]["kind"] == QUANTIZED_ADD for c in chains
               if any(p["kind"] == QUANTIZED_ADD for p in c))
    binaries = [p for c in chains for p in c if p["kind"] == "binary"]
    assert {p["algorithm"] for p in binaries} == set(BINARY_POST_OPS)
    assert {p["operand"] for p in binaries} == set(BINARY_OPERANDS)
    assert any(sum(p["kind"] == "sum" for p in c) > 1 for c in chains)
    assert any(p.get("zero_point") for c in chains for p in c)
    assert {e["dtype"] for e in entries if e["op"] == "conv2d"} == \
        {"float32", "int8", "uint8", "bfloat16", "float16", "float64"}
    assert any(isinstance(e.get("dst"), dict) and "strides" in e["dst"] for e in entries)
    assert any(isinstance(e.get("src"), dict) and "paddings" in e["src"] for e in entries)


def test_an_added_op_leaves_the_other_cases_as_they_were():
    """inverted_residual came after long runs had reported failures by (seed, case): a case that
    is not one is drawn exactly as before (seed 16's CI sample: cases 1 and 8 became inverted
    residuals, the other 14 are what they were), and the op is drawn about as often as its
    weight says."""
    older = tuple(o for o in generate.CHECKED_OPS if o not in generate.ADDED_OPS)
    drawn = {(s, k): generate.case(s, k, "host") for s in (0, 16) for k in range(200)}
    added = [sk for sk, e in drawn.items() if e["op"] == "inverted_residual"]
    assert all(e == generate.case(*sk, "host", older) for sk, e in drawn.items()
               if sk not in added)
    w = generate.WEIGHTS
    assert abs(len(added) / len(drawn) - w["inverted_residual"] / sum(w.values())) < 0.04
    assert {generate.case(1, k, "host", ("inverted_residual",))["op"] for k in range(20)} == \
        {"inverted_residual"}


def test_inverted_residual_reference_matches_the_ops_own_test():
    """The checker's reference (three ``conv`` calls, the post-op chain of conv2d) against the
    float64 block of tests/test_inverted_residual.py, written apart from it; and its bound,
    float32's rounding through three sums, is small but not zero."""
    from blockpad.check import reference

    from .test_inverted_residual import RELU6, SIGMOID
    from .test_inverted_residual import reference as block

    rng = np.random.default_rng(3)
    c, e, k, kernel, stride = 5, 13, 7, 5, 2
    entry = {"op": "inverted_residual", "kernel": [kernel, kernel], "stride": [stride, stride],
             "expand_post_ops": [RELU6], "depthwise_post_ops": [SIGMOID],
             "post_ops": [{"kind": "bias"}, {"kind": "sum"}]}
    shapes = {"src": (2, c, 9, 6), "expand_weights": (e, c, 1, 1), "expand_bias": (e,),
              "depthwise_weights": (e, 1, 1, kernel, kernel), "depthwise_bias": (e,),
              "weights": (k, e, 1, 1), "bias": (k,), "sum": (2, k, 5, 3)}
    t = {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()}
    want, bound = reference.reference(entry, t)
    np.testing.assert_allclose(want, block(entry, t), rtol=1e-12, atol=1e-12)
    assert want.shape == (2, k, 5, 3)
    assert np.all(bound > 0) and np.all(bound < 1e-3 * (1 + np.abs(want)))


def test_pool_windows_always_hold_an_image_cell():
    assert generate.window_ok(5, 3, 1, 1, 1)
    assert not generate.window_ok(1, 2, 1, 1, 2)     # cells at -1 and 1 of a 1-wide image
    assert not generate.window_ok(3, 1, 1, 1, 1)     # the padded column alone


# ---- the checker catches what it is for ----------------------------------------------------------

ENTRY = {"name": "case0", "op": "eltwise", "shape": [2, 5, 3, 3], "dtype": "float32",
         "policy": "dst_fused", "algorithm": "sigmoid", "alpha": 0.0, "beta": 0.0,
         "src": "nchw", "dst": "nChw8c"}


@pytest.fixture(scope="module")
def lib_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("check") / "lib"
    bp.build(parse_spec({"kernel": [ENTRY]}), "host", out, log=lambda m: None)
    return str(out)


class Faulty(execute.Native):
    """The real kernel, then one fault of the kind a kernel can commit."""

    def __init__(self, lib_dir, fault):
        super().__init__(lib_dir)
        self.fault = fault

    def call(self, sig, args, mems, path):
        super().call(sig, args, mems, path)
        self.fault(*mems)


def _byte_after(mem):
    ctypes.memset(mem.buffer.ctypes.data + mem.buffer.nbytes, 0, 1)


def _first_value(mem):
    mem.buffer[mem.layout.logical_offsets().flat[0]] += 1


def _source_byte(src, dst):
    """Flip a byte of a read-only source behind numpy's back, as a stray store would."""
    addr = src.buffer.ctypes.data + 4 * int(src.layout.logical_offsets().flat[7])
    byte = ctypes.cast(addr, ctypes.POINTER(ctypes.c_ubyte))
    byte[0] ^= 0xFF


def _padding(mem):
    mem.buffer[mem.layout.padding_offsets()[0]] = 1.0


def _state(mem):
    mem.state = "unknown"


@pytest.mark.parametrize("fault, found", [
    (lambda s, d: None, None),
    (lambda s, d: _byte_after(d), "dst: 1 guard bytes written"),
    (lambda s, d: _byte_after(s), "src: 1 guard bytes written"),
    (lambda s, d: _first_value(d), "dst: 1 of 90 elements wrong; worst at [0, 0, 0, 0]"),
    (_source_byte, "src: read-only source changed (1 bytes)"),
    (lambda s, d: _padding(d), "dst: state 'clean' but 1 of 54 padding elements are not zero"),
    (lambda s, d: _state(d), "policy 'dst_fused' promises a clean destination"),
])
def test_each_fault_is_reported(lib_dir, fault, found):
    result = execute.run_case(0, ENTRY, 0, Faulty(lib_dir, fault))
    if found is None:
        assert (result["status"], result["problems"], result["guard_bytes"]) == ("ok", [], 0)
        return
    assert result["status"] == "wrong"
    assert any(found in p for p in result["problems"]), result["problems"]


def test_every_call_path_is_checked(lib_dir):
    results = [execute.run_case(k, ENTRY, 0, execute.Native(lib_dir)) for k in range(12)]
    assert {r["status"] for r in results} == {"ok"}
    assert {r["call"] for r in results} == set(execute.CALL_PATHS)


@NEEDS_QEMU
def test_under_qemu_the_harness_reports_stores_outside_the_buffers(tmp_path, monkeypatch):
    """An aarch64 kernel runs on the harness's copies of the buffers: its guard bytes and
    input comparison are what see an overrun there; the checker counts them."""
    out = tmp_path / "neon"
    bp.build({"kernel": [ENTRY]}, "neon", out, log=lambda m: None)
    call = execute.Emulated(str(out))
    assert execute.run_case(0, ENTRY, 0, call)["status"] == "ok"      # for real, under qemu

    def overrun(lib_dir, calls):
        raise qemu.QemuRunError("case0: call failed under qemu-aarch64 (rc=1): tvm_run: case0 "
                                "wrote 3 guard bytes around tensor 1 (/tmp/1.bin)")

    monkeypatch.setattr(qemu, "run_many", overrun)
    result = execute.run_case(0, ENTRY, 0, call)
    assert (result["status"], result["guard_bytes"]) == ("wrong", 3)
    assert "wrote 3 guard bytes around tensor 1" in result["problems"][0]


FAKE_WORKER = """
import json, os, sys
job = json.load(sys.stdin)
for k, entry in job["cases"]:
    print(json.dumps({"start": k}), flush=True)
    if entry["name"] == "crash":
        os.abort()
    print(json.dumps({"case": k, "status": "ok", "problems": [], "guard_bytes": 0}), flush=True)
"""


def test_a_crashing_case_is_pinned_down_and_the_batch_goes_on(tmp_path, monkeypatch):
    script = tmp_path / "worker.py"
    script.write_text(FAKE_WORKER)
    monkeypatch.setattr(driver, "WORKER", (sys.executable, str(script)))
    entries = {k: {"name": "crash" if k == 12 else "fine"} for k in (10, 11, 12, 13)}
    results = sorted(driver._execute("unused", "host", 0, entries), key=lambda r: r["case"])
    assert [(r["case"], r["status"]) for r in results] == \
        [(10, "ok"), (11, "ok"), (12, "crash"), (13, "ok")]
    assert "signal 6" in results[2]["problems"][0]


FAKE_BUILDER = """
import json, os, sys
if any(k["name"] == "crash" for k in json.load(sys.stdin)["kernel"]):
    os.abort()
"""


def test_a_compiler_crash_costs_its_case_only(tmp_path, monkeypatch):
    """The 10,000-case run died twice inside TVM's LoopPartition, losing the run: builds now
    run in a child process, split like a failed build until the crashing case is alone."""
    monkeypatch.setattr(driver, "BUILDER", FAKE_BUILDER)
    entries = {k: {"name": "crash" if k == 3 else "fine"} for k in (1, 2, 3, 4)}
    built, failed = driver._build("host", entries, str(tmp_path / "lib"))
    assert sorted(k for _, ks in built for k in ks) == [1, 2, 4]
    assert [(r["case"], r["status"]) for r in failed] == [(3, "build-failed")]
    assert "the compiler died (signal 6)" in failed[0]["problems"][0]


def test_a_failure_writes_a_spec_that_reads_back_and_replays(tmp_path):
    entry = generate.case(5, 3, "host", ("conv2d",))
    found = replay.command("host", 5, 3, ("conv2d",))
    assert found == "blockpad check --target host --seed 5 --case 3 --ops conv2d"
    path = replay.write_spec(tmp_path, "host", 5, 3, entry, ["dst: wrong"], found)
    with open(path) as f:
        text = f.read()
    assert f"# found by: {found}" in text
    assert f"# replay this spec: blockpad check --target host --seed 5 --spec {path} --case 3" \
        in text
    doc = tomllib.loads(text)
    assert doc["kernel"] == [entry]
    assert parse_spec(doc).kernels[0].name == "case3"
    assert driver.spec_cases(path) == {3: entry}      # case 3 again: the same data


def test_shrinking_keeps_only_what_the_failure_needs():
    """A made-up failure (it needs in place and a blocked source): every other feature goes."""
    entry = generate.case(1, 2, "host", ("eltwise",))
    entry.update(policy="tracked", dtype="float16", inplace=True, src="aBc8b", dst="aBc8b",
                 shape=[2, 9, 3])

    def fails(e):
        return e.get("inplace") and e["src"] == "aBc8b"

    small = shrink.shrink(entry, fails, lambda e: True, log=lambda m: None)
    assert small == {**entry, "policy": "dst_fused", "dtype": "float32"}


def test_dropping_a_post_op_renames_the_later_tensors():
    """sum_1 becomes sum, binary_1 binary_0, each keeping its layout: the shrunk spec still
    names every tensor its chain reads, and parses."""
    chain = [{"kind": "sum"}, {"kind": "binary", "algorithm": "add", "operand": "full"},
             {"kind": "sum", "scale": 0.5}, {"kind": "binary", "algorithm": "mul",
                                             "operand": "full"}]
    entry = {"name": "case0", "op": "matmul", "shape": [3, 5], "n": 7, "src": "ab",
             "weights": "ab", "dst": "aB8b", "sum": "aB8b", "sum_1": "aB8b", "binary_0": "ab",
             "binary_1": "ba", "post_ops": chain}
    first, second = list(shrink.simpler(entry))[:2]
    assert (first["post_ops"], first["sum"], first["binary_1"]) == (chain[1:], "aB8b", "ba")
    assert "sum_1" not in first
    assert (second["binary_0"], "binary_1" in second, second["sum_1"]) == ("ba", False, "aB8b")
    for e in (first, second):
        parse_spec({"kernel": [e]})


def test_bounds_reject_a_wrong_result_and_accept_rounding():
    x = np.random.default_rng(0).standard_normal((4, 7)).astype(np.float32)
    want, bound = execute.reference({"op": "eltwise", "algorithm": "tanh"}, {"src": x})
    got = np.tanh(x)                         # float32 tanh: rounded, within the bound
    assert not execute._compare("dst", got, want, bound)
    got[1, 2] += 1e-3
    assert "1 of 28 elements wrong; worst at [1, 2]" in execute._compare("dst", got, want, bound)[0]


def test_a_float16_subnormal_result_may_be_off_by_half_its_spacing():
    """10,000-case run, seed 20261121 case 2707: a float16 product, -1.39e-6, is a subnormal
    (spacing 2**-24 = 6e-8); the kernel rounded it correctly to -1.3709e-6 and failed a purely
    relative bound (1.4e-9). Every float16 product of subnormal size, rounded, must pass."""
    rng = np.random.default_rng(1)
    a, b = (rng.uniform(-4e-3, 4e-3, 4096).astype(np.float16) for _ in range(2))
    want, bound = execute.reference({"op": "binary", "algorithm": "mul"}, {"src0": a, "src1": b})
    assert not execute._compare("dst", a * b, want, bound)
    wrong = (a * b).copy()
    wrong[7] = np.nextafter(wrong[7], np.float16(1)) + np.float16(6e-8)   # two spacings off
    assert "1 of 4096 elements wrong" in execute._compare("dst", wrong, want, bound)[0]


# Two cases of the 10,000-case run on int8 convolutions whose exp post-ops overflow to inf:
# an int32 destination with a negative zero point (the rounded value, clamped to
# [min - zp, max - zp], overflowed its conversion to int32), and a uint8 one whose saturated
# result was right but whose error bound was NaN (inf - inf).
OVERFLOWING_EXP = """[[kernel]]
name = "case2118"
op = "conv2d"
shape = [2, 2, 5, 9]
dtype = "uint8"
channels = 8
groups = 1
kernel = [3, 3]
stride = [1, 1]
pad = [0, 0]
dilation = [1, 1]
spatial_pad = "stage"
policy = "dst_stage"
post_ops = [{ kind = "sum", scale = 0.5 }, { kind = "eltwise", algorithm = "exp", alpha = 0.0, beta = 0.0 }]
src = { tag = "nChw16c", strides = [725, 722, 144, 16, 1] }
weights = "oihw"
dst = "nhwC8c"
sum = "nhwC8c"
src_zero_point = 182
scales = "tensor"
dst_dtype = "int32"
dst_scale = 1.0
dst_zero_point = -367

[[kernel]]
name = "case3168"
op = "conv2d"
shape = [1, 23, 9, 9]
dtype = "int8"
channels = 46
groups = 23
kernel = [1, 3]
stride = [1, 1]
pad = [0, 0]
dilation = [1, 1]
spatial_pad = "stage"
policy = "on_handle"
post_ops = [{ kind = "eltwise", algorithm = "exp" },
            { kind = "eltwise", algorithm = "exp" }]
src = "nchW8w4w"
weights = "goihw"
dst = "nchw"
src_zero_point = 96
scales = "channel"
dst_dtype = "uint8"
dst_scale = 0.02
dst_zero_point = 156
"""


def test_saturating_int8_convolutions_from_the_ten_thousand(tmp_path):
    spec = tmp_path / "cases.toml"
    spec.write_text(OVERFLOWING_EXP)
    for seed, k in ((20261128, 2118), (20261127, 3168)):
        s = driver.check("host", seed=seed, only=k, spec=str(spec), out=str(tmp_path / "f"),
                         log=lambda m: None)
        assert s.checked == 1 and s.failed == 0, s.line()


def test_a_float16_result_past_its_largest_value_is_inf():
    """seed 20261128 case 2791: a float16 matmul's 616140 stored as inf, correctly."""
    want, bound = np.array([616140.4, 6e4, 65521.0, -7e4]), np.array([304.0, 16.0, 0.0, 1.0])
    got = np.array([np.inf, 6e4, np.inf, -np.inf], np.float16)
    assert not execute._compare("dst", got, want, bound)
    got[1] = np.inf          # 60000 is far from float16's largest value
    assert "1 of 4 elements wrong" in execute._compare("dst", got, want, bound)[0]


def test_a_target_this_machine_cannot_run_is_refused_before_building():
    from blockpad import machine
    from blockpad.codegen.targets import get_target

    if not machine.missing_features(get_target("amx").features):
        pytest.skip("this CPU runs AMX code: nothing to refuse")
    with pytest.raises(bp.MissingCPUFeatureError, match="target amx: this CPU lacks"):
        driver.check("amx", cases=1, log=lambda m: None)


@pytest.mark.skipif(machine.cuda_devices(), reason="this machine has a CUDA device")
def test_a_gpu_target_without_a_gpu_is_refused_before_building(tmp_path):
    with pytest.raises(bp.BlockpadError, match="compute capability 8.0 or later, which this "
                       "machine lacks. Build here with --build-only"):
        driver.check("cuda-sm80", cases=1, log=lambda m: None)
    with pytest.raises(bp.BlockpadError, match="needs --work DIR"):
        driver.check("cuda-sm80", cases=1, build_only=True, log=lambda m: None)
    with pytest.raises(bp.BlockpadError, match="no readable check-plan.json"):
        driver.run_built(str(tmp_path), log=lambda m: None)


def test_cuda_cases_draw_the_policies_and_layouts_a_gpu_library_takes():
    """A GPU library keeps no padding state and takes dense tensors: its cases draw dst_fused
    and dst_stage only, and no layout with gaps between dims."""
    drawn = [generate.case(3, k, "cuda-sm90") for k in range(300)]
    assert {e["policy"] for e in drawn if "policy" in e} == {"dst_fused", "dst_stage"}
    assert not any("strides" in json.dumps(e) for e in drawn)
    assert any("strides" in json.dumps(generate.case(3, k, "host")) for k in range(300))


def test_build_only_then_run_built_checks_the_same_cases(tmp_path):
    """What a GPU host does with cases built elsewhere, on this machine's own target."""
    lines = []
    built = driver.check("host", cases=3, seed=7, ops=("eltwise", "reorder"), work=str(tmp_path),
                         build_only=True, log=lines.append)
    assert built.checked == built.failed    # only build failures are counted at build time
    assert (tmp_path / driver.PLAN).is_file()
    assert f"blockpad check --run-built {tmp_path}" in lines[-1]
    ran = driver.run_built(str(tmp_path), out=str(tmp_path / "failures"), log=lines.append)
    assert ran.counts["ok"] == 3, lines


def test_build_only_with_nothing_to_build_leaves_an_empty_plan(tmp_path):
    """A benchdnn file none of whose problems blockpad states (3-D only, say) builds nothing;
    its plan says so instead of the folder missing (a traceback, before)."""
    problems = tmp_path / "only_3d"
    problems.write_text("--dt=u8:s8:u8 mb1ic4id5ih5iw5oc4od5oh5ow5kd1kh1kw1\n")
    work = tmp_path / "work"
    driver.check("host", benchdnn=str(problems), work=str(work), build_only=True,
                 log=lambda m: None)
    ran = driver.run_built(str(work), out=str(tmp_path / "failures"), log=lambda m: None)
    assert ran.checked == 0
