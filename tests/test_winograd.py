"""Winograd convolution F(m x m, 3x3): the transform matrices, the kernels under every padding
policy and layout against a float64 direct convolution (numpy), the documented error bound,
the weights transform, ``algorithm = "auto"``, bp.Graph, bad specs, and the instructions
AVX-512 and NEON builds emit (NEON run under qemu-aarch64)."""

from __future__ import annotations

import json
import re
from fractions import Fraction

import numpy as np
import pytest

import blockpad as bp
from blockpad import machine
from blockpad import winograd as wino
from blockpad.codegen.build import make_kernels
from blockpad.codegen.spec import parse_spec
from blockpad.codegen.targets import get_target
from blockpad.errors import ArgumentError, SpecError
from blockpad.runtime.graph.ops import conv_ref
from blockpad.schedules import winograd as winograd_schedules
from blockpad.schedules.winograd import Winograd
from blockpad.testing import qemu
from blockpad.vocabulary import POLICIES

from .conftest import asm_functions, kernel_instructions

RELU = {"kind": "eltwise", "algorithm": "relu"}
CHAIN = [{"kind": "bias"}, RELU]


def _conv(name, shape, k, tag, wtag, m, pad=(1, 1), post_ops=CHAIN, policy="dst_fused", **kw):
    return {"name": name, "op": "conv2d", "shape": list(shape), "channels": k,
            "kernel": [3, 3], "pad": list(pad), "src": kw.pop("src", tag),
            "dst": kw.pop("dst", tag), "weights": wtag, "algorithm": "winograd",
            "winograd_tile": m, "post_ops": post_ops, "policy": policy, **kw}


# (name, tile, input channels) of every conv kernel in SPEC
CASES = [(f"w4_{p}", 4, 20) for p in POLICIES] + [
    ("w2_8c_sum", 2, 13), ("w6_nhwc", 6, 16), ("w4_halo", 4, 16), ("w4_pad02", 4, 16)]
SPEC = {"library": {"name": "test-winograd"}, "kernel": [
    # odd sizes: C=20 and K=24 fill 16-channel blocks partly, 7x9 leaves partial 4x4 tiles
    *[_conv(f"w4_{p}", (1, 20, 7, 9), 24, "nChw16c", "hwOi16o", 4, policy=p) for p in POLICIES],
    _conv("w2_8c_sum", (2, 13, 6, 5), 11, "nChw8c", "hwOi8o", 2,
          post_ops=[RELU, {"kind": "sum", "scale": 0.5}], sum="nChw8c"),
    _conv("w6_nhwc", (1, 16, 9, 10), 12, "nhwc", "hwOi16o", 6, post_ops=[]),
    _conv("w4_halo", (1, 16, 6, 8), 8, "nChw8c", "hwOi8o", 4,
          src={"tag": "nChw8c", "paddings": {"h": [1, 1], "w": [1, 1]}},
          dst={"tag": "nChw8c", "paddings": {"h": [1, 2], "w": [2, 1]}}),
    _conv("w4_pad02", (1, 16, 5, 6), 16, "nChw16c", "oihw", 4, pad=(0, 2)),
    {"name": "transform6", "op": "winograd_weights", "shape": [12, 5, 3, 3], "src": "oihw",
     "dst": "hwOi8o", "winograd_tile": 6},
    {"name": "auto_big", "op": "conv2d", "shape": [1, 32, 28, 28], "channels": 32,
     "kernel": [3, 3], "pad": [1, 1], "src": "nChw8c", "weights": "OIhw8i8o", "dst": "nChw8c",
     "algorithm": "auto"},
    {"name": "auto_strided", "op": "conv2d", "shape": [1, 8, 8, 8], "channels": 8,
     "kernel": [3, 3], "stride": [2, 2], "pad": [1, 1], "src": "nChw8c", "weights": "OIhw8i8o",
     "dst": "nChw8c", "algorithm": "auto"},
]}


@pytest.fixture(scope="module")
def lib_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("winograd")
    bp.build(parse_spec(SPEC), "host", d, log=lambda m: None)
    return d


@pytest.fixture(scope="module")
def lib(lib_dir):
    return bp.load(lib_dir)


