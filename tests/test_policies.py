"""The six padding policies: the generated code differs as docs/padding-contract.md's table says, the
manifest records each kernel's contract, the runtime honours it, and every policy computes the
same numbers."""

import re

import numpy as np
import pytest

import blockpad as bp
from blockpad.codegen.build import make_kernels
from blockpad.codegen.spec import parse_spec
from blockpad.runtime import counters
from blockpad.runtime.stream import Stream
from blockpad.vocabulary import CLEAN_AFTER_CALL, POLICIES

from .reference import eltwise

SHAPE = (2, 30, 3, 5)
BLK = bp.Layout("nChw16c", SHAPE)


def _spec(policy):
    return {"library": {"policy": policy}, "kernel": [
        {"op": "eltwise", "name": "relu", "shape": list(SHAPE), "src": "nChw16c", "dst": "nChw16c"},
        {"op": "eltwise", "name": "sigmoid", "shape": list(SHAPE), "src": "nChw16c",
         "dst": "nChw16c", "algorithm": "sigmoid"},
        {"op": "binary", "name": "scale", "shape": list(SHAPE), "shape1": [1, 30, 1, 1],
         "src0": "nChw16c", "src1": "nchw", "dst": "nChw8c", "algorithm": "mul"},
        {"op": "reorder", "name": "pack", "shape": list(SHAPE), "src": "nchw", "dst": "nChw16c"},
        {"op": "reorder", "name": "unpack", "shape": list(SHAPE), "src": "nChw16c", "dst": "nchw"},
    ]}


@pytest.fixture(scope="module")
def libs(tmp_path_factory):
    out = {}
    for policy in POLICIES:
        d = tmp_path_factory.mktemp(policy)
        bp.build(parse_spec(_spec(policy)), "host", d, log=lambda m: None)
        out[policy] = bp.load(d)
    return out


def _zero_store(tir):
    """A Select on a condition over indices alone (relu's own Select tests a source value) whose
    value is computed, not read (a masked read selects the source element itself)."""
    return any("[" not in part.split(",")[0] and not part.split(",", 1)[1].lstrip().startswith("src[")
               for part in tir.split("T.Select(")[1:])


def _masked_read(tir):
    """A read of the source masked on indices: an if_then_else, or (float sources, so that the
    vectoriser keeps a blend) a Select that picks the source element or 0."""
    return "T.if_then_else(" in tir or re.search(r"T\.Select\([^\[,]*, src\[", tir) is not None


def _kernel_tir(policy, name):
    req = next(k for k in parse_spec(_spec(policy)).kernels if k.name == name)
    return [k.func.script() for k in make_kernels(req)]


# ---- what the generator emits ---------------------------------------------------------------

@pytest.mark.parametrize("policy", POLICIES)
def test_generated_stages_differ_by_policy(policy):
    relu = _kernel_tir(policy, "relu")
    sigmoid = _kernel_tir(policy, "sigmoid")
    main, *stages = sigmoid
    has_select = _zero_store(main)
    predicated = "T.where(" in main
    masked_read = _masked_read(main)
    if policy == "dst_fused":
        # relu(0) == 0: the padding is computed as is; sigmoid(0) != 0: an explicit zero store
        assert not _zero_store(relu[0]) and "T.where(" not in relu[0] and len(relu) == 1
        assert has_select and not predicated and not stages
    elif policy == "dst_stage":
        assert predicated and not has_select
        assert len(stages) == 1 and "T.float32(0.0)" in stages[0]   # the separate zero-pad
    elif policy in ("on_handle", "user"):
        assert predicated and not has_select and not stages         # padding left as set
    elif policy == "src":
        assert masked_read and not predicated and not has_select and not stages
    else:  # tracked: the cheapest code, no select, no predicate, no stage
        assert not (has_select or predicated or masked_read or stages)


def test_contract_in_manifest(libs):
    sig = libs["dst_fused"].kernels["sigmoid"]
    assert sig.padding["policy"] == "dst_fused"
    assert sig.padding["dst_writes"] == "select" and sig.padding["produces"] == "clean"
    assert libs["dst_fused"].kernels["relu"].padding["dst_writes"] == "full"
    assert libs["dst_stage"].kernels["relu"].padding["dst_stage"] == "relu__zero_pad_dst"
    assert libs["src"].kernels["relu"].padding["requires"] == "any"
    assert libs["tracked"].kernels["sigmoid"].padding["produces"] == "dirty"
    assert libs["tracked"].kernels["relu"].padding["produces"] == "inherit"
    assert libs["on_handle"].kernels["relu"].padding["produces"] == "preserved"
    assert libs["dst_fused"].kernels["pack"].padding is None   # reorders: same under all


# ---- every policy computes the same numbers ---------------------------------------------------

