"""Arm NEON: one library cross-compiled for ``--target neon`` (aarch64-linux-gnu, +neon), its
kernels executed for real under qemu-aarch64 (blockpad.testing.qemu) and compared with numpy,
the NEON instructions asserted in its machine code, and ``blockpad.load`` refusing it on x86.

Building needs ``aarch64-linux-gnu-gcc`` (it links the library: gcc-aarch64-linux-gnu); the
tests that execute kernels also need ``qemu-aarch64`` and the aarch64 C library (qemu-user,
libc6-dev-arm64-cross). Each test skips, saying what to install, where its tools are missing;
the target's flags need nothing."""

from __future__ import annotations

import re
import shutil
import subprocess

import numpy as np
import pytest
import scipy.special

import blockpad as bp
from blockpad import assembly, machine, vocabulary
from blockpad import manifest as mf
from blockpad.bench import isa
from blockpad.codegen.spec import parse_spec
from blockpad.codegen.targets import get_target
from blockpad.runtime.library import Signature
from blockpad.testing import qemu

from .conftest import asm_functions, dot_inputs, garbage, kernel_instructions, random_array
from .reference import REFERENCES, dot_reference

# building needs the cross compiler only (the fixtures skip without it: machine-code and
# manifest tests run without the emulator); running needs the emulator and sysroot too
MISSING = qemu.missing_tools()
executes = pytest.mark.skipif(bool(MISSING), reason="runs aarch64 code under qemu, and this "
                              "machine lacks: " + "; ".join(MISSING))

SHAPE = [2, 30, 5, 7]          # C=30: the last 4- and 8-channel blocks are partial; W=7 odd
HALO = {"h": [1, 2], "w": [3, 1]}
POLICIES = tuple(p for p in vocabulary.POLICIES if p not in vocabulary.MEMORY_STATE)


def _eltwise(algorithm, policy, tag="nChw4c", shape=SHAPE):
    return {"name": f"{algorithm}_{policy}_{tag}", "op": "eltwise", "shape": shape, "src": tag,
            "dst": tag, "algorithm": algorithm, "policy": policy}


_CONV_F32 = {"op": "conv2d", "kernel": [3, 3], "src": "nChw4c", "weights": "OIhw4i4o",
             "dst": "nChw4c"}
