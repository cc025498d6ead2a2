"""The ``avx512-vnni``, ``avx512-bf16`` and ``amx`` targets: libraries built the way users
build them, the instructions asserted in their assembly, their numbers checked against numpy,
and the runtime's guards (CPU features, AMX permission) exercised for real.

This machine may or may not have the instructions: VNNI and BF16 kernels run for real where the
CPU has ``avx512_vnni`` / ``avx512_bf16`` (skipped, saying so, where it has not; their
schedules also run everywhere with the plain-loop twins of the instructions). AMX kernels run for real only on a CPU
with AMX; elsewhere the same schedules (same packing, blocking and accumulation order) run with
the plain-loop twins of the tile intrinsics (``schedules.x86_intrin``) on the host, and loading
the AMX library must raise an error naming the missing feature, never die of SIGILL."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import blockpad as bp
from blockpad import assembly, machine
from blockpad.bench import isa
from blockpad.codegen.build import make_kernels
from blockpad.codegen.spec import parse_spec
from blockpad.codegen.targets import get_target
from blockpad.runtime.library import Signature
from blockpad.vocabulary import POLICIES

from .conftest import asm_functions, dot_inputs, kernel_instructions
from .reference import dot_reference

HAVE_VNNI = "avx512_vnni" in machine.cpu_features()
HAVE_AMX = {"amx_tile", "amx_int8", "amx_bf16"} <= machine.cpu_features()
NO_VNNI = "this CPU has no avx512_vnni: vpdpbusd cannot execute here"

LARGE_WEIGHTS = {"name": "conv_u8_large", "op": "conv2d", "dtype": "uint8",
                 "shape": [1, 512, 2, 7], "channels": 1024, "kernel": [1, 1],
                 "src": "nChw16c", "weights": "OIhw4i16o4i", "dst": "nChw16c",
                 "post_ops": [{"kind": "bias"}]}
# int8 with channel tails (C=20, K=24 pad to 32), spatial padding read through a guard and from
# a pre-padded halo, s8 and u8 sources, odd rows (M=19), blocked and plain destinations
VNNI_SPEC = {"library": {"name": "test-vnni"}, "kernel": [
    {"name": "conv_s8_pad", "op": "conv2d", "dtype": "int8", "shape": [2, 20, 5, 6],
     "channels": 24, "kernel": [3, 3], "pad": [1, 1], "src": "nChw16c",
     "weights": "OIhw4i16o4i", "dst": "nChw16c"},
    {"name": "conv_s8_halo", "op": "conv2d", "dtype": "int8", "shape": [1, 32, 4, 7],
     "channels": 16, "kernel": [3, 3], "pad": [1, 1], "weights": "OIhw4i16o4i",
     "src": {"tag": "nChw16c", "paddings": {"h": [1, 1], "w": [1, 1]}}, "dst": "nChw16c"},
    {"name": "conv_u8_bias_relu", "op": "conv2d", "dtype": "uint8", "shape": [1, 32, 3, 9],
     "channels": 16, "kernel": [1, 1], "stride": [1, 2], "src": "nChw16c",
     "weights": "OIhw4i16o4i", "dst": "nChw16c",
     "post_ops": [{"kind": "bias"}, {"kind": "eltwise", "algorithm": "relu"}]},
    {"name": "mm_u8", "op": "matmul", "dtype": "uint8", "shape": [6, 40], "n": 32, "src": "ab",
     "weights": "BA16b4a", "dst": "ab"},
    {"name": "mm_s8_rows19", "op": "matmul", "dtype": "int8", "shape": [19, 64], "n": 48,
     "src": "ab", "weights": "BA16b4a", "dst": "aB16b"},
    # other padding policies: a separate stage zeroes the destination padding; masked reads
    # of a source whose padding may be garbage
    {"name": "conv_s8_stage", "op": "conv2d", "dtype": "int8", "shape": [1, 20, 3, 5],
     "channels": 24, "kernel": [3, 3], "pad": [1, 1], "src": "nChw16c",
     "weights": "OIhw4i16o4i", "dst": "nChw16c", "policy": "dst_stage"},
    {"name": "conv_s8_masked", "op": "conv2d", "dtype": "int8", "shape": [1, 20, 3, 5],
     "channels": 24, "kernel": [3, 3], "pad": [1, 1], "src": "nChw16c",
     "weights": "OIhw4i16o4i", "dst": "nChw16c", "policy": "src"},
    # N and K that are not multiples of the 16 lanes or of 4: padded accumulator lanes
    # nobody reads, a source copied with its rows zero-padded to a multiple of 4
    {"name": "mm_s8_odd", "op": "matmul", "dtype": "int8", "shape": [7, 18], "n": 13,
     "src": "ab", "weights": "BA16b4a", "dst": "ab"},
    {"name": "mm_u8_odd_stage", "op": "matmul", "dtype": "uint8", "shape": [5, 30], "n": 30,
     "src": "ab", "weights": "BA16b4a", "dst": "aB16b", "policy": "dst_stage"},
    # 512 KiB of weights: read panel by panel, each tile prefetching the next panel's
    # (prefetch.prefetch_next_panel)
    LARGE_WEIGHTS,
    # not tensorized (fp32, bf16: RegisterTiled): zmm FMAs along the 16-channel block; bf16
    # with channel tails, spatial padding, bias and relu in fp32
    {"name": "conv_f32", "op": "conv2d", "dtype": "float32", "shape": [1, 16, 4, 6],
     "channels": 16, "kernel": [3, 3], "pad": [1, 1], "src": "nChw16c",
     "weights": "OIhw16i16o", "dst": "nChw16c"},
    {"name": "conv_bf16", "op": "conv2d", "dtype": "bfloat16", "shape": [2, 20, 5, 6],
     "channels": 24, "kernel": [3, 3], "pad": [1, 1], "src": "nChw16c",
     "weights": "OIhw16i16o2i", "dst": "nChw16c",
     "post_ops": [{"kind": "bias"}, {"kind": "eltwise", "algorithm": "relu"}]},
    {"name": "mm_bf16_small", "op": "matmul", "dtype": "bfloat16", "shape": [4, 32], "n": 16,
     "src": "ab", "weights": "BA16b2a", "dst": "ab"},
]}
VNNI_INT8 = ("conv_s8_pad", "conv_s8_halo", "conv_u8_bias_relu", "mm_u8", "mm_s8_rows19",
             "conv_s8_stage", "conv_s8_masked", "mm_s8_odd", "mm_u8_odd_stage", "conv_u8_large")

# AMX: rows and columns multiples of 16, K a multiple of 64 (int8) / 32 (bf16); the nChw16c
# convolution (16 channels a row, not 64) is left to vpdpbusd in the same library
AMX_SPEC = {"library": {"name": "test-amx"}, "kernel": [
    {"name": "mm_u8", "op": "matmul", "dtype": "uint8", "shape": [32, 128], "n": 48,
     "src": "ab", "weights": "BA16b4a", "dst": "ab"},
    {"name": "mm_s8", "op": "matmul", "dtype": "int8", "shape": [16, 192], "n": 32,
     "src": "ab", "weights": "BA16b4a", "dst": "ab", "post_ops": [{"kind": "bias"}]},
    {"name": "mm_bf16", "op": "matmul", "dtype": "bfloat16", "shape": [32, 96], "n": 32,
     "src": "ab", "weights": "BA16b2a", "dst": "ab"},
    {"name": "conv_u8_nhwc", "op": "conv2d", "dtype": "uint8", "shape": [1, 64, 4, 18],
     "channels": 32, "kernel": [3, 3], "src": "nhwc", "weights": "OIhw16i16o4i",
     "dst": "nChw16c"},
    {"name": "conv_s8_blocked", "op": "conv2d", "dtype": "int8", "shape": [1, 20, 5, 6],
     "channels": 24, "kernel": [3, 3], "pad": [1, 1], "src": "nChw16c",
     "weights": "OIhw4i16o4i", "dst": "nChw16c"},
    # bf16 nhwc: 64 channels a row, two 32-channel weight blocks (16i x 2i) per filter tap
    {"name": "conv_bf16_nhwc", "op": "conv2d", "dtype": "bfloat16", "shape": [1, 64, 4, 18],
     "channels": 32, "kernel": [3, 3], "src": "nhwc", "weights": "OIhw16i16o2i",
     "dst": "nChw16c", "post_ops": [{"kind": "bias"}]},
    # one weight block covering a 32-channel row
    {"name": "conv_bf16_nhwc32", "op": "conv2d", "dtype": "bfloat16", "shape": [2, 32, 3, 18],
     "channels": 16, "kernel": [1, 3], "src": "nhwc",
     "weights": "OIhw16i16o2i", "dst": "nhwc"},
    # a bf16 convolution AMX cannot tile (spatially padded, 16 channels a row)
    {"name": "conv_bf16_blocked", "op": "conv2d", "dtype": "bfloat16", "shape": [1, 20, 5, 6],
     "channels": 24, "kernel": [3, 3], "pad": [1, 1], "src": "nChw16c",
     "weights": "OIhw16i16o2i", "dst": "nChw16c"},
]}
AMX_TILES = {"mm_u8": "tdpbusd", "mm_s8": "tdpbssd", "mm_bf16": "tdpbf16ps",
             "conv_u8_nhwc": "tdpbusd", "conv_bf16_nhwc": "tdpbf16ps",
             "conv_bf16_nhwc32": "tdpbf16ps"}


@pytest.fixture(scope="session")
def vnni_dir(tmp_path_factory):
    return _built(tmp_path_factory, VNNI_SPEC, "avx512-vnni")


@pytest.fixture(scope="session")
def amx_dir(tmp_path_factory):
    return _built(tmp_path_factory, AMX_SPEC, "amx")


def _built(tmp_path_factory, spec, target):
    """``spec`` built for ``target`` as a user builds it, once a session."""
    out = tmp_path_factory.mktemp(target) / "lib"
    bp.build(parse_spec(spec), target, out, log=lambda m: None)
    return out


def _has(code, mnemonic) -> bool:
    return any(l.split()[0] == mnemonic for l in code if l.split())


# ---- checks ------------------------------------------------------------------------------

def _check(name, sig, args, exact):
    got, want = args["dst"].to_numpy(), dot_reference(sig, args)
    if exact:
        np.testing.assert_array_equal(got, want.astype(np.float32), err_msg=name)
    elif got.dtype == np.float32:   # bf16 products are exact in fp32; only the order differs
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4, err_msg=name)
    else:   # a bf16 destination: the float32 sum rounded once more, to 8 significant bits
        np.testing.assert_allclose(got.astype(np.float64), want, rtol=2.0 ** -8, atol=1e-4,
                                   err_msg=name)
    pad = args["dst"].buffer[args["dst"].layout.padding_offsets()]
    assert not pad.size or np.all(pad == 0), f"{name}: destination padding not zero"


def _is_exact(sig) -> bool:
    return sig.args[0][2].dtype in ("int8", "uint8")


# ---- targets ----------------------------------------------------------------------------------

def test_targets_list_vnni_bf16_and_amx_with_their_features(capsys):
    from blockpad.cli import main

    assert main(["targets"]) == 0
    out = capsys.readouterr().out
    vnni, bf16, amx = get_target("avx512-vnni"), get_target("avx512-bf16"), get_target("amx")
    assert (vnni.tvm["mcpu"], bf16.tvm["mcpu"], amx.tvm["mcpu"]) == (
        "cascadelake", "cooperlake", "sapphirerapids")
    assert "avx512_vnni" in vnni.features and "amx_tile" not in vnni.features
    assert "avx512_bf16" not in vnni.features
    assert {"avx512_vnni", "avx512_bf16"} <= set(bf16.features) and "amx_tile" not in bf16.features
    assert {"amx_tile", "amx_int8", "amx_bf16", "avx512_vnni", "avx512_bf16"} <= set(amx.features)
    for t in (vnni, bf16, amx):
        line = next(l for l in out.splitlines() if l.startswith(t.name + " "))
        assert line and ", ".join(t.features) in out


@pytest.mark.parametrize("cpu, want", [(("AuthenticAMD", 25), "zen4"),
                                       (("GenuineIntel", 6), "avx512-bf16"),
                                       (None, "avx512-bf16")])
def test_native_takes_the_zen4_target_on_a_zen4_only(monkeypatch, cpu, want):
    """``zen4`` has avx512-bf16's instructions and code generator and differs in a schedule
    default (reduction in one pass): ``native`` takes it on AMD family 25 with those features
    (Zen 4; Zen 3 lacks AVX-512), and avx512-bf16 on an Intel CPU with the same flags."""
    from blockpad.codegen.targets import native_target

    zen4, bf16 = get_target("zen4"), get_target("avx512-bf16")
    assert zen4.features == bf16.features and zen4.tvm == bf16.tvm
    assert not zen4.reduction_passes and bf16.reduction_passes
    monkeypatch.setattr(machine, "arch", lambda: "x86_64")
    monkeypatch.setattr(machine, "cpu_features", lambda: frozenset(bf16.features))
    monkeypatch.setattr(machine, "cpu_model", lambda: cpu)
    assert native_target() == want
    monkeypatch.setattr(machine, "cpu_features", lambda: frozenset(get_target("avx512").features))
    assert native_target() == "avx512"   # a Zen 4 target needs the Zen 4's features too


def test_cpu_model_reads_the_vendor_and_family_of_proc_cpuinfo():
    model = machine.cpu_model()
    if model is None:
        pytest.skip("no vendor_id / cpu family in /proc/cpuinfo on this machine")
    vendor, family = model
    assert vendor in open("/proc/cpuinfo").read() and family > 0


# ---- avx512-vnni ------------------------------------------------------------------------------

def test_vnni_int8_kernels_are_tensorized_to_vpdpbusd(vnni_dir):
    funcs = asm_functions(vnni_dir)
    for name in VNNI_INT8:
        code = kernel_instructions(funcs, name)
        dots = [l for l in code if l.split() and l.split()[0] == "vpdpbusd"]
        assert dots and all("zmm" in l for l in dots), f"{name}: no zmm vpdpbusd"
        # VNNI keeps its instruction: not the vpmaddubsw + vpmaddwd sequence of CPUs without it
        assert not _has(code, "vpmaddubsw"), name
    # weights of 512 KiB and more prefetch the next panel into L2, the others nothing
    for name in VNNI_INT8:
        fetches = _has(kernel_instructions(funcs, name), "prefetcht1")
        assert fetches == (name == LARGE_WEIGHTS["name"]), name
    # 6 rows x 32 columns is one register tile of 6 x 2 vectors: each broadcast source
    # dword feeds two vpdpbusd
    _, m = isa.hot_loop(funcs, "mm_u8", "x86_64")
    assert m["dot"] >= 12 and m["dot"] / m["loads"] >= 0.75, m


@pytest.mark.parametrize("name", ["conv_f32", "conv_bf16"])
def test_vnni_float_conv_is_16_lane_zmm_fma(vnni_dir, name):
    """fp32 and bf16 convolutions: RegisterTiled's zmm FMAs (bf16 widened to fp32 by a
    zero-extend and a shift, 16 lanes at a time: no scalar conversion)."""
    code = kernel_instructions(asm_functions(vnni_dir), name)
    fmas = [l for l in code if l.split() and l.split()[0].startswith("vfmadd")]
    assert fmas and all("zmm" in l for l in fmas)
    if name == "conv_bf16":   # the weight vectors: 16 bf16 widened at once
        widen = [l for l in code if l.split() and l.split()[0] in ("vpmovzxwd", "vpslld")]
        assert widen and all(l.split()[-1].startswith("%zmm") for l in widen)


@pytest.mark.skipif(not HAVE_VNNI, reason=NO_VNNI)
def test_vnni_library_runs_here_and_matches_numpy(vnni_dir, rng):
    lib = bp.load(vnni_dir)
    for name, sig in lib.kernels.items():
        if sig.op not in ("conv2d", "matmul"):
            continue
        args = dot_inputs(sig, rng)
        lib[name](*[args[a[0]] for a in sig.args])
        _check(name, sig, args, _is_exact(sig))


def _twin(spec_kernel, rule, target):
    """One kernel of a spec scheduled by ``rule`` (built with the plain-loop intrinsics),
    compiled for this machine's host ISA, and called like ``Kernel.run_raw``."""
    import tvm

    kernel = make_kernels(parse_spec({"kernel": [spec_kernel]}).kernels[0])[0]
    sch = rule.apply(kernel.func, get_target(target))
    assert sch is not None, f"{spec_kernel['name']}: the {target} rule did not take it"
    lib = tvm.compile(tvm.IRModule({kernel.name: sch.mod["main"]}),
                      target=get_target("host").tvm_target())
    sig = Signature(kernel.describe())

    def run(args):
        lib[kernel.name](*[args[a.name].physical_view(a.storage) for a in kernel.args])
    return sig, run