def _chain(lib, x, y):
    """pack -> relu -> sigmoid -> scale -> (reorder back in numpy): memories from the library."""
    a, b, c = (lib.memory(BLK) for _ in range(3))
    d = lib.memory(bp.Layout("nChw8c", SHAPE))
    lib["pack"](x, a)
    lib["relu"](a, b)
    lib["sigmoid"](b, c)
    lib["scale"](c, y, d)
    return d


@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_computes_the_same(libs, policy, rng):
    x = rng.standard_normal(SHAPE).astype("float32")
    y = rng.standard_normal((1, 30, 1, 1)).astype("float32")
    want = 1 / (1 + np.exp(-np.maximum(x, 0))) * y
    d = _chain(libs[policy], x, y)
    assert np.allclose(d.to_numpy(), want, atol=1e-6)
    if policy in CLEAN_AFTER_CALL:
        assert d.padding_is_zero() and d.state == "clean"


def test_zero_pad_counts_follow_the_policy(libs, rng):
    x = rng.standard_normal(SHAPE).astype("float32")
    y = rng.standard_normal((1, 30, 1, 1)).astype("float32")
    calls = {}
    for policy in POLICIES:
        counters.reset()
        _chain(libs[policy], x, y)
        calls[policy] = counters.snapshot()
    assert calls["on_handle"].calls == 4 and calls["on_handle"].blocking_calls == 4  # per memory
    assert calls["user"].calls == 4                  # memory creation is synchronous there too
    assert calls["dst_fused"].calls == 0             # kernels keep destinations clean
    assert calls["dst_stage"].calls == 3             # relu, sigmoid and scale each get a stage
    assert calls["src"].calls == 0                   # kernels mask; destinations may be dirty
    assert calls["tracked"].calls == 0               # nothing here needs a clean source
    assert calls["dst_stage"].bytes == 2 * (BLK.alloc_len - x.size) * 4 + (2 * 32 * 15 - x.size) * 4


# ---- runtime behaviour of the policies ----------------------------------------------------------

def test_tracked_states_and_lazy_cleanup(libs, rng):
    lib = libs["tracked"]
    x = rng.standard_normal(SHAPE).astype("float32")
    a, b = lib.memory(BLK), lib.memory(BLK)
    assert a.state == "unknown"
    lib["pack"](x, a)
    assert a.state == "clean"             # reorders write zero padding
    lib["sigmoid"](a, b)
    assert b.state == "dirty"             # sigmoid(0) = 0.5 landed in the padding
    lib["relu"](b, a)
    assert a.state == "dirty"             # relu inherits its source's dirt
    counters.reset()
    a.cleanup()
    assert a.state == "clean" and a.padding_is_zero() and counters.snapshot().calls == 1


def test_user_policy_set_data_handle_on_a_stream(libs, rng):
    lib = libs["user"]
    x = rng.standard_normal(SHAPE).astype("float32")
    mem = lib.memory(BLK)
    dirty = bp.Memory.from_numpy(x, BLK).buffer.copy()
    dirty[BLK.padding_offsets()] = np.nan
    stream = Stream("test")
    counters.reset()
    event = mem.set_data_handle(dirty, stream=stream)
    assert event is not None
    event.wait()
    assert mem.padding_is_zero() and mem.state == "clean"
    assert counters.snapshot().blocking_calls == 0 and counters.snapshot().calls == 1
    assert mem.set_data_handle(dirty.copy(), clean=True) is None   # the caller vouches: no work
    assert counters.snapshot().calls == 1
    out = lib.memory(BLK)
    done = lib["relu"](bp.Memory.from_numpy(x, BLK), out, stream=stream)   # kernels queue too
    stream.wait()
    assert done.done and np.allclose(out.to_numpy(), np.maximum(x, 0))


def test_on_handle_zero_pads_at_set_data_handle(libs, rng):
    lib = libs["on_handle"]
    mem = lib.memory(BLK)
    buf = np.full(BLK.alloc_len, np.nan, "float32")
    counters.reset()
    assert mem.set_data_handle(buf) is None
    assert mem.padding_is_zero() and counters.snapshot().blocking_calls == 1


def test_read_only_buffer_is_never_written(libs, rng):
    lib = libs["on_handle"]
    const = np.full(BLK.alloc_len, 7.0, "float32")
    const.setflags(write=False)
    mem = lib.memory(BLK)
    mem.set_data_handle(const)
    assert np.all(const == 7.0)                       # the caller's constant is untouched
    assert mem.padding_is_zero() and mem.buffer is not const


def test_src_policy_tolerates_dirty_sources(libs, rng):
    lib = libs["src"]
    x = rng.standard_normal(SHAPE).astype("float32")
    src = bp.Memory.from_numpy(x, BLK)
    src.buffer[BLK.padding_offsets()] = np.nan
    out = lib.memory(BLK)
    lib["relu"](src, out)
    assert np.array_equal(out.to_numpy(), np.maximum(x, 0))
    assert out.padding_is_zero()   # relu of masked (zero) padding: clean, as the contract says
    assert out.state == "clean"


