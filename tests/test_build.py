"""The ahead-of-time build, its manifest, and the checks load() makes before running anything."""

import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

import blockpad as bp
from blockpad import machine
from blockpad.codegen.spec import load_spec, parse_spec
from blockpad.runtime.tvm_runtime import pool_threads

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = {"kernel": [{"op": "reorder", "shape": [1, 20, 3, 3], "src": "nchw", "dst": "nChw16c"}]}
NAME = "reorder_nchw_nChw16c_f32_1x20x3x3"


@pytest.fixture(scope="session")
def small_dir(build_dir):
    out = build_dir / "small"
    bp.build(parse_spec(SMALL), "host", out, log=lambda m: None)
    return out


@pytest.fixture
def small_copy(small_dir, tmp_path):
    """A private copy a test may damage."""
    out = tmp_path / "lib"
    shutil.copytree(small_dir, out)
    return out


def test_manifest_records_what_a_user_needs(reorder_lib_dir):
    manifest = json.loads((reorder_lib_dir / "manifest.json").read_text())
    assert manifest["target"]["name"] == "host"
    assert "avx2" in manifest["target"]["features"] and "fma" in manifest["target"]["features"]
    assert manifest["tvm_version"].startswith("0.27")
    assert len(manifest["library_sha256"]) == 64
    k = next(k for k in manifest["kernels"] if k["name"] == "to_halo")
    assert k["op"] == "reorder"
    assert [a["role"] for a in k["args"]] == ["in", "out"]
    assert k["args"][1]["layout"] == {"tag": "nChw16c", "shape": [2, 30, 5, 7], "dtype": "float32",
                                      "paddings": [[0, 0], [0, 0], [1, 2], [3, 1]]}


def test_rebuild_does_nothing_and_says_so(small_dir):
    lines = []
    result = bp.build(parse_spec(SMALL), "host", small_dir, log=lines.append)
    assert not result.rebuilt
    assert any("up to date" in line and "nothing to compile" in line for line in lines)


def test_build_shows_progress_and_a_changed_spec_rebuilds(tmp_path):
    lines = []
    spec = {"kernel": SMALL["kernel"] + [{"op": "zero_pad", "shape": [1, 20, 3, 3], "layout": "nChw16c"}]}
    bp.build(parse_spec(SMALL), "host", tmp_path, log=lambda m: None)
    result = bp.build(parse_spec(spec), "host", tmp_path, log=lines.append)
    assert result.rebuilt
    assert any(line.startswith("[1/2]") for line in lines) and any(line.startswith("[2/2]") for line in lines)
    assert set(bp.load(tmp_path).kernels) == {NAME, "zero_pad_nChw16c_f32_1x20x3x3"}


def test_example_spec_parses():
    spec = load_spec(os.path.join(ROOT, "examples", "reorders.toml"))
    assert len(spec.kernels) == 12


@pytest.mark.parametrize("doc, message", [
    ({}, "expected one or more"),
    ({"kernel": [{"op": "conv9d"}]}, "op: expected one of"),
    ({"kernel": [{"op": "reorder", "shape": [1, 2], "src": "ab"}]}, "needs a layout for dst"),
    ({"kernel": [{"op": "reorder", "shape": [1, 2], "src": "ab", "dst": "ba", "colour": 1}]}, "unknown key colour"),
    ({"kernel": [{"op": "reorder", "src": "ab", "dst": "ba"}]}, "expected 'shape' or 'shapes'"),
    ({"kernel": [{"op": "reorder", "shape": [1, 2], "src": "nChw", "dst": "ba"}]}, "upper case"),
    ({"kernel": [{"op": "reorder", "shape": [1, 2], "src": "ab", "dst": "ba"}] * 2}, "already makes"),
    ({"kernel": [{"op": "reorder", "name": "x", "shapes": [[1, 2], [2, 2]], "src": "ab", "dst": "ba"}]},
     "names one kernel"),
    ({"kernel": [{"op": "reorder", "shape": [1, 2], "src": "ab", "dst": "abc"}]}, "has 3 dims"),
])
def test_spec_errors(doc, message):
    with pytest.raises(bp.SpecError, match=message):
        parse_spec(doc)


def test_unknown_target():
    with pytest.raises(bp.SpecError, match="target: expected one of host"):
        bp.build(parse_spec(SMALL), "riscv", "unused")


