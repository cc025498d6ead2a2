"""Search spaces for autotuning: the schedule variants of blockpad's own rules, each one a
MetaSchedule workload.

A rule's ``space(func, target) -> list[Schedule]`` gives complete schedules of ``func``, the
first one what ``apply`` returns (register tiles, vector widths, parallel splits); a rule whose
space is empty (``rule.ScheduleRule``'s default) contributes its one schedule. Tuning measures these variants.

Why each variant is its own workload, with a trivial trace, rather than one workload per
kernel with a trace per variant (MetaSchedule's ``ScheduleFn`` way): a rule may rewrite
``func`` before it schedules it (register_tiled stages the convolution window's source), so a
variant's trace does not replay on the kernel's function, and MetaSchedule replays every trace
when it opens a database (it refuses such records: "old_outputs.size() ==
new_outputs.size()"). A scheduled function with a trace that only annotates it is a record any
MetaSchedule tool opens and applies, and matching it needs no replay: a build regenerates the
variants and looks their structural hashes up.
MetaSchedule's generic space (``PostOrderApply``) is not searched: given the same handful of
trials it found kernels ten times slower than the rules' (a 3x3 conv: 208 us against 22.7 us
in 8 trials).
"""

from __future__ import annotations

import tvm

from blockpad.vocabulary import OP_ATTR

from . import RULES, finish
from .rule import first_match

#: Attributes that name a kernel rather than describe its computation: a record must match the
#: same computation whatever the kernel is called.
NAMING_ATTRS = ("global_symbol", OP_ATTR)


def workload(func: tvm.tirx.PrimFunc) -> tvm.IRModule:
    """The module MetaSchedule keys ``func``'s records by: its naming attributes stripped, in
    the form MetaSchedule normalises a task to (one ``main``, noalias), so that the structural
    hash is the same in every process and for every kernel name."""
    for attr in NAMING_ATTRS:
        if func.attrs is not None and attr in func.attrs:
            func = func.without_attr(attr)
    func = func.with_attr("global_symbol", "main").with_attr("tirx.noalias", True)
    return tvm.IRModule({"main": func})


def variants(func, target) -> list:
    """The scheduled funcs tuning chooses between, from the first rule of ``target.family``
    that takes ``func``: its ``space`` where that is not empty, else its one schedule; the rule's
    default first."""
    rule, sch = first_match(RULES[target.family], func, target)
    return [finish(s.mod["main"], target) for s in rule.space(func, target) or [sch]]