# convolutions the library above does not have: stride, dilation, groups, channels-last
# source and destination, 64-channel rows with AMX-style weights, an asymmetric kernel
AWKWARD_CONVS = [
    {"dtype": "int8", "shape": [1, 20, 7, 9], "channels": 32, "kernel": [3, 3], "pad": [1, 1],
     "stride": [2, 2], "src": "nChw16c", "weights": "OIhw4i16o4i", "dst": "nChw16c"},
    {"dtype": "uint8", "shape": [2, 16, 6, 8], "channels": 16, "kernel": [3, 3], "pad": [2, 2],
     "dilation": [2, 2], "src": "nChw16c", "weights": "OIhw4i16o4i", "dst": "nChw16c"},
    {"dtype": "int8", "shape": [1, 16, 5, 5], "channels": 16, "kernel": [1, 3], "pad": [0, 1],
     "src": "nhwc", "weights": "OIhw4i16o4i", "dst": "nhwc"},
    {"dtype": "int8", "shape": [1, 32, 5, 6], "channels": 32, "kernel": [3, 3], "pad": [1, 1],
     "groups": 2, "src": "nChw16c", "weights": "gOIhw4i16o4i", "dst": "nChw16c"},
    {"dtype": "uint8", "shape": [1, 64, 3, 17], "channels": 16, "kernel": [2, 2], "pad": [1, 0],
     "src": "nhwc", "weights": "OIhw16i16o4i", "dst": "nChw16c"},
    # weights of 576 KiB, read panel by panel with the next one prefetched: 8 panels of 2
    # column blocks, the taps and channel blocks the reduction's loops
    {"dtype": "int8", "shape": [1, 256, 3, 5], "channels": 256, "kernel": [3, 3], "pad": [1, 1],
     "src": "nChw16c", "weights": "OIhw4i16o4i", "dst": "nChw16c"},
]