def test_cleanup_for_custom_kernels():
    """dst_stage's public companion (seed 000 option 2.b): users zero the padding they spoiled."""
    mem = bp.Memory.from_numpy(np.ones(SHAPE, "float32"), BLK)
    mem.buffer[BLK.padding_offsets()] = 3.0   # a user's own kernel wrote the padding
    mem.cleanup()
    assert mem.padding_is_zero() and np.all(mem.to_numpy() == 1)


def test_dst_fused_tail_is_blended_in_whole_vectors(tmp_path, rng):
    """The last, partial channel block of a dst_fused kernel whose op breaks zeros: its zero
    store stays one blend per whole vector (not 8 lanes cut into 2 + 6), and the kernel makes
    one parallel launch. Then the numbers, padding included."""
    import re

    from blockpad.codegen.targets import get_target
    from blockpad.schedules import schedule

    shape = [1, 42, 40, 40]   # the third 16c block has 10 real channels: 8 + 2 of 8 lanes
    spec = {"library": {"policy": "dst_fused"}, "kernel": [
        {"op": "eltwise", "name": "sigmoid", "shape": shape, "src": "nChw16c",
         "dst": "nChw16c", "algorithm": "sigmoid"}]}
    (kernel,) = make_kernels(parse_spec(spec).kernels[0])
    tir = schedule(kernel.func, get_target("host")).script()
    widths = [int(b or a) - int(a if b else 0)
              for a, b in re.findall(r"T\.vectorized\((\d+)(?:, (\d+))?\)", tir)]
    assert widths and set(widths) == {8}, widths
    assert tir.count("T.parallel(") == 1, tir   # the tail's few rows on the calling thread
    tir = schedule(kernel.func, get_target("avx512")).script()   # 16 lanes: the block is one
    assert tir.count("T.parallel(") == 1 and "T.vectorized(16)" in tir, tir

    bp.build(parse_spec(spec), "host", tmp_path, log=lambda m: None)
    lay = bp.Layout("nChw16c", tuple(shape))
    x = rng.standard_normal(shape).astype("float32")
    dst = bp.Memory(lay, np.full(lay.alloc_len, np.nan, "float32"))
    bp.load(tmp_path)["sigmoid"](bp.Memory.from_numpy(x, lay), dst)
    np.testing.assert_allclose(dst.to_numpy(), eltwise(spec["kernel"][0], x), rtol=1e-5,
                               atol=1e-6)
    assert dst.padding_is_zero()


def test_src_policy_convolution_reads_block_padding_in_vectors(tmp_path, rng):
    """Under ``src`` every read of channel padding is masked (it may be garbage); the mask is a
    blend, not a branch per lane: 40 -> 41 channels (the weights' last output block 9 of 16 real)
    built for AVX-512 has no scalar FMA (a lane-varying ``if_then_else`` made TVM emit 896 and
    run 15x slower than dst_fused). Then the numbers, with NaN in the source's and the weights'
    padding."""
    import tvm

    from blockpad.codegen.targets import get_target
    from blockpad.schedules import schedule

    shape, k = [1, 40, 6, 7], 41
    spec = {"library": {"policy": "src"}, "kernel": [
        {"op": "conv2d", "name": "c", "shape": shape, "channels": k, "kernel": [1, 1],
         "src": "nChw16c", "weights": "OIhw16i16o", "dst": "nChw16c",
         "post_ops": [{"kind": "bias"}]}]}
    (kernel,) = make_kernels(parse_spec(spec).kernels[0])
    target = get_target("avx512")
    asm = tvm.compile(schedule(kernel.func, target), target=target.tvm_target()) \
        .mod.inspect_source("asm")
    assert re.findall(r"vfmadd\w+\s+%zmm", asm)
    assert not re.findall(r"vfmadd\w+ss\b", asm)

    bp.build(parse_spec(spec), "host", tmp_path, log=lambda m: None)
    x = rng.standard_normal(shape).astype("float32")
    w = rng.standard_normal((k, shape[1], 1, 1)).astype("float32")
    b = rng.standard_normal(k).astype("float32")
    src = bp.Memory.from_numpy(x, bp.Layout("nChw16c", tuple(shape)))
    wts = bp.Memory.from_numpy(w, bp.Layout("OIhw16i16o", w.shape))
    for m in (src, wts):
        m.buffer[m.layout.padding_offsets()] = np.nan
    dst_lay = bp.Layout("nChw16c", (1, k, *shape[2:]))
    dst = bp.Memory(dst_lay, np.full(dst_lay.alloc_len, np.nan, "float32"))
    bp.load(tmp_path)["c"](src, wts, bp.Memory.from_numpy(b, bp.Layout("a", (k,))), dst)
    ref = np.einsum("nchw,kc->nkhw", x, w[:, :, 0, 0]) + b[None, :, None, None]
    np.testing.assert_allclose(dst.to_numpy(), ref, rtol=1e-4, atol=1e-4)   # padding: dirty,
    # as src's contract says (``produces``)
