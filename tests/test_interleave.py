"""A heavy epilogue interleaved with the next register tile's dot products
(``schedules/interleave.py``): which kernels take it, and their results against the numpy
reference of blockpad's check harness under every padding policy. The rewrite runs with the
plain-loop twin of ``vpdpbusd`` on any CPU, and for real where the CPU has VNNI."""

from __future__ import annotations

import pytest
import tvm
import tvm_ffi
from tvm import s_tir

import blockpad as bp
from blockpad import machine
from blockpad.check import execute
from blockpad.codegen.build import make_kernels
from blockpad.codegen.spec import parse_spec
from blockpad.codegen.targets import get_target
from blockpad.runtime.library import Signature
from blockpad.schedules.x86_tensorized import Vnni
from blockpad.vocabulary import ACC_PREV, POLICIES

HAVE_VNNI = "avx512_vnni" in machine.cpu_features()

# a residual bottleneck's last 1x1 (int8 ResNet-50's layer1 conv3, smaller): 64 channels (16
# dot-product steps), the quantized sum's 18 operations an element; 8 rows x 2 tiles of 7
# columns x 2 panels = 32 tasks, run 4 tiles a task
QADD = {"op": "conv2d", "dtype": "uint8", "shape": [1, 64, 8, 14], "channels": 64,
        "kernel": [1, 1], "src": "nChw16c", "weights": "OIhw4i16o4i", "dst": "nChw16c",
        "dst_dtype": "uint8", "dst_zero_point": 117, "addend": "nChw16c",
        "post_ops": [{"kind": "bias", "dtype": "int32"},
                     {"kind": "quantized_add", "scales": [0.24, 0.175, 0.134],
                      "zero_points": [117, 140, 0]}]}
CASES = {
    "qadd": QADD,
    # an int8 destination, a source zero point (the compensation in the epilogue), 48 output
    # channels (one panel of 3 column vectors: tiles of 5 columns)
    "qadd_s8": {**QADD, "dtype": "int8", "src_zero_point": 3, "channels": 48,
                "shape": [1, 64, 8, 15],
                "dst_dtype": "int8", "dst_zero_point": -5,
                "post_ops": [{"kind": "quantized_add", "dt": "uint8", "scales": [0.05, 0.01, 0.04],
                              "zero_points": [-3, 128, 5]}]},
    # a plain requantized 1x1 over 16 steps: 9 operations an element, heavy enough
    "requant": {k: v for k, v in QADD.items() if k != "addend"} | {
        "post_ops": [{"kind": "bias", "dtype": "int32"}]},
}
# a reduction of 128 steps: the same epilogue is light beside it
LIGHT = {**QADD, "shape": [1, 512, 8, 14]}


def _scheduled(entry, rule):
    kernel = make_kernels(parse_spec({"kernel": [{"name": "k", **entry}]}).kernels[0])[0]
    sch = rule.apply(kernel.func, get_target("avx512-vnni"))
    assert sch is not None
    return kernel, sch.mod["main"]


def _interleaved(func) -> bool:
    names = set()
    tvm_ffi.structural_walk(func, (s_tir.SBlock, lambda b: names.update(
        buf.name for buf in b.alloc_buffers)))
    return ACC_PREV in names


class Twin:
    """blockpad check's runner for kernels scheduled by the VNNI rule with the plain-loop twin
    of ``vpdpbusd``, compiled for this machine."""

    paths = ("direct",)

    def __init__(self, entries: dict):
        self.sigs, self.args, funcs = {}, {}, {}
        for name, entry in entries.items():
            kernel, func = _scheduled(entry, Vnni(reference=True))
            self.sigs[name] = Signature({**kernel.describe(), "name": name})
            self.args[name] = kernel.args
            funcs[name] = func.with_attr("global_symbol", name)
        self.lib = tvm.compile(tvm.IRModule(funcs), target=get_target("host").tvm_target())

    def signature(self, name):
        return self.sigs[name]

    def memory(self, sig, layout, buf, clean):
        return execute.memory(sig, layout, buf, clean, None)

    def call(self, sig, args, mems, path="direct"):
        """The check harness makes sources read-only, which DLPack cannot export: copies."""
        views = [m.physical_view(a.storage) for m, a in zip(mems, self.args[sig.name])]
        self.lib[sig.name](*[v if v.flags.writeable else v.copy() for v in views])


@pytest.mark.parametrize("case", CASES)
def test_heavy_epilogues_are_interleaved_and_light_ones_not(case):
    assert _interleaved(_scheduled(CASES[case], Vnni())[1])
    assert not _interleaved(_scheduled(LIGHT, Vnni())[1])


def test_interleaved_twin_matches_numpy():
    """The rewritten schedule with the plain-loop twin of ``vpdpbusd``, on any CPU (one kernel:
    the twin's unrolled reduction takes LLVM ~13 s to compile)."""
    twin = Twin({"qadd": QADD})
    for seed in range(2):
        result = execute.run_case(0, {"name": "qadd"}, seed, twin)
        assert (result["status"], result["guard_bytes"]) == ("ok", 0), result["problems"]


@pytest.mark.skipif(not HAVE_VNNI, reason="this CPU has no avx512_vnni: vpdpbusd cannot "
                    "execute here (the twin above checks the schedule)")
def test_interleaved_vnni_library_matches_numpy_under_every_policy(tmp_path):
    spec = {"kernel": [{"name": f"{c}_{p}", **e, "policy": p}
                       for c, e in CASES.items() for p in POLICIES]}
    bp.build(parse_spec(spec), "avx512-vnni", tmp_path, log=lambda m: None)
    runner = execute.Native(str(tmp_path))
    for k in spec["kernel"]:
        for seed in range(2):
            result = execute.run_case(0, {"name": k["name"]}, seed, runner)
            assert (result["status"], result["guard_bytes"]) == ("ok", 0), \
                (k["name"], result["problems"])