def _args(sig):
    return {name: lay for name, _, lay, _ in sig.args}


def _run(lib, name, rng):
    """Run conv ``name`` on random data: weights through its library's transform kernel;
    returns (result, float64 reference, the destination memory)."""
    sig = lib.kernels[name]
    lays = _args(sig)
    p = sig.params
    src = lays["src"]
    x = rng.standard_normal(src.shape).astype("float32")
    w = rng.standard_normal((p["channels"], src.shape[1], 3, 3)).astype("float32")
    u = lib.memory(lays["weights"])
    lib[p["winograd"]["weights_transform"]](w, u)
    extra, ref_extra = [], {}
    if "bias" in lays:
        b = rng.standard_normal(lays["bias"].shape).astype("float32")
        extra.append(b)
        ref_extra["bias"] = b
    if "sum" in lays:
        s = rng.standard_normal(lays["sum"].shape).astype("float32")
        extra.append(bp.Memory.from_numpy(s, lays["sum"]))
        ref_extra["operands"] = {"sum": s}
    dst = lib.memory(lays["dst"])
    lib[name](bp.Memory.from_numpy(x, src), u, *extra, dst)
    ref = conv_ref(x, w, pad=tuple(p["pad"]), post_ops=p["post_ops"], **ref_extra)
    return dst.to_numpy(), ref, dst


# ---- the transforms ----------------------------------------------------------------------

@pytest.mark.parametrize("m", wino.TILES)
def test_matrices_compute_the_correlation_exactly(m):
    """A^T [(G g G^T) (.) (B^T d B)] A is the 2-D correlation of d and g, in exact
    arithmetic, checked on random integer tiles against the definition."""
    at, g, bt = wino.matrices(m)
    a = m + 2
    rng = np.random.default_rng(m)
    d = [[Fraction(int(v)) for v in row] for row in rng.integers(-9, 10, (a, a))]
    f = [[Fraction(int(v)) for v in row] for row in rng.integers(-9, 10, (3, 3))]

    def mul(x, y):
        return [[sum(x[i][k] * y[k][j] for k in range(len(y))) for j in range(len(y[0]))]
                for i in range(len(x))]

    def tr(x):
        return [list(r) for r in zip(*x)]

    u, v = mul(mul(g, f), tr(g)), mul(mul(bt, d), tr(bt))
    y = mul(mul(at, [[u[i][j] * v[i][j] for j in range(a)] for i in range(a)]), tr(at))
    want = [[sum(d[i + r][j + s] * f[r][s] for r in range(3) for s in range(3))
             for j in range(m)] for i in range(m)]
    assert y == want
    if m == 4:
        assert bt[0] == (4, 0, -5, 0, 1, 0)   # Lavin's F(4x4, 3x3)


def test_error_bound_grows_with_the_tile():
    kappa = [wino.amplification(m) for m in wino.TILES]
    assert kappa == sorted(kappa) and kappa[0] == pytest.approx(5.0)
    assert wino.error_bound(4, 512) > wino.error_bound(4, 64)
    assert wino.candidates(64) == [2, 4, 6]
    assert wino.candidates(10 ** 6) == []   # past the tolerance: auto picks direct


def test_auto_takes_winograd_for_few_ragged_channels():
    """A pruned network's small ragged 3x3s (40 -> 41 at 56x56) gain from Winograd as much as
    whole blocks do, since the transforms run over whole channel blocks: ``auto`` picks it."""
    assert wino.choose(1, 40, 41, 56, 56) == 4 and wino.choose(1, 48, 50, 56, 56) == 4
    assert wino.choose(1, 92, 78, 28, 28) is not None


def test_the_cost_model_goes_by_the_target():
    """Rates measured on one machine pick badly on another: on Zen 4 F(2x2) beats direct at
    7x7 with 512 channels (its memory streams the transformed weights ten times faster than
    the AVX2 machine's the defaults were measured on), and the planner asks the model of the
    target it plans for (the probe of a model build, a kernel cache's target otherwise)."""
    from blockpad.model_build import plan_kernels

    assert wino.target_rates("no such target") is wino.DEFAULT_RATES
    assert wino.choose(1, 512, 512, 7, 7) is None
    assert wino.choose(1, 512, 512, 7, 7, wino.target_rates("zen4")) == 2
    g = bp.Graph(name="w7")
    g.output(g.conv2d(g.input("x", (1, 512, 7, 7)), g.constant(
        "w", np.zeros((512, 512, 3, 3), np.float32)), pad=1, name="conv", algorithm="auto"))
    tiles = {t: [dict(r.params).get("winograd_tile") for r in plan_kernels(
        g, lambda m: None, get_target(t))[1] if r.op == "conv2d"] for t in ("host", "zen4")}
    assert tiles == {"host": [None], "zen4": [2]}


