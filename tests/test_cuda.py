"""CUDA targets (cuda-sm80, cuda-sm90), built ahead of time with nvcc.

There is no GPU here: these tests check what is built (a fatbin of SASS + PTX inside the shared
library, not CUDA source; the tensor-core instructions in the PTX, and in the SASS when
cuobjdump can disassemble it) and that loading refuses cleanly. Running the kernels needs a GPU
host. Everything skips, saying why, when nvcc is not installed."""

from __future__ import annotations

import ctypes
import glob
import importlib.util
import json
import os
import re
import shutil
import struct
import subprocess
import sys

import numpy as np
import pytest

import blockpad as bp
from blockpad import machine
from blockpad.codegen.cuda_aot import FATBIN_MAGIC
from blockpad.codegen.spec import parse_spec

pytestmark = pytest.mark.skipif(shutil.which("nvcc") is None,
                                reason="nvcc not on PATH: CUDA targets compile with it at build "
                                       "time (install the CUDA toolkit: apt-get install "
                                       "nvidia-cuda-toolkit, or put its bin/ on PATH)")

ARCHS = {"cuda-sm80": 80, "cuda-sm90": 90}
SHAPE = [2, 30, 5, 7]   # C = 30: two channels of padding in the last 16-channel block
SPEC = {"library": {"name": "cuda-test"}, "kernel": [
    {"op": "reorder", "shape": SHAPE, "src": "nchw", "dst": "nChw16c"},
    {"op": "reorder", "shape": SHAPE, "src": "nChw16c", "dst": "nchw"},
    {"name": "sigmoid_fused", "op": "eltwise", "shape": SHAPE, "src": "nChw16c", "dst": "nChw16c",
     "algorithm": "sigmoid", "policy": "dst_fused"},
    {"name": "relu_fused", "op": "eltwise", "shape": SHAPE, "src": "nChw16c", "dst": "nChw16c",
     "algorithm": "relu", "policy": "dst_fused"},
    {"name": "tanh_fused", "op": "eltwise", "shape": SHAPE, "src": "nChw16c", "dst": "nChw16c",
     "algorithm": "tanh", "policy": "dst_fused"},
    {"name": "sigmoid_stage", "op": "eltwise", "shape": SHAPE, "src": "nChw16c", "dst": "nChw16c",
     "algorithm": "sigmoid", "policy": "dst_stage"},
    {"name": "relu_stage", "op": "eltwise", "shape": SHAPE, "src": "nChw16c", "dst": "nChw16c",
     "algorithm": "relu", "policy": "dst_stage"},
    {"name": "add", "op": "binary", "shape": SHAPE, "src0": "nChw16c", "src1": "nChw16c",
     "dst": "nChw16c", "algorithm": "add"},
    {"name": "zero_pad_halo", "op": "zero_pad", "shape": SHAPE,
     "layout": {"tag": "nChw16c", "paddings": {"h": [1, 2], "w": [3, 1]}}},
]}


@pytest.fixture(scope="session", params=list(ARCHS))
def cuda_lib(request, build_dir):
    out = build_dir / request.param
    bp.build(parse_spec(SPEC), request.param, out, log=lambda m: None)
    return request.param, ARCHS[request.param], out


def fatbin_entries(data: bytes):
    """(kind, sm) of each entry of the first fatbin in ``data``: kind 1 is PTX, 2 is an ELF
    cubin (SASS)."""
    at = data.find(FATBIN_MAGIC)
    assert at >= 0, "no fatbin in the library"
    _, _, header, size = struct.unpack_from("<IHHQ", data, at)
    pos, end, out = at + header, at + header + size, []
    while pos < end:
        kind, _, entry_header, payload = struct.unpack_from("<HHIQ", data, pos)
        out.append((kind, struct.unpack_from("<I", data, pos + 28)[0]))
        pos += entry_header + payload
    return out, data[at:end]


def test_targets_are_listed_with_the_compute_capability():
    from blockpad.codegen.targets import TARGETS

    for name, cc in ARCHS.items():
        t = TARGETS[name]
        assert t.family == "cuda" and f"sm_{cc}" in t.features and "avx2" in t.features
        tvm_target = t.tvm_target(num_cores=4)
        assert tvm_target.kind.name == "cuda" and str(tvm_target.attrs["arch"]) == f"sm_{cc}"
        assert tvm_target.host.kind.name == "llvm"


def test_library_embeds_a_fatbin_not_cuda_source(cuda_lib):
    name, cc, out = cuda_lib
    data = (out / "kernels.so").read_bytes()
    source = (out / "source" / "kernels.cu").read_text()
    assert 'extern "C" __global__' in source
    assert b"__global__" not in data and b"__launch_bounds__" not in data, "CUDA source embedded"
    entries, _ = fatbin_entries(data)
    assert (2, cc) in entries, f"no sm_{cc} SASS in {entries}"
    assert (1, cc) in entries, f"no compute_{cc} PTX in {entries}"


def test_tvm_loader_reads_the_embedded_binary(cuda_lib):
    """TVM's own library loader (tvm_ffi ProcessLibraryBin) walks the packed modules of the
    exported .so and hands the CUDA module's bytes to ``ffi.Module.load_from_bytes.cuda``; with
    no CUDA runtime here, a stand-in loader records them: format ``fatbin``, the kernels'
    function table, the fatbin itself."""
    name, cc, out = cuda_lib
    code = f"""
import struct, tvm_ffi
from blockpad.runtime.tvm_runtime import _runtime
_runtime()
got = []
@tvm_ffi.register_global_func("ffi.Module.load_from_bytes.cuda", override=True)
def _load(payload):
    got.append(bytes(payload))
    return tvm_ffi.system_lib()
tvm_ffi.load_module({str(out / "kernels.so")!r})
(p,) = got
n = struct.unpack_from("<Q", p)[0]
print(p[8:8 + n].decode(), b"relu_stage_kernel" in p, p.count(bytes.fromhex("50ed55ba")))
"""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["fatbin", "True", "1"]


def test_manifest_records_the_compute_capability(cuda_lib):
    name, cc, out = cuda_lib
    target = json.loads((out / "manifest.json").read_text())["target"]
    assert target["name"] == name and f"sm_{cc}" in target["features"]
    assert target["tvm"]["kind"] == "cuda" and target["tvm"]["arch"] == f"sm_{cc}"