@pytest.mark.parametrize("spec", VNNI_SPEC["kernel"][:2] + [
    {"name": f"conv_{i}", "op": "conv2d", **c} for i, c in enumerate(AWKWARD_CONVS)],
    ids=lambda k: k["name"])
def test_vnni_schedule_is_exact_on_any_cpu_with_the_reference_twin(spec, rng):
    """The same packing, tiling, shift and compensation with the plain-loop twin: what runs
    where the CPU lacks VNNI (and a check of the schedule on shapes the library lacks)."""
    from blockpad.schedules.x86_tensorized import Vnni

    sig, run = _twin(spec, Vnni(reference=True), "avx512-vnni")
    args = dot_inputs(sig, rng)
    run(args)
    _check(spec["name"], sig, args, exact=True)


# ---- avx512-bf16: vdpbf16ps ---------------------------------------------------------------------
# bf16 convolution and matmul on OIhw8i16o2i / BA16b2a weights (16 outputs x 2 input channels,
# one zmm): channel tails, spatial padding through a guard and from a halo, bias and relu,
# stride, odd rows, a reduction padded to whole pairs (K = 19), plain and blocked destinations,
# every other kind of padding policy

HAVE_BF16 = "avx512_bf16" in machine.cpu_features()
_BF16 = {"op": "conv2d", "dtype": "bfloat16", "kernel": [3, 3], "pad": [1, 1], "src": "nChw16c",
         "weights": "OIhw8i16o2i", "dst": "nChw16c"}