def test_bench_winograd_fits_the_rates_that_made_the_times():
    """``bench winograd``'s fit recovers the rates behind times the model itself computes, and
    the picks with them lose nothing."""
    from blockpad.bench import winograd as bench

    made = {"direct": 50e9, "gemm": 60e9, "transform": 5e9, "weights": 10e9}
    times = {t: [[wino.estimate(1, c, k, hw, hw, m, made) / t for m in bench.VARIANTS]
                 for c, k, hw in bench.SHAPES] for t in (1, 2)}
    fitted = bench.fit(bench.SHAPES, times)
    assert fitted == pytest.approx(made, rel=1e-2)
    chosen, lost = bench.picks(bench.SHAPES, times, fitted)
    assert lost == {1: pytest.approx(0), 2: pytest.approx(0)}
    assert chosen[3] == wino.choose(1, 512, 512, 7, 7, made)


def test_bench_winograd_runs_end_to_end(tmp_path, monkeypatch, capsys):
    """``blockpad bench winograd --quick``: builds every variant of two layers for the host,
    times them in a process of its own and prints each layer's times and picks, and either
    the fitted rates or why the fit failed (one round of a loaded machine may not fit)."""
    from blockpad.bench import winograd as bench

    monkeypatch.chdir(tmp_path)
    bench.main(target="host", repeat=1, threads=1, quick=True)
    out = capsys.readouterr().out
    assert "64 -> 64 @ 28x28" in out and "256 -> 256 @ 7x7" in out
    assert "the current model for host" in out
    assert "an entry for blockpad/winograd.py RATES" in out or "the fit failed" in out


# ---- kernels against numpy ----------------------------------------------------------------

@pytest.mark.parametrize("name,m,c", CASES)
def test_kernels_match_direct_convolution_within_the_bound(lib, name, m, c, rng):
    got, ref, dst = _run(lib, name, rng)
    err = np.abs(got - ref).max() / np.abs(ref).max()
    assert err <= wino.error_bound(m, c), f"{name}: {err:.2e} > {wino.error_bound(m, c):.2e}"
    assert err <= wino.TOLERANCE
    if lib.kernels[name].padding["produces"] == "clean" and dst.layout.has_padding:
        assert dst.padding_is_zero()


def test_every_policy_gives_the_same_numbers(lib):
    outs = [_run(lib, f"w4_{p}", np.random.default_rng(7))[0] for p in POLICIES]
    for p, o in zip(POLICIES[1:], outs[1:]):
        np.testing.assert_array_equal(o, outs[0], err_msg=p)


def test_dst_fused_overwrites_garbage_in_padding(lib, rng):
    """A destination full of NaN: the kernel writes every logical element and zero in every
    padding element (channels 24..31, the halo of w4_halo)."""
    for name in ("w4_dst_fused", "w4_halo"):
        sig = lib.kernels[name]
        lays = _args(sig)
        x = rng.standard_normal(lays["src"].shape).astype("float32")
        w = rng.standard_normal((sig.params["channels"], x.shape[1], 3, 3)).astype("float32")
        b = rng.standard_normal(sig.params["channels"]).astype("float32")
        u = lib.memory(lays["weights"])
        lib[sig.params["winograd"]["weights_transform"]](w, u)
        buf = np.full(lays["dst"].alloc_len, np.nan, np.float32)
        dst = bp.Memory(lays["dst"], buf)
        lib[name](bp.Memory.from_numpy(x, lays["src"]), u, b, dst)
        assert np.isfinite(buf).all()
        assert np.all(buf[lays["dst"].padding_offsets()] == 0)
        ref = conv_ref(x, w, b, pad=(1, 1), post_ops=CHAIN)
        assert np.abs(dst.to_numpy() - ref).max() <= wino.TOLERANCE * np.abs(ref).max()


