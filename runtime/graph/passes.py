"""Graph passes over a list of ops that name their input and output variables (PaddlePaddle's
program form, seed 003): the in-place pass lives here; layout propagation and memory planning
are in ``planning.py``, where they need the kernels.

The IR: ``Node(name, op, inputs, outputs, attrs)``; variables are names, and a name may be
written more than once (a framework's memory-reuse pass does that), so "the same variable" means
the same *definition*: the readers of a definition are the ops after it that read the name
before the next op that writes it (an op that reads and writes a name reads the old one).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

from blockpad.vocabulary import with_defaults


@dataclass
class Node:
    name: str
    op: str
    inputs: list
    outputs: list
    attrs: dict = field(default_factory=dict)
    inplace: int | None = None      # index of the input the op overwrites with its output
    orig_outputs: list | None = None  # the output names before the in-place pass renamed them

    def __post_init__(self):
        if self.orig_outputs is None:
            self.orig_outputs = list(self.outputs)


@dataclass(frozen=True)
class Pattern:
    """Seed 003's pattern: var1 -> in-place candidate op -> var2 -> next op -> var3."""

    input: str
    op: str
    output: str
    next_op: str
    next_output: str

    def __str__(self):
        return f"{self.input} -> {self.op} -> {self.output} -> {self.next_op} -> {self.next_output}"


@dataclass
class InplaceResult:
    nodes: list                     # the rewritten ops (the input list is not modified)
    patterns: list                  # every pattern detected, as seed 003 counts them
    applied: list                   # (op, overwritten var, original output name)
    refused: list                   # (op, var, reason)

    @property
    def inplace_ops(self) -> list:
        return [op for op, _, _ in self.applied]


def readers(nodes, index: int, var: str) -> list:
    """Indices of the ops reading the definition of ``var`` made by op ``index`` (-1: a graph
    input or constant): up to and including the next op that writes ``var`` if it reads it."""
    out = []
    for j in range(index + 1, len(nodes)):
        n = nodes[j]
        if var in n.inputs:
            out.append(j)
        if var in n.outputs:
            break
    return out


def _definition(nodes, index: int, var: str) -> int:
    """Index of the op whose write of ``var`` op ``index`` reads (-1: none, a graph input)."""
    for j in range(index - 1, -1, -1):
        if var in nodes[j].outputs:
            return j
    return -1


def _next_writer(nodes, index: int, var: str):
    for j in range(index + 1, len(nodes)):
        if var in nodes[j].outputs:
            return j
    return None


def inplace_patterns(nodes, capable) -> list:
    """All patterns of seed 003: for each op that can run in place, each of its inputs, each
    output, each op reading that output, each output of that op."""
    found = []
    for i, n in enumerate(nodes):
        if not capable(n):
            continue
        for var in n.inputs:
            for out in n.outputs:
                for j in readers(nodes, i, out):
                    for nxt_out in nodes[j].outputs:
                        found.append(Pattern(var, n.name, out, nodes[j].name, nxt_out))
    return found


def inplace_pass(nodes, capable, protected=()) -> InplaceResult:
    """Seed 003's oneDNN in-place pass.

    ``capable(node)``: the indices of the inputs ``node`` may overwrite (empty: it cannot run in
    place). ``protected``: variables never overwritten (graph inputs, constant weights, and
    results the caller reads). For each capable op, in order, and each input it could overwrite,
    the rules are checked:

    1. the input's definition is read by no other op;
    2. no later op writes the input variable, unless that op reads this op's output (which
       becomes the same variable) and can itself run in place over it, this op's output having
       no other reader.

    When they hold, the output is renamed to the input (the op's output list), every reader of
    the output is renamed too (each consumer: the seed's multi-output case), and a reader that
    already computes in place (reads and writes the output name) has its output renamed too."""
    nodes = copy.deepcopy(list(nodes))
    protected = set(protected)
    patterns = inplace_patterns(nodes, capable)
    applied, refused = [], []
    for i, n in enumerate(nodes):
        if n.inplace is not None or len(n.outputs) != 1:
            continue
        out = n.outputs[0]
        for idx in capable(n):
            var = n.inputs[idx]
            reason = _check(nodes, i, var, out, protected, capable)
            if reason:
                refused.append((n.name, var, reason))
                continue
            forced = _rule2_partner(nodes, i, var, out)
            _rename(nodes, i, out, var)
            n.outputs[0] = var
            n.inplace = idx
            if out in protected:
                protected.add(var)      # the result the caller reads now lives in var
            if forced is not None:
                w = nodes[forced]
                w.inplace = w.inputs.index(var)
                applied.append((w.name, var, w.orig_outputs[0]))
            applied.append((n.name, var, n.orig_outputs[0]))
            break
    applied.sort(key=lambda a: [m.name for m in nodes].index(a[0]))
    return InplaceResult(nodes, patterns, applied, refused)


def _rule2_partner(nodes, i, var, out):
    w = _next_writer(nodes, i, var)
    return w if w is not None and out in nodes[w].inputs else None