BF16_SPEC = {"library": {"name": "test-bf16"}, "kernel": [
    {**_BF16, "name": "conv_pad", "shape": [2, 20, 5, 6], "channels": 24},
    {**_BF16, "name": "conv_halo", "shape": [1, 32, 4, 7], "channels": 16,
     "src": {"tag": "nChw16c", "paddings": {"h": [1, 1], "w": [1, 1]}}},
    {**_BF16, "name": "conv_bias_relu", "shape": [1, 32, 3, 9], "channels": 16,
     "kernel": [1, 1], "pad": [0, 0], "stride": [1, 2],
     "post_ops": [{"kind": "bias"}, {"kind": "eltwise", "algorithm": "relu"}]},
    {**_BF16, "name": "conv_bf16_dst", "shape": [1, 32, 3, 9], "channels": 24, "dst_dtype": "bfloat16",
     "post_ops": [{"kind": "bias"}, {"kind": "eltwise", "algorithm": "relu"}]},
    {**_BF16, "name": "conv_stride_dil", "shape": [1, 16, 9, 9], "channels": 32, "pad": [2, 2],
     "stride": [2, 2], "dilation": [2, 2]},
    {**_BF16, "name": "conv_stage", "shape": [1, 20, 3, 5], "channels": 24, "policy": "dst_stage"},
    {**_BF16, "name": "conv_masked", "shape": [1, 20, 3, 5], "channels": 24, "policy": "src"},
    {**_BF16, "name": "conv_tracked", "shape": [1, 20, 3, 5], "channels": 24, "policy": "tracked"},
    {"name": "mm", "op": "matmul", "dtype": "bfloat16", "shape": [6, 40], "n": 32, "src": "ab",
     "weights": "BA16b2a", "dst": "ab"},
    {"name": "mm_rows19", "op": "matmul", "dtype": "bfloat16", "shape": [19, 64], "n": 48,
     "src": "ab", "weights": "BA16b2a", "dst": "aB16b"},
    {"name": "mm_odd", "op": "matmul", "dtype": "bfloat16", "shape": [7, 19], "n": 13,
     "src": "ab", "weights": "BA16b2a", "dst": "ab"},
    # 8-channel blocks: ymm vdpbf16ps on OIhw4i8o2i / BA8b2a
    {**_BF16, "name": "conv_c8", "shape": [1, 12, 5, 6], "channels": 20, "src": "nChw8c",
     "weights": "OIhw4i8o2i", "dst": "nChw8c"},
    {"name": "mm_8", "op": "matmul", "dtype": "bfloat16", "shape": [9, 22], "n": 20,
     "src": "ab", "weights": "BA8b2a", "dst": "ab"},
    # the same under the src policy, whose weights padding may be NaN: padding the reduction
    # to whole pairs would add 0 x NaN, so it stays on FMAs (blockpad.masked_reads)
    {"name": "mm_odd_masked", "op": "matmul", "dtype": "bfloat16", "shape": [7, 19], "n": 13,
     "src": "ab", "weights": "BA16b2a", "dst": "ab", "policy": "src"},
]}
BF16_FMA = ("mm_odd_masked",)


@pytest.fixture(scope="session")
def bf16_dir(tmp_path_factory):
    return _built(tmp_path_factory, BF16_SPEC, "avx512-bf16")


def test_bf16_kernels_are_tensorized_to_vdpbf16ps(bf16_dir):
    """Every kernel's products are zmm ``vdpbf16ps`` (two a lane), none FMAs of widened
    values; the helper function the instruction comes through is inlined, not called."""
    funcs = asm_functions(bf16_dir)
    for name in BF16_FMA:
        code = kernel_instructions(funcs, name)
        assert any(l.split()[0].startswith("vfmadd") for l in code if l.split()), name
        assert not _has(code, "vdpbf16ps"), name
    for k in BF16_SPEC["kernel"]:
        if k["name"] in BF16_FMA:
            continue
        code = kernel_instructions(funcs, k["name"])
        dots = [l for l in code if l.split() and l.split()[0] == "vdpbf16ps"]
        reg = "ymm" if "8o2i" in k["weights"] or "8b2a" in k["weights"] else "zmm"
        assert dots and all(reg in l for l in dots), f"{k['name']}: no {reg} vdpbf16ps"
        assert not any(l.split()[0].startswith("vfmadd") for l in code if l.split()), k["name"]
        assert not any("blockpad_vdpbf16ps" in l for l in code), k["name"]
    # 6 rows x 32 columns: one register tile of 6 x 2 vectors, each broadcast pair feeding two
    _, m = isa.hot_loop(funcs, "mm", "x86_64")
    assert m["dot"] >= 12 and m["dot"] / m["loads"] >= 0.75, m


@pytest.mark.skipif(not HAVE_BF16, reason="this CPU has no avx512_bf16: vdpbf16ps cannot "
                                          "execute here")
def test_bf16_library_runs_here_and_matches_numpy(bf16_dir, rng):
    lib = bp.load(bf16_dir)
    assert {k["name"] for k in BF16_SPEC["kernel"]} <= set(lib.kernels)
    for name, sig in lib.kernels.items():
        if sig.op in ("conv2d", "matmul"):
            args = dot_inputs(sig, rng)
            lib[name](*[args[a[0]] for a in sig.args])
            _check(name, sig, args, exact=False)


@pytest.mark.parametrize("spec", [k for k in BF16_SPEC["kernel"] if k["name"] in (
    "conv_pad", "conv_halo", "conv_bias_relu", "conv_stride_dil", "mm_odd", "conv_c8",
    "mm_8")] + [
    {**_BF16, "name": "conv_groups", "shape": [1, 32, 5, 6], "channels": 32, "groups": 2,
     "weights": "gOIhw8i16o2i"},
    {**_BF16, "name": "conv_nhwc", "shape": [1, 16, 5, 5], "channels": 16, "kernel": [1, 3],
     "pad": [0, 1], "src": "nhwc", "dst": "nhwc"}], ids=lambda k: k["name"])
def test_bf16_schedule_matches_numpy_on_any_cpu_with_the_reference_twin(spec, rng):
    """The same packing and tiling with ``vdpbf16ps``'s plain-loop twin: the schedule checked
    on a CPU without the instruction, and on shapes the library lacks."""
    from blockpad.schedules.x86_tensorized import Vdpbf16

    lanes = 8 if "8o2i" in spec["weights"] or "8b2a" in spec["weights"] else 16
    sig, run = _twin(spec, Vdpbf16(lanes, reference=True), "avx512-bf16")
    args = dot_inputs(sig, rng)
    run(args)
    _check(spec["name"], sig, args, exact=False)


# ---- host: AVX2 without VNNI ----------------------------------------------------------------
# int8 on vpmaddubsw + vpmaddwd (schedules.x86_intrin: the source split so that nothing
# saturates): the VNNI spec's awkward cases, an nChw8c convolution on 8o4i weights (one ymm of
# weights a step), every padding policy