def test_ptx_is_saved_for_the_arch(cuda_lib):
    name, cc, out = cuda_lib
    ptx = (out / "source" / "kernels.ptx").read_text()
    assert re.search(rf"^\.target sm_{cc}$", ptx, re.M)
    for kernel in ("relu_stage", "relu_stage__zero_pad_dst", "add", "zero_pad_halo"):
        assert f".visible .entry {kernel}_kernel(" in ptx


def test_every_stage_is_bound_and_predicates_survive(cuda_lib):
    """One thread per element; the valid-region predicate (dst_stage) and the zero-pad
    predicate stay in the one guard around the store."""
    name, cc, out = cuda_lib
    src = out / "source"
    for tir in src.glob("*.tir.py"):
        text = tir.read_text()
        assert 'thread="blockIdx.x"' in text and 'thread="threadIdx.x"' in text, tir.name
    stage = (src / "relu_stage.tir.py").read_text()
    assert "T.where(not " in stage and ">= 30" in stage   # channels 30, 31 are not written
    assert "T.where(" in (src / "zero_pad_halo.tir.py").read_text()
    fused = (src / "sigmoid_fused.tir.py").read_text()
    assert "T.Select(" in fused                            # sigmoid(0) != 0: padding selected 0


def test_device_code_is_compiled_with_ieee_math(cuda_lib):
    """No ``--use_fast_math`` (TVM's default): on an H100 its ``tanh.approx`` put tanh 1e-5
    from float64, over the checker's bound. IEEE ``tanhf`` and ``1 / x`` instead (CUDA's
    accurate functions use ``ex2.approx`` inside, with their own range reduction)."""
    from blockpad.generated import show

    name, cc, out = cuda_lib
    assert "tanh.approx" not in show(out, "ptx", "tanh_fused")
    sigmoid = show(out, "ptx", "sigmoid_fused")
    assert re.search(r"(rcp|div)\.rn\.f32", sigmoid) and "div.approx" not in sigmoid
    assert "div.full" not in sigmoid


def test_inspect_shows_cuda_and_ptx(cuda_lib):
    name, cc, out = cuda_lib
    cli = subprocess.run([sys.executable, "-m", "blockpad", "inspect", str(out), "--cuda",
                          "--kernel", "relu_stage"], capture_output=True, text=True, timeout=120)
    assert cli.returncode == 0, cli.stderr
    assert cli.stdout.count('extern "C" __global__') == 1
    assert "relu_stage_kernel(" in cli.stdout and "zero_pad_dst" not in cli.stdout
    from blockpad.generated import show

    assert show(out, "cuda").count("__global__") >= 2 * len(SPEC["kernel"])
    ptx = show(out, "ptx", "zero_pad_halo")
    assert ptx.startswith(".visible .entry zero_pad_halo_kernel") and ".entry add_kernel" not in ptx


def test_load_without_a_gpu_is_refused_clearly(cuda_lib, monkeypatch):
    name, cc, out = cuda_lib
    monkeypatch.setattr(machine, "cuda_devices", lambda: None)
    with pytest.raises(bp.LoadError, match=rf"compute capability {cc // 10}\.0 or later "
                                           rf"\(sm_{cc}\); this machine has no CUDA driver"):
        bp.load(out)
    monkeypatch.setattr(machine, "cuda_devices", lambda: ((7, 5),))
    with pytest.raises(bp.LoadError, match=r"CUDA devices have compute capability 7\.5"):
        bp.load(out)
    monkeypatch.setattr(machine, "cuda_devices", lambda: ())
    with pytest.raises(bp.LoadError, match="reports no usable device"):
        bp.load(out)


@pytest.mark.skipif(machine.cuda_devices() is not None, reason="this machine has a CUDA driver")
def test_this_machine_has_no_gpu_and_says_so(cuda_lib):
    with pytest.raises(bp.LoadError, match="no CUDA driver"):
        bp.load(cuda_lib[2])


# ---- matmul: shared-memory tiling (fp32), tensor cores (fp16 sources, fp32 accumulation) ----

def matmul_kernel(name, m, n, k, dtype, tags=("ab", "ab", "ab")):
    """A matmul kernel as the operator framework declares one (sources by logical index, an
    ``acc`` reduction stage, a ``dst`` stage), here until codegen/ops/matmul.py exists."""
    from tvm import te

    from blockpad.codegen.ops.common import OpDef, Source, materialize
    from blockpad.codegen.policy import plan

    a = Source("src", bp.Layout(tags[0], (m, k), dtype))
    b = Source("weights", bp.Layout(tags[1], (k, n), dtype))
    r = te.reduce_axis((0, k), "k")
    opdef = OpDef("matmul", [a, b], lambda i, j: te.sum(
        a(i, r).astype("float32") * b(r, j).astype("float32"), axis=r), reduce=True, axes=[r])
    return materialize(opdef, bp.Layout(tags[2], (m, n), "float32"),
                       plan("dst_fused", True, reads_padding=True, reduces_over_padding=True), name)[0]


def compile_cuda(func, name, target_name):
    """(CUDA source, fatbin, PTX) of one scheduled kernel."""
    import tvm

    from blockpad.codegen import cuda_aot
    from blockpad.codegen.targets import get_target

    target = get_target(target_name)
    lib = tvm.compile(tvm.IRModule({name: func}), target=target.tvm_target())
    source = cuda_aot.device_source(lib)
    return (source, *cuda_aot.compile_device(source, cuda_aot.sm(target)))


def cuobjdump():
    """cuobjdump and nvdisasm (which it runs for -sass): on PATH, or from the nvidia-cuda-cuobjdump
    and nvidia-cuda-nvdisasm wheels; None without them."""
    found = shutil.which("cuobjdump"), shutil.which("nvdisasm")
    if all(found):
        return found[0], os.environ
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        tools = [glob.glob(os.path.join(root, "*", "bin", t)) for t in ("cuobjdump", "nvdisasm")]
        if all(tools):
            path = os.pathsep.join({os.path.dirname(t[0]) for t in tools})
            return tools[0][0], {**os.environ, "PATH": path + os.pathsep + os.environ["PATH"]}
    return None


BF16_MATMUL = {"op": "matmul", "dtype": "bfloat16", "shape": [200, 100], "n": 150,
               "src": "AB16b16a", "weights": "ab", "dst": "ab"}   # no multiple of 16 but src


def bf16_matmul_kernel():
    """The matmul op's own bf16 kernel (uint16 bits in its arguments)."""
    return spec_kernel("mm_bf16", BF16_MATMUL)


_TC_CONV = {"op": "conv2d", "dtype": "float16", "kernel": [3, 3], "pad": [1, 1],
            "src": "nChw16c", "weights": "OIhw16i16o", "dst": "nChw16c"}
