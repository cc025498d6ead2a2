"""blockpad's own x86 tensor intrinsics: their semantics on the host, and the instructions they
compile to. VNNI runs for real where the CPU has avx512_vnni; AMX cannot run without AMX, so
its schedule runs with the plain-loop twin of each intrinsic (the instruction's arithmetic, under
the same packing, blocking and accumulation order) and the real one is checked in the
assembly."""

import numpy as np
import pytest
import tvm
import tvm_ffi
from tvm import te

from blockpad import machine
from blockpad.schedules import x86_intrin as xi

M, N, K = 32, 48, 128


def _int8_matmul(intrin_k, src="uint8"):
    """u8 or s8 X[M, K] x s8 W packed [N/16][K/k][16][k] -> s32 Y[M, N] (the VNNI packing)."""
    x = te.placeholder((M, K), src, name="X")
    w = te.placeholder((N // 16, K // intrin_k, 16, intrin_k), "int8", name="W")
    k = te.reduce_axis((0, K), "k")
    y = te.compute((M, N), lambda i, j: te.sum(
        x[i, k].astype("int32") * w[j // 16, k // intrin_k, j % 16, k % intrin_k].astype("int32"),
        axis=k), name="Y")
    return te.create_prim_func([x, w, y])


def _vnni_schedule(reference, src="uint8"):
    sch = tvm.s_tir.Schedule(_int8_matmul(4, src))
    blk = sch.get_sblock("Y")
    i, j, k = sch.get_loops(blk)
    jo, ji = sch.split(j, [None, 16])
    ko, ki = sch.split(k, [None, 4])
    sch.reorder(i, jo, ko, ji, ki)
    sch.parallel(sch.fuse(i, jo))
    init = sch.decompose_reduction(blk, ko)
    sch.vectorize(sch.get_loops(init)[-1])
    sch.tensorize(ji, xi.name(xi.VNNI if src == "uint8" else xi.VNNI_S8, reference))
    return sch.mod


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


VNNI_PACK = lambda w: w.reshape(N // 16, 16, K // 4, 4).transpose(0, 2, 1, 3).copy()
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

    for base in (xi.VNNI_S8, xi.AMX_S8, xi.AMX_BF16, xi.AMX_ZERO_F32):
        ref = TensorIntrin.get(xi.name(base, True))
        assert not tvm_ffi.structural_equal(ref.desc, ref.impl), base
    s8 = TensorIntrin.get(xi.name(xi.VNNI_S8, True)).impl.script()
    assert "128" in s8 and "vpdpbusd" not in s8


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