HOST_CONV = {"op": "conv2d", "dtype": "int8", "shape": [2, 20, 5, 6], "channels": 24,
             "kernel": [3, 3], "pad": [1, 1], "src": "nChw16c", "weights": "OIhw4i16o4i",
             "dst": "nChw16c"}
HOST_SPEC = {"library": {"name": "test-host-int8"}, "kernel": [
    *[k for k in VNNI_SPEC["kernel"] if k["name"] in VNNI_INT8 and "policy" not in k
      and k["name"] != "conv_s8_pad"],
    {"name": "conv_s8_8c", "op": "conv2d", "dtype": "int8", "shape": [1, 12, 5, 7],
     "channels": 20, "kernel": [3, 3], "pad": [1, 1], "src": "nChw8c",
     "weights": "OIhw2i8o4i", "dst": "nChw8c"},
    {"name": "mm_u8_8b_stage", "op": "matmul", "dtype": "uint8", "shape": [5, 30], "n": 30,
     "src": "ab", "weights": "BA8b4a", "dst": "aB8b", "policy": "dst_stage"},
    *[{"name": f"conv_s8_{p}", **HOST_CONV, "policy": p} for p in POLICIES],
    *[{"name": f"mm_u8_odd_{p}", "op": "matmul", "dtype": "uint8", "shape": [7, 18], "n": 13,
       "src": "ab", "weights": "BA16b4a", "dst": "aB16b", "policy": p} for p in POLICIES],
]}


@pytest.fixture(scope="session")
def host_int8_dir(tmp_path_factory):
    return _built(tmp_path_factory, HOST_SPEC, "host")


def test_host_int8_kernels_are_vpmaddubsw_and_vpmaddwd(host_int8_dir):
    """Every int8 kernel multiplies with ymm vpmaddubsw + vpmaddwd in its hot loop; no loop
    multiplies integers otherwise (every ``imul`` in a loop is index arithmetic, by a
    constant: the dot loops' and the zero-haloed source copy's; the epilogue's float scale is
    not a product of the data), and the widening path the kernels compiled to before
    (``vpmovsxbd`` + ``vpmulld``) is gone."""
    funcs = asm_functions(host_int8_dir)
    for k in HOST_SPEC["kernel"]:
        name = k["name"]
        code = kernel_instructions(funcs, name)
        for needed in ("vpmaddubsw", "vpmaddwd"):
            found = [l for l in code if l.split() and l.split()[0] == needed]
            assert found and all("ymm" in l for l in found), f"{name}: no ymm {needed}"
        for old in ("vpmulld", "vpmovsxbd"):
            assert not _has(code, old), f"{name}: {old}"
        _, hot = isa.hot_loop(funcs, name, "x86_64")
        assert hot["dot"] >= 4, (name, hot)
        for lines in assembly.kernel_code(funcs, name).values():
            for loop in isa.innermost_loops(lines):
                muls = [l for l in loop if l.split() and l.split()[0].startswith(("imul", "vpmul"))]
                assert all(l.split()[0] == "imull" and l.split()[1].startswith("$")
                           for l in muls), (name, muls)


def test_host_int8_library_runs_here_and_is_exact(host_int8_dir, rng):
    """Full-range sources and weights (the pairs that saturate one vpmaddubsw), garbage in
    the padding a kernel masks, NaN destinations: exact against numpy's int64 reference."""
    lib = bp.load(host_int8_dir)
    ran = 0
    for name, sig in lib.kernels.items():
        if sig.op not in ("conv2d", "matmul"):
            continue
        for _ in range(2):
            args = dot_inputs(sig, rng)
            lib[name](*[args[a[0]] for a in sig.args])
            dst = args["dst"]
            np.testing.assert_array_equal(dst.to_numpy(), dot_reference(sig, args).astype(np.float32),
                                          err_msg=name)
            pad = dst.buffer[dst.layout.padding_offsets()]   # NaN before the call
            if dst.state == "clean":
                assert np.all(pad == 0), f"{name}: destination padding not zero"
            elif sig.padding["produces"] == "preserved":
                assert np.all(np.isnan(pad)), f"{name}: destination padding not preserved"
        ran += 1
    assert ran == len(HOST_SPEC["kernel"])


# weight_bits = 7 (weights in [-64, 64], ONNX Runtime's reduce_range): one vpmaddubsw a step
SEVEN_SPEC = {"library": {"name": "test-seven-bit"}, "kernel": [
    {"name": f"conv_{dt}_{bits}", **HOST_CONV, "dtype": dt, "weight_bits": bits}
    for dt in ("uint8", "int8") for bits in (7, 8)] + [
    {"name": "mm_u8_7", "op": "matmul", "dtype": "uint8", "shape": [7, 18], "n": 13,
     "src": "ab", "weights": "BA16b4a", "dst": "aB16b", "weight_bits": 7}]}


@pytest.fixture(scope="session")
def seven_bit_dir(tmp_path_factory):
    return _built(tmp_path_factory, SEVEN_SPEC, "host")


def _seven_bit_inputs(sig, rng):
    """dot_inputs with the weights in [-64, 64], both ends present (the pairs nearest the int16
    bound: 2 x 255 x 64 = 32640), padding included (the kernel reads it as zeros)."""
    args = dot_inputs(sig, rng)
    w = args["weights"]
    w.buffer[:] = rng.integers(-64, 65, w.buffer.shape).astype(np.int8)
    w.buffer[w.layout.padding_offsets()] = 0
    w.buffer[:2] = [-64, 64]
    return args


def test_seven_bit_weights_take_one_vpmaddubsw_a_step_and_stay_exact(seven_bit_dir, rng):
    """With weight_bits = 7 the hot loop multiplies the whole source byte: no split into
    ``u >> 1`` (masked by 0x7F7F7F7F) and ``u & 1``, so one vpmaddubsw + vpmaddwd per output
    vector and step instead of two; exact against numpy's int64 reference with weights at both
    ends of [-64, 64] and full-range sources (s8 and u8)."""
    funcs = asm_functions(seven_bit_dir)
    lib = bp.load(seven_bit_dir)
    split_mask = "$2139062143"   # 0x7F7F7F7F
    for dt in ("uint8", "int8"):
        for bits in (7, 8):
            name = f"conv_{dt}_{bits}"
            code = kernel_instructions(funcs, name)
            assert _has(code, "vpmaddubsw") and _has(code, "vpmaddwd"), name
            hot = max(isa.innermost_loops([l for ls in assembly.kernel_code(funcs, name).values()
                                           for l in ls]),
                      key=lambda loop: sum("vpmaddubsw" in l for l in loop))
            assert any(split_mask in l for l in hot) == (bits == 8), name
    for name, sig in lib.kernels.items():
        if sig.op not in ("conv2d", "matmul"):
            continue
        args = _seven_bit_inputs(sig, rng)
        lib[name](*[args[a[0]] for a in sig.args])
        np.testing.assert_array_equal(args["dst"].to_numpy(),
                                      dot_reference(sig, args).astype(np.float32), err_msg=name)