TC_CONVS = {   # fp16, GEMM M, N, K each > 64 but no multiple of the 128 x 128 x 64 tiles
    "conv_f16_fused": {**_TC_CONV, "shape": [1, 30, 9, 9], "channels": 70},   # C, K tails
    "conv_f16_plain_s2": {**_TC_CONV, "shape": [2, 20, 15, 13], "channels": 72, "stride": [2, 2],
                          "src": "nchw", "weights": "oihw", "dst": "nchw"},
    "conv_f16_1x1_s2_bias": {**_TC_CONV, "shape": [1, 80, 18, 18], "channels": 96,
                             "kernel": [1, 1], "pad": [0, 0], "stride": [2, 2],
                             "post_ops": [{"kind": "bias"}, {"kind": "eltwise", "algorithm": "relu"}]},
    "conv_f16_stage_dst_stage": {**_TC_CONV, "shape": [1, 20, 9, 9], "channels": 72,
                                 "spatial_pad": "stage", "policy": "dst_stage"},
    # bf16 (uint16 bits in the arguments and in halo.staged_source's copy): cuda_bf16's
    # fragments
    "conv_bf16_fused": {**_TC_CONV, "dtype": "bfloat16", "shape": [1, 30, 9, 9],
                        "channels": 70, "post_ops": [{"kind": "bias"}]},
    "conv_bf16_stage_dst_stage": {**_TC_CONV, "dtype": "bfloat16", "shape": [1, 20, 9, 9],
                                  "channels": 72, "weights": "OIhw16i16o2i",
                                  "spatial_pad": "stage", "policy": "dst_stage"},
}


def spec_kernel(name, spec):
    from blockpad.codegen.build import make_kernels

    return make_kernels(parse_spec({"library": {"name": "x"},
                                    "kernel": [{"name": name, **spec}]}).kernels[0])[0]


def emulate_tensor_cores(kernel, out):
    """The CUDA schedule of ``kernel`` with every ``tensorize`` left out, run serially on the
    CPU (``run_serially``) on random inputs and garbage in dst: saves its dst and the unscheduled
    kernel's as ``out``-got.npy and ``out``-expected.npy. ``tensorize`` only swaps a block whose
    loops match an intrinsic's description for the intrinsic, so without it the schedule is the
    tensor-core one (tiles, im2col gather into shared memory, padding, fragments, epilogue,
    predicates) with each wmma load, fill, mma and store as the loops it stands for. Not
    covered: the intrinsics' own code (fragments spread over a warp's lanes), TVM's lowering
    after scheduling, nvcc."""
    from unittest import mock

    import tvm
    from tvm import s_tir

    from blockpad.codegen.targets import get_target
    from blockpad.schedules import schedule

    with mock.patch.object(s_tir.Schedule, "tensorize", lambda *a, **k: None):
        func = schedule(kernel.func, get_target("cuda-sm80"))
    assert 'scope="wmma.accumulator"' in func.script(), "not the tensor-core schedule"
    rng = np.random.default_rng(0)
    args = [_random(rng, [int(x) for x in p.shape], str(p.dtype)) for p in kernel.func.params]
    expected = [a.copy() for a in args]
    run_serially(func)(*args)
    tvm.compile(tvm.IRModule({"main": kernel.func}), target="llvm")["main"](*expected)
    np.save(f"{out}-got.npy", args[-1])
    np.save(f"{out}-expected.npy", expected[-1])


def _random(rng, shape, dtype):
    """Standard normal values; a uint16 parameter holds bf16 bits."""
    if dtype == "uint16":
        return rng.standard_normal(shape).astype(bp.layout.numpy_dtype("bfloat16")).view(dtype)
    return rng.standard_normal(shape).astype(dtype)


@pytest.fixture(scope="session")
def tensor_core_kernels(tmp_path_factory):
    """The tensor-core schedules, each compiled for each arch, keyed by (kernel, arch): two
    matmuls, fp16 (blocked src, so operands are re-indexed on their way to shared memory) and
    bf16 (odd shapes, padded), and the ``TC_CONVS``; plus each conv's serial CPU emulation
    (``emulate_tensor_cores``). Scheduling imports TVM's CUDA tensor intrinsics, whose
    TVMScript decorator calls inspect.stack() hundreds of times: under pytest's deep stacks that
    takes minutes, in a fresh process about half a minute, so all run in one."""
    out = tmp_path_factory.mktemp("tensor_cores")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = f"""
import sys
sys.path.insert(0, {root!r})
from blockpad.codegen.targets import get_target
from blockpad.schedules import schedule
from tests.test_cuda import (ARCHS, TC_CONVS, bf16_matmul_kernel, compile_cuda,
                             emulate_tensor_cores, matmul_kernel, spec_kernel)
kernels = {{"mm_float16": matmul_kernel("mm_f16", 256, 192, 128, "float16",
                                        ("AB16b16a", "ab", "ab")),
           "mm_bfloat16": bf16_matmul_kernel(),
           **{{name: spec_kernel(name, spec) for name, spec in TC_CONVS.items()}}}}
for key, kernel in kernels.items():
    func = schedule(kernel.func, get_target("cuda-sm80"))
    open({str(out)!r} + f"/{{key}}.params", "w").write(" ".join(str(p.dtype) for p in func.params))
    open({str(out)!r} + f"/{{key}}.tir.py", "w").write(func.script())
    for name in ARCHS:
        source, fatbin, ptx = compile_cuda(func, key, name)
        open({str(out)!r} + f"/{{key}}-{{name}}.cu", "w").write(source)
        open({str(out)!r} + f"/{{key}}-{{name}}.fatbin", "wb").write(fatbin)
        open({str(out)!r} + f"/{{key}}-{{name}}.ptx", "w").write(ptx)
    if key in TC_CONVS:
        emulate_tensor_cores(kernel, {str(out)!r} + f"/{{key}}")
"""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    return out


def tensor_core_kernel(out, key, target_name):
    """(CUDA source, fatbin, PTX, parameter dtypes, scheduled TIR) of one of
    ``tensor_core_kernels``."""
    return ((out / f"{key}-{target_name}.cu").read_text(),
            (out / f"{key}-{target_name}.fatbin").read_bytes(),
            (out / f"{key}-{target_name}.ptx").read_text(),
            (out / f"{key}.params").read_text().split(), (out / f"{key}.tir.py").read_text())