def test_load_in_a_fresh_process(small_dir):
    """A process that did not build the library loads and runs it, without TVM's compiler."""
    code = f"""
import sys, numpy as np, blockpad as bp
lib = bp.load({str(small_dir)!r})
x = np.arange(180, dtype="float32").reshape(1, 20, 3, 3)
m = bp.Memory.empty(bp.Layout("nChw16c", (1, 20, 3, 3)))
lib[{NAME!r}](x, m)
assert np.array_equal(m.to_numpy(), x) and m.padding_is_zero()
assert "tvm" not in sys.modules, "the runtime imported the tvm package"
print("ok", sorted(lib.kernels))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ok")


def test_missing_library_dir(tmp_path):
    with pytest.raises(bp.LoadError, match="expected a built library with manifest.json"):
        bp.load(tmp_path)


def test_corrupt_manifest(small_copy):
    (small_copy / "manifest.json").write_text("{not json")
    with pytest.raises(bp.LoadError, match="not a readable manifest"):
        bp.load(small_copy)


def test_missing_so(small_copy):
    (small_copy / "kernels.so").unlink()
    with pytest.raises(bp.LoadError, match="which is missing"):
        bp.load(small_copy)


def test_hash_mismatch(small_copy):
    with open(small_copy / "kernels.so", "ab") as f:
        f.write(b"\0")
    with pytest.raises(bp.LoadError, match="does not match the manifest"):
        bp.load(small_copy)


def _edit_manifest(path, edit):
    m = json.loads((path / "manifest.json").read_text())
    edit(m)
    (path / "manifest.json").write_text(json.dumps(m))


def test_tvm_version_mismatch(small_copy):
    _edit_manifest(small_copy, lambda m: m.update(tvm_version="0.26.0"))
    with pytest.raises(bp.LoadError, match="built with apache-tvm 0.26.0"):
        bp.load(small_copy)


@pytest.mark.parametrize("threads,message", [
    (["x"], "lacks or mangles"),
    ("this pool's", "has no function nope"),
])
def test_a_mangled_thread_variant_is_refused(small_copy, threads, message):
    """``threads`` names a kernel's variants per pool size: a malformed table fails the load,
    and a variant for this process's pool that the library lacks fails the first use of the
    kernel, each with a LoadError, never a missing-attribute error from TVM."""
    if threads == "this pool's":
        threads = {str(pool_threads()): "nope"}
    name = json.loads((small_copy / "manifest.json").read_text())["kernels"][0]["name"]
    _edit_manifest(small_copy, lambda m: m["kernels"][0].update(threads=threads))
    with pytest.raises(bp.LoadError, match=message):
        bp.load(small_copy)[name]


def test_wrong_architecture(small_copy):
    _edit_manifest(small_copy, lambda m: m["target"].update(arch="aarch64"))
    with pytest.raises(bp.LoadError, match=f"library is for aarch64.*this machine is {machine.arch()}"):
        bp.load(small_copy)


def test_avx512_library_is_refused_not_crashed(build_dir):
    """A real AVX-512 build: on a machine without AVX-512 load() must raise, never run it."""
    out = build_dir / "avx512"
    bp.build(parse_spec(SMALL), "avx512", out, log=lambda m: None)
    if "avx512f" in machine.cpu_features():
        lib = bp.load(out)   # this machine can run it: check it does, correctly
        x = np.ones((1, 20, 3, 3), "float32")
        m = bp.Memory.empty(bp.Layout("nChw16c", (1, 20, 3, 3)))
        lib[NAME](x, m)
        assert np.array_equal(m.to_numpy(), x)
        return
    with pytest.raises(bp.MissingCPUFeatureError, match="avx512f"):
        bp.load(out)


def test_cli_build_and_info(tmp_path):
    spec = tmp_path / "s.toml"
    spec.write_text('[[kernel]]\nop = "zero_pad"\nshape = [1, 3, 2, 2]\nlayout = "nChw8c"\n')
    run = lambda *a: subprocess.run([sys.executable, "-m", "blockpad", *a], capture_output=True,
                                    text=True, timeout=300)
    first = run("build", str(spec), "--target", "host", "--out", str(tmp_path / "o"))
    assert first.returncode == 0, first.stderr
    assert "[1/1]" in first.stderr
    again = run("build", str(spec), "--target", "host", "--out", str(tmp_path / "o"))
    assert "nothing to compile" in again.stderr
    info = run("info", str(tmp_path / "o"))
    assert "zero_pad_nChw8c_f32_1x3x2x2(inout buf: nChw8c[1, 3, 2, 2] float32)" in info.stdout
    bad = run("build", str(tmp_path / "missing.toml"), "--out", str(tmp_path / "x"))
    assert bad.returncode == 2 and "cannot read the spec" in bad.stderr


def test_inspect_shows_tir_and_asm(reorder_lib_dir):
    from blockpad.generated import show

    tir = show(reorder_lib_dir, "tir", "to_halo")
    assert "def to_halo(" in tir and "T.vectorized" in tir
    asm = show(reorder_lib_dir, "asm", "to_halo")
    assert "__tvm_ffi_to_halo" in asm and "__tvm_ffi_from_halo" not in asm
    # a parallel kernel's hot loop is in the bodies it launches: shown with it, and only there
    bodies = {}
    for name in bp.load(reorder_lib_dir).kernels:
        if "T.parallel" in show(reorder_lib_dir, "tir", name):
            text = show(reorder_lib_dir, "asm", name)
            bodies[name] = set(re.findall(r"(?m)^(\.L__tvm_parallel_lambda[.\d]*):", text))
            assert bodies[name] and "mm" in text, name   # vector registers: xmm, ymm
    assert bodies, "no parallel kernel in the library"
    assert sum(len(b) for b in bodies.values()) == len(set().union(*bodies.values()))
    with pytest.raises(bp.LoadError, match="no kernel 'nope'"):
        show(reorder_lib_dir, "tir", "nope")
    with pytest.raises(bp.LoadError, match="has no cuda source"):
        show(reorder_lib_dir, "cuda")


# ---- errors name their entry and kernel, and none hides another --------------------------------

def test_parse_time_checks_are_listed_together():
    """What the spec alone shows is refused when it is parsed (before any TVM work), each
    problem naming its entry and kernel, all of them in one error."""
    shape = [1, 6, 4, 4]
    doc = {"kernel": [
        {"op": "eltwise", "shape": shape, "src": "nchw", "dst": "nchw", "algorithm": "mish"},
        {"op": "softmax", "shape": shape, "src": "nchw", "dst": "nchw", "axis": 4},
        {"op": "reorder", "shape": shape, "src": "nchw", "dst": "nChw8c"},   # fine
        {"op": "conv2d", "name": "conv_sum", "shape": shape, "channels": 6, "src": "nchw",
         "weights": "oihw", "dst": "nchw", "post_ops": [{"kind": "sum"}], "sum": "nChw8c"},
        {"op": "binary", "name": "add_inplace", "shape": shape, "src0": "nchw", "src1": "nchw",
         "dst": "nhwc", "inplace": True},
    ]}
    with pytest.raises(bp.SpecError) as e:
        parse_spec(doc)
    lines = str(e.value).splitlines()
    assert lines[0] == "spec: 4 problems:"
    assert re.search(r"kernel #1 \(eltwise_nchw_nchw_f32_1x6x4x4_\w+\): eltwise algorithm: "
                     r"expected one of relu.*got 'mish'", lines[1])
    assert re.search(r"kernel #2 \(softmax_\w+\): softmax: axis must be an integer in \[-4, 4\)"
                     r".*got 4", lines[2])
    assert "kernel #4 (conv_sum): sum (a sum post-op): its layout must have dst's padded dims" in lines[3]
    assert "kernel #5 (add_inplace): in place needs src0 and dst in one layout" in lines[4]


def test_build_lists_every_kernel_that_fails(tmp_path, monkeypatch):
    """A kernel whose code generation fails and one whose scheduling fails are both reported,
    by entry and kernel name, in one error after the build went through all of them."""
    import blockpad.codegen.build as build_mod
    import blockpad.schedules

    make, schedule = build_mod.make_kernels, blockpad.schedules.schedule_for_pools

    def failing_make(req):
        if req.name == "bad_generate":
            raise IndexError("list index out of range")   # what a TVM bug looks like
        return make(req)

    def failing_schedule(func, target):
        if "bad_schedule" in str(func.attrs["global_symbol"]):
            raise bp.LayoutError("no rule for this nest")
        return schedule(func, target)

    monkeypatch.setattr(build_mod, "make_kernels", failing_make)
    monkeypatch.setattr(blockpad.schedules, "schedule_for_pools", failing_schedule)
    entry = {"op": "zero_pad", "shape": [1, 3, 2, 2], "layout": "nChw8c"}
    doc = {"library": {"name": "three"}, "kernel": [
        {**entry, "name": "bad_generate"}, {**entry, "name": "good"},
        {**entry, "name": "bad_schedule"}]}
    lines = []
    with pytest.raises(bp.BuildError) as e:
        bp.build(doc, "host", tmp_path, log=lines.append)
    text = str(e.value)
    assert text.startswith("three: 2 of 3 spec kernels cannot be built for host:")
    assert "kernel #1 (bad_generate): code generation failed: IndexError: list index" in text
    assert "kernel #3 (bad_schedule): scheduling failed: no rule for this nest" in text
    assert "good" not in text and "[2/3] good: generated" in "\n".join(lines)
    assert not (tmp_path / "kernels.so").exists()


def test_build_takes_a_spec_as_a_dict(small_dir):
    """A dict shaped like the TOML is a spec: the same build key as its parsed form."""
    lines = []
    result = bp.build(SMALL, "host", small_dir, log=lines.append)
    assert not result.rebuilt and "nothing to compile" in lines[0]
    with pytest.raises(bp.SpecError, match="spec dict: expected one or more"):
        bp.build({"kernels": []}, "host", small_dir)


def test_a_missing_cross_compiler_names_its_package(tmp_path, monkeypatch):
    """neon links with aarch64-linux-gnu-gcc: without it on PATH the build stops before any
    kernel is generated or scheduled, saying what to install."""
    import blockpad.codegen.build as build_mod

    monkeypatch.setenv("PATH", str(tmp_path))   # a PATH with no compiler on it
    monkeypatch.setattr(build_mod, "make_kernels", lambda req: pytest.fail("generated"))
    with pytest.raises(bp.BuildError, match=r"target neon links with aarch64-linux-gnu-gcc, "
                       r"which is not on PATH; install it \(Debian/Ubuntu: apt-get install "
                       r"gcc-aarch64-linux-gnu\)"):
        bp.build(SMALL, "neon", tmp_path / "out", log=lambda m: None)