def test_weights_transform_kernel(lib, rng):
    """The transform kernel of its own (op winograd_weights): G w G^T, channel padding zero."""
    w = rng.standard_normal((12, 5, 3, 3)).astype("float32")
    sig = lib.kernels["transform6"]
    out = lib.memory(_args(sig)["dst"])
    lib["transform6"](w, out)
    g = np.array(wino.matrices(6)[1], dtype=np.float64)
    want = np.einsum("er,kcrs,ns->kcen", g, w.astype(np.float64), g)
    np.testing.assert_allclose(out.to_numpy(), want, rtol=1e-6, atol=1e-6)
    assert out.padding_is_zero()   # K = 12 in 8-channel panels


def test_manifest_names_the_transform_and_the_layout(lib_dir):
    manifest = json.loads((lib_dir / "manifest.json").read_text())
    entries = {k["name"]: k for k in manifest["kernels"]}
    conv = entries["w4_dst_fused"]
    assert conv["params"]["algorithm"] == "winograd"
    assert conv["params"]["winograd"]["weights_transform"] == "w4_dst_fused__winograd_weights"
    wei = next(a for a in conv["args"] if a["name"] == "weights")
    assert wei["layout"]["tag"] == "hwOi16o" and wei["layout"]["shape"] == [24, 20, 6, 6]
    t = entries["w4_dst_fused__winograd_weights"]
    assert t["op"] == "winograd_weights"
    assert [a["layout"]["tag"] for a in t["args"]] == ["oihw", "hwOi16o"]


def test_auto_picks_by_the_cost_model(lib, lib_dir, rng):
    sig = lib.kernels["auto_big"]
    picked = sig.params["auto"]
    assert picked["by"] == "cost model"
    est = picked["estimate_us"]
    assert picked["chosen"] == min(est, key=est.get)
    assert set(est) == {"direct", *(f"winograd{m}" for m in wino.candidates(32))}
    if picked["chosen"] != "direct":
        got, ref, _ = _run(lib, "auto_big", rng)
        assert np.abs(got - ref).max() <= wino.TOLERANCE * np.abs(ref).max()
    strided = lib.kernels["auto_strided"].params["auto"]   # Winograd does not apply
    assert strided["chosen"] == "direct" and set(strided["estimate_us"]) == {"direct"}


@pytest.mark.parametrize("entry,match", [
    ({"stride": [2, 2]}, "stride 1"),
    ({"winograd_tile": 5}, "winograd_tile"),
    ({"dtype": "int8", "weights": "hwOi16o"}, "float32"),
    ({"algorithm": "fast"}, "algorithm"),
])
def test_bad_specs_are_refused(entry, match):
    base = _conv("bad", (1, 16, 8, 8), 16, "nChw16c", "hwOi16o", 4, post_ops=[])
    with pytest.raises(SpecError, match=match):
        for req in parse_spec({"kernel": [{**base, **entry}]}).kernels:
            make_kernels(req)


# ---- bp.Graph -------------------------------------------------------------------------------

@pytest.mark.parametrize("algorithm", ["winograd", "auto"])
def test_graph_transforms_constant_weights_once(algorithm, rng, tmp_path):
    x = rng.standard_normal((1, 16, 12, 12)).astype("float32")
    w = rng.standard_normal((16, 16, 3, 3)).astype("float32")
    b = rng.standard_normal(16).astype("float32")
    g = bp.Graph(policy="tracked")
    y = g.relu(g.conv2d(g.input("x", x.shape), g.constant("w", w), g.constant("b", b), pad=1,
                        algorithm=algorithm))
    g.output(y)
    ref = np.maximum(conv_ref(x, w, b, pad=(1, 1), post_ops=[{"kind": "bias"}]), 0)
    first = g.run(x=x)
    assert first.report.weight_reorders >= 1
    out = next(iter(first.numpy().values()))
    assert np.abs(out - ref).max() <= wino.TOLERANCE * np.abs(ref).max()
    assert g.run(x=x).report.weight_reorders == 0
    w[:] = rng.standard_normal(w.shape)           # weights="check": transformed again
    again = g.run(x=x)
    assert again.report.weight_reorders >= 1
    ref = np.maximum(conv_ref(x, w, b, pad=(1, 1), post_ops=[{"kind": "bias"}]), 0)
    out = next(iter(again.numpy().values()))
    assert np.abs(out - ref).max() <= wino.TOLERANCE * np.abs(ref).max()


