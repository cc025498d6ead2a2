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
import math
from dataclasses import dataclass, field

import numpy as np

from blockpad.layout import pad_sides
from blockpad.vocabulary import (
    QUANTIZED_ADD,
    QUANTIZED_DTYPES,
    qlinear_order,
    quantized_add_entry,
    with_defaults,
)

#: what ``Graph(fuse=...)`` may fuse: a convolution's eltwise reader and residual add (oneDNN's
#: post-ops, ``fuse_post_ops``), and whole inverted residuals (``fuse_inverted_residuals``)
FUSIONS = ("eltwise", "sum", "inverted_residual")
INVERTED_RESIDUAL = FUSIONS[2]


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

    1. the input's definition is read by no other op that runs after this one (the plan runs
       the ops in this order, so a reader before it has read the input already: a ResNet
       block's input, read by its first convolution, can take the block's result by way of
       the last one's sum post-op; seed 003 refuses any other reader, for graphs whose ops
       may run out of order);
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
    others = [nodes[j].name for j in readers(nodes, _definition(nodes, i, var), var) if j > i]
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
                  kinds=("eltwise", "sum"), dtype_of=lambda var: "float32"):
    """oneDNN's post-ops, found in the graph: a convolution whose result has exactly one
    reader takes that reader into its kernel when it is an eltwise (``eltwise`` post-op) or an
    add of a tensor of the result's shape computed before the convolution (``sum`` post-op, at
    most one). Repeated, so conv -> add -> relu becomes one kernel. The result must not be one
    the caller reads. ``same_shape(node)``: whether a binary node's operands have one shape.
    ``kinds``: the post-ops to fuse (``eltwise``, ``sum``). ``dtype_of(var)``: a value's
    element type. A post-op runs on the value before it is requantized, so on a quantized
    result (uint8 ``q`` standing for ``s (q - z)``) a relu of ``q`` or a quantized add (its
    own scales) is not the post-op of the same name: an 8-bit convolution takes only a
    quantized add of an 8-bit tensor (``"sum"`` in ``kinds``), as its ``quantized_add``
    entry, which rounds the convolution's value first and so gives the two ops' result to
    the bit (a quantized ResNet's residual ``QLinearAdd``: int8 ResNet-50, 16 steps fewer).

    The fused op runs where the convolution was when no op in between reads or writes the
    names the absorbed op writes (a name may be written again: memory reuse), else where the
    absorbed op was when no op in between writes the convolution's inputs, else not at all.
    Returns the rewritten ops and the fusions made ((conv, absorbed op) pairs)."""
    nodes = copy.deepcopy(list(nodes))
    protected = set(protected)
    fused = []
    start = 0   # a fusion at i leaves the ops before i as they were: none of them fuses anew
    while start is not None:
        begin, start = start, None
        for i in range(begin, len(nodes)):
            n = nodes[i]
            if n.op != "conv2d" or len(n.outputs) != 1 or n.outputs[0] in protected:
                continue
            out = n.outputs[0]
            integer = dtype_of(out) in QUANTIZED_DTYPES
            if integer and not n.attrs.get("quant"):
                continue
            rs = readers(nodes, i, out)
            if len(rs) != 1:
                continue
            j = rs[0]
            r = nodes[j]
            if r.inputs.count(out) != 1 or len(r.outputs) != 1 or out in r.outputs:
                continue
            chain = list(n.attrs["post_ops"])
            if integer:
                other = r.inputs[1 - r.inputs.index(out)] if len(r.inputs) == 2 else None
                if not (r.op == "binary" and "scales" in r.attrs and "sum" in kinds
                        and same_shape(r) and dtype_of(r.outputs[0]) == dtype_of(out)
                        and dtype_of(other) in QUANTIZED_DTYPES and _definition(nodes, j, other) < i
                        and not any(p["kind"] == QUANTIZED_ADD for p in chain)):
                    continue
                addend_first = r.inputs.index(out) == 1   # QLinearAdd's operand order
                order = qlinear_order(addend_first)
                chain.append(quantized_add_entry({
                    "addend_first": addend_first,
                    "scales": [r.attrs["scales"][k] for k in order],
                    "zero_points": [r.attrs["zero_points"][k] for k in order],
                    "dt": None if dtype_of(other) == dtype_of(out) else dtype_of(other)}))
                inputs = list(n.inputs) + [other]   # the addend: the last post-op tensor
            elif r.op == "eltwise" and "eltwise" in kinds:
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
            n.attrs = {**n.attrs, "post_ops": chain,
                       "sum": n.attrs["sum"] or (r.op == "binary" and not integer)}
            n.inputs = inputs
            n.outputs, n.orig_outputs = list(r.outputs), list(r.orig_outputs)
            fused.append((n.name, r.name))
            nodes[at] = n
            del nodes[j if at == i else i]
            start = i
            break
    return nodes, fused


