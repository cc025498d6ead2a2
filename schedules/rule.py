"""The schedule rule contract, once: TVM dlight's ``apply(func, target) -> Schedule | None``.

None means "not mine", and the next rule of the target family's list is tried (``first_match``,
the one walk both scheduling, ``schedules.schedule``, and tuning, ``schedules.space``, use). A
rule says which ops it takes (``ops``) and, where it needs more (a CPU feature, a shape),
refines ``takes``; ``schedule`` then only schedules.
"""

from __future__ import annotations

import tvm_ffi

from .common import op_of


class ScheduleRule:
    #: the blockpad ops this rule schedules (``codegen.kernel.finish`` names them); () every op
    ops: tuple = ()

    def takes(self, func, target) -> bool:
        """Whether ``func`` is this rule's to schedule for ``target``."""
        return not self.ops or op_of(func) in self.ops

    def apply(self, func, target):
        """A schedule of ``func``, or None if it is not this rule's (or the rule gives up)."""
        return self.schedule(func, target) if self.takes(func, target) else None

    def schedule(self, func, target):
        """Schedule ``func``, which ``takes`` accepted; None if the rule cannot after all."""
        raise NotImplementedError

    def for_threads(self, func, target, threads: int):
        """A schedule of ``func`` for a thread pool of exactly ``threads`` threads, where the
        rule would split the work differently for it than ``apply``'s schedule (which serves
        any pool); None otherwise. A schedule cannot see the pool it runs on, so the build
        compiles this one beside the default and the runtime calls it when its pool has that
        many threads (``schedules.schedule_for_pools``, ``manifest.KernelRecord.threads``). It
        must compute what ``apply``'s does, in the same order: only the tasks may differ."""
        return None

    def space(self, func, target) -> list:
        """Complete schedules of ``func`` for tuning to choose between, ``apply``'s first; []
        when the rule has no variants (tuning then measures ``apply``'s one schedule)."""
        return []


def distinct(schedules, first: bool = False) -> list:
    """The schedules of an iterable that are not None, each once: two variants of a rule can
    schedule alike (compared by structural hash). ``first``: stop at the first."""
    out, seen = [], set()
    for sch in schedules:
        if sch is None or tvm_ffi.structural_hash(sch.mod) in seen:
            continue
        seen.add(tvm_ffi.structural_hash(sch.mod))
        out.append(sch)
        if first:
            break
    return out


def first_match(rules, func, target):
    """``(rule, schedule)`` of the first of ``rules`` that takes ``func``."""
    for rule in rules:
        sch = rule.apply(func, target)
        if sch is not None:
            return rule, sch
    raise NotImplementedError(f"no {target.family} schedule rule takes op {op_of(func)!r}")