SPEC = {
    "library": {"name": "test-neon"},
    "kernel": [
        {"op": "reorder", "shape": SHAPE, "dtypes": ["float32", "int8"], "src": "nchw",
         "dst": "nChw4c"},
        {"op": "reorder", "shape": SHAPE, "src": "nChw4c", "dst": "nchw"},
        {"op": "reorder", "shape": SHAPE, "src": "nchw", "dst": "nChw8c"},
        {"op": "reorder", "shape": SHAPE, "dtypes": ["float32", "bfloat16"], "src": "nChw8c",
         "dst": "nchw"},
        {"op": "reorder", "shape": SHAPE, "src": "nChw8c", "dst": "nChw4c"},
        {"op": "reorder", "shape": [1, 3, 4, 4], "src": "nchw", "dst": "nChw4c"},
        {"name": "to_halo", "op": "reorder", "shape": SHAPE, "src": "nchw",
         "dst": {"tag": "nChw4c", "paddings": HALO}},
        {"name": "from_halo", "op": "reorder", "shape": SHAPE,
         "src": {"tag": "nchw", "paddings": {"h": [1, 1], "w": [1, 1]}}, "dst": "nChw8c"},
        {"name": "to_strided", "op": "reorder", "shape": SHAPE, "src": "nchw",
         "dst": {"tag": "nChw4c", "strides": [1400, 160, 30, 4, 1]}},
        {"op": "zero_pad", "shape": SHAPE, "layout": "nChw4c"},
        {"name": "zero_pad_halo", "op": "zero_pad", "shape": SHAPE,
         "layout": {"tag": "nChw4c", "paddings": HALO}},
        *[_eltwise(a, p) for a in ("relu", "sigmoid", "gelu_erf") for p in POLICIES],
        _eltwise("gelu_erf", "dst_fused", "nChw8c", [1, 30, 3, 5]),
        _eltwise("relu", "dst_fused", "nchw"),
        _eltwise("exp", "dst_fused", "nchw"),
        _eltwise("tanh", "dst_fused", "nChw4c"),
        _eltwise("gelu_tanh", "dst_fused", "nChw4c"),
        *[{"name": f"add_{p}", "op": "binary", "shape": SHAPE, "src0": "nChw4c", "src1": "nChw4c",
           "dst": "nChw4c", "algorithm": "add", "policy": p} for p in POLICIES],
        {"name": "mul_bcast_src", "op": "binary", "shape": [1, 30, 5, 7], "shape1": [1, 30, 1, 1],
         "src0": "nChw8c", "src1": "nChw8c", "dst": "nChw8c", "algorithm": "mul",
         "policy": "src"},
        # int8 on plain NEON: no sdot there (Armv8.0 lacks it), widening multiply-adds
        {"name": "mm_s8", "op": "matmul", "dtype": "int8", "shape": [6, 64], "n": 32,
         "src": "ab", "weights": "BA4b4a", "dst": "ab"},
        # fp32 convolution and matmul (register tiles of fmla), softmax and pooling on awkward
        # channel counts, spatial padding, strides, odd matmul sizes, every padding policy
        {"name": "conv_f32_pad_bias", **_CONV_F32, "shape": [1, 30, 5, 7], "channels": 10,
         "pad": [1, 1], "post_ops": [{"kind": "bias"}, {"kind": "eltwise", "algorithm": "relu"}]},
        {"name": "conv_f32_8c_stride", **_CONV_F32, "shape": [1, 30, 7, 9], "channels": 12,
         "pad": [1, 1], "stride": [2, 2], "src": "nChw8c", "weights": "OIhw8i8o",
         "dst": "nChw8c"},
        *[{"name": f"conv_f32_{p}", **_CONV_F32, "shape": [1, 30, 4, 5], "channels": 10,
           "pad": [1, 1], "policy": p} for p in ("dst_stage", "src")],
        {"name": "mm_f32_odd", "op": "matmul", "shape": [7, 18], "n": 13, "src": "ab",
         "weights": "Ba4b", "dst": "ab", "post_ops": [{"kind": "bias"}]},
        *[{"name": f"softmax_{p}", "op": "softmax", "shape": SHAPE, "src": "nChw4c",
           "dst": "nChw4c", "policy": p} for p in POLICIES],
        {"name": "log_softmax", "op": "softmax", "shape": SHAPE, "src": "nChw8c",
         "dst": "nChw8c", "log": True},
        *[{"name": f"pool_{a}_{p}", "op": "pool", "shape": SHAPE, "src": "nChw4c",
           "dst": "nChw4c", "algorithm": a, "kernel": [3, 3], "stride": [2, 2], "pad": [1, 1],
           "policy": p} for a, p in (("max", "dst_fused"), ("avg", "dst_stage"),
                                     ("max", "src"))],
    ],
}

# int8 with sdot (neon-dotprod): weights with 4 x 4 blocks, output lanes outside reduction
# lanes (BA4b4a: [N/4][K/4][4n][4k]; OIhw4o4i), K and C not multiples of 16
_CONV_S8 = {"op": "conv2d", "dtype": "int8", "kernel": [3, 3], "src": "nChw4c",
            "weights": "OIhw4o4i", "dst": "nChw4c"}