TENSOR_CORES = {   # dtype: (wmma mma in the PTX, HMMA in the SASS)
    "float16": (r"m16n16k16\.f32\.f32", "HMMA.16816.F32"),
    "bfloat16": (r"m16n16k16\.f32\.bf16\.bf16\.f32", "HMMA.16816.F32.BF16"),
}


@pytest.mark.slow   # the first tensor-core schedule in a process imports TVM's intrinsics
@pytest.mark.parametrize("dtype", list(TENSOR_CORES))
@pytest.mark.parametrize("target_name", list(ARCHS))
def test_matmul_runs_on_tensor_cores(tensor_core_kernels, dtype, target_name):
    source, fatbin, ptx, params, _ = tensor_core_kernel(tensor_core_kernels, f"mm_{dtype}",
                                                        target_name)
    cc = ARCHS[target_name]
    assert "nvcuda::wmma::mma_sync" in source
    assert re.search(rf"^\.target sm_{cc}$", ptx, re.M)
    mma = re.findall(rf"^\s*wmma\.mma\.sync\.aligned\.row\.col\.{TENSOR_CORES[dtype][0]}",
                     ptx, re.M)
    assert len(mma) >= 8, "expected the tensor-core MMA in the PTX"
    entries, _ = fatbin_entries(fatbin)
    assert {(1, cc), (2, cc)} <= set(entries)
    if dtype == "bfloat16":   # bf16 stays uint16 bits in the arguments, as everywhere
        assert params == ["uint16", "uint16", "float32"]


@pytest.mark.slow
@pytest.mark.skipif(cuobjdump() is None, reason="the SASS check needs cuobjdump and nvdisasm "
                    "(pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm; .ci/run does)")
@pytest.mark.parametrize("dtype", list(TENSOR_CORES))
@pytest.mark.parametrize("target_name", list(ARCHS))
def test_matmul_sass_has_hmma(tensor_core_kernels, dtype, target_name, tmp_path):
    _, fatbin, _, _, _ = tensor_core_kernel(tensor_core_kernels, f"mm_{dtype}", target_name)
    sass = disassemble(fatbin, tmp_path)
    assert f"code for sm_{ARCHS[target_name]}" in sass and TENSOR_CORES[dtype][1] in sass


def disassemble(fatbin, tmp_path) -> str:
    """The SASS of ``fatbin`` (cuobjdump -sass)."""
    tool = cuobjdump()
    (tmp_path / "k.fatbin").write_bytes(fatbin)
    sass = subprocess.run([tool[0], "-sass", str(tmp_path / "k.fatbin")], env=tool[1],
                          capture_output=True, text=True, timeout=120)
    assert sass.returncode == 0, sass.stderr
    return sass.stdout



@pytest.mark.slow
@pytest.mark.parametrize("target_name", list(ARCHS))
def test_fp16_and_bf16_conv_run_on_tensor_cores(tensor_core_kernels, target_name):
    """Implicit GEMM: source windows gathered (im2col, never materialised) and weights staged
    in dynamic shared memory by all threads, 16x16x16 wmma fragments loaded from there, fp32
    accumulation; one kernel (epilogue fused); spatial padding guarded in the gather; the
    dst_stage predicate kept. bf16 stays uint16 bits in the arguments."""
    cc = ARCHS[target_name]
    tir = {}
    for name in TC_CONVS:
        source, fatbin, ptx, params, tir[name] = tensor_core_kernel(tensor_core_kernels, name,
                                                                    target_name)
        dtype = TC_CONVS[name]["dtype"]
        assert "nvcuda::wmma::mma_sync" in source, name
        assert re.search(rf"^\.target sm_{cc}$", ptx, re.M) and ptx.count(".entry") == 1, name
        mma = re.findall(rf"^\s*wmma\.mma\.sync\.aligned\.row\.col\."
                         rf"{TENSOR_CORES[dtype][0]}", ptx, re.M)
        assert len(mma) >= 8, name
        element = {"float16": "shared.f16", "bfloat16": "bf16"}[dtype]
        for operand in ("a.sync.aligned.row", "b.sync.aligned.col"):
            assert f"wmma.load.{operand}.m16n16k16.{element}" in ptx, name
        if dtype == "bfloat16":
            assert params[:2] == ["uint16", "uint16"] and "float32" in params[2:], name
        assert ".extern .shared" in ptx and "bar.sync" in ptx, name
        assert 'scope="shared.dyn"' in tir[name] and "T.tvm_mma_sync(" in tir[name], name
        assert {(1, cc), (2, cc)} <= set(fatbin_entries(fatbin)[0]), name
    assert re.search(r"src_pad_reindex_pad_shared_dyn\[.*\] = T\.if_then_else\(.*"
                     r"T\.if_then_else\(1 <= ", tir["conv_f16_fused"])   # the halo guard
    for name in ("conv_f16_stage_dst_stage", "conv_bf16_stage_dst_stage"):
        assert re.search(r"T\.where\(.* and not .*>= 72\)", tir[name]), name
    assert re.search(r"src_pad_reindex_pad_shared_dyn\[.*\] = T\.if_then_else\(.*"
                     r"T\.if_then_else\(1 <= .*T\.reinterpret\(\"bfloat16\", src\[",
                     tir["conv_bf16_fused"])   # the halo guard around the bits read as bf16


@pytest.mark.slow
@pytest.mark.skipif(cuobjdump() is None, reason="the SASS check needs cuobjdump and nvdisasm "
                    "(pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm; .ci/run does)")
@pytest.mark.parametrize("target_name", list(ARCHS))
def test_fp16_and_bf16_conv_sass_has_hmma(tensor_core_kernels, target_name, tmp_path):
    for name, spec in TC_CONVS.items():
        sass = disassemble(tensor_core_kernel(tensor_core_kernels, name, target_name)[1],
                           tmp_path)
        assert f"code for sm_{ARCHS[target_name]}" in sass, name
        assert TENSOR_CORES[spec["dtype"]][1] in sass, name


@pytest.mark.slow
@pytest.mark.parametrize("name", list(TC_CONVS))
def test_tensor_core_conv_algorithm_on_the_cpu(tensor_core_kernels, name):
    """The tensor-core schedule with each wmma intrinsic as the loops it replaces, run serially
    on the CPU (``emulate_tensor_cores`` says what that covers) against the unscheduled kernel:
    valid outputs within fp16 rounding of fp32 sums (bf16: exact products, fp32 sums),
    padding the plan leaves (dst_stage) exactly the garbage it was."""
    got = np.load(tensor_core_kernels / f"{name}-got.npy")
    expected = np.load(tensor_core_kernels / f"{name}-expected.npy")
    assert not np.isnan(got).any() and np.abs(expected).max() > 1
    np.testing.assert_allclose(got.astype("float32"), expected.astype("float32"),
                               rtol=1e-2, atol=1e-2)


