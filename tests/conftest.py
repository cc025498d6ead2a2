"""Shared fixtures: libraries are built once per test session (TVM compiles take seconds)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading

import numpy as np
import pytest

import blockpad as bp
from blockpad import assembly
from blockpad.codegen.spec import parse_spec
from blockpad.codegen.targets import get_target

# Reorders and zero pads covering the layout families, blocks that do not divide the dims,
# nested blocks, halos, custom strides and every dtype class.
REORDER_SPEC = {
    "library": {"name": "test-reorders"},
    "kernel": [
        {"op": "reorder", "shapes": [[2, 30, 5, 7], [1, 3, 4, 4]], "dtypes": ["float32", "int8"],
         "src": "nchw", "dst": "nChw16c"},
        {"op": "reorder", "shapes": [[2, 30, 5, 7]], "dtypes": ["float32", "bfloat16", "uint8"],
         "src": "nChw16c", "dst": "nchw"},
        {"op": "reorder", "shape": [2, 30, 5, 7], "dtype": "float16", "src": "nhwc", "dst": "nChw8c"},
        {"op": "reorder", "shape": [2, 30, 5, 7], "src": "nChw8c", "dst": "nChw16c"},
        {"op": "reorder", "shape": [20, 30, 3, 3], "dtype": "int8", "src": "oihw", "dst": "OIhw4i16o4i"},
        {"op": "reorder", "shape": [20, 30, 3, 3], "src": "OIhw16i16o", "dst": "oihw"},
        {"op": "reorder", "shape": [33, 17], "dtype": "int32", "src": "ab", "dst": "AB16b16a"},
        {"op": "reorder", "shape": [2, 3, 5, 4, 6], "src": "ncdhw", "dst": "nCdhw8c"},
        {"name": "to_halo", "op": "reorder", "shape": [2, 30, 5, 7], "src": "nchw",
         "dst": {"tag": "nChw16c", "paddings": {"h": [1, 2], "w": [3, 1]}}},
        {"name": "from_halo", "op": "reorder", "shape": [2, 30, 5, 7], "src":
            {"tag": "nchw", "paddings": {"h": [1, 1], "w": [1, 1]}}, "dst": "nChw8c"},
        {"name": "to_strided", "op": "reorder", "shape": [2, 30, 5, 7], "src": "nchw",
         "dst": {"tag": "nChw16c", "strides": [3000, 1400, 200, 20, 1]}},
        # the stride of an extent-1 dim addresses nothing: numpy's view passes its own value
        {"name": "to_strided_n1", "op": "reorder", "shape": [1, 30, 5, 7], "src": "nchw",
         "dst": {"tag": "nChw16c", "strides": [3003, 560, 112, 16, 1]}},
        {"op": "zero_pad", "shape": [2, 30, 5, 7], "dtypes": ["float32", "bfloat16"], "layout": "nChw16c"},
        {"name": "zero_pad_halo", "op": "zero_pad", "shape": [2, 30, 5, 7],
         "layout": {"tag": "nChw16c", "paddings": {"h": [1, 2], "w": [3, 1]}}},
        {"op": "zero_pad", "shape": [20, 30, 3, 3], "dtype": "int8", "layout": "OIhw4i16o4i"},
        {"op": "zero_pad", "shape": [2, 32, 5, 7], "layout": "nChw16c"},
    ],
}


def needs_cross_compiler(target: str = "neon"):
    """Skip (saying what to install) where ``target``'s cross compiler, which links its
    libraries, is not installed."""
    t = get_target(target)
    return pytest.mark.skipif(shutil.which(t.cross_compiler) is None,
                              reason=f"{t.cross_compiler} not installed: it links {target} "
                                     f"libraries (apt-get install {t.cross_package})")


@pytest.fixture(scope="session")
def build_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("build")


@pytest.fixture(scope="session")
def reorder_lib_dir(build_dir):
    out = build_dir / "reorders"
    bp.build(parse_spec(REORDER_SPEC), "host", out, log=lambda m: None)
    return out


@pytest.fixture(scope="session")
def reorder_lib(reorder_lib_dir):
    return bp.load(reorder_lib_dir)


def random_array(shape, dtype, rng):
    dt = bp.layout.numpy_dtype(dtype)
    if dt.kind in "iu":
        info = np.iinfo(dt)
        return rng.integers(max(info.min, -100), min(info.max, 100), size=shape).astype(dt)
    return rng.standard_normal(shape).astype(dt)


def garbage(n, dtype):
    """A buffer full of NaN (floats) or all-ones bits (integers): what 'dirty' looks like."""
    dt = bp.layout.numpy_dtype(dtype)
    buf = bp.runtime.memory.aligned_empty(n, dt)
    buf.view(np.uint8)[:] = 0xFF  # NaN for every float type, -1 / max for integers
    return buf


def policy_libraries(tmp_path_factory, prefix, cases, policy_cases) -> dict:
    """One library per policy (a library has one), built once: every case of ``cases`` under
    ``dst_fused``, the names ``policy_cases[policy]`` lists under each other policy."""
    out = {}
    for policy in ("dst_fused", *policy_cases):
        names = cases if policy == "dst_fused" else policy_cases[policy]
        d = tmp_path_factory.mktemp(f"{prefix}-{policy}")
        spec = {"library": {"policy": policy},
                "kernel": [{**cases[n], "name": n} for n in names]}
        bp.build(parse_spec(spec), "host", d, log=lambda m: None)
        out[policy] = bp.load(d)
    return out


GUARD = 64   # elements of garbage on each side of a destination: a zmm of bytes


def run_guarded(kernel, arrays, policy):
    """``kernel`` run on the logical ``arrays`` (under ``src``, every source's padding is
    garbage and its state ``dirty``) into a garbage-filled destination between guard regions;
    returns the destination Memory and the whole buffer, guards included."""
    mems = []
    for name, _, lay, _ in kernel.signature.args[:-1]:
        mem = bp.Memory.from_numpy(arrays[name], lay)
        if policy == "src":
            # consumers must not trust source padding. A kernel that reduces over padded
            # blocks asks for a source stage (contract src_stage), which the runtime runs in
            # place before the call (runtime.padding.before_call); the others mask.
            mem.buffer[lay.padding_offsets()] = garbage(1, lay.dtype)[0]
            mem.state = "dirty"
        mems.append(mem)
    lay = kernel.signature.args[-1][2]
    whole = garbage(lay.alloc_len + 2 * GUARD, lay.dtype)
    dst = bp.Memory.from_buffer(whole[GUARD:-GUARD], lay)
    kernel(*mems, dst)
    return dst, whole


def assert_padding_contract(kernel, whole):
    """The destination padding the kernel's contract promises (zero, or the garbage left
    untouched where it writes valid elements only), and nothing written past the guards."""
    lay, contract, name = kernel.signature.args[-1][2], kernel.signature.padding, kernel.name
    pad = whole[GUARD:-GUARD][lay.padding_offsets()]
    if contract["dst_writes"] in ("full", "select") or contract["dst_stage"]:
        assert np.all(pad == 0), f"{name}: destination padding not zeroed"
    elif contract["dst_writes"] == "valid":
        assert np.all(np.isnan(pad)), f"{name}: 'valid' kernel wrote the destination padding"
    assert np.all(np.isnan(whole[:GUARD])) and np.all(np.isnan(whole[-GUARD:])), \
        f"{name}: wrote outside the destination buffer"


@pytest.fixture
def rng():
    return np.random.default_rng(int(os.environ.get("BLOCKPAD_TEST_SEED", "0")))


def asm_functions(lib_dir) -> dict:
    """The instructions of each function of a built library, from the assembly the build keeps
    (``source/kernels.s``, what ``blockpad inspect --asm`` shows)."""
    return assembly.functions((lib_dir / "source" / "kernels.s").read_text())


def kernel_instructions(funcs, name) -> list:
    """A kernel's instructions: its entry point and the functions it reaches."""
    return [line for lines in assembly.kernel_code(funcs, name).values() for line in lines]


