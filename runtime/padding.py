"""Running zero-pads, and the padding contract around every kernel call.

The build records, per kernel, what it requires of its sources' padding and what it leaves in
its destination's (codegen.policy.PaddingPlan.contract). This module is where the runtime honours
it: which zero-pads run before and after a kernel, and which state each memory is left in."""

from __future__ import annotations

import time

from . import counters
from .memory import CLEAN, DIRTY, Memory, aligned_empty


def zero_pad(mem: Memory, blocking: bool = False) -> None:
    """Zero ``mem``'s padding with its library's generated zero-pad kernel (numpy if it has
    none for this layout), counting the pass. A read-only buffer is copied, never written."""
    lay = mem.layout
    if not lay.has_padding:
        mem.state = CLEAN
        return
    if not mem.buffer.flags.writeable:
        copy = aligned_empty(mem.buffer.size, mem.buffer.dtype)
        copy[...] = mem.buffer
        mem.buffer = copy
    start = time.perf_counter()
    kernel = mem.library.zero_pad_kernel(lay) if mem.library is not None else None
    if kernel is not None:
        kernel.run_raw([mem.physical_view(kernel.signature.args[0].storage)])
    else:
        mem.buffer[lay.padding_offsets()] = 0
    counters.record(len(lay.padding_offsets()) * lay.itemsize, time.perf_counter() - start,
                    blocking)
    mem.state = CLEAN


def before_call(contract: dict | None, sources: list) -> None:
    """Zero-pad the sources the kernel needs clean and may not have clean (seed 001 option C:
    execution checks each source's state and cleans it).

    Under every policy a source whose state is ``dirty`` or ``unknown`` is zero-padded in place
    (a read-only buffer is copied first, never written) when the kernel requires clean
    sources: the policy decides who normally writes the zeros, but a memory the caller says is
    not clean is never trusted. ``src`` with a source stage zero-pads every padded source,
    every call (that policy keeps no state). One state check per source: a clean memory costs
    nothing more."""
    if not contract or contract["requires"] != "clean":
        return
    every_call = contract["src_stage"] and contract["policy"] == "src"
    for mem in sources:
        if every_call or mem.state != CLEAN:
            zero_pad(mem)


def after_call(contract: dict | None, sources: list, dst: Memory, stage) -> None:
    """Run the destination stage, if any, and record the destination's padding state."""
    if stage is not None:
        _run_stage(stage, dst)
    produces = contract["produces"] if contract else CLEAN   # reorders and zero-pads: clean
    if produces == "preserved":
        return
    if produces == "inherit":   # a loop, not all(<generator>): this runs on every call
        produces = CLEAN
        for m in sources:
            if m.state != CLEAN:
                produces = DIRTY
                break
    dst.state = produces


def _run_stage(kernel, dst: Memory) -> None:
    start = time.perf_counter()
    kernel.run_raw([dst.physical_view(kernel.signature.args[0].storage)])
    lay = dst.layout
    counters.record(len(lay.padding_offsets()) * lay.itemsize, time.perf_counter() - start, False)