def _check(nodes, i, var, out, protected, capable):
    n = nodes[i]
    if var in protected:
        return f"{var!r} is a graph input, a constant or a result the caller reads"
    if n.inputs.count(var) > 1:
        return f"{n.name} reads {var!r} twice"
    others = [nodes[j].name for j in readers(nodes, _definition(nodes, i, var), var) if j != i]
    if others:   # rule 1
        return f"{var!r} is also read by {', '.join(others)} (rule 1)"
    if var == out:
        return None
    w = _next_writer(nodes, i, var)
    if w is None:
        return None
    later = nodes[w]
    out_readers = readers(nodes, i, out)
    if out in later.inputs:   # rule 2: the later op would read and write the same variable
        k = later.inputs.index(out)
        if k not in capable(later):
            return (f"{later.name} reuses {var!r} for its output and reads {out!r}: it would run "
                    f"in place, which it cannot (rule 2)")
        if out_readers != [w]:
            return (f"{later.name} would overwrite {var!r} in place while "
                    f"{', '.join(nodes[j].name for j in out_readers if j != w)} still read it "
                    f"(rule 2)")
        if later.inputs.count(out) > 1:
            return f"{later.name} reads {out!r} twice (rule 2)"
        return None
    if any(j > w for j in out_readers):
        return (f"{later.name} overwrites {var!r} before every reader of {out!r} has run "
                f"(rule 2)")
    return None


def _rename(nodes, i, old: str, new: str) -> None:
    """Rename the definition of ``old`` made by op ``i`` to ``new`` in every op reading it; an
    op that reads and writes ``old`` (in place by name) is renamed on both sides, and the
    renaming goes on through its output."""
    for j in readers(nodes, i, old):
        m = nodes[j]
        m.inputs = [new if v == old else v for v in m.inputs]
        if old in m.outputs:
            m.outputs = [new if v == old else v for v in m.outputs]
            _rename(nodes, j, old, new)
            return


def _touches(nodes, lo: int, hi: int, names, writes_only=False) -> bool:
    """Whether an op strictly between ``lo`` and ``hi`` writes (or, unless ``writes_only``,
    reads) one of ``names``."""
    names = set(names)
    return any(names & set(nodes[k].outputs) or (not writes_only and names & set(nodes[k].inputs))
               for k in range(lo + 1, hi))


def fuse_post_ops(nodes, protected=(), same_shape=lambda node: True,
                  kinds=("eltwise", "sum"), float_result=lambda node: True):
    """oneDNN's post-ops, found in the graph: a convolution whose result has exactly one
    reader takes that reader into its kernel when it is an eltwise (``eltwise`` post-op) or an
    add of a tensor of the result's shape computed before the convolution (``sum`` post-op, at
    most one). Repeated, so conv -> add -> relu becomes one kernel. The result must not be one
    the caller reads. ``same_shape(node)``: whether a binary node's operands have one shape.
    ``kinds``: the post-ops to fuse (``eltwise``, ``sum``). ``float_result(node)``: whether a
    convolution's result is floating point; only those fuse. A post-op runs on the value
    before it is requantized, so on a quantized result (uint8 ``q`` standing for ``s (q - z)``)
    a relu of ``q`` or a quantized add (its own scales) is not the post-op of the same name.

    The fused op runs where the convolution was when no op in between reads or writes the
    names the absorbed op writes (a name may be written again: memory reuse), else where the
    absorbed op was when no op in between writes the convolution's inputs, else not at all.
    Returns the rewritten ops and the fusions made ((conv, absorbed op) pairs)."""
    nodes = copy.deepcopy(list(nodes))
    protected = set(protected)
    fused = []
    changed = True
    while changed:
        changed = False
        for i, n in enumerate(nodes):
            if n.op != "conv2d" or len(n.outputs) != 1 or n.outputs[0] in protected \
                    or not float_result(n):
                continue
            out = n.outputs[0]
            rs = readers(nodes, i, out)
            if len(rs) != 1:
                continue
            j = rs[0]
            r = nodes[j]
            if r.inputs.count(out) != 1 or len(r.outputs) != 1 or out in r.outputs:
                continue
            chain = list(n.attrs["post_ops"])
            if r.op == "eltwise" and "eltwise" in kinds:
                chain.append({"kind": "eltwise", "algorithm": r.attrs["algorithm"],
                              "alpha": float(r.attrs["alpha"]), "beta": float(r.attrs["beta"])})
                inputs = list(n.inputs)
            elif r.op == "binary" and r.attrs["algorithm"] == "add" and not n.attrs["sum"] \
                    and "sum" in kinds and same_shape(r):
                other = r.inputs[1 - r.inputs.index(out)]
                if _definition(nodes, j, other) >= i:
                    continue          # computed after the convolution: cannot be its input
                chain.append(with_defaults({"kind": "sum"}))
                inputs = list(n.inputs)   # the first sum: before the binary operands
                binaries = sum(p["kind"] == "binary" for p in n.attrs["post_ops"])
                inputs.insert(len(inputs) - binaries, other)
            else:
                continue
            if not _touches(nodes, i, j, r.outputs):
                at = i                      # the fused op runs in the convolution's place
            elif not _touches(nodes, i, j, n.inputs, writes_only=True):
                at = j                      # ... or in the absorbed op's
            else:
                continue
            n.attrs = {**n.attrs, "post_ops": chain, "sum": n.attrs["sum"] or r.op == "binary"}
            n.inputs = inputs
            n.outputs, n.orig_outputs = list(r.outputs), list(r.orig_outputs)
            fused.append((n.name, r.name))
            nodes[at] = n
            del nodes[j if at == i else i]
            changed = True
            break
    return nodes, fused