_MM_S8 = {"op": "matmul", "dtype": "int8", "src": "ab", "weights": "BA4b4a"}
DOTPROD_SPEC = {
    "library": {"name": "test-neon-dotprod"},
    "kernel": [
        {"name": "mm_s8", **_MM_S8, "shape": [6, 64], "n": 32, "dst": "ab"},
        {"name": "mm_s8_blocked", **_MM_S8, "shape": [5, 30], "n": 30, "src": "aB4b",
         "dst": "aB4b", "post_ops": [{"kind": "bias"}, {"kind": "eltwise", "algorithm": "relu"}]},
        {"name": "conv_s8", **_CONV_S8, "shape": [1, 14, 5, 6], "channels": 10},
        # awkward nests: spatial padding read through a guard, C and K that are not block
        # multiples (C=30: the last 4- and 8-channel blocks partial; K=12 in nChw8c: the last
        # 8-block half past the weights' 4-blocks), strides, dilation, groups, M, N and K of
        # plain matmuls that are not multiples of 4, every padding policy
        {"name": "conv_s8_pad_bias", **_CONV_S8, "shape": [1, 30, 5, 6], "channels": 10,
         "pad": [1, 1], "post_ops": [{"kind": "bias"}, {"kind": "eltwise", "algorithm": "relu"}]},
        {"name": "conv_s8_8c_stride", **_CONV_S8, "shape": [1, 30, 7, 9], "channels": 12,
         "pad": [1, 1], "stride": [2, 2], "src": "nChw8c", "dst": "nChw8c"},
        {"name": "conv_s8_groups", **_CONV_S8, "shape": [1, 16, 5, 5], "channels": 16,
         "pad": [2, 2], "dilation": [2, 2], "groups": 2, "weights": "gOIhw4o4i"},
        {"name": "conv_s8_stage", **_CONV_S8, "shape": [1, 30, 4, 5], "channels": 10,
         "pad": [1, 1], "policy": "dst_stage"},
        {"name": "conv_s8_src", **_CONV_S8, "shape": [1, 30, 4, 5], "channels": 10,
         "pad": [1, 1], "policy": "src"},
        {"name": "conv_s8_masked", **_CONV_S8, "shape": [1, 32, 4, 5], "channels": 10,
         "pad": [1, 1], "policy": "src"},
        {"name": "mm_s8_odd", **_MM_S8, "shape": [5, 30], "n": 30, "dst": "ab",
         "post_ops": [{"kind": "bias"}]},
        {"name": "mm_s8_odd_stage", **_MM_S8, "shape": [7, 18], "n": 13, "dst": "aB4b",
         "policy": "dst_stage"},
        {"name": "mm_s8_odd_masked", **_MM_S8, "shape": [7, 18], "n": 13, "dst": "aB4b",
         "policy": "src"},
    ],
}

REFERENCE = {
    "relu": lambda x: np.maximum(x, 0),
    "sigmoid": lambda x: scipy.special.expit(x.astype(np.float64)),
    "gelu_erf": lambda x: 0.5 * x * (1 + scipy.special.erf(x.astype(np.float64) / np.sqrt(2))),
    "exp": lambda x: np.exp(x.astype(np.float64)),
    "tanh": lambda x: np.tanh(x.astype(np.float64)),
    "gelu_tanh": lambda x: 0.5 * x * (1 + np.tanh(
        np.sqrt(2 / np.pi) * (x + 0.044715 * x.astype(np.float64) ** 3))),
    "add": lambda a, b: a.astype(np.float64) + b,
    "mul": lambda a, b: a.astype(np.float64) * b,
}


@pytest.fixture(scope="session")
def neon_dir(tmp_path_factory):
    """The library, built the way a user builds it: ``blockpad build SPEC --target neon``."""
    from blockpad.cli import main

    _need_compiler("neon")
    out = tmp_path_factory.mktemp("neon") / "lib"
    spec = out.parent / "neon.toml"
    spec.write_text(_toml(SPEC))
    assert main(["build", str(spec), "--target", "neon", "--out", str(out)]) == 0
    return out


@pytest.fixture(scope="session")
def neon_lib(neon_dir):
    return signatures(neon_dir)


@pytest.fixture(scope="session")
def dotprod_dir(tmp_path_factory):
    _need_compiler("neon-dotprod")
    out = tmp_path_factory.mktemp("neon-dotprod") / "lib"
    bp.build(parse_spec(DOTPROD_SPEC), "neon-dotprod", out, log=lambda m: None)
    return out


@pytest.fixture(scope="session")
def dotprod_lib(dotprod_dir):
    return signatures(dotprod_dir)