def test_small_or_grouped_fp16_conv_stays_on_cuda_cores():
    """M = 36 output pixels is below the tensor-core rule's GEMM sizes, and a depthwise
    convolution is no GEMM: DirectConv (fp16 sources, fp32 FMAs) takes both."""
    from blockpad.codegen.targets import get_target
    from blockpad.schedules import schedule

    for name, spec in {"small": {"shape": [1, 16, 6, 6], "channels": 80},
                       "depthwise": {"shape": [1, 96, 10, 10], "channels": 96, "groups": 96,
                                     "weights": "Goihw16g"}}.items():
        kernel = spec_kernel(name, {**_TC_CONV, **spec})
        _, _, ptx = compile_cuda(schedule(kernel.func, get_target("cuda-sm80")), name,
                                 "cuda-sm80")
        assert not re.search(r"\bw?mma\.", ptx) and re.search(r"fma\.rn(\.ftz)?\.f32", ptx), name
        assert "bar.sync" in ptx, name

def test_fp32_matmul_tiles_through_shared_memory():
    from blockpad.codegen.targets import get_target
    from blockpad.schedules import schedule

    kernel = matmul_kernel("mm_f32", 100, 70, 50, "float32")   # no multiple of any tile
    source, _, ptx = compile_cuda(schedule(kernel.func, get_target("cuda-sm80")), "mm_f32",
                                  "cuda-sm80")
    assert "__shared__" in source and "__syncthreads()" in source
    assert not re.search(r"\bw?mma\.", ptx) and re.search(r"ld\.shared(\.v\d)?\.f32", ptx)


def test_fallback_binds_any_kernel():
    """Ops without a CUDA rule still get every loop bound (here a matmul kept from its rule)."""
    from blockpad.codegen.targets import get_target
    from blockpad.schedules import cuda

    kernel = matmul_kernel("mm_any", 33, 17, 9, "float32")
    sch = cuda.Fallback().apply(kernel.func, get_target("cuda-sm80"))
    source, _, ptx = compile_cuda(sch.mod["main"], "mm_any", "cuda-sm80")
    assert source.count("__global__") >= 2 and ".target sm_80" in ptx


def test_dst_stage_matmul_keeps_its_predicate():
    """dst_stage: output columns 100..111 of the last aB16b block are padding the kernel must
    leave alone. dlight inlines the ``dst`` stage (and its ``T.where``) into its store from the
    accumulator, whose own predicate bounds only dlight's tile; KeptPredicates puts it back.
    Checked in the TIR and by running the schedule serially on the CPU with garbage in dst."""
    import tvm

    from blockpad.codegen.build import make_kernels
    from blockpad.codegen.targets import get_target
    from blockpad.schedules import schedule

    spec = parse_spec({"library": {"name": "x"}, "kernel": [
        {"name": "mm_stage", "op": "matmul", "shape": [100, 50], "n": 100, "src": "ab",
         "weights": "ab", "dst": "aB16b", "policy": "dst_stage"}]})
    kernel = make_kernels(spec.kernels[0])[0]
    func = schedule(kernel.func, get_target("cuda-sm80"))
    text = func.script()
    assert 'T.sblock("dst")' not in text and "acc_reindex_pad_local" in text   # dlight's rule
    assert re.search(r"T\.where\(.* and not .*>= 100\)", text)
    rng = np.random.default_rng(0)
    args = [_random(rng, [int(x) for x in p.shape], str(p.dtype)) for p in kernel.func.params]
    expected = [a.copy() for a in args]
    run_serially(func)(*args)
    tvm.compile(tvm.IRModule({"main": kernel.func}), target="llvm")["main"](*expected)
    np.testing.assert_allclose(args[-1], expected[-1], rtol=1e-5, atol=1e-5)   # padding too


# ---- convolution, softmax, pooling: their own CUDA rules ---------------------------------------

_CONV = {"op": "conv2d", "kernel": [3, 3], "pad": [1, 1], "src": "nChw16c",
         "weights": "OIhw16i16o", "dst": "nChw16c"}
