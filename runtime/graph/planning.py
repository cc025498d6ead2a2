"""Planning: a graph's passes for one set of input layouts, giving a ``Plan`` (steps in order,
the buffers they read and write, the arena they share).

* **post-op fusion** (``passes.fuse_post_ops``): an eltwise that is a convolution's only reader
  runs inside the convolution's kernel (oneDNN's eltwise post-op; the sum post-op, for an add,
  on request: ``fuse=("eltwise", "sum")``);
* **in place** (``passes.inplace_pass``, seed 003): eltwise, softmax and binary ops overwrite
  their input where the seed's rules allow;
* **layout propagation**: convolutions run on blocked layouts (``nChw16c``/``nChw8c`` and blocked
  weights); eltwise, binary and softmax follow their input's layout, so data stays blocked
  between ops; a reorder is inserted only where a consumer needs a layout no version of the
  value has (each version made once, shared by every consumer); weights are read in the
  layout their kernel wants, prepared by the graph's ``WeightCache``;
* **fallback**: an op whose blocked kernel cannot be had (not prebuilt, not compilable) runs on
  plain layouts; one with no kernel at all runs its numpy reference;
* **memory planning**: buffers of intermediate values share slots of an arena once their last
  reader has run; in-place ops share their input's buffer, which lowers the peak.

A plan reads its graph only through ``PlanSource``: public attributes and methods that
``Graph`` has, so planning never depends on how the graph stores what it was told.
"""

from __future__ import annotations

import copy
import math
import warnings
from dataclasses import dataclass
from typing import Protocol

from blockpad.errors import ArgumentError, FallbackWarning
from blockpad.layout import Layout, dtype_name

from .kernels import reorder_request
from .ops import GRAPH_OPS, plain
from .passes import INVERTED_RESIDUAL, InplaceResult, Node, fuse_inverted_residuals, fuse_post_ops, inplace_pass
from .weights import WeightCache


class PlanSource(Protocol):
    """What planning reads of a graph (``Graph`` is one). The program: ``nodes`` (passes.Node,
    in order), ``inputs`` ({name: (shape, dtype)}), ``outputs`` (names the caller reads),
    ``weight_cache`` (its ``arrays`` give each constant's shape and dtype; planning asks it
    which are prepacked and warms the weight reorders). The options: ``policy``, ``layouts``
    (``"blocked"``/``"plain"``), ``fuse`` (post-op kinds), ``inplace`` (bool), and the
    ``cache`` that kernels are found in. The ops' ``choices`` also call ``conv_blocks``,
    ``narrow_block`` and ``weight_tag``."""

    policy: str
    layouts: str
    fuse: frozenset
    inplace: bool
    cache: object
    nodes: list
    inputs: dict
    outputs: list
    weight_cache: WeightCache

    def conv_blocks(self, c_in: int, c_out: int, groups: int) -> list: ...

    def narrow_block(self, channels: int, dtype) -> int | None: ...

    def weight_tag(self, block: int, groups: int, depthwise: bool, dtype: str = "float32",
                   src_block: int | None = None) -> str: ...


class _Storage:
    __slots__ = ("id", "nbytes", "kind", "first", "last", "slot", "bufs", "value")

    def __init__(self, sid, kind):
        self.id, self.kind = sid, kind     # kind: input, constant, weight, arena, output
        self.nbytes = 0
        self.first = self.last = None
        self.slot = None
        self.bufs = []
        self.value = None                  # input / constant name


class _Buf:
    """A value in one layout, held by a storage (in-place values and plain aliases share one)."""

    __slots__ = ("id", "storage", "layout")

    def __init__(self, bid, storage, layout):
        self.id, self.storage, self.layout = bid, storage, layout
        storage.bufs.append(self)
        storage.nbytes = max(storage.nbytes, layout.nbytes)