@pytest.fixture(scope="session")
def dotprod_asm(dotprod_dir) -> dict:
    return asm_functions(dotprod_dir)


def _need_compiler(target):
    t = get_target(target)
    if shutil.which(t.cross_compiler) is None:
        pytest.skip(f"{t.cross_compiler} not installed: it links {target} libraries "
                    f"(apt-get install {t.cross_package})")


def signatures(lib_dir) -> dict:
    manifest = mf.read(lib_dir)
    return {k["name"]: Signature(k) for k in manifest["kernels"]}


@pytest.fixture(scope="session")
def neon_asm(neon_dir) -> dict:
    return asm_functions(neon_dir)


# ---- the library --------------------------------------------------------------------------------

def test_cli_builds_an_aarch64_library_with_a_manifest(neon_dir, neon_lib):
    elf = (neon_dir / "kernels.so").read_bytes()[:20]
    assert elf[:4] == b"\x7fELF" and int.from_bytes(elf[18:20], "little") == 183   # EM_AARCH64
    target = mf.read(neon_dir)["target"]
    assert target["name"] == "neon" and target["arch"] == "aarch64"
    assert target["features"] == ["asimd"]
    assert target["tvm"]["mtriple"] == "aarch64-linux-gnu"
    assert len(neon_lib) >= len(SPEC["kernel"])


def test_load_refuses_it_on_another_architecture(neon_dir):
    if machine.arch() == "aarch64":
        assert "relu_dst_fused_nChw4c" in bp.load(neon_dir)
        return
    with pytest.raises(bp.LoadError, match=r"aarch64.*this machine is x86_64"):
        bp.load(neon_dir)


def test_neon_dotprod_target_requires_asimddp():
    t = get_target("neon-dotprod")
    assert (t.family, t.arch, t.cross_compiler) == ("arm", "aarch64", "aarch64-linux-gnu-gcc")
    assert set(t.features) == {"asimd", "asimddp"} and t.vector_bytes == 16
    assert "+dotprod" in t.tvm["mattr"]


# ---- machine code -------------------------------------------------------------------------------

def test_elementwise_kernels_compute_in_4_lane_fp32_vectors(neon_asm, neon_lib):
    for name, sig in neon_lib.items():
        if sig.op not in ("eltwise", "binary"):
            continue
        code = kernel_instructions(neon_asm, name)
        assert code, f"{name}: no code found in the library"
        arith = [i for i in code if re.match(r"f[a-z]+\s+v\d+\.4s", i)]
        assert arith, f"{name}: no 4-lane fp32 arithmetic (fadd/fmul/fmla/fmaxnm ... v.4s)"
    sig_code = kernel_instructions(neon_asm, "gelu_erf_dst_fused_nChw4c")
    assert any(i.startswith("fmla") and ".4s" in i for i in sig_code), "gelu: no fmla v.4s"


def test_reorders_store_whole_vectors(neon_asm, neon_lib):
    for name, sig in neon_lib.items():
        if sig.op != "reorder":
            continue
        code = kernel_instructions(neon_asm, name)
        # fp32: q registers (4 lanes; d for the 2-lane rest of a 3-channel block). Narrower
        # types have scalar stores from w registers (strb/strh), so any store from a SIMD
        # register is a vector of them: 4 x int8 of a c4 block is one s register, 7 x bf16
        # of a w=7 row a d + s + h
        fp32 = sig.args[-1][3] == "float32"
        reg = r"\b[dq]\d+\b|\bv\d+\.[24]s\b" if fp32 else r"\b[sdq]\d+\b|\bv\d+\."
        stores = [i for i in code if re.match(r"(str|stp|stur|st1)\s", i) and re.search(reg, i)]
        assert stores, f"{name}: no vector stores"


# ---- running under qemu -------------------------------------------------------------------------

def _fill_dst(layout):
    """A destination full of NaN (integers: all ones): whatever the kernel leaves is visible."""
    return bp.Memory(layout, garbage(layout.alloc_len, layout.dtype))