OPS = {   # small shapes; channel tails (C = 20, 30), ragged tiles, every padding mechanism
    "conv_fused": {**_CONV, "shape": [1, 30, 8, 8], "channels": 20},
    "conv_stage_bias": {**_CONV, "shape": [1, 20, 7, 7], "channels": 24, "spatial_pad": "stage",
                        "post_ops": [{"kind": "bias"}, {"kind": "eltwise", "algorithm": "relu"}]},
    "conv_dst_stage": {**_CONV, "shape": [1, 20, 6, 6], "channels": 24, "policy": "dst_stage"},
    "conv_src_policy": {**_CONV, "shape": [1, 20, 6, 6], "channels": 24, "policy": "src"},
    "conv_plain_s2": {**_CONV, "shape": [2, 5, 9, 11], "channels": 7, "stride": [2, 2],
                      "src": "nchw", "weights": "oihw", "dst": "nchw"},
    "conv_depthwise": {**_CONV, "shape": [1, 32, 10, 10], "channels": 32, "groups": 32,
                       "weights": "Goihw16g"},
    "conv_halo": {**_CONV, "shape": [1, 16, 8, 8], "channels": 16,
                  "src": {"tag": "nChw16c", "paddings": {"h": [1, 1], "w": [1, 1]}}},
    "softmax": {"op": "softmax", "shape": [2, 30, 3, 5], "src": "nChw16c", "dst": "nChw16c"},
    "softmax_stage": {"op": "softmax", "shape": [2, 30, 3, 5], "policy": "dst_stage",
                      "src": "nChw16c", "dst": "nChw16c"},
    "logsoftmax_wide": {"op": "softmax", "shape": [2, 3000, 2, 3], "log": True, "src": "nhwc",
                        "dst": "nhwc"},
    "softmax_h_mixed": {"op": "softmax", "shape": [2, 30, 7, 5], "axis": 2, "src": "nchw",
                        "dst": "nChw16c"},
    # dst's halo gives its stage more rows than the statistics' (seed 1 case 134 on an H100)
    "softmax_halo": {"op": "softmax", "shape": [7, 3], "axis": 0,
                     "src": {"tag": "ab", "paddings": {"b": [2, 0]}},
                     "dst": {"tag": "ab", "paddings": {"b": [1, 1]}}},
    # one row of statistics per block under 8 rows of threads (dst's padded 8b): TVM dropped
    # the rows' predicate from the statistic's store (seed 12 case 98 on an H100: inf, NaN)
    "softmax_one_row": {"op": "softmax", "shape": [5, 1, 6, 5, 9], "axis": 0,
                        "src": "dceAB8b16a", "dst": "dceAB8b16a"},
    # built nothing before (seed 1 on an H100 host): a vector select nvcc refused (the
    # epilogue of dlight's matmul, vectorized), and a channel tile across conv groups whose
    # shared copy changes size per block (TVM's CanProveDivisible)
    "matmul_u8_select": {"op": "matmul", "shape": [11, 7], "dtype": "uint8", "n": 24,
                         "post_ops": [{"kind": "bias"}, {"kind": "eltwise", "algorithm": "tanh"}],
                         "src": "ab", "weights": "ab", "dst": "Ab4a"},
    "grouped_tile_across_groups": {"op": "conv2d", "shape": [1, 24, 3, 9], "channels": 18,
                                   "groups": 3, "kernel": [5, 5], "stride": [1, 3], "pad": [4, 3],
                                   "src": "nhwC8c", "weights": "goIhw8i", "dst": "nchw"},
    # built nothing before (seed 1818): a one-element shared tile (one channel, one tap a
    # step) left its copy no loop to bind; the quantized add's fmas had no CUDA lowering
    "one_tap_conv": {"op": "conv2d", "shape": [2, 1, 9, 1], "channels": 1, "kernel": [1, 3],
                     "stride": [1, 3], "pad": [0, 2], "dilation": [1, 2], "src": "nChw8c",
                     "weights": "oihw", "dst": "nChW8w8c"},
    "qconv_add": {"op": "conv2d", "shape": [2, 3, 5, 5], "dtype": "uint8", "channels": 20,
                  "kernel": [3, 3], "pad": [1, 1], "src": "nChw16c", "weights": "OIhw4i16o4i",
                  "dst": "nChw16c", "src_zero_point": 119, "dst_dtype": "int8",
                  "dst_scale": 0.05, "dst_zero_point": -1, "addend": "nChw16c",
                  "post_ops": [{"kind": "quantized_add", "scales": [0.1, 0.02, 0.1],
                                "zero_points": [-1, 25, 96], "addend_first": True,
                                "dt": "int8"}]},
    "qmatmul_add": {"op": "matmul", "shape": [14, 27], "dtype": "int8", "n": 13,
                    "policy": "dst_stage", "src": "aB16b2b", "weights": "aB4b", "dst": "aB16b",
                    "dst_dtype": "uint8", "dst_scale": 0.05, "addend": "aB16b",
                    "post_ops": [{"kind": "quantized_add", "scales": [0.01, 0.02, 0.1],
                                  "zero_points": [0, 52, 125]}]},
    "pool_avg": {"op": "pool", "shape": [2, 30, 8, 8], "algorithm": "avg", "kernel": [3, 3],
                 "stride": [2, 2], "pad": [1, 1], "src": "nChw16c", "dst": "nChw16c"},
    "pool_max_stage": {"op": "pool", "shape": [2, 30, 9, 9], "kernel": [3, 3], "stride": [2, 2],
                       "policy": "dst_stage", "src": "nChw16c", "dst": "nChw16c"},
}


@pytest.fixture(scope="session", params=list(ARCHS))
def ops_lib(request, build_dir):
    out = build_dir / f"ops-{request.param}"
    spec = {"library": {"name": "cuda-ops"}, "kernel": [{"name": n, **k} for n, k in OPS.items()]}
    bp.build(parse_spec(spec), request.param, out, log=lambda m: None)
    return ARCHS[request.param], out


def kernel_ptx(out, name):
    from blockpad.generated import show

    return show(out, "ptx", name)


def test_conv_tiles_through_shared_memory(ops_lib):
    """Every conv: one kernel, a 2-D thread block tile staged through shared memory with
    barriers, FMAs on shared/register operands, accumulators in registers (no local memory)."""
    cc, out = ops_lib
    for name in (n for n in OPS if n.startswith("conv")):
        ptx = kernel_ptx(out, name)
        assert ptx.count(".entry") == 1, name   # the epilogue is fused, nothing left at the root
        assert ".shared" in ptx and "bar.sync" in ptx and re.search(r"ld\.shared", ptx), name
        assert re.search(r"fma\.rn(\.ftz)?\.f32", ptx) and ".local" not in ptx, name
        tir = (out / "source" / f"{name}.tir.py").read_text()
        assert 'thread="threadIdx.x"' in tir and 'scope="shared"' in tir, name
    fused = (out / "source" / "conv_fused.tir.py").read_text()
    # fused spatial padding: the guard loads the zero-haloed shared tile, not the FMA operand
    assert re.search(r'src_pad_shared\[.*\] = T\.if_then_else\(', fused)
    stage = (out / "source" / "conv_dst_stage.tir.py").read_text()
    assert "T.where(" in stage and ">= 24" in stage        # channels 24..31 not written


def test_softmax_reduces_across_threads(ops_lib):
    """A block of rows per thread block; each row's max and sum reduced across its lanes (warp
    shuffles), computed once per row, not per element; one kernel."""
    from blockpad.generated import show

    cc, out = ops_lib
    for name in (n for n in OPS if "softmax" in n):
        ptx = kernel_ptx(out, name)
        assert ptx.count(".entry") == 1 and "shfl.sync" in ptx, name
        tir = (out / "source" / f"{name}.tir.py").read_text()
        assert 'thread="threadIdx.y"' in tir, name
        for stat in ("max", "sum"):   # the row reduction's inner loop is the lanes
            block = tir.split(f'T.sblock("{stat}")')[0].rsplit("for ", 3)
            assert 'thread="threadIdx.x"' in "".join(block[-2:]), (name, stat)
        # one block shape: every stage binds the extents dst binds (TVM launched the first
        # binding's, and the rows beyond it went unwritten on an H100)
        for axis in ("threadIdx.x", "threadIdx.y"):
            extents = set(re.findall(rf'T\.thread_binding\((\d+), thread="{axis}"\)', tir))
            assert len(extents) == 1, (name, axis, extents)
        # lane 0 stores a row's statistic; a barrier before the other lanes read it (TVM put
        # none where they index it alike: wrong rows on an H100)
        source = show(out, "cuda", name)
        stores = re.findall(r"== 0\)+ \{\s*\w+_shared_ptr\[[^\]]*\] = [^;]*;\s*\}\s*(\S+)", source)
        assert stores and all(nxt == "__syncthreads();" for nxt in stores), (name, stores)
        # a store not guarded by the row of threads is made by every row: every row must have
        # reduced the statistic (a guard on threadIdx.y before it, and not on the store, is
        # the predicate TVM drops: the other rows store the identity)
        for store in re.finditer(r"if \(([^\n]*)\) \{\s*\w+_shared_ptr\[[^\]]*\] = red_buf",
                                 source):
            # from the statistic's initial value to its first shuffle
            reduce = re.split(r"in_thread_\w+\[0\] = [-0-9]", source[:store.start()])[-1]
            reduce = reduce.split("__shfl")[0]
            if "threadIdx.y" not in store.group(1):
                assert "threadIdx.y" not in reduce, (name, store.group(0))
    assert "T.where(" in (out / "source" / "softmax_stage.tir.py").read_text()


