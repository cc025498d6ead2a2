"""Run checked cases against a built library and judge them: the part of ``blockpad check``
that touches kernels, run in a child process (``python -m blockpad.check.execute``) so that a
kernel that crashes takes down only its batch's worker, never the checker.

Every argument lives in a buffer larger than its layout needs, filled with a guard pattern:
the layout's elements sit in the middle, and every byte that is neither a logical element nor
padding (the guard regions before and after, the gaps of a strided layout) must keep the
pattern. Around one call:

* sources hold random values; their padding is mostly NaN (all-ones bits for integers), the
  memory's state saying so (``dirty`` or ``unknown``): a kernel whose contract (``padding`` in
  the manifest) says ``requires: any`` must cope with it, one that requires ``clean`` must be
  handed it zeroed by the runtime (seed 001 option C); sources the kernel only reads are
  read-only buffers and must come back byte for byte;
* destinations start as NaN everywhere (their padding zeroed when the memory is made under
  ``on_handle`` and ``user``, as those policies do);
* the call is direct, bound (``Kernel.bind``) or queued on a ``Stream`` (native targets);
* the destination's logical elements are compared with ``reference`` within its error bound;
  its padding must be zero wherever its state says ``clean``, its state must be ``clean``
  under the policies that promise it, and padding a policy promises to preserve must be.

On an aarch64 target the call runs under qemu-aarch64 (``blockpad.testing.qemu``), with the
runtime's own padding steps (``runtime.padding``) around it. The harness runs the kernel on its
own copies of the buffers, with guard bytes of its own around each and the inputs compared
after the call: a store outside a buffer or into a source is reported from there.

On a CUDA target (``Device``) the whole guarded buffers travel to the GPU and back around a call
through the public API on PyTorch tensors; judging is the same. Such libraries are usually built
on one machine (``blockpad check --build-only``) and run on a GPU host (``--run-built``)."""

from __future__ import annotations

import json
import re
import sys
import traceback

import numpy as np

from blockpad.layout import numpy_dtype
from blockpad.runtime.memory import aligned_empty, nonzero_padding
from blockpad.vocabulary import CLEAN_AFTER_CALL, SEVEN_BIT_RANGE

from .reference import reference

GUARD_BYTES = 256           # each side of every buffer; a multiple of the 64-byte alignment
GUARD_PATTERN = np.frombuffer(bytes.fromhex("addec07f"), np.uint8)   # float32 NaN 0x7fc0dead
# how a native kernel is called: each call path honours the padding contract on its own
CALL_PATHS = ("direct", "bound", "stream")
# inverted_residual's weights besides ``weights`` (its projection's): those of its inner sums
IR_WEIGHTS = ("expand_weights", "depthwise_weights")


# ---- how a call is made: natively through the public API, or under qemu --------------------

class Native:
    """A library this machine runs: ``bp.load`` and ``Library.memory``."""

    paths = CALL_PATHS

    def __init__(self, lib_dir):
        import blockpad as bp

        self.lib = bp.load(lib_dir)

    def signature(self, name):
        return self.lib.kernels[name]

    def memory(self, sig, layout, buf, clean):
        return memory(sig, layout, buf, clean, self.lib)

    def call(self, sig, args, mems, path="direct"):
        kernel = self.lib[sig.name]
        if path == "bound":
            kernel.bind(*mems)()
        elif path == "stream":
            from blockpad import Stream

            kernel(*mems, stream=Stream()).wait()
        else:
            kernel(*mems)


class _Elsewhere:
    """A library whose kernels run away from the checker's memories (under qemu, on a GPU):
    the runtime's padding steps (``runtime.padding``, what ``Kernel.__call__`` does around the
    compiled function) run here, on the same memories, around ``run``."""

    def signature(self, name):
        return self.kernels[name]

    def memory(self, sig, layout, buf, clean):
        return memory(sig, layout, buf, clean, None)

    def call(self, sig, args, mems, path="direct"):
        from blockpad.runtime import padding

        contract = sig.padding
        sources = [m for m, a in zip(mems, sig.args) if a.role in ("in", "inout")]
        padding.before_call(contract, [m for m in sources if m.layout.has_padding])
        self.run(sig, args, mems)
        for m, a in zip(mems, sig.args):
            if a.role != "in":
                padding.after_call(contract, sources, m, None)


