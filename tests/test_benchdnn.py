"""Reading oneDNN's benchdnn convolution problems (``blockpad check --benchdnn``): descriptors,
options, attributes, and an end-to-end check of the problems blockpad states."""

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from blockpad.check import benchdnn, check
from blockpad.errors import SpecError
from blockpad.layout import window_out_size

# ---- descriptors ----------------------------------------------------------------------------


def test_descriptor_implicit_rules():
    g = benchdnn.descriptor("ic32oc13_ih13oh12kh3ph0_n\"tails_conv:1\"")
    # square form: w copies h; oh 12 from 13 rows with a 3x3 and no front pad: one back row
    assert (g["mb"], g["ic"], g["oc"], g["ih"], g["iw"], g["kh"], g["kw"]) == (2, 32, 13, 13,
                                                                                 13, 3, 3)
    assert g["ph"] == g["pw"] == (0, 1)
    g = benchdnn.descriptor("mb1ic19ih13iw15oc20oh7ow8kh3kw3sh2sw2")   # pads derived
    assert g["ph"] == (1, 1) and g["pw"] == (1, 1)
    g = benchdnn.descriptor("g4mb3ic8ih9oc8kh3dh1ph2")   # output computed; dilation 1 is 2
    assert g["g"] == 4 and g["dh"] == 2 and g["oh"] == 9 and g["ph"] == (2, 2)


def test_a_1d_problem_is_2d_of_height_1():
    g = benchdnn.descriptor("ic19oc32_iw13ow12kw3pw1")
    assert (g["ih"], g["kh"], g["oh"], g["ph"], g["iw"], g["ow"], g["pw"]) == (1, 1, 1, (0, 0),
                                                                               13, 12, (1, 0))


def test_negative_back_padding():
    # 4 rows short of the end with stride 2: the source would be cropped
    with pytest.raises(benchdnn.Unsupported, match="back padding -4"):
        benchdnn.descriptor("ic4ih11oc4oh4kh1sh2ph0")
    # one row short with stride 2: no output lost, so it is 0
    assert benchdnn.descriptor("ic4ih10oc4oh5kh1sh2ph0")["ph"] == (0, 0)


def test_descriptor_refusals():
    with pytest.raises(benchdnn.Unsupported, match="3-D"):
        benchdnn.descriptor("ic16id5ih5oc16od5oh5kd3kh3")
    with pytest.raises(SpecError, match="not a benchdnn"):
        benchdnn.descriptor("ic16ih5oc16oh5kh3xyz")


@settings(max_examples=200, deadline=None)
@given(i=st.integers(1, 40), k=st.integers(1, 7), s=st.integers(1, 4), p=st.integers(0, 4),
       d=st.integers(0, 2))
def test_computed_output_matches_the_padded_window(i, k, s, p, d):
    """An output left out is benchdnn's; its back pad is derived from it; blockpad's window
    size over (front, back) must give that output again."""
    span = (k - 1) * (d + 1) + 1
    if i + 2 * p < span:
        return
    geo = benchdnn.descriptor(f"ic3ih{i}oc5kh{k}sh{s}ph{p}dh{d}")
    assert geo["oh"] == (i - span + 2 * p) // s + 1
    assert window_out_size(i, k, s, geo["ph"], d + 1) == geo["oh"]


# ---- options and attributes -------------------------------------------------------------------

