"""The six zero-padding policies (seed 000; docs/padding-contract.md) and what each makes the generator emit.

A policy is decided per kernel into a ``PaddingPlan``: how the kernel reads its sources' padding,
how it writes its destination's, which separate zero-pad stages run around it, and the contract the
manifest records for the runtime (what the kernel requires of each source, what it promises of its
destination).

Source padding states: ``clean`` (zero), ``dirty`` (anything), ``unknown``.
"""

from __future__ import annotations

from dataclasses import dataclass

from blockpad.errors import SpecError
from blockpad.vocabulary import POLICIES

# How the destination's padding is written:
#   "full"   compute over the padded extents; the op's own arithmetic leaves zeros there
#   "select" compute over the padded extents, storing select(is_padding, 0, value)
#   "valid"  compute over the logical elements only; the padding is not touched
#   "any"    compute over the padded extents without caring what lands in the padding


@dataclass(frozen=True)
class PaddingPlan:
    policy: str
    reads: str            # "trusted": sources' padding is zero | "masked": kernel ignores it
    dst_writes: str       # one of the four above
    dst_stage: bool       # a separate zero-pad kernel runs on the destination after the kernel
    src_stage: bool       # the runtime zero-pads dirty sources (in place) before the kernel
    requires: str         # what each source's padding must be: "clean" or "any"
    produces: str         # destination padding afterwards: "clean", "dirty", "preserved"

    def contract(self) -> dict:
        return {"policy": self.policy, "reads": self.reads, "dst_writes": self.dst_writes,
                "dst_stage": self.dst_stage, "src_stage": self.src_stage,
                "requires": self.requires, "produces": self.produces}


def check_policy(name: str) -> str:
    if name not in POLICIES:
        raise SpecError(f"policy: expected one of {', '.join(POLICIES)}; got {name!r}")
    return name


def plan(policy: str, propagates_zero: bool, reads_padding: bool,
         reduces_over_padding: bool = False) -> PaddingPlan:
    """Decide what to emit for one kernel.

    ``propagates_zero``: derived from the op's TE (codegen.ops.common.propagates_zero) -- with
    clean sources, is every destination padding element already zero by the arithmetic?
    ``reads_padding``: derived too (codegen.ops.common.reads_padding) -- does a valid output
    read source padding or halo unguarded? Only a kernel that does not may accept dirty sources
    (``requires: any``) under the policies that read sources as they are.
    ``reduces_over_padding``: the op sums or multiplies across a padded dim of a source (conv,
    matmul), so masking its reads would sit in the innermost loop; such kernels take a zero-pad
    stage on their sources under the ``src`` policy instead (seed 000 option 3's fallback).
    """
    check_policy(policy)
    fused = "full" if propagates_zero else "select"
    if policy == "dst_fused":     # seed 000 option 1: kernels keep destinations clean
        return PaddingPlan(policy, "trusted", fused, False, False, "clean", "clean")
    if policy == "dst_stage":     # option 2: valid region only, then a separate zero-pad kernel
        return PaddingPlan(policy, "trusted", "valid", True, False, "clean", "clean")
    if policy in ("on_handle", "user"):   # current oneDNN / option 5: zeroed at handle time,
        return PaddingPlan(policy, "trusted", "valid", False, False, "clean",
                           "preserved")   # preserved
    if policy == "src":           # option 3: consumers do not trust input padding
        if reduces_over_padding:
            return PaddingPlan(policy, "trusted", "any", False, True, "clean", "dirty")
        return PaddingPlan(policy, "masked", "any", False, False, "any",
                           "clean" if propagates_zero else "dirty")
    # tracked (option 4): cheapest code; the runtime zero-pads lazily where a consumer needs it
    # (a kernel that reads padding or halo), as seed 000 lets each implementation say what it
    # accepts. "full" arithmetic on clean sources gives a clean destination when the op
    # propagates zeros.
    return PaddingPlan(policy, "trusted", "full" if propagates_zero else "any", False, False,
                       "clean" if reads_padding else "any",
                       "inherit" if propagates_zero else "dirty")