def test_what_nvcc_or_tvm_refused_builds(ops_lib):
    """The two CUDA build failures of seed 1 build (ops_lib would not exist otherwise): no
    select left in a vectorized loop, and the cross-group tile on the fallback rule."""
    cc, out = ops_lib
    lines = (out / "source" / "matmul_u8_select.tir.py").read_text().splitlines()
    at = next(i for i, line in enumerate(lines) if "T.Select(" in line)
    indent, loops = len(lines[at]) - len(lines[at].lstrip()), []
    for line in reversed(lines[:at]):     # the loops around the select
        depth = len(line) - len(line.lstrip())
        if depth < indent and line.lstrip().startswith("for "):
            loops.append(line)
        indent = min(indent, depth)
    assert loops and not any("T.vectorized(" in loop for loop in loops), loops
    assert 'scope="shared"' not in (out / "source" / "grouped_tile_across_groups.tir.py").read_text()


def test_quantized_add_rounds_each_fma_once(ops_lib):
    """QLinearAdd's two fmas reach the device code as CUDA's ``__fmaf_rn`` (TVM lowers
    ``tirx.fma`` for LLVM only): a single rounding each, as on the CPU and in ONNX Runtime."""
    from blockpad.generated import show

    cc, out = ops_lib
    for name in ("qconv_add", "qmatmul_add"):
        assert show(out, "cuda", name).count("__fmaf_rn(") >= 2, name
        assert re.search(r"fma\.rn\.f32", kernel_ptx(out, name)), name


def test_a_one_element_tile_is_copied_by_one_thread(ops_lib):
    cc, out = ops_lib
    tir = (out / "source" / "one_tap_conv.tir.py").read_text()
    assert 'scope="shared"' in tir and re.search(r"T\.where\(\w+ \* \d+ \+ \w+ < 1\)", tir)


def test_pool_reduces_its_window_in_a_register(ops_lib):
    cc, out = ops_lib
    for name in ("pool_avg", "pool_max_stage"):
        ptx = kernel_ptx(out, name)
        assert ptx.count(".entry") == 1 and ".local" not in ptx, name
        tir = (out / "source" / f"{name}.tir.py").read_text()
        assert 'scope="local"' in tir and "T.unroll(3)" in tir, name
    assert "T.where(" in (out / "source" / "pool_max_stage.tir.py").read_text()


def run_serially(func):
    """``func``, a scheduled CUDA kernel, made runnable on the CPU: each thread-bound loop
    becomes a serial loop (a block's threads one after the other: a cooperative copy then
    completes before the loop that reads it, as its barrier promises), shared and local buffers
    become plain memory. Local buffers are per thread on a GPU: each serial thread iteration
    starts by filling the local buffers it touches with NaN (integers: -2^30 + 7), so a thread
    that read another thread's registers would show it. Explicit barriers are dropped. What this does not
    check: TVM's own lowering after scheduling (barrier insertion, the all-reduce lowering,
    storage compaction) and nvcc: a missing barrier showed only on a GPU (blockpad check
    --run-built)."""
    import tvm
    import tvm_ffi
    from tvm import tirx

    local = [b for b in func.body.block.alloc_buffers if b.scope() == "local"]

    def touches(stmt, buf):
        hit = []
        tvm_ffi.structural_walk(stmt, [
            (tvm.ir.expr.TensorLoad, lambda n: hit.append(n.source.same_as(buf))),
            (tirx.BufferStore, lambda n: hit.append(n.buffer.same_as(buf)))])
        return any(hit)

    def poison(buf):
        idx = [tirx.Var(f"p{i}", "int32") for i in range(len(buf.shape))]
        garbage = float("nan") if "float" in str(buf.dtype) else -(1 << 30) + 7   # int32 acc
        stmt = tirx.BufferStore(buf, tirx.const(garbage, str(buf.dtype)), idx)
        for v, n in reversed(list(zip(idx, buf.shape))):
            stmt = tirx.For(v, 0, n, tirx.ForKind.SERIAL, stmt)
        return stmt

    def serial(loop):
        if loop.kind != tirx.ForKind.THREAD_BINDING:
            return loop
        fills = [poison(b) for b in local if touches(loop.body, b)]
        body = tirx.SeqStmt([*fills, loop.body]) if fills else loop.body
        return tirx.For(loop.loop_var, loop.min, loop.extent, tirx.ForKind.SERIAL, body, None,
                        loop.annotations)

    def no_barrier(seq):   # a serial block's threads need none, and the CPU has none
        kept = [st for st in seq.seq if not (isinstance(st, tirx.Evaluate) and isinstance(
            st.value, tvm.ir.expr.Call) and st.value.op.name == "tirx.tvm_storage_sync")]
        return tirx.SeqStmt(kept) if len(kept) > 1 else kept[0]

    serial_func = tvm_ffi.structural_map(func, [(tirx.For, serial), (tirx.SeqStmt, no_barrier)])
    return tvm.compile(tvm.IRModule({"main": serial_func}), target="llvm")["main"]