def run_in_threads(fn, args) -> None:
    """``fn(a)`` for each of ``args``, each in its own thread, all at once; re-raises the first
    exception any thread raised (a failed assert in a thread would otherwise only be printed)."""
    errors = []

    def guarded(a):
        try:
            fn(a)
        except BaseException as e:  # noqa: BLE001 - handed to the test's thread
            errors.append(e)

    threads = [threading.Thread(target=guarded, args=(a,)) for a in args]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def dot_inputs(sig, rng) -> dict:
    """Memories for every argument: full-range integers (u8 0..255, s8 -128..127: the shift
    and the compensation of s8 sources must hold at the extremes), a unit scale (so the float
    destination is the exact int32 accumulator), NaN-filled destinations, garbage in the
    padding of sources a kernel promises to mask."""
    out = {}
    for name, role, lay, _ in sig.args:
        dt = bp.layout.numpy_dtype(lay.dtype)
        if role != "in":
            out[name] = bp.Memory(lay, np.full(lay.alloc_len, np.nan, dt))
            continue
        if name == "scale":
            a = np.ones(lay.shape, dt)
        elif dt.kind in "iu":
            info = np.iinfo(dt)
            a = rng.integers(info.min, info.max + 1, lay.shape).astype(dt)
        else:
            a = rng.standard_normal(lay.shape).astype(dt)
        out[name] = bp.Memory.from_numpy(a, lay)
        if sig.padding and sig.padding["reads"] == "masked" and lay.has_padding:
            out[name].buffer[lay.padding_offsets()] = 0x7F if dt.kind in "iu" else np.nan
    return out


POOL_RUN = """
import json, sys
import numpy as np
import blockpad as bp
lib = bp.load(sys.argv[1])
kernel = lib[sys.argv[2]]
rng = np.random.default_rng(0)
args = kernel.signature.args
arrays = {a.name: (rng.standard_normal(a.layout.shape)
                   * (float(sys.argv[4]) if "weights" in a.name else 1.0)).astype("float32")
          for a in args[:-1]}
dst = lib.memory(args[-1].layout)
kernel(*(bp.Memory.from_numpy(arrays[a.name], a.layout) for a in args[:-1]), dst)
np.savez(sys.argv[3], dst=dst.to_numpy(), **arrays)
print(json.dumps(lib.symbol(sys.argv[2])))
"""


def run_in_pool(lib_dir, kernel, threads: int, weight_scale: float = 1.0):
    """``(symbol, arrays)``: call float32 ``kernel`` of the library in ``lib_dir`` once on
    seeded random inputs in a fresh process whose thread pool has ``threads`` threads (the
    pool size picks a kernel's variant: ``manifest.KernelRecord.threads``); ``arrays`` holds
    the inputs by argument name and the result as ``dst``."""
    out = os.path.join(lib_dir, f"pool_run_{kernel}_{threads}.npz")
    proc = subprocess.run([sys.executable, "-c", POOL_RUN, str(lib_dir), kernel, out,
                           str(weight_scale)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "TVM_NUM_THREADS": str(threads)})
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1]), dict(np.load(out))