class Emulated(_Elsewhere):
    """An aarch64 library on another machine: the kernel (and its ``dst_stage``) runs under
    qemu-aarch64."""

    paths = CALL_PATHS    # drawn, as on a native target, though the harness makes every call

    def __init__(self, lib_dir):
        from blockpad import manifest as mf
        from blockpad.runtime.library import Signature

        self.dir = lib_dir
        self.kernels = {r.name: Signature(r) for r in mf.kernel_records(mf.read(lib_dir))}

    def run(self, sig, args, mems):
        from blockpad.testing import qemu

        stage = sig.padding.get("dst_stage") if sig.padding else None
        calls = [(sig.name, mems)] + [(stage, [m]) for m, a in zip(mems, sig.args)
                                      if stage and a.role != "in"]
        try:
            qemu.run_many(self.dir, calls)
        except qemu.QemuRunError as e:
            # the harness keeps guard bytes around every buffer and compares inputs
            m = re.search(r"wrote (\d+) guard bytes|changed its input", str(e))
            if m:
                raise Overrun(str(e), int(m[1] or 0)) from None
            raise


class Device(_Elsewhere):
    """A CUDA library on this machine's GPU, called through the public API on PyTorch tensors.
    Each argument goes to device memory whole, guard regions included, and comes back whole
    after the call, so the judging is the host's: guard bytes, untouched sources, values,
    padding. A GPU library keeps no padding state (its policies, ``dst_fused`` and
    ``dst_stage``, zero the destination's padding in the kernel or its stage): sources are
    handed over clean, as the contract requires, and the destination's state after the call is
    what the contract promises, which the padding check then verifies byte by byte."""

    paths = ("direct",)   # a GPU kernel has no bound or streamed form

    def __init__(self, lib_dir):
        import torch  # noqa: F401 - the GPU tensors' maker; fails clearly where it is missing

        import blockpad as bp

        self.lib = bp.load(lib_dir)
        self.kernels = self.lib.kernels

    def run(self, sig, args, mems):
        import torch

        sent, tensors = [], []
        for a, m, spec in zip(args, mems, sig.args):
            host = a.whole.view(np.uint8).copy()
            lo, hi = GUARD_BYTES, GUARD_BYTES + m.buffer.nbytes
            host[lo:hi] = m.buffer.view(np.uint8)      # a cleaned copy of a read-only source
            dev = torch.from_numpy(host).cuda()
            sent.append((host, dev, lo, hi))
            tensors.append(dev[lo:hi].view(getattr(torch, spec.storage))
                           .reshape(m.layout.physical_shape))
        self.lib[sig.name](*tensors)
        torch.cuda.synchronize()
        for a, spec, (host, dev, lo, hi) in zip(args, sig.args, sent):
            back = dev.cpu().numpy()
            whole = a.whole.view(np.uint8)
            whole[:lo], whole[hi:] = back[:lo], back[hi:]
            if spec.role != "in" or not np.array_equal(back[lo:hi], host[lo:hi]):
                whole[lo:hi] = back[lo:hi]    # a source the kernel wrote shows as changed


class Overrun(Exception):
    """A store outside an argument's buffer or into a source, seen by the qemu harness
    (``tvm_run.c``), which runs the kernel on its own copies of the buffers."""

    def __init__(self, message: str, guard_bytes: int):
        super().__init__(message)
        self.guard_bytes = guard_bytes


def memory(sig, layout, buf, clean, library):
    """A Memory on ``buf`` made as the kernel's policy says a memory is made: what
    ``Library.memory`` does for a library of that one policy (a checked library mixes
    policies, one per kernel): under ``on_handle`` and ``user`` its padding is zeroed now
    (``cleanup``), under the others it is left as it is, ``clean`` if so, else ``unknown``."""
    from blockpad import Memory

    mem = Memory(layout, buf, "clean" if clean else "unknown", library=library)
    if not clean and (sig.padding or {}).get("policy") in ("on_handle", "user"):
        mem.cleanup()
    return mem


def runner(lib_dir, target):
    from blockpad import machine
    from blockpad.codegen.targets import get_target

    t = get_target(target)
    if t.family == "cuda":
        return Device(lib_dir)
    if t.arch != machine.arch():
        return Emulated(lib_dir)
    return Native(lib_dir)


# ---- one case -----------------------------------------------------------------------------------