#: ``_conv_shape`` of a 1x1 convolution: stride 1, no padding, dense, one group
POINTWISE = ((1, 1), (1, 1), ((0, 0), (0, 0)), (1, 1), 1)


def _conv_shape(attrs, weights) -> tuple:
    """(kernel, stride, pad per side, dilation, groups) of a float conv2d node."""
    return (tuple(weights[2:]), tuple(attrs["stride"]), pad_sides(attrs["pad"]),
            tuple(attrs["dilation"]), attrs["groups"])


def _bias_then_eltwise(chain) -> list | None:
    """The eltwise entries of a chain ``[bias, eltwise...]``, else None: what an inverted
    residual's expansion and depthwise stages take (their bias a tensor of the fused op)."""
    if not chain or chain[0]["kind"] != "bias" or any(p["kind"] != "eltwise" for p in chain[1:]):
        return None
    return [dict(p) for p in chain[1:]]


def fuse_inverted_residuals(nodes, protected, types, constant):
    """MobileNetV2's inverted residual, found in the graph after ``fuse_post_ops``: a 1x1
    convolution (stride 1, no padding) with a bias and eltwise post-ops, whose result only a
    depthwise convolution reads (odd kernel, padding kernel // 2 on each side, no dilation,
    bias and eltwise post-ops), whose result only a 1x1 convolution reads (any float post-op
    chain: bias, the residual add, ...) becomes one ``inverted_residual`` node in the
    projection's place, so the expanded tensor never reaches memory
    (codegen/ops/inverted_residual.py). ``types(node)``: the (shape, dtype) of its inputs;
    ``constant(name)``: a constant (weights and biases must be: a fused kernel's weights
    are prepacked once). Intermediate results the caller reads (``protected``) stay, and so
    does a block whose expanded tensor is under ``FUSE_EXPANDED_BYTES``: it fits the cache
    between three kernels anyway, and the fused kernel's bands recompute the depthwise
    window's halo rows of the expansion.
    Returns the rewritten ops and the fusions made ((expand, depthwise, project) names)."""
    nodes = copy.deepcopy(list(nodes))
    fused = []
    i = 0
    while i < len(nodes):
        match = _inverted_residual_at(nodes, i, protected, types, constant)
        if match is None:
            i += 1
            continue
        j, k = match
        a, b, c = nodes[i], nodes[j], nodes[k]
        e, _, kh, kw = types(b)[1][0]
        node = Node(c.name, "inverted_residual",
                    [*a.inputs[:3], *b.inputs[1:3], *c.inputs[1:]], list(c.outputs),
                    {"expanded": int(types(a)[1][0][0]), "channels": int(types(c)[1][0][0]),
                     "kernel": [int(kh), int(kw)], "stride": list(b.attrs["stride"]),
                     "expand_post_ops": _bias_then_eltwise(a.attrs["post_ops"]),
                     "depthwise_post_ops": _bias_then_eltwise(b.attrs["post_ops"]),
                     "post_ops": list(c.attrs["post_ops"])},
                    orig_outputs=list(c.orig_outputs))
        nodes[k] = node
        del nodes[j]
        del nodes[i]
        fused.append((a.name, b.name, c.name))
    return nodes, fused


