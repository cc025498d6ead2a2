"""blockpad's own x86 tensor intrinsics: their semantics on the host, and the instructions they
compile to. VNNI and vdpbf16ps run for real where the CPU has avx512_vnni / avx512_bf16; AMX
cannot run without AMX, so its schedule runs with the plain-loop twin of each intrinsic (the
instruction's arithmetic, under the same packing, blocking and accumulation order) and the real
one is checked in the assembly."""

import numpy as np
import pytest
import tvm
import tvm_ffi
from tvm import te

from blockpad import machine
from blockpad.schedules import x86_intrin as xi

M, N, K = 32, 48, 128


def _dot_matmul(steps, src="uint8", lanes=16):
    """u8 or s8 X[M, K] x s8 W packed [N/lanes][K/steps][lanes][steps] -> s32 Y[M, N] (the
    VNNI packing for 16 lanes and 4 steps); ``src`` uint16: bf16 bits by bf16 bits -> fp32."""
    bf16 = src == "uint16"
    x = te.placeholder((M, K), src, name="X")
    w = te.placeholder((N // lanes, K // steps, lanes, steps), src if bf16 else "int8", name="W")
    k = te.reduce_axis((0, K), "k")

    def elem(v):
        return tvm.tirx.reinterpret("bfloat16", v).astype("float32") if bf16 else v.astype("int32")
    y = te.compute((M, N), lambda i, j: te.sum(
        elem(x[i, k]) * elem(w[j // lanes, k // steps, j % lanes, k % steps]), axis=k), name="Y")
    return te.create_prim_func([x, w, y])


def _dot_schedule(intrin, reference, src="uint8", lanes=16):
    """The matmul with each step of ``lanes`` columns x its reduction steps one ``intrin``."""
    from blockpad.schedules.dot_intrin import KINDS

    steps = KINDS[src][0]
    sch = tvm.s_tir.Schedule(_dot_matmul(steps, src, lanes))
    blk = sch.get_sblock("Y")
    i, j, k = sch.get_loops(blk)
    jo, ji = sch.split(j, [None, lanes])
    ko, ki = sch.split(k, [None, steps])
    sch.reorder(i, jo, ko, ji, ki)
    sch.parallel(sch.fuse(i, jo))
    init = sch.decompose_reduction(blk, ko)
    sch.vectorize(sch.get_loops(init)[-1])
    sch.tensorize(ji, xi.name(intrin, reference))
    return sch.mod


def _vnni_schedule(reference, src="uint8"):
    return _dot_schedule(xi.VNNI if src == "uint8" else xi.VNNI_S8, reference, src)


def _amx_schedule(dtype, reference):
    """AMX int8: A[16, 64] u8 x B packed [K/4][N][4]; bf16 (uint16 storage): A[16, 32] x B
    [K/2][N][2]."""
    step = 4 if dtype == "uint8" else 2
    kt = 64 if dtype == "uint8" else 32
    acc = "int32" if dtype == "uint8" else "float32"
    store = "uint8" if dtype == "uint8" else "uint16"   # bf16 kept as its bits
    wdt = "int8" if dtype == "uint8" else "uint16"
    x = te.placeholder((M, K), store, name="X")
    w = te.placeholder((K // step, N, step), wdt, name="W")
    k = te.reduce_axis((0, K), "k")

    def elem(v):
        return v.astype(acc) if dtype == "uint8" else \
            tvm.tirx.reinterpret("bfloat16", v).astype(acc)
    y = te.compute((M, N), lambda i, j: te.sum(
        elem(x[i, k]) * elem(w[k // step, j, k % step]), axis=k), name="Y")
    sch = tvm.s_tir.Schedule(te.create_prim_func([x, w, y]))
    blk = sch.get_sblock("Y")
    i, j, kk = sch.get_loops(blk)
    io, ii = sch.split(i, [None, 16])
    jo, ji = sch.split(j, [None, 16])
    ko, ki = sch.split(kk, [None, kt])
    sch.reorder(io, jo, ko, ii, ji, ki)
    sch.parallel(sch.fuse(io, jo))
    init = sch.decompose_reduction(blk, ko)
    zero = xi.AMX_ZERO_I32 if acc == "int32" else xi.AMX_ZERO_F32
    sch.tensorize(sch.get_loops(init)[-2], xi.name(zero, reference))
    sch.tensorize(ii, xi.name(xi.AMX_INT8 if dtype == "uint8" else xi.AMX_BF16, reference))
    return sch.mod


def _run(mod, target, *arrays):
    lib = tvm.compile(mod, target=tvm.target.Target(target))
    tensors = [tvm.runtime.tensor(a) for a in arrays]
    lib["main"](*tensors)
    return tensors[-1].numpy()


def _data(rng, step, packing, src="uint8"):
    """Full-range operands (u8 0..255 or s8 -128..127 by s8 -128..127): the widening, the
    shift and the compensation must hold at the extremes."""
    info = np.iinfo(src)
    x = rng.integers(info.min, info.max + 1, (M, K)).astype(src)
    w = rng.integers(-128, 128, (N, K)).astype("int8")
    x[0, :4], w[0, :4] = info.min, -128
    want = x.astype(np.int32) @ w.astype(np.int32).T
    return x, packing(w), want


VNNI_PACK = lambda w, lanes=16: w.reshape(N // lanes, lanes, K // 4, 4).transpose(0, 2, 1, 3).copy()
AMX_PACK = lambda w: w.T.reshape(K // 4, 4, N).transpose(0, 2, 1).copy()


@pytest.mark.parametrize("src", ["uint8", "int8"])
def test_vnni_reference_twin_equals_numpy(rng, src):
    """The twin (vpdpbusd's arithmetic in plain loops; s8 shifted and compensated) under the
    schedule, on this CPU, against numpy's int32 matmul."""
    x, wp, want = _data(rng, 4, VNNI_PACK, src)
    got = _run(_vnni_schedule(True, src), {"kind": "llvm", "mcpu": "x86-64-v3"}, x, wp,
               np.zeros((M, N), "int32"))
    assert np.array_equal(got, want)


def test_the_twins_are_the_instructions_arithmetic_not_the_description():
    """The twins registered as ``_ref`` are not the descriptions: the s8 twin computes the
    +128 shift and its compensation, the AMX ones loop over the tile configuration."""
    from tvm.s_tir import TensorIntrin

    for base in (xi.VNNI_S8, xi.MADDUBS_S8, xi.AMX_S8, xi.AMX_BF16, xi.AMX_ZERO_F32):
        ref = TensorIntrin.get(xi.name(base, True))
        assert not tvm_ffi.structural_equal(ref.desc, ref.impl), base
    s8 = TensorIntrin.get(xi.name(xi.VNNI_S8, True)).impl.script()
    assert "128" in s8 and "vpdpbusd" not in s8
    s8 = TensorIntrin.get(xi.name(xi.MADDUBS_S8, True)).impl.script()
    assert "32767" in s8 and "pmadd" not in s8   # vpmaddubsw's saturation, written out


def test_a_corrupted_operand_is_caught(rng):
    """One weight byte of the packed operand moved from -128 to 127: the twin's result moves
    by exactly that column's products, and the comparison with numpy fails."""
    x, wp, want = _data(rng, 4, VNNI_PACK, "int8")
    wp[0, 0, 0, 0] = 127   # W[0, 0] (-128 in _data) as the kernel reads it
    got = _run(_vnni_schedule(True, "int8"), {"kind": "llvm", "mcpu": "x86-64-v3"}, x, wp,
               np.zeros((M, N), "int32"))
    diff = got - want
    assert not np.array_equal(got, want)
    assert np.array_equal(diff[:, 0], 255 * x[:, 0].astype(np.int32)) and not diff[:, 1:].any()


def test_vnni_compiles_to_vpdpbusd():
    lib = tvm.compile(_vnni_schedule(False), target=tvm.target.Target(
        {"kind": "llvm", "mtriple": "x86_64-linux-gnu", "mcpu": "cascadelake"}))
    asm = lib.mod.inspect_source("asm")
    assert "vpdpbusd" in asm and "zmm" in asm


@pytest.mark.skipif("avx512_vnni" not in machine.cpu_features(),
                    reason="this CPU has no avx512_vnni: the instruction cannot execute here")
@pytest.mark.parametrize("src", ["uint8", "int8"])
def test_vnni_runs_on_this_cpu(rng, src):
    x, wp, want = _data(rng, 4, VNNI_PACK, src)
    got = _run(_vnni_schedule(False, src), {"kind": "llvm", "mcpu": "cascadelake"}, x, wp,
               np.zeros((M, N), "int32"))
    assert np.array_equal(got, want)


def test_amx_int8_reference_twin_equals_numpy(rng):
    x, wp, want = _data(rng, 4, AMX_PACK)
    got = _run(_amx_schedule("uint8", True), {"kind": "llvm", "mcpu": "x86-64-v3"}, x, wp,
               np.zeros((M, N), "int32"))
    assert np.array_equal(got, want)
    # one byte of B's tile moved (-128 -> 127): exactly its output column changes, by 255 x
    # the A column it multiplies
    wp[0, 0, 0] = 127
    bad = _run(_amx_schedule("uint8", True), {"kind": "llvm", "mcpu": "x86-64-v3"}, x, wp,
               np.zeros((M, N), "int32"))
    diff = bad - want
    assert np.array_equal(diff[:, 0], 255 * x[:, 0].astype(np.int32)) and not diff[:, 1:].any()


def test_amx_bf16_reference_twin_equals_numpy(rng):
    import ml_dtypes

    x = rng.standard_normal((M, K)).astype(ml_dtypes.bfloat16)
    w = rng.standard_normal((N, K)).astype(ml_dtypes.bfloat16)
    want = x.astype(np.float32) @ w.astype(np.float32).T
    wp = w.T.reshape(K // 2, 2, N).transpose(0, 2, 1).copy()
    lib = tvm.compile(_amx_schedule("bfloat16", True),
                      target=tvm.target.Target({"kind": "llvm", "mcpu": "x86-64-v3"}))
    y = np.zeros((M, N), "float32")
    y = tvm.runtime.tensor(y)   # 64-byte aligned, as the compiled placeholders assume
    lib["main"](tvm.runtime.tensor(x.view(np.uint16)), tvm.runtime.tensor(wp.view(np.uint16)), y)
    np.testing.assert_allclose(y.numpy(), want, rtol=1e-3, atol=1e-2)


@pytest.mark.parametrize("dtype, instr", [("uint8", "tdpbusd"), ("bfloat16", "tdpbf16ps")])
def test_amx_compiles_to_tile_instructions(dtype, instr):
    lib = tvm.compile(_amx_schedule(dtype, False), target=tvm.target.Target(
        {"kind": "llvm", "mtriple": "x86_64-linux-gnu", "mcpu": "sapphirerapids"}))
    asm = lib.mod.inspect_source("asm")
    for needed in (instr, "tileloadd", "tilestored", "ldtilecfg", "tilezero"):
        assert needed in asm, needed


# ---- vdpbf16ps: bf16 pairs into float32 lanes --------------------------------------------------

HAVE_BF16 = "avx512_bf16" in machine.cpu_features()
COOPERLAKE = {"kind": "llvm", "mtriple": "x86_64-linux-gnu", "mcpu": "cooperlake"}


def _bf16_data(rng, lanes=16):
    """bf16 X[M, K] and W[N, K] as their uint16 bits, W packed [N/lanes][K/2][lanes][2], and
    numpy's float64 product of the bf16 values."""
    import ml_dtypes

    x = rng.standard_normal((M, K)).astype(ml_dtypes.bfloat16)
    w = rng.standard_normal((N, K)).astype(ml_dtypes.bfloat16)
    want = x.astype(np.float64) @ w.astype(np.float64).T
    wp = w.reshape(N // lanes, lanes, K // 2, 2).transpose(0, 2, 1, 3).copy()
    return x.view(np.uint16), wp.view(np.uint16), want


BF16_LANES = [(16, "VDPBF16", "zmm"), (8, "VDPBF16_8", "ymm")]


@pytest.mark.parametrize("lanes, intrin, reg", BF16_LANES)
def test_vdpbf16_reference_twin_equals_numpy(rng, lanes, intrin, reg):
    """The twin (two bf16 products a lane, odd first, each added with one rounding) under the
    schedule, on this CPU: numpy's float64 product of the same bf16 values, to fp32's sums."""
    x, wp, want = _bf16_data(rng, lanes)
    got = _run(_dot_schedule(getattr(xi, intrin), True, "uint16", lanes),
               {"kind": "llvm", "mcpu": "x86-64-v3"}, x, wp, np.zeros((M, N), "float32"))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)


def test_vdpbf16_twin_adds_the_odd_product_first():
    """Pair 0 (1, 0) makes each lane 1; pair 1 is (2**-30, -1): the odd element first gives
    1 - 1 + 2**-30 = 2**-30, the even one first 0 (1 + 2**-30 rounds to 1). The twin says odd
    first; where the CPU has the instruction, it agrees (measured so on a Zen 4)."""
    import ml_dtypes

    x = np.zeros((M, K), ml_dtypes.bfloat16)
    x[:, 0], x[:, 2], x[:, 3] = 1.0, 2.0 ** -30, -1.0
    w = np.zeros((N, K), ml_dtypes.bfloat16)
    w[:, :4] = 1.0
    wp = w.reshape(N // 16, 16, K // 2, 2).transpose(0, 2, 1, 3).copy().view(np.uint16)
    runs = [({"kind": "llvm", "mcpu": "x86-64-v3"}, True)] + [(COOPERLAKE, False)] * HAVE_BF16
    for target, reference in runs:
        got = _run(_dot_schedule(xi.VDPBF16, reference, "uint16"), target, x.view(np.uint16), wp,
                   np.zeros((M, N), "float32"))
        assert np.all(got == np.float32(2.0 ** -30)), (reference, got[0, :4])


@pytest.mark.parametrize("lanes, intrin, reg", BF16_LANES)
def test_vdpbf16_compiles_to_vdpbf16ps(lanes, intrin, reg):
    """One zmm (ymm) ``vdpbf16ps`` a step, inlined (no call left), no FMA of widened values."""
    asm = tvm.compile(_dot_schedule(getattr(xi, intrin), False, "uint16", lanes),
                      target=tvm.target.Target(COOPERLAKE)).mod.inspect_source("asm")
    ops = [l.split() for l in asm.splitlines() if l.strip() and not l.strip().startswith(".")]
    dots = [o for o in ops if o[0] == "vdpbf16ps"]
    assert dots and all(reg in " ".join(o) for o in dots)
    assert not any(o[0].startswith("vfmadd") for o in ops)
    assert not any(o[0] == "callq" and xi.vdpbf16ps_fn(lanes)[0] in " ".join(o) for o in ops)


@pytest.mark.skipif(not HAVE_BF16, reason="this CPU has no avx512_bf16: vdpbf16ps cannot "
                                          "execute here")
@pytest.mark.parametrize("lanes, intrin, reg", BF16_LANES)
def test_vdpbf16_runs_on_this_cpu_as_its_twin_computes(rng, lanes, intrin, reg):
    """The instruction and its twin agree bit for bit on normal numbers (same products, same
    order, same rounding), and both with numpy's float64 product to fp32's sums."""
    x, wp, want = _bf16_data(rng, lanes)
    out = np.zeros((M, N), "float32")
    got = _run(_dot_schedule(getattr(xi, intrin), False, "uint16", lanes), COOPERLAKE, x, wp, out)
    twin = _run(_dot_schedule(getattr(xi, intrin), True, "uint16", lanes),
                {"kind": "llvm", "mcpu": "x86-64-v3"}, x, wp, out)
    assert np.array_equal(got, twin)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)


# ---- vpmaddubsw + vpmaddwd: int8 without VNNI ------------------------------------------------
# The numpy twins below are Intel's pseudo-code in plain loops, saturation and wrap-around
# included; they are checked against the instructions on this CPU (AVX2), then used to show
# that one vpmaddubsw saturates where the split of x86_intrin._maddubs_impl stays exact.

HAVE_AVX2 = "avx2" in machine.cpu_features()
HOST = {"kind": "llvm", "mtriple": "x86_64-linux-gnu", "mcpu": "x86-64-v3"}
MADDUBS = {("uint8", 8): xi.MADDUBS, ("int8", 8): xi.MADDUBS_S8,
           ("uint8", 16): xi.MADDUBS_16, ("int8", 16): xi.MADDUBS_S8_16}


def vpmaddubsw(a, b):
    """Word i: SaturateToSignedWord(ZeroExtend(a[2i]) * SignExtend(b[2i]) + ZeroExtend(a[2i+1])
    * SignExtend(b[2i+1]))."""
    out = np.empty(len(a) // 2, np.int16)
    for i in range(len(out)):
        v = int(np.uint8(a[2 * i])) * int(b[2 * i]) + int(np.uint8(a[2 * i + 1])) * int(b[2 * i + 1])
        out[i] = min(max(v, -32768), 32767)
    return out


def vpmaddwd(a, b):
    """Dword i: a[2i] * b[2i] + a[2i+1] * b[2i+1] of signed words, modulo 2**32 (only two
    -32768 * -32768 products reach it)."""
    out = np.empty(len(a) // 2, np.int32)
    for i in range(len(out)):
        v = int(a[2 * i]) * int(b[2 * i]) + int(a[2 * i + 1]) * int(b[2 * i + 1])
        out[i] = (v + 2**31) % 2**32 - 2**31
    return out


def vpsubw(a, b):
    return ((a.astype(np.int64) - b + 2**15) % 2**16 - 2**15).astype(np.int16)


def maddubs_step(a, w, src):
    """What one ``_maddubs_impl`` step adds to C[lanes], instruction by instruction: the 4
    source bytes a (s8 shifted to u8) split into h = u >> 1 and l = u & 1, broadcast to every
    lane; w[lanes, 4] the weight register."""
    lanes = w.shape[0]
    u = a.astype(np.int64) + (128 if src == "int8" else 0)
    wb = w.reshape(-1)

    def bcast(q):
        return np.tile(np.asarray(q, np.int64), lanes).astype(np.uint8)

    def const(v):
        return np.full(2 * lanes, v, np.int16)

    high = vpmaddubsw(bcast(u >> 1), wb)
    if src == "int8":
        high = vpsubw(high, vpmaddubsw(bcast([64] * 4), wb))
    return vpmaddwd(high, const(2)) + vpmaddwd(vpmaddubsw(bcast(u & 1), wb), const(1))


def _edges(src):
    return {"uint8": [0, 1, 127, 128, 254, 255], "int8": [-128, -127, -1, 0, 1, 127]}[src]


W_EDGES = [-128, -127, -65, -64, -1, 0, 1, 63, 64, 65, 127]


def test_numpy_twins_are_what_the_instructions_compute():
    """vpmaddubsw and vpmaddwd on this CPU against the numpy twins, on every pair of edge
    bytes and words (saturating pairs included) and on random registers."""
    if not HAVE_AVX2:
        pytest.skip("this CPU has no AVX2: vpmaddubsw cannot execute here")
    from tvm.script import tirx as T

    @T.prim_func(s_tir=True)
    def instr(a: T.Buffer((64, 32), "uint8"), b: T.Buffer((64, 32), "int8"),
              w: T.Buffer((64, 16), "int16"), v: T.Buffer((64, 16), "int16"),
              x: T.Buffer((64, 16), "int16"), y: T.Buffer((64, 8), "int32")):
        for r in range(64):
            x[r, T.ramp(0, 1, 16)] = T.call_llvm_pure_intrin(
                "int16x16", "llvm.x86.avx2.pmadd.ub.sw", a.vload([r, 0], dtype="uint8x32"),
                b.vload([r, 0], dtype="int8x32"))
            y[r, T.ramp(0, 1, 8)] = T.call_llvm_pure_intrin(
                "int32x8", "llvm.x86.avx2.pmadd.wd", w.vload([r, 0], dtype="int16x16"),
                v.vload([r, 0], dtype="int16x16"))

    rng = np.random.default_rng(7)
    a = rng.integers(0, 256, (64, 32)).astype(np.uint8)
    b = rng.integers(-128, 128, (64, 32)).astype(np.int8)
    edges = [(u0, u1, w0, w1) for u0 in (0, 1, 128, 255) for u1 in (0, 127, 255)
             for w0 in (-128, -1, 0, 127) for w1 in (-128, 64, 127)]
    a.reshape(-1, 2)[:len(edges)] = [e[:2] for e in edges]
    b.reshape(-1, 2)[:len(edges)] = [e[2:] for e in edges]
    words = rng.integers(-32768, 32768, (2, 64, 16)).astype(np.int16)
    words[:, 0, :4] = [[-32768, -32768, 32767, -32768], [-32768, -32768, 32767, 32767]]
    lib = tvm.compile(tvm.IRModule({"main": instr}), target=tvm.target.Target(HOST))
    x, y = np.zeros((64, 16), np.int16), np.zeros((64, 8), np.int32)
    args = [tvm.runtime.tensor(t) for t in (a, b, *words, x, y)]
    lib["main"](*args)
    x, y = args[-2].numpy(), args[-1].numpy()
    for r in range(64):
        assert np.array_equal(x[r], vpmaddubsw(a[r], b[r])), r
        assert np.array_equal(y[r], vpmaddwd(words[0, r], words[1, r])), r
    assert x.min() == -32768 and x.max() == 32767   # the edges saturated both ways
    assert y[0, 0] == -2**31   # -32768 * -32768 * 2 wraps


@pytest.mark.parametrize("src", ["uint8", "int8"])
def test_one_vpmaddubsw_saturates_and_the_split_is_exact(src):
    """Every combination of edge source bytes and edge weights in a step: the split gives
    numpy's int32 dot product; one vpmaddubsw of the (shifted) source, as oneDNN's kernels
    issue it, does not where a pair passes 32767 (255 * 127 * 2 = 64770)."""
    e = _edges(src)
    shift = 128 if src == "int8" else 0
    saturated = 0
    for a0 in e:
        for a1 in e:
            a = np.array([a0, a1, a1, a0], src)
            w = np.array([[w0, w1, w1, w0] for w0 in W_EDGES for w1 in W_EDGES[:8]], np.int8)
            want = w.astype(np.int64) @ a.astype(np.int64)
            assert np.array_equal(maddubs_step(a, w, src), want), (a0, a1)
            u = np.tile((a.astype(np.int64) + shift).astype(np.uint8), len(w))
            naive = vpmaddwd(vpmaddubsw(u, w.reshape(-1)), np.ones(2 * len(w), np.int16)) \
                - shift * w.astype(np.int64).sum(axis=1)
            saturated += int((naive != want).sum())
    assert saturated > 0
    # 255 x 127 twice: 64770 exact, 32767 by one vpmaddubsw
    a = np.array([255, 255, 0, 0] if src == "uint8" else [127, 127, -128, -128], src)
    w = np.full((8, 4), 127, np.int8)
    assert maddubs_step(a, w, src)[0] == int(a.astype(np.int64).sum()) * 127


@pytest.mark.parametrize("src", ["uint8", "int8"])
@pytest.mark.parametrize("lanes", [8, 16])
@pytest.mark.parametrize("reference", [True, False], ids=["twin", "instructions"])
def test_maddubs_matmul_equals_numpy(rng, src, lanes, reference):
    """A matmul, each step one intrinsic, over full-range operands with the extremes in its
    first row: the plain-loop TIR twin anywhere, the instructions where this CPU has them
    (ymm: AVX2; zmm: AVX-512BW)."""
    if not reference and not {8: HAVE_AVX2, 16: "avx512bw" in machine.cpu_features()}[lanes]:
        pytest.skip(f"this CPU has no {'AVX2' if lanes == 8 else 'AVX-512BW'}: the "
                    f"{lanes}-lane vpmaddubsw cannot execute here")
    x, wp, want = _data(rng, 4, lambda w: VNNI_PACK(w, lanes), src)
    x[1, :4] = np.iinfo(src).max
    want = x.astype(np.int32) @ _unpack(wp, lanes).astype(np.int32).T
    mcpu = "x86-64-v3" if lanes == 8 or reference else "skylake-avx512"
    got = _run(_dot_schedule(MADDUBS[src, lanes], reference, src, lanes),
               {**HOST, "mcpu": mcpu}, x, wp, np.zeros((M, N), "int32"))
    assert np.array_equal(got, want)


def _unpack(wp, lanes):
    return wp.transpose(0, 2, 1, 3).reshape(N, K)


@pytest.mark.parametrize("lanes, mcpu, reg", [(8, "x86-64-v3", "ymm"),
                                              (16, "skylake-avx512", "zmm")])
def test_maddubs_compiles_to_vpmaddubsw_and_vpmaddwd(lanes, mcpu, reg):
    for src in ("uint8", "int8"):
        lib = tvm.compile(_dot_schedule(MADDUBS[src, lanes], False, src, lanes),
                          target=tvm.target.Target({**HOST, "mcpu": mcpu}))
        ops = [l.split() for l in lib.mod.inspect_source("asm").splitlines() if l.split()]
        for needed in ("vpmaddubsw", "vpmaddwd"):
            found = [o for o in ops if o[0] == needed]
            assert found and all(reg in " ".join(o) for o in found), (src, needed)
        assert not any(o[0] in ("vpmulld", "vpmovsxbd", "vpdpbusd") for o in ops), src


# dtype: (target, a target without the instruction, instruction, products a step, feature, a
# chain's value after one call from its start c over s steps: int8 adds 4 products of 1 x 1 a
# step, bf16's pairs of zero add nothing)
PEAKS = {"int8": ("avx512-vnni", "avx512", "vpdpbusd", 64, "avx512_vnni",
                  lambda c, s: (c.astype("int64") + 4 * s).astype("int32")),
         "bfloat16": ("avx512-bf16", "avx512-vnni", "vdpbf16ps", 32, "avx512_bf16",
                      lambda c, s: c.astype("float32"))}


def test_peak_target_defaults_to_what_the_dtype_needs():
    from blockpad.bench.peak import resolve_target
    from blockpad.codegen.targets import native_target

    assert resolve_target(None, "float32") == "host"
    assert resolve_target(None, "int8") == resolve_target(None, "bfloat16") == native_target()
    assert resolve_target("native", "float32") == native_target()
    assert resolve_target("avx512-vnni", "int8") == "avx512-vnni"


@pytest.mark.parametrize("dtype", list(PEAKS))
def test_dot_peak_kernels_are_chains_of_the_instruction(dtype):
    """``bench.peak --dtype int8 | bfloat16`` times what it says: every chain step one zmm
    ``vpdpbusd`` / ``vdpbf16ps`` (none folded away), a target without the instruction
    refused by name, and where this CPU has it, the chains hold what the steps add."""
    from blockpad.bench import peak
    from blockpad.errors import SpecError

    target, without, instr, products, feature, after = PEAKS[dtype]
    p = peak.Peak(target, 1, dtype)
    asm = p._lib.mod.inspect_source("asm")
    assert asm.count(instr) >= peak.CHAINS and "zmm" in asm
    assert p.flops == peak.CHAINS * 2 * products * peak.STEPS
    with pytest.raises(SpecError, match=f"{feature}.*'{without}'"):
        peak.Peak(without, 1, dtype)
    if feature in machine.cpu_features():
        p()
        want = after(np.arange(peak.CHAINS), peak.STEPS)[:, None]
        assert np.array_equal(p._args[2].numpy()[0], np.broadcast_to(want, (peak.CHAINS, 16)))