def source_values(name, layout, sig, rng) -> np.ndarray:
    """Random logical values: full-range integers (s8 -128..127, u8 0..255: a shifted or
    compensated dot product must hold at the extremes; the weights of a ``weight_bits = 7``
    kernel -64..64), normal floats; dot-product weights and
    scales shrink with the sum's length so post-ops (exp) see values of order one."""
    dt = numpy_dtype(layout.dtype)
    terms = _dot_terms(sig)
    if name == "scale":
        return (rng.uniform(0.5, 1.5, layout.shape) / (64 * 64 * np.sqrt(terms))).astype(dt)
    if dt.kind in "iu":
        info = np.iinfo(dt)
        lo, hi = (info.min, info.max) if dt.itemsize == 1 else (-100, 100)
        if name == "weights" and sig.params.get("weight_bits", 8) == 7:
            lo, hi = SEVEN_BIT_RANGE     # the promise the kernel was built with, both ends
        return rng.integers(lo, hi + 1, layout.shape).astype(dt)
    x = rng.standard_normal(layout.shape)
    if name == "weights":
        x = x / np.sqrt(terms)
    elif name in IR_WEIGHTS and sig.op == "inverted_residual":
        x = x / np.sqrt(np.prod(layout.shape[1:]))    # each stage's sum: C, KH x KW, E terms
    return x.astype(dt)


def _dot_terms(sig) -> int:
    """Products summed per output: K of matmul's (K, N) weights; C/G x KH x KW of conv's
    (K, C, KH, KW) or (G, K/G, C/G, KH, KW); E of inverted_residual's projection (K, E, 1,
    1)."""
    if sig.op == "inverted_residual":
        return int(np.prod(next(a.layout.shape for a in sig.args if a.name == "weights")[1:]))
    if sig.op not in ("conv2d", "matmul"):
        return 1
    w = sig.args[1].layout.shape
    return w[0] if sig.op == "matmul" else int(np.prod(w[-3:]))


class GuardedArg:
    """One argument: its guarded buffer, what it held before the call, its Memory."""

    def __init__(self, name, role, layout):
        self.name, self.role, self.layout = name, role, layout
        dt = numpy_dtype(layout.dtype)
        self.guard = GUARD_BYTES // dt.itemsize
        self.whole = aligned_empty(layout.alloc_len + 2 * self.guard, dt)
        raw = self.whole.view(np.uint8)
        raw[:] = np.resize(GUARD_PATTERN, raw.size)
        self.buf = self.whole[self.guard:self.guard + layout.alloc_len]
        inside = np.zeros(self.whole.size, bool)
        inside[layout.logical_offsets().reshape(-1) + self.guard] = True
        inside[layout.padding_offsets() + self.guard] = True
        self.outside = ~np.repeat(inside, dt.itemsize)     # per byte: guard and gaps

    def snapshot(self):
        self.before = self.whole.view(np.uint8).copy()

    def changed(self, mask) -> int:
        return int(np.count_nonzero((self.whole.view(np.uint8) != self.before) & mask))


def run_case(k: int, entry: dict, seed: int, call) -> dict:
    """Build the arguments of case ``k``, call its kernel, judge the result."""
    sig = call.signature(entry["name"])
    # the entry's parameters, those it leaves out at the defaults the manifest recorded
    entry = {**sig.params, **entry, "op": sig.op}
    rng = np.random.default_rng((seed, k, 1))
    args, mems, inputs = [], [], {}
    for name, role, layout, _ in sig.args:
        a = GuardedArg(name, role, layout)
        if role == "out":
            a.buf.view(np.uint8)[:] = 0xFF                  # NaN / all ones: visible if left
            mem = call.memory(sig, layout, a.buf, clean=False)
        else:
            values = source_values(name, layout, sig, rng)
            inputs["src" if sig.op == "zero_pad" else name] = values
            dirty = sig.op == "zero_pad" or rng.random() < 0.7
            a.buf[layout.logical_offsets()] = values
            a.buf.view(np.uint8)[_padding_bytes(layout)] = 0xFF if dirty else 0
            buf = a.buf
            if role == "in":
                buf = a.buf.view()
                buf.flags.writeable = False
            mem = call.memory(sig, layout, buf, clean=not dirty)
            if dirty and layout.has_padding and mem.state != "clean" and rng.random() < 0.5:
                mem.state = "dirty"
        a.snapshot()
        args.append(a)
        mems.append(mem)
    problems = []
    path = str(rng.choice(call.paths))
    try:
        call.call(sig, args, mems, path)
    except Overrun as e:
        return {"case": k, "status": "wrong", "problems": [str(e)],
                "guard_bytes": e.guard_bytes, "call": path}
    except Exception as e:  # noqa: BLE001 - any failure of a valid call is a finding
        return {"case": k, "status": "raised", "problems": [f"{type(e).__name__}: {e}"],
                "guard_bytes": 0, "call": path}
    guard = 0
    for a, mem in zip(args, mems):
        n = a.changed(a.outside)
        guard += n
        if n:
            problems.append(f"{a.name}: {n} guard bytes written (outside the layout's "
                            f"elements and padding)")
        if a.role == "in":
            n = a.changed(~a.outside)
            if n:
                problems.append(f"{a.name}: read-only source changed ({n} bytes)")
        else:
            problems += _check_destination(a, mem, sig, entry, inputs)
    status = "ok" if not problems else "wrong"
    return {"case": k, "status": status, "problems": problems, "guard_bytes": guard,
            "call": path}