def test_graph_refuses_winograd_where_it_does_not_apply():
    g = bp.Graph()
    x = g.input("x", (1, 8, 8, 8))
    with pytest.raises(ArgumentError, match="winograd"):
        g.conv2d(x, g.constant("w", np.ones((8, 8, 3, 3), "float32")), stride=2, pad=1,
                 algorithm="winograd")
        g.plan(x=bp.Layout("nchw", (1, 8, 8, 8)))
    with pytest.raises(ArgumentError, match="algorithm"):
        g.conv2d(x, g.constant("w2", np.ones((8, 8, 3, 3), "float32")), algorithm="fft")


# ---- other targets --------------------------------------------------------------------------

TINY = {"kernel": [_conv("tiny", (1, 8, 6, 7), 8, "nChw4c", "hwOi4o", 2, post_ops=[])]}


def test_avx512_gemm_is_zmm_fmas(tmp_path):
    spec = {"kernel": [_conv("w", (1, 32, 8, 8), 32, "nChw16c", "hwOi16o", 4, post_ops=[])]}
    bp.build(parse_spec(spec), "avx512", tmp_path, log=lambda m: None)
    code = kernel_instructions(asm_functions(tmp_path), "w")
    fmas = [i for i in code if "vfmadd" in i]
    assert fmas and all("zmm" in i for i in fmas if "vfmadd231ps" in i)
    assert sum("zmm" in i for i in fmas) >= 32


def test_avx512_gemm_cuts_an_odd_panel_off(tmp_path, rng):
    """70 output channels are 5 panels of 16: the GEMM takes them two a tile and the fifth in
    a GEMM of its own (``tile_edges.panel_parts``); the numbers match numpy where this CPU
    runs AVX-512."""
    spec = {"kernel": [_conv("odd", (1, 20, 6, 9), 70, "nChw16c", "hwOi16o", 4)]}
    func = make_kernels(parse_spec(spec).kernels[0])[0].func
    script = Winograd().schedule(func, get_target("avx512")).mod["main"].script()
    assert 'T.sblock("wino_acc_panels_update")' in script
    if "avx512f" not in machine.cpu_features():
        pytest.skip("numbers: this CPU has no avx512f (the schedule is checked above)")
    bp.build(parse_spec(spec), "avx512", tmp_path, log=lambda m: None)
    got, ref, _ = _run(bp.load(tmp_path), "odd", rng)
    assert np.abs(got - ref).max() / np.abs(ref).max() <= wino.error_bound(4, 20)


def test_stages_run_in_bands_of_tile_rows_where_the_weights_fit_in_l2():
    """64 -> 64 at 56x56 (590 KB of F(4x4) weights): the transforms and the GEMM run a row
    of tiles at a time, their scratch in L2 between the stages; with 2.4 MB of weights
    (128 -> 128 at 28x28) every band would read them all again: one pass. The bands are the
    threads' tasks (one parallel loop: a band's three stages are too short to share), the
    stages of an unbanded kernel each split among the threads. The numbers of banded
    kernels: the small cases above (bands of one row of two)."""
    def band(c, hw):
        spec = {"kernel": [_conv("b", (1, c, hw, hw), c, "nChw16c", "hwOi16o", 4)]}
        func = make_kernels(parse_spec(spec).kernels[0])[0].func
        rows = winograd_schedules._band_rows(func, winograd_schedules._facts(func))
        script = Winograd().schedule(func, get_target("avx512")).mod.script()
        return rows, re.findall(r"T\.parallel\((\d+)\)", script)
    assert band(64, 56) == (1, ["14"])
    rows, parallel = band(128, 28)
    assert rows == 0 and len(parallel) == 3