#: The smallest expanded tensor (the expansion's result) an inverted residual is fused for.
#: MobileNetV2 on an AVX2 EPYC (512 KiB L2; 1 thread, ``blockpad bench model``), the fused
#: kernel against the three: 112x112x96 0.99 ms vs 1.41 (4.8 MiB expanded), 56x56x144 0.84
#: vs 1.10 (1.8 MiB), 28x28x192 0.30 vs 0.34 (0.6 MiB); 14x14x576 0.62 vs 0.61 (0.44 MiB),
#: 7x7x960 0.60 vs 0.48 (0.18 MiB: two bands of 4 and 3 rows recompute 4 of 7 rows). Once the
#: fused kernel applied the expansion's epilogue on its registers (Zen 4, AVX-512, both builds
#: in one process), fusing the 14x14 blocks too (0.29-0.44 MiB) made MobileNetV2 4.03 -> 3.92 ms
#: at 2 threads (6.95 / 6.92 at 1); the 7x7 ones as well made no further difference.
FUSE_EXPANDED_BYTES = 256 * 1024


def _inverted_residual_at(nodes, i, protected, types, constant):
    """``(j, k)``: the depthwise and projection nodes of an inverted residual whose expansion
    is node ``i``, else None."""
    a = nodes[i]
    if not _fusable_conv(a, types, constant, inputs=3):
        return None
    (src, dt), (w, _) = types(a)[:2]
    if _conv_shape(a.attrs, w) != POINTWISE \
            or _bias_then_eltwise(a.attrs["post_ops"]) is None \
            or math.prod((src[0], w[0], *src[2:])) * np.dtype(dt).itemsize < FUSE_EXPANDED_BYTES:
        return None
    j = _only_reader(nodes, i, protected)
    if j is None or not _fusable_conv(nodes[j], types, constant, inputs=3):
        return None
    b = nodes[j]
    wd = types(b)[1][0]
    kernel, _, pad, dilation, groups = _conv_shape(b.attrs, wd)
    if groups != w[0] or wd[0] != w[0] or wd[1] != 1 or dilation != (1, 1) \
            or any(n % 2 == 0 for n in kernel) \
            or pad != tuple((n // 2, n // 2) for n in kernel) \
            or _bias_then_eltwise(b.attrs["post_ops"]) is None:
        return None
    k = _only_reader(nodes, j, protected)
    if k is None or not _fusable_conv(nodes[k], types, constant, inputs=None):
        return None
    c = nodes[k]
    if _conv_shape(c.attrs, types(c)[1][0]) != POINTWISE:
        return None
    # the fused node runs in the projection's place: nothing in between may write what the
    # expansion and the depthwise read
    if _touches(nodes, i, k, [*a.inputs, *b.inputs[1:]], writes_only=True):
        return None
    return j, k


def _fusable_conv(n, types, constant, inputs):
    """A float conv2d node without quantization, not asked to be Winograd (``auto`` never
    picks it for a 1x1 or a depthwise kernel), whose weights (and, with ``inputs`` = 3, its
    bias: src, weights, bias and nothing else) are constants."""
    if n.op != "conv2d" or n.attrs.get("quant") is not None or len(n.outputs) != 1 \
            or "float" not in types(n)[0][1] or n.attrs.get("algorithm") == "winograd":
        return False
    if inputs is not None and len(n.inputs) != inputs:
        return False
    return all(constant(v) for v in n.inputs[1:(inputs or 2)])


def _only_reader(nodes, i, protected):
    """The index of the one op reading node ``i``'s result, once and as its source (input 0),
    if the result is not one the caller reads; else None."""
    out = nodes[i].outputs[0]
    if out in protected:
        return None
    rs = readers(nodes, i, out)
    if len(rs) != 1 or nodes[rs[0]].inputs.count(out) != 1 or nodes[rs[0]].inputs[0] != out \
            or out in nodes[rs[0]].outputs:
        return None
    return rs[0]