@pytest.mark.parametrize("name", list(OPS))
def test_scheduled_algorithm_matches_the_kernel_on_the_cpu(name):
    """The CUDA schedule's algorithm (tiles, staging, cross-thread reductions, predicates), run
    serially on the CPU, against the same kernel unscheduled: no GPU here to run it on."""
    import tvm

    from blockpad.codegen.build import make_kernels
    from blockpad.codegen.targets import get_target
    from blockpad.schedules import schedule

    spec = parse_spec({"library": {"name": "x"}, "kernel": [{"name": name, **OPS[name]}]})
    kernel = make_kernels(spec.kernels[0])[0]
    scheduled = run_serially(schedule(kernel.func, get_target("cuda-sm80")))
    reference = tvm.compile(tvm.IRModule({"main": kernel.func}), target="llvm")["main"]
    rng = np.random.default_rng(0)
    # garbage in dst: padding the plan leaves must stay
    args = [_random(rng, [int(x) for x in p.shape], str(p.dtype)) for p in kernel.func.params]
    expected = [a.copy() for a in args]
    scheduled(*args)
    reference(*expected)
    assert not np.isnan(args[-1]).any()
    np.testing.assert_allclose(args[-1], expected[-1], rtol=1e-4, atol=1e-4)   # summation order


# ---- calling a GPU library: GPU tensors in, zero-copy, padding contract honoured -------------

class FakeCudaTensor:
    """A DLPack producer that says its memory is on CUDA device 0 (as a torch.cuda tensor does),
    backed by host memory that nothing here dereferences: enough to drive the runtime's argument
    path up to the launch without a GPU."""

    _exported = []   # every DLManagedTensor handed out, with its owner

    def __init__(self, shape, dtype="float32", device=2, strides=None):
        self.array = np.zeros(shape, dtype)
        self.device = device
        self._shape = (ctypes.c_int64 * len(shape))(*shape)
        self._strides = None if strides is None else (ctypes.c_int64 * len(shape))(*strides)

    def __dlpack_device__(self):
        return self.device, 0

    def __dlpack__(self, stream=None, **kwargs):
        code = {"f": 2, "i": 0, "u": 1}[self.array.dtype.kind]
        tensor = _DLManagedTensor(_DLTensor(
            self.array.ctypes.data, _DLDevice(self.device, 0), self.array.ndim,
            _DLDataType(code, 8 * self.array.itemsize, 1),
            ctypes.cast(self._shape, ctypes.POINTER(ctypes.c_int64)),
            None if self._strides is None else
            ctypes.cast(self._strides, ctypes.POINTER(ctypes.c_int64)), 0), None, None)
        # no deleter: the struct, and the shape and memory it points to, are kept for the
        # whole session: the runtime's tensors made from them may outlive this object (freed
        # first, they crashed the garbage collector at exit)
        self._exported.append((tensor, self))
        new = ctypes.pythonapi.PyCapsule_New
        new.restype, new.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_char_p,
                                                        ctypes.c_void_p]
        return new(ctypes.addressof(tensor), b"dltensor", None)


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p),
                ("deleter", ctypes.c_void_p)]


@pytest.fixture
def gpu_library(cuda_lib):
    """The built CUDA library with its module replaced by a recorder of launches (this machine
    has no GPU to load the real one on)."""
    from blockpad import manifest as mf
    from blockpad.runtime.library import Library

    launches = []

    class Module:
        def __getitem__(self, name):
            return lambda *tensors: launches.append((name, tensors))
    return Library(str(cuda_lib[2]), mf.read(cuda_lib[2]), Module()), launches


def test_gpu_kernels_take_gpu_tensors_zero_copy(gpu_library):
    lib, launches = gpu_library
    assert lib.device == "cuda"
    lay = lib["relu_stage"].signature.args[0][2]
    src, dst = FakeCudaTensor(lay.physical_shape), FakeCudaTensor(lay.physical_shape)
    lib["relu_stage"](src, dst)
    (name, (s, d)), (stage, (z,)) = launches
    assert name == "relu_stage" and stage == "relu_stage__zero_pad_dst"   # dst_stage's stage
    assert str(s.device) == "cuda:0" and s.data_ptr() == src.array.ctypes.data   # no copy
    assert d.data_ptr() == z.data_ptr() == dst.array.ctypes.data
    launches.clear()
    plain = lib["reorder_nchw_nChw16c_f32_2x30x5x7"]
    plain(FakeCudaTensor(SHAPE), FakeCudaTensor(lay.physical_shape))     # logical shape: plain
    assert [n for n, _ in launches] == [plain.name]


def test_gpu_kernels_refuse_host_memory_and_bad_tensors(gpu_library):
    lib, launches = gpu_library
    k = lib["relu_fused"]
    shape = k.signature.args[0][2].physical_shape
    with pytest.raises(bp.ArgumentError, match="runs on a CUDA GPU; expected a tensor in CUDA "
                                               "device memory; got one on cpu"):
        k(np.zeros(shape, "float32"), FakeCudaTensor(shape))
    with pytest.raises(bp.ArgumentError, match="expected a CUDA tensor .*; got list"):
        k([0.0], FakeCudaTensor(shape))
    with pytest.raises(bp.ArgumentError, match=r"takes a GPU tensor of physical shape "
                                               r"\(2, 2, 5, 7, 16\); got shape \(2, 30, 5, 7\)"):
        k(FakeCudaTensor(SHAPE), FakeCudaTensor(shape))
    with pytest.raises(bp.ArgumentError, match="expected dtype float32; got int32"):
        k(FakeCudaTensor(shape, "int32"), FakeCudaTensor(shape))
    same = FakeCudaTensor(shape)
    with pytest.raises(bp.ArgumentError, match="overlap in memory"):
        k(same, same)
    with pytest.raises(bp.ArgumentError, match="bind"):
        k.bind(FakeCudaTensor(shape), FakeCudaTensor(shape))
    k.signature.padding = {**k.signature.padding, "policy": "tracked"}
    with pytest.raises(bp.ArgumentError, match="policy 'tracked' keeps padding state"):
        k(FakeCudaTensor(shape), FakeCudaTensor(shape))
    assert not launches


def test_a_bf16_gpu_kernel_takes_the_bits_and_names_them():
    """A bf16 kernel moves uint16 bits: it takes a uint16 view of the tensor, and a bfloat16
    tensor is refused with what to pass instead (not a message that contradicts itself)."""
    from blockpad.runtime.library import _as_gpu_tensor

    lay = bp.Layout("nChw16c", (1, 20, 3, 3), "bfloat16")
    bits = FakeCudaTensor(lay.physical_shape, "uint16")
    assert str(_as_gpu_tensor(bits, "k: argument 'src'", "in", lay, "uint16").dtype) == "uint16"
    with pytest.raises(bp.ArgumentError, match=r"expected dtype bfloat16 \(as its uint16 "
                                               r"bits\); got float32"):
        _as_gpu_tensor(FakeCudaTensor(lay.physical_shape), "k", "in", lay, "uint16")