def test_a_gemm_with_large_weights_prefetches_the_next_panel(tmp_path, rng):
    """2.4 MB of F(2x2) weights (192 -> 192): too large for bands, they come from memory on
    every inference, so each GEMM task prefetches its share of the next panel's
    (``prefetch.prefetch_next_panel``; ResNet-50's layer4 and the pruned network's
    Winograd layers). The numbers stay what they were; a small kernel prefetches nothing."""
    spec = {"kernel": [_conv("big", (1, 192, 8, 8), 192, "nChw8c", "hwOi8o", 2),
                       _conv("cut", (1, 192, 8, 8), 200, "nChw8c", "hwOi8o", 2),
                       _conv("small", (1, 32, 8, 8), 32, "nChw8c", "hwOi8o", 2)]}
    bp.build(parse_spec(spec), "host", tmp_path, log=lambda m: None)
    funcs = asm_functions(tmp_path)
    fetches = {name: sum(i.split()[0] == "prefetcht1" for i in kernel_instructions(funcs, name)
                         if i.split()) for name in ("big", "cut", "small")}
    # "cut": 25 output blocks, the last a GEMM of its own; the first part prefetches the
    # leading panels of each position (pruned ResNet-50's layer2.1: 0.89-0.91x in order)
    assert fetches["big"] > 0 and fetches["cut"] > 0 and fetches["small"] == 0, fetches
    for name in ("big", "cut"):
        got, ref, _ = _run(bp.load(tmp_path), name, rng)
        assert np.abs(got - ref).max() / np.abs(ref).max() <= wino.error_bound(2, 192), name


@pytest.mark.skipif(bool(qemu.missing_tools()), reason="aarch64 toolchain / emulator not "
                    "installed: " + "; ".join(qemu.missing_tools()))
def test_neon_runs_under_qemu(tmp_path, rng):
    bp.build(parse_spec(TINY), "neon", tmp_path, log=lambda m: None)
    code = kernel_instructions(asm_functions(tmp_path), "tiny")
    assert any(i.split()[0] == "fmla" for i in code if i.split())
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    lays = {a["name"]: bp.Layout.from_dict(a["layout"]) for k in manifest["kernels"]
            if k["name"] == "tiny" for a in k["args"]}
    x = rng.standard_normal((1, 8, 6, 7)).astype("float32")
    w = rng.standard_normal((8, 8, 3, 3)).astype("float32")
    u = bp.Memory(lays["weights"], np.zeros(lays["weights"].alloc_len, np.float32))
    dst = bp.Memory(lays["dst"], np.full(lays["dst"].alloc_len, np.nan, np.float32))
    qemu.run_many(tmp_path, [("tiny__winograd_weights", [w, u]),
                             ("tiny", [bp.Memory.from_numpy(x, lays["src"]), u, dst])])
    ref = conv_ref(x, w, pad=(1, 1))
    assert np.abs(dst.to_numpy() - ref).max() <= wino.error_bound(2, 8) * np.abs(ref).max()


def test_auto_prefers_tuning_records_to_the_cost_model():
    """Where records time some candidates, the fastest recorded one wins whatever the model
    says; the chosen request keeps the kernel's name and says under which name it was tuned."""
    from blockpad.codegen import auto

    req = next(iter(parse_spec({"kernel": [{
        "name": "a", "op": "conv2d", "shape": [1, 16, 12, 12], "channels": 16,
        "kernel": [3, 3], "pad": [1, 1], "src": "nChw8c", "weights": "OIhw8i8o",
        "dst": "nChw8c", "algorithm": "auto"}]}).kernels))
    labels = [label for label, _ in auto.candidates(req)]
    assert labels == ["direct", *(f"winograd{m}" for m in wino.candidates(16))]
    times = {"a__auto_direct": 2e-4, "a__auto_winograd6": 1e-4}
    chosen, picked = auto.resolve(req, lambda c: times.get(c.name))
    assert picked["chosen"] == "winograd6" and picked["by"] == "tuning records"
    assert chosen.name == "a" and picked["tuned_as"] == "a__auto_winograd6"
    assert dict(chosen.params)["winograd_tile"] == 6
    assert chosen.layout["weights"].shape == (16, 16, 8, 8)
    _, by_model = auto.resolve(req, lambda c: None)
    assert by_model["by"] == "cost model"