def _padding_bytes(layout) -> np.ndarray:
    offs = layout.padding_offsets()
    n = layout.itemsize
    return (offs[:, None] * n + np.arange(n)).reshape(-1)


def _check_destination(a: GuardedArg, mem, sig, entry, inputs) -> list:
    out = []
    lay = a.layout
    got = mem.to_numpy()
    if sig.op == "zero_pad":
        want, bound = inputs["src"], None
    else:
        want, bound = reference(entry, inputs)
    out += _compare(a.name, got, want, bound)
    contract = sig.padding or {}
    if lay.has_padding:
        pad = mem.buffer[lay.padding_offsets()].view(np.uint8)
        nonzero = nonzero_padding(mem)
        if mem.state == "clean" and nonzero:
            out.append(f"{a.name}: state 'clean' but {nonzero} of {len(lay.padding_offsets())} "
                       f"padding elements are not zero")
        if contract.get("policy") in CLEAN_AFTER_CALL and mem.state != "clean":
            out.append(f"{a.name}: state {mem.state!r} after the call; policy "
                       f"{contract['policy']!r} promises a clean destination")
        if contract.get("produces") == "preserved":
            before = a.before[a.guard * lay.itemsize:][_padding_bytes(lay)]
            n = int(np.count_nonzero(before != pad))
            if n:
                out.append(f"{a.name}: {n} padding bytes written; the contract says "
                           f"'produces: preserved'")
    return out


def _overflows(dtype, g, want, bound):
    """Where ``g`` is the infinity of ``want``'s sign and ``want`` may round past the type's
    largest value (float16 max 65504 + half its spacing: a float16 matmul's 616140 is inf)."""
    if np.dtype(dtype).kind != "f" or dtype == np.float64:
        return np.zeros(np.shape(g), bool)
    top = np.finfo(dtype).max
    threshold = float(top) + (float(top) - float(np.nextafter(top, dtype.type(0)))) / 2
    return np.isinf(g) & (np.sign(g) == np.sign(want)) & (np.abs(want) + bound >= threshold)


def _compare(name, got, want, bound) -> list:
    if bound is None:
        same = got.dtype == want.dtype and np.array_equal(got.view(np.uint8), want.view(np.uint8))
        if same:
            return []
        per_byte = got.view(np.uint8).reshape(*got.shape, -1) != \
            want.view(np.uint8).reshape(*want.shape, -1)
        bad = np.argwhere(per_byte.any(-1))
        i = tuple(int(v) for v in bad[0])
        return [(f"{name}: {len(bad)} of {got.size} elements differ; first at {list(i)}: got "
                f"{got[i]!r}, want {want[i]!r} (bit-exact op)")]
    g = got.astype(np.float64)
    err = np.abs(g - want)
    bad = ~((err <= bound) | (g == want) | _overflows(got.dtype, g, want, bound))
    # equal is right even where the bound is NaN (inf - inf in an overflowing exp's bound)
    if not bad.any():
        return []
    worst = np.where(bad, np.nan_to_num(err, nan=np.inf), -1.0)
    i = np.unravel_index(int(np.argmax(worst)), worst.shape)
    i = tuple(int(v) for v in i)
    allowed = float(np.broadcast_to(bound, err.shape)[i])
    return [(f"{name}: {int(bad.sum())} of {got.size} elements wrong; worst at {list(i)}: got "
            f"{g[i]:.7g}, want {want[i]:.7g} (allowed error {allowed:.3g})")]


# ---- the worker process ------------------------------------------------------------------------

def main() -> int:
    """Read ``{"dir", "target", "seed", "cases": [[k, entry], ...]}`` on stdin; print one JSON
    line ``{"start": k}`` before each case and its result after, so the parent knows which
    case was running if this process dies."""
    job = json.load(sys.stdin)
    call = runner(job["dir"], job["target"])
    for k, entry in job["cases"]:
        print(json.dumps({"start": k}), flush=True)
        try:
            result = run_case(k, entry, job["seed"], call)
        except Exception:  # noqa: BLE001 - a checker bug: report it, keep checking
            result = {"case": k, "status": "checker-error",
                      "problems": [traceback.format_exc(limit=4)], "guard_bytes": 0}
        print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