def _source(layout, rng, dirty_padding=False):
    mem = bp.Memory.from_numpy(random_array(layout.shape, layout.dtype, rng), layout)
    if dirty_padding:
        mem.buffer[layout.padding_offsets()] = garbage(1, layout.dtype)[0]
    return mem


def _padding(mem):
    return mem.buffer[mem.layout.padding_offsets()]


@executes
def test_reorders_and_zero_pads_are_exact(neon_dir, neon_lib, rng):
    calls, checks = [], []
    for name, sig in neon_lib.items():
        if sig.op == "reorder":
            (_, _, src_l, _), (_, _, dst_l, _) = sig.args
            # source padding NaN: a reorder must neither read it into valid elements nor copy it
            src, dst = _source(src_l, rng, dirty_padding=True), _fill_dst(dst_l)
            calls.append((name, [src, dst]))
            checks.append((name, src, dst))
        elif sig.op == "zero_pad" and "__" not in name:
            lay = sig.args[0][2]
            mem = _source(lay, rng, dirty_padding=True)
            want = mem.to_numpy()
            calls.append((name, [mem]))
            checks.append((name, want, mem))
    assert len(calls) >= 13
    launched = qemu.run_many(neon_dir, calls)
    # the parallel loops ran split into tasks on threads, as on a device, not as one range
    assert qemu.TASKS > 1 and max(launched) == qemu.TASKS, launched
    for name, src, dst in checks:
        want = src if isinstance(src, np.ndarray) else src.to_numpy()
        got = dst.to_numpy()
        same = got.dtype == want.dtype and np.array_equal(got.view(np.uint8), want.view(np.uint8))
        assert same, f"{name}: values differ"
        pad = _padding(dst)
        assert not pad.size or not np.any(pad.view(np.uint8)), f"{name}: padding not zero"


def _expected_padding(contract, has_stage):
    """What the destination padding must hold after the call (and its dst stage, if any)."""
    if has_stage or contract["dst_writes"] in ("full", "select"):
        return "zero"
    if contract["dst_writes"] == "valid":
        return "untouched"   # never written: still the NaN put there before
    return "any"


def _queue(calls, name, sig, args, dst):
    """Queue ``name``'s call, and its destination zero-pad stage where the policy has one;
    return what the destination padding must hold afterwards."""
    calls.append((name, args))
    stage = sig.padding.get("dst_stage")
    if stage:
        calls.append((stage, [dst]))
    return _expected_padding(sig.padding, bool(stage))


def _unary_calls(lib, rng, ops):
    """For every kernel of ``ops`` (sources, then the destination): its calls on random
    sources (NaN in source padding the kernel promises to mask, NaN in the destination) and
    per kernel its sources, destination and what the destination padding must hold."""
    calls, kernels = [], []
    for name, sig in lib.items():
        if sig.op not in ops:
            continue
        masked = sig.padding["reads"] == "masked"   # the kernel must ignore source padding
        srcs = [_source(lay, rng, dirty_padding=masked) for _, role, lay, _ in sig.args[:-1]]
        dst = _fill_dst(sig.args[-1][2])
        kernels.append((name, sig, srcs, dst, _queue(calls, name, sig, [*srcs, dst], dst)))
    return calls, kernels


@executes
def test_eltwise_and_binary_match_numpy_under_each_policy(neon_dir, neon_lib, rng):
    calls, kernels = _unary_calls(neon_lib, rng, ("eltwise", "binary"))
    policies = {sig.padding["policy"] for _, sig, *_ in kernels}
    assert len(kernels) >= 12 and set(POLICIES) <= policies
    checks = [(name, REFERENCE[sig.params["algorithm"]](*[s.to_numpy() for s in srcs]), dst,
               padding) for name, sig, srcs, dst, padding in kernels]
    qemu.run_many(neon_dir, calls)
    _check(checks, tol=2e-6)