def test_seven_bit_kernels_refuse_wider_weights_on_every_call_and_bind(seven_bit_dir, rng):
    """A weight of 65 (or -65) would saturate one vpmaddubsw: the call and bind() refuse it."""
    lib = bp.load(seven_bit_dir)
    for name in ("conv_uint8_7", "mm_u8_7"):
        sig = lib.kernels[name]
        args = _seven_bit_inputs(sig, rng)
        ordered = [args[a[0]] for a in sig.args]
        lib[name].bind(*ordered)()                # in range: fine
        for bad in (65, -65):
            args["weights"].buffer[1] = bad
            with pytest.raises(bp.ArgumentError, match=r"weight_bits = 7.*\[-64, 64\]"):
                lib[name](*ordered)
            with pytest.raises(bp.ArgumentError, match="weight_bits = 7"):
                lib[name].bind(*ordered)
    with pytest.raises(bp.SpecError, match="weight_bits"):
        parse_spec({"kernel": [{"name": "k", **HOST_CONV, "weight_bits": 6}]})


@pytest.mark.parametrize("dtype", ["uint8", "int8"])
def test_seven_bit_zmm_schedule_is_exact_with_the_reference_twin(dtype, rng):
    """AVX-512BW's 7-bit sequence (16 lanes of zmm), run here through its plain-loop twin,
    which writes out vpmaddubsw's saturation: exact for weights in [-64, 64]."""
    from blockpad.schedules.x86_tensorized import Maddubs7

    spec = {"name": "k", **HOST_CONV, "dtype": dtype, "weight_bits": 7}
    sig, run = _twin(spec, Maddubs7(16, reference=True), "avx512")
    args = _seven_bit_inputs(sig, rng)
    run(args)
    _check("k", sig, args, exact=True)


@pytest.mark.parametrize("spec", [{"name": f"conv_{i}", "op": "conv2d", **c}
                                  for i, c in enumerate(AWKWARD_CONVS)] + [
    {"name": "mm_s8_odd", **next(k for k in VNNI_SPEC["kernel"] if k["name"] == "mm_s8_odd")}],
    ids=lambda k: k["name"])
@pytest.mark.parametrize("lanes", [8, 16])
def test_maddubs_schedule_is_exact_with_the_reference_twin(spec, lanes, rng):
    """Stride, dilation, groups, channels-last, AMX-style weights: the AVX2 (8 lanes) and
    AVX-512BW (16) schedules with the plain-loop twin of the sequence, on this CPU."""
    from blockpad.schedules.x86_tensorized import Maddubs

    sig, run = _twin(spec, Maddubs(lanes, reference=True), "host" if lanes == 8 else "avx512")
    args = dot_inputs(sig, rng)
    run(args)
    _check(spec["name"], sig, args, exact=True)


def test_avx512_without_vnni_uses_zmm_vpmaddubsw():
    """``avx512`` (Skylake-SP: AVX-512BW, no VNNI): int8 takes 16 lanes of zmm (compiled
    here, not run: this CPU has no AVX-512)."""
    import tvm

    from blockpad.schedules.x86_tensorized import Maddubs

    kernel = make_kernels(parse_spec({"kernel": [{"name": "k", **HOST_CONV}]}).kernels[0])[0]
    sch = Maddubs(16).apply(kernel.func, get_target("avx512"))
    lib = tvm.compile(tvm.IRModule({"k": sch.mod["main"]}),
                      target=get_target("avx512").tvm_target())
    code = lib.mod.inspect_source("asm").splitlines()
    found = [l for l in code if l.split() and l.split()[0] == "vpmaddubsw"]
    assert found and all("zmm" in l for l in found)


# ---- amx --------------------------------------------------------------------------------------

def test_amx_kernels_use_tiles(amx_dir):
    funcs = asm_functions(amx_dir)
    for name, tile_op in AMX_TILES.items():
        code = kernel_instructions(funcs, name)
        for needed in (tile_op, "tileloadd", "tilestored", "ldtilecfg", "tilezero"):
            assert _has(code, needed), f"{name}: no {needed}"
    # matmul: the accumulator tile is loaded and stored once per output tile (and zeroed by
    # tilezero + a store), whatever K: A and B are the only loads per multiply
    for name in ("mm_u8", "mm_s8", "mm_bf16"):
        code = [l.split()[0] for l in kernel_instructions(funcs, name) if l.split()]
        dots = sum(op.startswith("tdp") for op in code)
        tiles = code.count("tilezero")
        assert code.count("tileloadd") == 2 * dots + tiles, name
        assert code.count("tilestored") == 2 * tiles, name
    # a convolution AMX cannot tile (16 channels a row) falls back to vpdpbusd, bf16 to
    # vdpbf16ps (its 16i16o2i weights are 16 outputs x 2 steps a zmm too)
    code = kernel_instructions(funcs, "conv_s8_blocked")
    assert _has(code, "vpdpbusd") and not _has(code, "tdpbssd")
    code = kernel_instructions(funcs, "conv_bf16_blocked")
    assert _has(code, "vdpbf16ps") and not _has(code, "tdpbf16ps")
    # bf16 nhwc, 64 channels in two weight blocks: per output tile and filter tap one
    # multiply per block, A and B loaded for each, the accumulator tile loaded once per
    # multiply (it is stored back between weight blocks)
    code = [l.split()[0] for l in kernel_instructions(funcs, "conv_bf16_nhwc") if l.split()]
    assert code.count("tdpbf16ps") == 3 * 3 * 2, code.count("tdpbf16ps")


@pytest.mark.parametrize("name", list(AMX_TILES))
def test_amx_schedule_matches_numpy_with_the_reference_twin(name, rng):
    from blockpad.schedules.x86_tensorized import Amx

    spec = next(k for k in AMX_SPEC["kernel"] if k["name"] == name)
    sig, run = _twin(spec, Amx(reference=True), "amx")
    args = dot_inputs(sig, rng)
    run(args)
    _check(name, sig, args, _is_exact(sig))


@pytest.mark.skipif(not HAVE_AMX, reason="this CPU has no AMX (amx_tile, amx_int8, amx_bf16)")
def test_amx_library_runs_here_and_matches_numpy(amx_dir, rng):
    lib = bp.load(amx_dir)
    for name, sig in lib.kernels.items():
        if sig.op in ("conv2d", "matmul"):
            args = dot_inputs(sig, rng)
            lib[name](*[args[a[0]] for a in sig.args])
            _check(name, sig, args, _is_exact(sig))