BATCH = """# options hold until --reset; a comma lists alternatives
--reset --dir=FWD_B --mb=1 --skip-impl="ref"   # harness options are ignored
--attr=oscale=per_oc:2.25;post_ops='sum:1.5;relu:0:0:2.6'
--cfg=u8s8s32,s8s8f32 --batch=shapes
--reset --dir=FWD_D --dt=u8:s8:u8
--attr-scales=src:common:0.25+wei:per_oc+dst:common:2
--attr-zero-points=src:common:-2+dst:common:1 --attr-post-ops=sum:1:0:s8+add:f32:per_oc
mb1ic3ih12oc4oh12kh3ph1
--attr-zero-points=src:common:5+wei:common:3:s8 mb1ic3ih12oc4oh12kh3ph1
--attr-zero-points=dst:per_dim_1 mb1ic3ih12oc4oh12kh3ph1
--attr-zero-points= --attr-post-ops=linear:0.3:0.2+round+abs+max:u8:per_oc mb1ic3ih12oc4oh12kh3ph1
--attr-post-ops= --dt=u8:s8:bf16 mb1ic3ih12oc4oh12kh3ph1
--dt=bf16:bf16:f32 --attr-scales= mb1ic19ih13iw15oc20oh7ow8kh3kw3sh2sw2
--dt=f32 --alg=wino --dir=FWD_I mb1ic8ih6oc8oh6kh3ph1
--dir=BWD_D mb1ic8ih6oc8oh6kh3ph1
--dir=FWD_I --dt=f32 --alg=direct --some-option=1 mb1ic8ih6oc8oh6kh3ph1
"""
SHAPES = """ic20oc13_ih9oh8kh3ph0_n"tails"
g4ic20ih5oc20oh5kh3ph1_n"grouped"
g20ic20ih5oc20oh5kh3ph1_n"depthwise"
"""


@pytest.fixture(scope="module")
def batch(tmp_path_factory):
    d = tmp_path_factory.mktemp("benchdnn")
    (d / "shapes").write_text(SHAPES)
    (d / "harness").write_text(BATCH)
    return str(d / "harness")


def test_problems_read_options_batches_and_alternatives(batch):
    ps = benchdnn.problems(batch, "host")
    assert len(ps) == 6 + 9
    first = ps[0].entry
    assert first["dtype"] == "uint8" and first["dst_dtype"] == "int32"
    assert first["shape"] == [1, 20, 9, 9] and first["pad"] == [[0, 1], [0, 1]]
    # FWD_B's bias first, the legacy eltwise scale as a linear after the relu
    assert [p["kind"] for p in first["post_ops"]] == ["bias", "sum", "eltwise", "eltwise"]
    assert first["post_ops"][3] == {"kind": "eltwise", "algorithm": "linear", "alpha": 2.6,
                                    "beta": 0.0}
    assert first["scales"] == "channel" and first["sum"] == first["dst"] == "nChw16c"
    # each descriptor under each alternative, in order
    assert ps[1].entry["dtype"] == "int8" and ps[1].entry["dst_dtype"] == "float32"
    assert ps[2].entry["weights"] == "gOIhw4i16o4i" and ps[4].entry["weights"] == "Goihw16g"
    # round-robin policies
    assert [p.entry["policy"] for p in ps[:6]] == ["dst_fused", "dst_stage", "src",
                                                   "on_handle", "tracked", "user"]
    asym = ps[6].entry
    assert (asym["src_zero_point"], asym["dst_zero_point"], asym["dst_scale"]) == (-2, 1, 2.0)
    assert asym["post_ops"] == [{"kind": "sum", "scale": 1.0, "zero_point": 0, "dt": "int8"},
                                {"kind": "binary", "algorithm": "add", "operand": "channel"}]
    reasons = [p.reason for p in ps[7:]]
    assert "weight zero point" in reasons[0] and "per_dim_1 dst zero point" in reasons[1]
    assert [p["algorithm"] for p in ps[9].entry["post_ops"]] == ["linear", "round", "abs",
                                                                  "max"]
    assert reasons[2] is None and "bfloat16 destination" in reasons[3]
    assert ps[11].entry["dtype"] == "bfloat16" and ps[11].entry["dst_dtype"] == "float32"
    assert "Winograd" in reasons[5]
    assert "direction BWD_D" in reasons[6] and "option --some-option" in reasons[7]


def test_a_binary_operand_per_spatial_point_is_refused():
    with pytest.raises(benchdnn.Unsupported, match="broadcast as 12"):
        benchdnn._operand("12", mb=2)
    assert benchdnn._operand("14", mb=1) == "full"     # a batch of one: dst's shape
    assert benchdnn._operand("per_tensor", mb=2) == "full"