@executes
def test_exp_covers_the_whole_fp32_range(neon_dir):
    # NEON has no vector libm here: exp is a polynomial (schedules.arm.vector_math) and must
    # still overflow to inf past log(FLT_MAX), and reach 0 at -inf, as expf does
    x = np.linspace(-30, 30, np.prod(SHAPE)).astype(np.float32).reshape(SHAPE)
    x.flat[:6] = [np.inf, -np.inf, 88.0, 88.7, 88.75, -87.0]
    y = np.full(SHAPE, np.nan, np.float32)
    qemu.run_aarch64(neon_dir, "exp_dst_fused_nchw", [x, y])
    with np.errstate(over="ignore"):
        want = np.exp(x.astype(np.float64)).astype(np.float32)
    assert list(np.isinf(y.flat[:6])) == [True, False, False, False, True, False]
    assert y.flat[1] == 0
    np.testing.assert_allclose(y, want, rtol=1e-6)


def _dot_calls(lib, rng, dtype):
    """For every matmul / conv of ``dtype`` in a library: its call (full-range integer inputs
    with a unit scale, so that the float destination is the int32 accumulator; NaN in the
    destination, garbage in source padding the kernel promises to mask) and its destination
    zero-pad stage where the policy has one; and per kernel the numpy result and what its
    destination padding must hold."""
    calls, checks = [], []
    for name, sig in lib.items():
        if sig.op not in ("matmul", "conv2d") or sig.args[0][2].dtype != dtype:
            continue
        args = dot_inputs(sig, rng)
        padding = _queue(calls, name, sig, [args[a[0]] for a in sig.args], args["dst"])
        checks.append((name, dot_reference(sig, args), args["dst"], padding))
    return calls, checks


def _check(checks, tol=None):
    """Each destination against its numpy result, and its padding against what the contract
    promises. ``tol`` None: exact (int8: the unit-scale destination is the int32 sum, integers
    below 2**24 being exact in float32; bias and relu rounded once, as numpy rounds them);
    else the relative and absolute tolerance (fp32: another summation order, polynomials)."""
    for name, want, dst, padding in checks:
        got = dst.to_numpy()
        if tol is None:
            np.testing.assert_array_equal(got, want.astype(np.float32), err_msg=name)
        else:
            np.testing.assert_allclose(got, want, rtol=tol, atol=tol, err_msg=name)
        pad = _padding(dst)
        if padding == "zero":
            assert np.all(pad == 0), f"{name}: destination padding not zero"
        elif padding == "untouched":
            assert np.all(np.isnan(pad)), f"{name}: wrote the padding it promised to leave alone"


def test_fp32_conv_and_matmul_are_register_tiles_of_fmla(neon_lib, neon_asm):
    """Each step of the reduction: a few loads feed many fmla (a register tile of 4-lane
    accumulators), not one fmla per loaded weight vector, and little spills. (A 7-row tile
    whose 3x3 window LLVM unrolls whole spills a few source vectors: 9 of 132 instructions.)"""
    names = [n for n, sig in neon_lib.items()
             if sig.op in ("conv2d", "matmul") and sig.args[0][2].dtype == "float32"]
    assert len(names) == 5
    for name in names:
        where, m = isa.hot_loop(neon_asm, name, "aarch64")
        assert where == "loop" and m["spills"] <= m["dot"] / 8 and m["dot"] >= 1.5 * m["loads"], \
            (name, m)


@executes
def test_fp32_conv_matmul_softmax_pool_match_numpy_under_each_policy(neon_dir, neon_lib, rng):
    calls, checks = _dot_calls(neon_lib, rng, "float32")
    more_calls, kernels = _unary_calls(neon_lib, rng, ("softmax", "pool"))
    entries = {k.get("name"): k for k in SPEC["kernel"]}
    checks += [(name, REFERENCES[sig.op](entries[name], src.to_numpy()), dst, padding)
               for name, sig, (src,), dst, padding in kernels]
    assert len(checks) == 5 + 4 + 3
    qemu.run_many(neon_dir, calls + more_calls)
    _check(checks, tol=1e-5)