@pytest.mark.skipif(HAVE_AMX, reason="this CPU has AMX: the library loads and runs here")
def test_amx_library_is_refused_here_without_sigill(amx_dir):
    # a fresh process loads the library and calls a kernel: it must exit with blockpad's
    # error naming the features, not be killed by an illegal instruction
    code = (f"import blockpad as bp\n"
            f"try:\n    lib = bp.load({str(amx_dir)!r})\n"
            f"except bp.LoadError as e:\n    print(type(e).__name__, e); raise SystemExit(3)\n"
            f"lib['mm_u8']\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=False)
    assert run.returncode == 3, (run.returncode, run.stdout, run.stderr)
    assert "MissingCPUFeatureError" in run.stdout
    missing = [f for f in ("amx_tile", "amx_int8", "amx_bf16", "avx512_bf16")
               if f not in machine.cpu_features()]
    assert missing and all(f in run.stdout for f in missing), run.stdout


# ---- the AMX permission ----------------------------------------------------------------------

def test_amx_permission_request_is_real_and_clear():
    """The real arch_prctl, no mock: granted where the CPU and kernel have AMX (and then
    asked once per process), refused with a TilePermissionError that says why elsewhere."""
    if HAVE_AMX:
        machine.request_amx()
        machine.request_amx()
        assert machine.request_amx.cache_info().hits >= 1
        return
    with pytest.raises(machine.TilePermissionError,
                       match=r"arch_prctl\(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA\).*"
                             r"(EOPNOTSUPP|ENOTSUP|EINVAL|EPERM)") as err:
        machine.request_amx()
    assert isinstance(err.value, bp.LoadError) and isinstance(err.value, bp.BlockpadError)


@pytest.mark.skipif(HAVE_AMX, reason="this CPU has AMX: the request is granted here")
def test_load_asks_for_tiles_before_any_call(amx_dir, monkeypatch):
    """A CPU that lists AMX in /proc/cpuinfo while Linux refuses the tile state (an old
    kernel, a sandbox): ``load`` must raise, because the first tile instruction would be
    SIGILL. The feature list is the only thing faked; the syscall is real and refuses here."""
    monkeypatch.setattr(machine, "cpu_features",
                        lambda: frozenset(get_target("amx").features))
    with pytest.raises(machine.TilePermissionError, match="AMX kernels cannot run"):
        bp.load(amx_dir)


# ---- rules decline what is not theirs ---------------------------------------------------------

def test_rules_leave_other_kernels_to_the_next_rule():
    from blockpad.schedules.x86_tensorized import Amx, Maddubs, Vnni

    def func(**fields):
        spec = {"name": "k", "op": "matmul", "src": "ab", "weights": "BA16b4a", "dst": "ab",
                **fields}
        return make_kernels(parse_spec({"kernel": [spec]}).kernels[0])[0].func

    s8 = {"dtype": "int8", "shape": [16, 64], "n": 32}
    assert Vnni().apply(func(**s8), get_target("avx512")) is None         # no avx512_vnni
    assert Vnni().apply(func(**s8), get_target("avx512-vnni")) is not None
    assert Vnni().apply(func(dtype="float32", shape=[16, 64], n=32, weights="BA16a16b"),
                        get_target("avx512-vnni")) is None                  # fp32: not a dot
    assert Maddubs(8).apply(func(**s8), get_target("host")) is not None   # AVX2
    assert Maddubs(16).apply(func(**s8), get_target("host")) is None      # no avx512bw
    assert Maddubs(16).apply(func(**s8), get_target("avx512")) is not None
    assert Maddubs(8).apply(func(dtype="float32", shape=[16, 64], n=32, weights="BA16a16b"),
                            get_target("host")) is None
    assert Amx().apply(func(**s8), get_target("avx512-vnni")) is None     # no amx_tile
    assert Amx().apply(func(dtype="int8", shape=[19, 64], n=32), get_target("amx")) is None
    assert Amx().apply(func(**s8), get_target("amx")) is not None


def test_amx_takes_bf16_convolutions_with_whole_weight_blocks():
    """bf16 convolution: bf16 weights and fp32 destination, bias and accumulator, bits in
    uint16 arguments; AMX takes an nhwc source whose weight blocks hold whole tile multiples
    of the reduction and leaves the rest (a 16-channel row, a block that splits a tile) to
    RegisterTiled."""
    def kernel(**fields):
        spec = {"name": "k", "op": "conv2d", "dtype": "bfloat16", "shape": [1, 64, 3, 18],
                "channels": 16, "kernel": [1, 3], "src": "nhwc", "weights": "OIhw16i16o2i",
                "dst": "nChw16c", "post_ops": [{"kind": "bias"}], **fields}
        return make_kernels(parse_spec({"kernel": [spec]}).kernels[0])[0]

    k = kernel()
    assert [(a.name, a.layout.dtype, a.storage) for a in k.args] == [
        ("src", "bfloat16", "uint16"), ("weights", "bfloat16", "uint16"),
        ("bias", "float32", "float32"), ("dst", "float32", "float32")]
    from blockpad.schedules.x86_tensorized import Amx

    amx = get_target("amx")
    assert Amx().apply(k.func, amx) is not None
    assert Amx().apply(kernel(weights="OIhw32i16o2i").func, amx) is not None
    assert Amx().apply(kernel(weights="OIhw8i16o2i").func, amx) is None     # 16 steps a block
    assert Amx().apply(kernel(shape=[1, 16, 3, 18]).func, amx) is None     # 16 channels a row
    assert Amx().apply(k.func, get_target("avx512")) is None


# ---- the instruction-mix benchmark's parser ----------------------------------------------------

def test_isa_counts_the_hot_loop_of_x86_and_arm_assembly():
    x86 = isa.innermost_loops([
        "movl $0, %eax", ".LBB0_1:", "vmovdqu64 (%rsi,%rax), %zmm1", "vpbroadcastd (%rdi), %zmm2",
        "vpdpbusd %zmm1, %zmm2, %zmm0", "vpdpbusd 64(%rsi), %zmm2, %zmm3",
        "vmovdqu64 %zmm0, 8(%rsp)", "cmpl $4, 12(%rsp)", "jne .LBB0_1", "retq"])
    assert len(x86) == 1
    assert isa.mix(x86[0], "x86_64") == {"instrs": 7, "dot": 2, "loads": 4, "stores": 1,
                                         "spills": 1, "tile_loads": 0}
    arm = isa.innermost_loops([
        ".LBB0_2:", "ldr q1, [x1], #16", "ld1r { v2.4s }, [x0]", "sdot v0.4s, v1.16b, v2.16b",
        "str q0, [sp, #32]", "subs x2, x2, #1", "b.ne .LBB0_2"])
    assert isa.mix(arm[0], "aarch64") == {"instrs": 6, "dot": 1, "loads": 2, "stores": 1,
                                          "spills": 1, "tile_loads": 0}
    ptx = assembly.functions(".visible .entry mm_kernel(\n.param .u64 p\n)\n{\n$L__BB0_1:\n"
                             "\tld.shared.v4.f32 {%f1, %f2, %f3, %f4}, [%r1];\n"
                             "\tfma.rn.ftz.f32 %f5, %f1, %f2, %f5;\n\tst.local.f32 [%rd1], %f5;\n"
                             "\t@%p1 bra $L__BB0_1;\n\tret;\n}\n")
    loop = isa.innermost_loops(assembly.kernel_code(ptx, "mm")["mm_kernel"])
    assert isa.mix(loop[0], "ptx") == {"instrs": 4, "dot": 1, "loads": 1, "stores": 1,
                                       "spills": 1, "tile_loads": 0}


def test_isa_reports_the_built_libraries(vnni_dir, amx_dir):
    vnni, amx = asm_functions(vnni_dir), asm_functions(amx_dir)
    # register tiles: accumulators stay in zmm registers (no store, no spill); per reduction
    # step one broadcast load per row, one weight load per column vector (and, s8, one
    # compensation vpdpbusd per column vector). One column vector where the destination has
    # one 16-channel block; two (K = 24 -> 32) or three (N = 48) where the blocks divide so,
    # and then each broadcast feeds as many dot products (dst_stage's valid-region predicate
    # is put back after tiling, so it tiles alike). 19 rows: tiles of 5, the last one's extra
    # row predicated off.
    for name, least in (("conv_s8_halo", 0.9), ("conv_s8_stage", 0.9), ("conv_s8_pad", 1.5),
                        ("conv_s8_masked", 1.5), ("mm_s8_rows19", 2.0)):
        where, m = isa.hot_loop(vnni, name, "x86_64")
        # (a store at most: LLVM may keep a loop counter in the frame)
        assert where == "loop" and m["stores"] <= 1 and not m["spills"], (name, m)
        assert m["dot"] / m["loads"] >= least, (name, m)
    # K = 96 bf16 is 3 multiplies per output tile: A and B tiles for each, C loaded once
    where, m = isa.hot_loop(amx, "mm_bf16", "x86_64")
    assert m["dot"] == 3 and m["tile_loads"] == 2 * 3 + 1, m


@pytest.mark.parametrize("dst_dtype, zp", [("uint8", 120), ("int32", 0)])
def test_requantized_epilogue_is_vector_code(tmp_path, rng, dst_dtype, zp):
    """An integer result's conversion (saturate, round half to even, zero point) stays vector
    code: ``nearbyint`` there was scalarised by TVM (64 vroundss + vcvttss2si per register
    tile: a uint8 1x1 conv 64 -> 256 at 56x56 took 1.58 ms, 0.72 ms now). Exact against numpy,
    uint8 (the magic-number rounding) and int32 (its sign-magnitude form, for |x| up to 2**31)."""
    spec = {"library": {"name": "requant"}, "kernel": [{
        "name": "conv_requant", "op": "conv2d", "dtype": "uint8", "shape": [1, 32, 6, 8],
        "channels": 48, "kernel": [1, 1], "src": "nChw16c", "weights": "OIhw4i16o4i",
        "dst": "nChw16c", "weight_bits": 7, "scales": "channel", "dst_dtype": dst_dtype,
        "dst_zero_point": zp, "post_ops": [{"kind": "bias", "dtype": "int32"}]}]}
    bp.build(spec, "host", tmp_path / "lib", log=lambda m: None)
    code = kernel_instructions(asm_functions(tmp_path / "lib"), "conv_requant")
    for scalar in ("vroundss", "vcvttss2si", "vcvtsi2ss"):
        assert not _has(code, scalar), scalar
    lib = bp.load(tmp_path / "lib")
    sig = lib.kernels["conv_requant"]
    x = rng.integers(0, 256, (1, 32, 6, 8)).astype(np.uint8)
    w = rng.integers(-64, 65, (48, 32, 1, 1)).astype(np.int8)
    # uint8: a spread that saturates some; int32: large values, halves included
    scale = (rng.uniform(1e-4, 3e-3, 48) if dst_dtype == "uint8" else
             rng.choice([0.5, 1.5, 7.25], 48)).astype(np.float32)
    bias = rng.integers(-3000, 3000, 48).astype(np.int32)
    mems = [bp.Memory.from_numpy(v, a[2]) for v, a in zip((x, w, scale, bias), sig.args)]
    dst = bp.Memory.empty(sig.args[4][2])
    lib["conv_requant"](*mems, dst)
    acc = np.einsum("nchw,kc->nkhw", x.astype(np.int64), w[:, :, 0, 0].astype(np.int64))
    v = (acc + bias[None, :, None, None]).astype(np.float32) * scale[None, :, None, None]
    info = np.iinfo(dst_dtype)
    want = np.clip(np.rint(v.astype(np.float64)), info.min - zp, info.max - zp) + zp
    np.testing.assert_array_equal(dst.to_numpy(), want.astype(dst_dtype))


def test_seven_bit_check_reads_elements_not_the_gaps_of_a_strided_layout():
    """Weights in a layout with gaps between dims: the kernel never reads the gaps, so the
    7-bit promise is checked at the elements (blockpad check's guard pattern in the gaps, -83
    and 127 as int8, was refused: seed 20261126 cases 127, 172, 189)."""
    from blockpad.runtime.library import check_seven_bit

    lay = bp.Layout("oihw", (4, 3, 1, 1), "int8", strides=(6, 1, 1, 1))
    buf = np.full(lay.alloc_len, 127, np.int8)                 # gaps: out of range
    buf[lay.logical_offsets().reshape(-1)] = np.arange(-6, 6)
    check_seven_bit(buf, lay, "k: argument 'weights'")
    buf[lay.logical_offsets()[1, 2, 0, 0]] = -65
    with pytest.raises(bp.ArgumentError, match=r"weight_bits = 7 .* got weights in \[-65, 5\]"):
        check_seven_bit(buf, lay, "k: argument 'weights'")


def test_conv_int8_bench_takes_vdpbf16ps_weights_only_where_the_target_has_them(capsys):
    """``blockpad bench conv-int8``: the bf16 column uses ``OIhw8i16o2i`` on a target with
    ``avx512_bf16`` and plain blocks (FMAs) elsewhere; where this CPU runs avx512-bf16, the
    quick run checks every variant against numpy and prints its row."""
    from blockpad.bench import conv_int8

    def bf16_weights(features):
        return {k["weights"] for k in conv_int8.spec(True, features)["kernel"]
                if k["dtype"] == "bfloat16"}

    assert bf16_weights(get_target("avx512-bf16").features) == {"OIhw8i16o2i"}
    assert bf16_weights(get_target("avx512-vnni").features) == {"OIhw16i16o"}
    if HAVE_BF16:
        rows = conv_int8.main(repeat=1, quick=True, target="avx512-bf16")
        assert len(rows) == 1 and "bf16 / fp32" in capsys.readouterr().out