class _Value:
    __slots__ = ("name", "shape", "dtype", "versions", "home", "kind")

    def __init__(self, name, shape, dtype, kind):
        self.name, self.shape, self.dtype, self.kind = name, tuple(shape), dtype, kind
        self.versions = {}
        self.home = None


@dataclass
class _Step:
    kind: str                  # kernel, numpy, reorder, bind
    label: str
    reads: list
    writes: list
    kernel: object = None
    args: list = None          # bufs in kernel argument order
    node: Node | None = None
    inplace: bool = False


class Plan:
    """The passes' result for one set of input layouts ({input name: Layout}).

    What it holds, read by execution and by tools (model builds, benchmarks, tests):
    ``steps`` (each a kernel, numpy or reorder step: ``label``, ``reads``/``writes`` and
    ``args`` as buffers, ``kernel``, ``node``, ``inplace``), ``bufs`` (every buffer: a value in
    one layout, ``storage`` shared by in-place values and plain aliases), ``outputs`` ({name:
    buffer}), ``weight_bufs`` ([(constant, buffer)] prepared once), ``slots`` (arena slot
    sizes), ``bind_at`` ({step index: storages first written there}), ``peak_bytes``,
    ``arena_bytes``, ``fused``, ``fallbacks``, ``inplace_result``, ``inplace_refused``."""

    def __init__(self, source: PlanSource, input_layouts: dict):
        self.source = source
        self.policy = source.policy
        self.storages, self.bufs = [], []
        self.steps: list[_Step] = []
        self.fallbacks: dict = {}
        self.inplace_refused: list = []
        self.weight_bufs: list = []       # (constant name, buf) prepared once
        self._build(input_layouts)
        self._plan_memory()
        weights = source.weight_cache
        for s in self.storages:       # a prepacked constant has no plain bytes to read
            if s.kind == "constant" and weights.is_prepacked(s.value) and s.last is not None:
                raise ArgumentError(weights.unpacked(s.value, s.bufs[0].layout))

    # -- construction --
    def _storage(self, kind):
        s = _Storage(len(self.storages), kind)
        self.storages.append(s)
        return s

    def _buf(self, storage, layout):
        b = _Buf(len(self.bufs), storage, layout)
        self.bufs.append(b)
        return b

    def _build(self, input_layouts):
        g = self.source
        env = {}
        for name, lay in input_layouts.items():
            v = env[name] = _Value(name, lay.shape, lay.dtype, "input")
            s = self._storage("input")
            s.value = name
            v.home = v.versions[lay] = self._buf(s, lay)
        for name, a in g.weight_cache.arrays.items():
            v = env[name] = _Value(name, a.shape, dtype_name(a.dtype), "constant")
            s = self._storage("constant")
            s.value = name
            lay = plain(a.shape, v.dtype)
            v.home = v.versions[lay] = self._buf(s, lay)

        # fusion and the in-place pass need each variable's shape at each op: track through
        # the program (names may be written more than once)
        start_types = {n: (tuple(v.shape), v.dtype) for n, v in env.items()}

        def track(program):
            env_types, node_types = dict(start_types), {}
            for n in program:
                ins = node_types[n.name] = [env_types[v] for v in n.inputs]
                for o, t in zip(n.outputs, GRAPH_OPS[n.op].infer(n, ins)):
                    env_types[o] = (tuple(t[0]), dtype_name(t[1]))
            return env_types, node_types

        env_types, node_types = track(g.nodes)

        protected = set(g.inputs) | set(g.weight_cache.arrays) | set(g.outputs)
        nodes = g.nodes
        self.fused = []
        if g.fuse and g.layouts == "blocked":
            nodes, self.fused = fuse_post_ops(
                nodes, protected, lambda n: len({t[0] for t in node_types[n.name]}) == 1,
                kinds=g.fuse, dtype_of=lambda v: env_types[v][1])
        if INVERTED_RESIDUAL in g.fuse and g.layouts == "blocked":
            nodes, blocks = fuse_inverted_residuals(
                nodes, protected, lambda n: node_types[n.name],
                lambda v: v in g.weight_cache.arrays)
            self.fused += blocks
        fused_types = track(nodes)[1]   # a convolution that took a sum reads one more input

        def capable(node):
            info = GRAPH_OPS[node.op]
            return info.inplace_inputs(node, fused_types[node.name]) if info.inplace_capable \
                else []

        if g.inplace:
            self.inplace_result = inplace_pass(nodes, capable, protected)
        else:
            self.inplace_result = InplaceResult(copy.deepcopy(nodes), [], [], [])
        for node in self.inplace_result.nodes:
            if node.op == "binary" and node.inplace == 1:   # commutative: the overwritten
                node.inputs.reverse()                        # operand becomes the kernel's src0
                node.inplace = 0
        defs = {name: env[name] for name in env}
        for node in self.inplace_result.nodes:
            self._place(node, env, defs)
        self.outputs = {}
        for name in g.outputs:
            v = defs[name]
            if v.home.storage.kind == "arena":
                v.home.storage.kind = "output"
            self.outputs[name] = v.home
            lay = v.home.layout
            if not lay.is_plain:   # the reorder a read will need: ready (and cached) now
                g.cache.find(reorder_request(lay, plain(lay.shape, lay.dtype)))

    def _place(self, node, env, defs):
        """Layout propagation and kernel choice for one op, with its reorders before it."""
        g = self.source
        info = GRAPH_OPS[node.op]
        ins = [env[v] for v in node.inputs]
        types = [(v.shape, v.dtype) for v in ins]
        out_types = info.infer(node, types)
        homes = [v.home.layout for v in ins]
        choices = info.choices(node, types, homes, g)
        if g.layouts == "plain":
            choices = [c for c in choices if all(l.is_plain for l in c.inputs + c.outputs)] \
                or choices[-1:]
        inplace = node.inplace is not None
        picked = kernel = None
        for choice in choices:
            if choice.request is None:
                picked = choice
                break
            kernel = g.cache.find(choice.request(inplace)) if inplace else None
            if kernel is None and inplace:
                kernel = g.cache.find(choice.request(False))
                if kernel is not None:
                    self.inplace_refused.append((node.name, "no in-place kernel for " +
                                                 choice.label))
                    inplace = False
            elif kernel is None:
                kernel = g.cache.find(choice.request(False))
            if kernel is not None:
                picked = choice
                break
        if picked is None:             # no kernel in any layout: the numpy reference
            if any(c.request is not None for c in choices):
                warnings.warn(f"{node.name} ({node.op}): no kernel in any layout "
                              f"({', '.join(c.label for c in choices)}) from its kernel cache "
                              f"(target {getattr(g.cache, 'target', '?')}); it runs its numpy "
                              f"reference", FallbackWarning, stacklevel=4)
            picked = choices[-1]
            self.fallbacks[node.name] = "numpy"
        elif picked is not choices[0] and picked.request is not None:
            self.fallbacks[node.name] = picked.label
        in_bufs = [self._version(v, lay) for v, lay in zip(ins, picked.inputs)]
        out_bufs = []
        for j, (oname, (shape, dtype)) in enumerate(zip(node.outputs, out_types)):
            lay = picked.outputs[j]
            if inplace and j == 0 and in_bufs[node.inplace].layout == lay:
                buf = in_bufs[node.inplace]
            elif inplace and j == 0 and info.alias:     # the same bytes in another shape
                buf = self._buf(in_bufs[node.inplace].storage, lay)
            else:
                if inplace and j == 0:
                    inplace = False
                    self.inplace_refused.append((node.name, "layouts differ"))
                buf = self._buf(self._storage("arena"), lay)
            v = _Value(node.orig_outputs[j], shape, dtype_name(dtype), "value")
            v.home = v.versions[lay] = buf
            env[oname] = v
            defs[node.orig_outputs[j]] = v
            out_bufs.append(buf)
        if inplace and info.alias:
            return                                      # nothing runs
        if kernel is not None:
            args = [in_bufs[i] if kind == "in" else out_bufs[i] for kind, i in picked.args]
            if inplace:
                args = [b for b, (kind, _i) in zip(args, picked.args) if kind == "in"]
            self.steps.append(_Step("kernel", node.name, in_bufs, out_bufs, kernel, args, node,
                                    inplace))
        else:
            self.steps.append(_Step("numpy", node.name, in_bufs, out_bufs, None, None, node,
                                    inplace))

    def _version(self, v: _Value, layout: Layout) -> _Buf:
        """``v`` in ``layout``: an existing version, a plain alias, or a new reorder."""
        buf = v.versions.get(layout)
        if buf is not None:
            return buf
        home = v.home
        if layout.is_plain and home.layout.is_plain and layout.dtype == home.layout.dtype and \
                math.prod(layout.shape) == math.prod(home.layout.shape):
            buf = v.versions[layout] = self._buf(home.storage, layout)   # same bytes
            return buf
        if v.kind == "constant":
            s = self._storage("weight")
            s.value = v.name
            buf = v.versions[layout] = self._buf(s, layout)
            self.weight_bufs.append((v.name, buf))
            self.source.weight_cache.warm(v.name, layout)
            return buf
        src = next((b for lay, b in v.versions.items() if lay == home.layout), home)
        buf = v.versions[layout] = self._buf(self._storage("arena"), layout)
        kernel = self.source.cache.find(reorder_request(src.layout, layout))
        self.steps.append(_Step("reorder", f"reorder {v.name} {src.layout.tag}->{layout.tag}",
                                [src], [buf], kernel, [src, buf] if kernel else None))
        return buf

    # -- memory --
    def _plan_memory(self):
        """Liveness over the steps; arena slots reused once a storage's last reader ran; the
        peak of live bytes; ``bind`` steps where a storage is first written."""
        steps = []
        for i, st in enumerate(self.steps):
            for b in st.reads:
                b.storage.last = i
            for b in st.writes:
                s = b.storage
                if s.first is None:
                    s.first = i
                s.last = max(s.last if s.last is not None else i, i)
        for s in self.storages:
            if s.kind == "output":
                s.last = len(self.steps)
        free, slots = [], []
        live = peak = 0
        bind_at = {}
        for i, st in enumerate(self.steps):
            for b in st.writes:
                s = b.storage
                if s.first == i and s.kind in ("arena", "output"):
                    live += s.nbytes
                    if s.kind == "arena":
                        fit = [k for k in free if slots[k] >= s.nbytes]
                        if fit:
                            k = min(fit, key=lambda k: slots[k])
                            free.remove(k)
                        else:
                            k = len(slots)
                            slots.append(s.nbytes)
                        s.slot = k
                    bind_at.setdefault(i, []).append(s)
            peak = max(peak, live)
            # in the step's order, not a set's: a set of storages iterates by address, which
            # differs from process to process, and a slot freed first is reused first, so the
            # slots would too (a built model's plan function names them: graph/native.py)
            for s in dict.fromkeys(b.storage for b in st.reads + st.writes):
                if s.kind == "arena" and s.last == i:
                    live -= s.nbytes
                    free.append(s.slot)
            steps.append(st)
        self.slots = slots
        self.peak_bytes = peak
        self.arena_bytes = sum(slots)
        self.bind_at = bind_at

    def describe(self) -> str:
        """The steps, one a line: what runs, in which layouts, in place or not."""
        lines = []
        for st in self.steps:
            lays = ", ".join(str(b.layout.tag) for b in st.reads)
            outs = ", ".join(str(b.layout.tag) for b in st.writes)
            how = "kernel" if st.kernel is not None else "numpy"
            tag = " [in place]" if st.inplace else ""
            lines.append(f"{st.label:40} {lays} -> {outs} ({how}){tag}")
        return "\n".join(lines)