def _sdot_hot_loop(funcs, name) -> dict:
    """The instruction mix of ``name``'s hot loop (``blockpad bench isa``'s: the innermost
    loop with the most dot instructions), which must be a loop of ``sdot``: most of its dot
    instructions are (the rest: the epilogue's ``fmla``, where LLVM unrolled the whole
    reduction into the loop over tiles)."""
    where, m = isa.hot_loop(funcs, name, "aarch64")
    loops = [l for lines in assembly.kernel_code(funcs, name).values()
             for l in isa.innermost_loops(lines)]
    hot = max(loops, key=lambda l: isa.mix(l, "aarch64")["dot"], default=[])
    sdots = sum(i.split()[0] == "sdot" for i in hot if i.split())
    assert where == "loop" and 2 * sdots > m["dot"], f"{name}: hot loop {where} {m}"
    return m


@executes
def test_int8_matmul_without_dotprod_uses_no_sdot(neon_dir, neon_lib, neon_asm, rng):
    assert not any(i.startswith("sdot") for i in kernel_instructions(neon_asm, "mm_s8"))
    calls, checks = _dot_calls(neon_lib, rng, "int8")
    qemu.run_many(neon_dir, calls)
    _check(checks)


def test_int8_matmul_and_conv_run_on_sdot(dotprod_dir, dotprod_lib, dotprod_asm):
    assert mf.read(dotprod_dir)["target"]["features"] == ["asimd", "asimddp"]
    int8 = [n for n, sig in dotprod_lib.items() if sig.op in ("matmul", "conv2d")]
    assert sorted(int8) == sorted(k["name"] for k in DOTPROD_SPEC["kernel"])
    for name in int8:
        sdot = [i for i in kernel_instructions(dotprod_asm, name) if i.startswith("sdot")]
        assert sdot and all(".4s" in i and ".16b" in i for i in sdot), f"{name}: no sdot"
        spills = _sdot_hot_loop(dotprod_asm, name)["spills"]
        # convolutions: register tiles whose accumulators stay in q registers. (A small
        # matmul's reduction, 5 to 8 steps, is unrolled whole into the loop over tiles, and
        # LLVM hoists all its loads: some spill.)
        assert dotprod_lib[name].op != "conv2d" or not spills, name


@executes
def test_int8_sdot_kernels_match_numpy_exactly_under_each_policy(dotprod_dir, dotprod_lib, rng):
    calls, checks = _dot_calls(dotprod_lib, rng, "int8")
    policies = {dotprod_lib[name].padding["policy"] for name, *_ in checks}
    assert set(POLICIES) <= policies
    qemu.run_many(dotprod_dir, calls)
    _check(checks)


def test_the_shared_object_holds_neon_code(neon_dir, dotprod_dir):
    objdump = shutil.which("aarch64-linux-gnu-objdump")
    if objdump is None:
        pytest.skip("aarch64-linux-gnu-objdump not installed (apt-get install "
                    "binutils-aarch64-linux-gnu)")

    def text(lib):
        return subprocess.run([objdump, "-d", "--no-show-raw-insn", str(lib / "kernels.so")],
                              capture_output=True, text=True, check=True).stdout
    neon, dotprod = text(neon_dir), text(dotprod_dir)
    assert re.search(r"\bfmla\s+v\d+\.4s", neon) and re.search(r"\bfmaxnm\s+v\d+\.4s", neon)
    assert not re.search(r"\bsdot\b", neon)
    assert re.search(r"\bsdot\s+v\d+\.4s, v\d+\.16b, v\d+\.16b", dotprod)


@executes
def test_plain_numpy_arrays_are_taken_too(neon_dir, rng):
    x = rng.standard_normal(SHAPE).astype(np.float32)
    y = np.full(SHAPE, np.nan, np.float32)
    qemu.run_aarch64(neon_dir, "relu_dst_fused_nchw", [x, y])
    np.testing.assert_array_equal(y, np.maximum(x, 0))