def test_stated_problems_are_exact(batch, tmp_path):
    """Every problem blockpad states, built for this machine and run against the checker's
    independent numpy reference (int64 sums, the documented rounding), guard bytes and all."""
    summary = check("host", seed=3, benchdnn=batch, out=str(tmp_path), log=lambda *a: None)
    assert summary.checked == 9
    assert summary.counts["ok"] == 9, summary.failures
    assert summary.guard_bytes == 0


# ---- oneDNN's own int8 lists (examples/benchdnn) ------------------------------------------------

#: what blockpad's conv2d does not state, by design or for now, and nothing else: each
#: problem of oneDNN's int8 convolution lists is either a case or refused for one of these
OUTSIDE = ("a 3-D convolution", "a weight zero point", "a per_dim_1 dst zero point",
           "a bfloat16 destination of an integer",
           "a float16 destination of an integer",
           "batch file")
LISTS = os.path.join(os.path.dirname(__file__), "..", "examples", "benchdnn")
HARNESSES = ("saturation_int8", "depthwise_int8", "int8", "attrs_int8",
             "attrs_int8_asymmetric", "dilated_int8", "zero_points")


@pytest.mark.parametrize("name", HARNESSES)
def test_onednn_int8_lists_are_stated_or_outside_the_attributes(name):
    ps = benchdnn.problems(os.path.join(LISTS, f"harness_conv_{name}"), "avx512-vnni")
    refused = [p for p in ps if p.entry is None and not p.reason.startswith(OUTSIDE)]
    assert not refused, "\n".join(f"{p.where}: {p.line}: {p.reason}" for p in refused[:5])


def test_memory_formats():
    opts = {**benchdnn.DEFAULTS, "dt": "u8:s8:s8", "stag": "axb", "dtag": "aBcd8b"}
    e = benchdnn.case(opts, "mb1ic5ih6oc7oh6kh3ph1", 0, "host")
    assert (e["src"], e["dst"], e["weights"]) == ("nhwc", "nChw8c", "OIhw4i16o4i")
    with pytest.raises(benchdnn.Unsupported, match="--wtag"):
        benchdnn.case({**opts, "wtag": "OIhw16i16o"}, "mb1ic5ih6oc7oh6kh3ph1", 0, "host")
    with pytest.raises(benchdnn.Unsupported, match="--stag=ABcd16a16b"):
        benchdnn.case({**opts, "stag": "ABcd16a16b"}, "mb1ic5ih6oc7oh6kh3ph1", 0, "host")


MASKED_STORE_PROBLEM = ("--reset --mb=2 --dir=FWD_B --dt=s8:s8:u8 "
                        "--attr-scales=src:common:0.25*+wei:per_oc:0.5*+dst:common:2* "
                        "--attr-post-ops=sum:1.5:2+relu ic21oc25_ih13oh13kh3ph1\n")


def test_predicated_stores_stay_predicated(tmp_path):
    """The first wrong answer ``--benchdnn`` found (oneDNN's harness_conv_attrs_int8): 25
    uint8 channels in nChw16c, dst_scale 2 and a relu; under the policies that write valid
    elements only, LLVM's loop vectorizer made AVX-512 masked stores of the epilogue's scalar
    loop that wrote channels 25-27 (``targets._X86_LLVM``). Each of the six copies runs under
    the next policy."""
    from blockpad.codegen.targets import native_target

    target = native_target()
    if target == "host":
        pytest.skip("this CPU has no AVX-512: the masked stores were AVX-512's")
    path = tmp_path / "problem"
    path.write_text(MASKED_STORE_PROBLEM * 6)
    summary = check(target, seed=1127, benchdnn=str(path), out=str(tmp_path),
                    log=lambda *a: None)
    assert summary.checked == 6 and summary.counts["ok"] == 6, summary.failures
