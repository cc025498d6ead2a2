"""A float32 convolution's last output-channel block in half vectors where its second half is
padding (``schedules/tile_edges.half_block``, taken on Zen 4 only): which kernels take it, and
their results against the numpy reference of blockpad check's harness under every padding
policy. The kernels are scheduled for ``zen4`` and compiled for ``host`` (AVX2), so they run on
any x86 CPU this project builds on."""

from __future__ import annotations

import pytest
import tvm
import tvm_ffi
from tvm import s_tir

from blockpad.check import execute
from blockpad.codegen.build import make_kernels
from blockpad.codegen.spec import parse_spec
from blockpad.codegen.targets import get_target
from blockpad.runtime.library import Signature
from blockpad.schedules import schedule
from blockpad.schedules.register_tiled import RegisterTiled
from blockpad.vocabulary import POLICIES

BLK16 = {"src": "nChw16c", "weights": "OIhw16i16o", "dst": "nChw16c"}
BIAS_RELU = [{"kind": "bias"}, {"kind": "eltwise", "algorithm": "relu"}]
HALVED = {
    # 21 channels: a block of 16 and 5, which a half vector holds; a sum post-op too
    "conv1x1": {"op": "conv2d", "shape": [1, 20, 6, 7], "channels": 21, "kernel": [1, 1],
            **BLK16, "sum": "nChw16c", "post_ops": [*BIAS_RELU, {"kind": "sum"}]},
    # 37 channels (3 blocks: pairs cut off the rest), a 3x3 with spatial padding
    "conv3x3": {"op": "conv2d", "shape": [1, 13, 5, 9], "channels": 37, "kernel": [3, 3],
            "pad": [1, 1], **BLK16, "post_ops": BIAS_RELU},
}
# 27 channels: the last block's 11 do not fit half a vector
WHOLE = {**HALVED["conv1x1"], "channels": 27}


def _scheduled(entry, target="zen4", name="k"):
    """(the kernel, its function scheduled by the register-tiled rule for ``target``, and its
    ``dst_stage`` zero-pad kernel if the policy has one)."""
    kernel, *stage = make_kernels(parse_spec({"kernel": [{"name": name, **entry}]}).kernels[0])
    sch = RegisterTiled().apply(kernel.func, get_target(target))
    assert sch is not None
    return kernel, sch.mod["main"], stage


def _halved(func) -> bool:
    names = set()
    tvm_ffi.structural_walk(func, (s_tir.SBlock, lambda b: names.add(b.name_hint)))
    return "dst_half" in names


class OnHost(execute._Elsewhere):
    """blockpad check's runner for kernels scheduled for ``zen4``, compiled for ``host``: the
    runtime's padding steps around each call, as for a library that runs elsewhere."""

    paths = ("direct",)

    def __init__(self, entries: dict):
        self.kernels, self.args, funcs = {}, {}, {}
        host = get_target("host")
        for name, entry in entries.items():
            kernel, func, stage = _scheduled(entry, name=name)
            self.kernels[name] = Signature({**kernel.describe(), "name": name})
            self.args[name] = kernel.args
            funcs[name] = func.with_attr("global_symbol", name)
            for k in stage:
                funcs[k.name] = schedule(k.func, host).with_attr("global_symbol", k.name)
        self.lib = tvm.compile(tvm.IRModule(funcs), target=host.tvm_target())

    def run(self, sig, args, mems):
        """The kernel, then its ``dst_stage`` on the destination. The check harness makes
        sources read-only, which DLPack cannot export: copies."""
        views = [m.physical_view(a.storage) for m, a in zip(mems, self.args[sig.name])]
        self.lib[sig.name](*[v if v.flags.writeable else v.copy() for v in views])
        stage = sig.padding.get("dst_stage")
        if stage:
            self.lib[stage](views[-1])


def test_the_last_block_is_halved_where_its_channels_fit_and_the_padding_is_a_constant():
    """Halved where the destination's padding is stored as a select's zeros or not at all
    (``dst_writes``: select, valid); not where a policy stores whatever the sums give there
    (any: ``src``, ``tracked``), which is the block's second half."""
    for policy in POLICIES:
        for entry in HALVED.values():
            kernel, func, _ = _scheduled({**entry, "policy": policy})
            assert _halved(func) == (kernel.contract["dst_writes"] in ("select", "valid"))
    assert _halved(_scheduled(HALVED["conv1x1"])[1])
    assert not _halved(_scheduled(WHOLE)[1])
    # Intel's AVX-512 cores run a zmm FMA at the rate of a ymm one: nothing to gain there
    assert not _halved(_scheduled(HALVED["conv1x1"], "avx512")[1])


@pytest.mark.parametrize("policy", POLICIES)
def test_halved_kernels_match_numpy(policy):
    """Each policy's padding contract, the guard regions and the values against the check
    harness's numpy reference."""
    runner = OnHost({f"{case}_{policy}": {**entry, "policy": policy}
                     for case, entry in HALVED.items()})
    for name in runner.kernels:
        for seed in range(2):
            result = execute.run_case(0, {"name": name}, seed, runner)
            assert (result["status"], result["guard_bytes"]) == ("ok", 0), \
                (name, result["problems"])