@executes
def test_a_kernel_error_comes_back_with_tvms_message(neon_dir, neon_lib, tmp_path):
    # call the harness directly with a wrong shape: the kernel's own argument check must fire
    # and its message travel back through TVMFFIErrorMoveFromRaised
    sig = neon_lib["relu_dst_fused_nchw"]
    words = []
    for i, (_, _, lay, storage) in enumerate(sig.args):
        path = tmp_path / f"{i}.bin"
        np.zeros(lay.alloc_len, np.float32).tofile(path)
        words.append(qemu._tensor_word(lay, storage, str(path)).replace("2x30x5x7", "2x30x5x6"))
    calls = tmp_path / "calls.txt"
    calls.write_text(" ".join(["relu_dst_fused_nchw", *words]) + "\n")
    r = subprocess.run([qemu.qemu_binary(), "-L", qemu.SYSROOT, "-cpu", "max", str(qemu.harness()),
                        str(neon_dir / "kernels.so"), str(calls)], capture_output=True, text=True)
    assert r.returncode == 1
    assert "ValueError" in r.stderr and "shape[3]" in r.stderr and "expected 7" in r.stderr


@executes
def test_the_harness_catches_writes_outside_buffers_and_into_inputs(neon_dir, neon_lib, tmp_path):
    """Every call's buffers sit between guard bytes and its inputs are compared after it: a
    destination file shorter than the kernel writes (the kernel overruns it), and a written
    tensor passed as an input, both fail the call, saying which."""
    sig = neon_lib["relu_dst_fused_nchw"]
    (_, _, src, storage), (_, _, dst, _) = sig.args

    def harness(dst_elements, dst_role):
        np.ones(src.alloc_len, np.float32).tofile(tmp_path / "src.bin")
        np.zeros(dst_elements, np.float32).tofile(tmp_path / "dst.bin")
        words = [qemu._tensor_word(src, storage, str(tmp_path / "src.bin"), "in"),
                 qemu._tensor_word(dst, storage, str(tmp_path / "dst.bin"), dst_role)]
        (tmp_path / "calls.txt").write_text(" ".join(["relu_dst_fused_nchw", *words]) + "\n")
        return subprocess.run([qemu.qemu_binary(), "-L", qemu.SYSROOT, "-cpu", "max",
                               str(qemu.harness()), str(neon_dir / "kernels.so"),
                               str(tmp_path / "calls.txt")], capture_output=True, text=True)
    ok = harness(dst.alloc_len, "out")
    assert ok.returncode == 0 and ok.stdout.startswith("ok"), ok.stderr
    short = harness(dst.alloc_len - 16, "out")
    assert short.returncode == 3
    assert re.search(r"relu_dst_fused_nchw wrote 64 guard bytes around tensor 1", short.stderr)
    written = harness(dst.alloc_len, "in")
    assert written.returncode == 3 and "changed its input tensor 1" in written.stderr


def test_arguments_are_checked_against_the_signature(neon_dir, neon_lib):
    wrong = bp.Memory.zeros(bp.Layout("nChw8c", SHAPE))
    with pytest.raises(bp.ArgumentError, match="expected layout"):
        qemu.run_aarch64(neon_dir, "relu_dst_fused_nChw4c", [wrong, wrong])
    with pytest.raises(bp.ArgumentError, match="has kernels"):
        qemu.run_aarch64(neon_dir, "no_such_kernel", [])


# ---- helpers ------------------------------------------------------------------------------------

def _toml(spec: dict) -> str:
    """A minimal TOML writer for this spec (tomllib only reads)."""
    def value(v):
        if isinstance(v, str):
            return f'"{v}"'
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, list):
            return "[" + ", ".join(value(x) for x in v) + "]"
        if isinstance(v, dict):
            return "{ " + ", ".join(f"{k} = {value(x)}" for k, x in v.items()) + " }"
        return repr(v)

    lines = ["[library]"] + [f"{k} = {value(v)}" for k, v in spec["library"].items()]
    for k in spec["kernel"]:
        lines += ["", "[[kernel]]"] + [f"{key} = {value(v)}" for key, v in k.items()]
    parse_spec(spec)   # the same spec, parsed directly, must be valid too
    return "\n".join(lines) + "\n"
