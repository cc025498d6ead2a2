"""Ahead of time for a whole model: a ``bp.Graph`` (or an ONNX file, through
``Graph.from_onnx``) -> a folder ``blockpad.load`` turns into a callable model (the format is
``runtime/model.py``'s).

0. **Pin** each ``algorithm = "auto"`` convolution whose candidates the tuning records time to
   the fastest of them (below); the others the planner resolves by its cost model.
1. **Plan** the graph for plain inputs with a probing cache, which answers every kernel request
   with a placeholder and records it: the plan the runtime will make, and the kernels it calls.
2. **Check** each recorded kernel can be generated (its TE, not compiled); one that cannot is
   refused to the planner, which falls back as it would at run time, and planning repeats.
3. **Build** them all into one library (``codegen.build``: one compile, its own up-to-date key).
4. **Load** that library, plan again over it alone and compare with step 1, then pack every
   constant into the layouts the plan reads it in and write the folder.

The whole is keyed by the graph, its constants' bytes, the target, TVM's version and the code
that generates kernels and plans; building again with the same key does nothing. This module
sits above the runtime and the code generator (as ``blockpad.jit`` does): ``codegen/`` never
imports the runtime's graph."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

from blockpad import manifest as mf
from blockpad import winograd
from blockpad.errors import ArgumentError, BlockpadError, BuildError
from blockpad.machine import gpu_requirement
from blockpad.runtime import model as rm
from blockpad.runtime.cache import KernelCache, Request
from blockpad.runtime.graph import Graph
from blockpad.runtime.memory import Memory


class _Probed:
    """A placeholder kernel: what the probing cache hands the planner."""

    def __init__(self, request):
        self.request = request


class _Probe:
    """A kernel cache that says yes to every request except those known to fail, and records
    what it said yes to. Enough of KernelCache's interface for planning."""

    def __init__(self, failed, target=None):
        self.failed = failed
        self.features = tuple(target.features) if target is not None else ()
        self.target_name = target.name if target is not None else None
        self.asked: dict = {}

    def target_features(self) -> tuple:
        return self.features

    def find(self, req: Request):
        if req in self.failed:
            return None
        self.asked.setdefault(req, None)
        return _Probed(req)


def _regraph(g: Graph, cache, pins=None) -> Graph:
    """``g``'s ops and constants over another kernel cache; ``pins``: ``{node: attrs}`` that
    replace those nodes' attributes (the algorithm of an ``auto`` convolution)."""
    pins = pins or {}
    h = Graph(policy=g.policy, cache=cache, inplace=g.inplace, layouts=g.layouts, block=g.block,
              fuse=tuple(g.fuse), name=g.name)
    for name, (shape, dtype) in g.inputs.items():
        h.input(name, shape, dtype)
    for name, a in g.constants.items():
        h.constant(name, a)
    for n in g.nodes:
        h.add_op(n.op, n.inputs, {**n.attrs, **pins.get(n.name, {})}, n.name, n.outputs)
    h.output(*g.outputs)
    return h


def _generable(req: Request) -> str | None:
    """None if the code generator can make ``req``'s kernel, else why not (scheduling it
    for a target is the build's: a failure there is a bug, reported with the kernel's name)."""
    from blockpad.codegen.build import make_kernels
    from blockpad.codegen.spec import parse_spec

    try:
        spec = parse_spec({"kernel": [req.entry("probe")]}, "model kernel")
        for k in spec.kernels:
            make_kernels(k)
    except BlockpadError as e:
        return str(e)
    return None


def _used(plan, asked) -> list:
    """The requests a run of ``plan`` calls: its steps' kernels and the reorders that read its
    results out to plain. (The planner also asks for what it would reorder weights with: a
    built model's weights come packed, so those are not built.)"""
    outs = {b.layout for b in plan.outputs.values()}
    used = [st.kernel.request for st in plan.steps if isinstance(st.kernel, _Probed)]
    used += [r for r in asked if r.op == "reorder" and r.tensors[0][1] in outs
             and r.tensors[-1][1].is_plain]
    return list(dict.fromkeys(used))


def plan_kernels(g: Graph, log, target=None) -> tuple:
    """Plan ``g`` for ``target`` (a ``codegen.targets.Target``: its CPU features and its cost
    model) and return (plan lines, the kernel requests the plan calls); each kernel the
    generator cannot make, which the plan falls back for, is logged."""
    plan, used = _plan(g, log, target)
    return plan.describe().splitlines(), used


def _plan(g: Graph, log, target) -> tuple:
    """(the probed plan, the requests it calls): ``plan_kernels``'s work."""
    failed, refused = set(), {}
    checked = set()
    while True:
        probe = _Probe(failed, target)
        h = _regraph(g, probe)
        plan = h.plan(**rm.input_layouts(h))
        used = _used(plan, probe.asked)
        new = [r for r in used if r not in checked]
        for r in new:
            checked.add(r)
            why = _generable(r)
            if why is not None:
                failed.add(r)
                refused[str(r)] = why
        if not any(r in failed for r in new):
            for r, why in refused.items():
                log(f"  no kernel for {r}: {why}")
            return plan, used
        log(f"planning again: {len(refused)} kernel(s) the generator cannot make, the plan "
            f"falls back for them")


# ---- auto convolutions: tuning records over the cost model ------------------------------------
#
# The planner resolves a convolution's ``algorithm = "auto"`` by the cost model alone
# (``blockpad.winograd.choose``): the runtime has no tuning records. A model build looks first:
# each auto convolution is asked of ``codegen.auto`` as one kernel (its direct request with the
# algorithm left open); where records time its candidates, the fastest recorded one is pinned
# on the node before the plan is made. ``model_spec`` hands ``tune`` those open requests, so that
# tuning a model measures every candidate (records are found by function, whatever the name).

def _auto_requests(g: Graph, log, target) -> dict:
    """``{node: KernelRequest}`` for each ``auto`` convolution with more than one candidate:
    the request it makes planned direct, with ``algorithm = "auto"``."""
    from blockpad.codegen import auto
    from blockpad.codegen.spec import parse_spec

    autos = [n.name for n in g.nodes if n.op == "conv2d" and n.attrs.get("algorithm") == "auto"]
    if not autos:
        return {}
    direct = {"algorithm": "direct", "winograd_tile": None}
    plan, _ = _plan(_regraph(g, g.cache, dict.fromkeys(autos, direct)), log, target)
    out = {}
    for st in plan.steps:
        if st.node is not None and st.node.name in autos and isinstance(st.kernel, _Probed) \
                and st.kernel.request.op == "conv2d":
            entry = {**st.kernel.request.entry("auto"), "algorithm": "auto"}
            req = parse_spec({"kernel": [entry]}, "model kernel").kernels[0]
            if len(auto.candidates(req)) > 1:
                out[st.node.name] = req
    return out


def _record_pins(g: Graph, log, target, tuning_logs) -> tuple:
    """``({node: attrs}, {node: choice})``: the attributes pinning each ``auto`` convolution
    whose candidates the tuning records time to the fastest recorded one, and the choice as
    ``codegen.auto`` records it (``model.json``'s ``auto_picks``); the other convolutions are
    left to the planner's cost model."""
    from blockpad.codegen import auto, tuning_records
    from blockpad.codegen.build import recorded_seconds

    logs = tuning_records.Logs(tuning_logs or tuning_records.default_dir(), target)
    if not logs.index:
        return {}, {}
    recorded = recorded_seconds(logs, target.tvm_target())
    nodes_of = {}   # one choice per distinct kernel (ResNet-50's 16 auto convolutions are 4)
    for node, req in _auto_requests(g, log, target).items():
        key = json.dumps(req.describe(), sort_keys=True)
        nodes_of.setdefault(key, (req, []))[1].append(node)
    pins, picks = {}, {}
    for req, nodes in nodes_of.values():
        chosen, picked = auto.resolve(req, recorded)
        if picked["by"] == "tuning records":
            params = dict(chosen.params)   # a direct candidate keeps the default tile param
            tile = params["winograd_tile"] if params["algorithm"] == "winograd" else None
            pins.update(dict.fromkeys(nodes, {"algorithm": "winograd" if tile else "direct",
                                              "winograd_tile": tile}))
            picks.update(dict.fromkeys(nodes, {k: picked[k] for k in ("chosen", "by", "time_us")}))
            times = ", ".join(f"{k} {'-' if v is None else f'{v} us'}"
                              for k, v in picked["time_us"].items())
            more = f" and {len(nodes) - 1} like it" if len(nodes) > 1 else ""
            log(f"  {nodes[0]}{more}: auto picked {picked['chosen']} by tuning records ({times})")
    return pins, picks


def _entry_name(i, req) -> str:
    return f"k{i:03d}_{req.op}"


def model_spec(source, conv_algorithm="auto", log=None, target="host"):
    """The build spec of the kernels ``source``'s plan for ``target`` calls (a ``bp.Graph``,
    an ONNX path or ModelProto), named as ``build_model`` names them: what ``blockpad tune
    model.onnx`` measures, so that building the model applies the records. An ``auto``
    convolution is there with its algorithm open, so that tuning times every candidate."""
    from blockpad.codegen.targets import get_target

    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    g = _graph(source, conv_algorithm)
    target = get_target(target)
    plan, requests = _plan(g, log, target)
    open_ = _auto_requests(g, log, target)
    spec = _spec(g, requests)
    planned = {st.kernel.request: st.node.name for st in plan.steps
               if st.node is not None and isinstance(st.kernel, _Probed)}
    kernels = tuple(dataclasses.replace(open_[planned[r]], name=k.name)
                    if planned.get(r) in open_ else k for r, k in zip(requests, spec.kernels))
    return dataclasses.replace(spec, kernels=kernels)


def _graph(source, conv_algorithm) -> Graph:
    return source if isinstance(source, Graph) else \
        Graph.from_onnx(source, conv_algorithm=conv_algorithm)


def _spec(g: Graph, requests):
    from blockpad.codegen.spec import parse_spec

    entries = [r.entry(_entry_name(i, r)) for i, r in enumerate(requests)]
    return parse_spec({"library": {"name": g.name}, "kernel": entries}, f"model {g.name}")


def build_key(g: Graph, doc: dict, target, tuning_logs=None) -> str:
    """Everything the folder depends on: the graph, the constants' bytes, the target, TVM, the
    code generator (with the packaged tuning records, and ``tuning_logs``' for this target if
    given) and the runtime's planner (with the cost model that picks Winograd convolutions)."""
    from blockpad import jit

    h = hashlib.sha256(json.dumps([doc, target.name, mf.tvm_version()], sort_keys=True).encode())
    for name, a in sorted(g.constants.items()):
        a = np.ascontiguousarray(a)
        h.update(f"{name} {a.shape} {a.dtype}".encode())
        h.update(a.view(np.uint8).reshape(-1))
    h.update(jit.fingerprint().encode())
    records = sorted((Path(tuning_logs) / target.name).glob("*.json")) if tuning_logs else []
    for f in [Path(winograd.__file__), *sorted(Path(rm.__file__).parent.rglob("*.py")),
              *records]:
        h.update(f.read_bytes())
    return h.hexdigest()


def _up_to_date(out_dir, key) -> bool:
    try:
        doc = rm.read_doc(out_dir)
        manifest = mf.read(out_dir)
        return doc.get("build_key") == key and os.path.isfile(
            os.path.join(out_dir, manifest["library"])) and \
            os.path.getsize(os.path.join(out_dir, doc["weights"])) == doc["weights_bytes"]
    except (BlockpadError, OSError, KeyError):
        return False


def _pack(g: Graph, plan) -> dict:
    """Each constant's shape and the constant in every layout the plan reads it in: packed for
    the weights its kernels take blocked (transformed for Winograd convolutions), plain where
    a step reads the constant as it is."""
    from blockpad.runtime.graph.ops import plain

    out = {}
    for cname, buf in plan.weight_bufs:
        lay = buf.layout
        a = np.ascontiguousarray(g.constants[cname])
        m = winograd.domain_tile(lay, a.shape)
        if m is not None:      # a Winograd convolution's weights: transformed once, here
            a = winograd.transform(a, m).astype(a.dtype)
        out.setdefault(cname, {})[lay] = Memory.from_numpy(a.reshape(lay.shape), lay)
    read_plain = {b.storage.value for st in plan.steps for b in st.reads
                  if b.storage.kind == "constant"}
    for cname, a in g.constants.items():
        if cname in read_plain or cname not in out:
            a = np.ascontiguousarray(a)
            lay = plain(a.shape, str(a.dtype))
            out.setdefault(cname, {})[lay] = Memory(lay, a.reshape(-1).copy())
    return {k: (np.shape(g.constants[k]), list(v.values())) for k, v in out.items()}


def _algorithms_picked(doc: dict, plan) -> dict:
    """``doc`` with each convolution's ``algorithm = "auto"`` replaced by the plan's pick
    (``winograd`` and its tile, or ``direct``), so that the built model runs the kernels and
    packed weights it was built with whatever a later runtime's cost model would pick: a
    runtime that planned ``auto`` again refused to load a model after the cost model changed
    (it would read the weights in a layout the build did not pack)."""
    picked = {}
    for st in plan.steps:
        sig = getattr(st.kernel, "signature", None)
        if st.node is not None and sig is not None and sig.op == "conv2d":
            tile = sig.params.get("winograd_tile") \
                if sig.params.get("algorithm") == "winograd" else None
            picked[st.node.name] = {"algorithm": "winograd", "winograd_tile": tile} \
                if tile else {"algorithm": "direct"}
    nodes = [{**n, "attrs": {**n["attrs"], **picked[n["name"]]}}
             if n["op"] == "conv2d" and n["attrs"].get("algorithm") == "auto"
             and n["name"] in picked else n for n in doc["nodes"]]
    return {**doc, "nodes": nodes}


def _native_plan(plan, cache, lib, constants, target, out_dir, log) -> dict | None:
    """Compile the plan's kernel calls into ``plan.so`` (``runtime/graph/native.py``) and
    return what ``model.json`` records of it, or None (and say why) where a run needs more
    than kernel calls: its steps are called from Python then. The calls are described with
    ``constants`` where the loaded model will have them: views of one buffer, at their offsets
    in ``weights.bin``."""
    from blockpad.codegen.plan_function import build_plan
    from blockpad.runtime.graph.execution import describe_plan
    from blockpad.runtime.graph.native import PLAN_FUNCTION
    from blockpad.runtime.memory import aligned_empty

    table, nbytes = rm.weights_table(constants)
    shared = aligned_empty(max(nbytes, 1), np.uint8)[:nbytes]
    views = {(entry["name"], mem.layout): shared[e["offset"]:e["offset"] + e["nbytes"]].view(
                 mem.buffer.dtype)
             for entry, (_, mems) in zip(table, constants.values())
             for mem, e in zip(mems, entry["layouts"])}
    desc, why = describe_plan(plan, cache, shared, views)
    if desc is not None and not desc.calls:
        desc, why = None, "the plan calls no kernel"
    path = os.path.join(out_dir, rm.PLAN_LIBRARY)
    if desc is None:
        for stale in (path, path + ".py"):
            if os.path.exists(stale):
                os.remove(stale)
        log(f"no plan function: {why}; the steps are called from Python")
        return None
    variants = {n: rec.threads for n, rec in ((c.kernel, lib.kernels[c.kernel].record)
                                              for c in desc.calls) if rec.threads}
    pools = sorted({n for threads in variants.values() for n in threads})
    names = {None: PLAN_FUNCTION, **{n: f"{PLAN_FUNCTION}__threads{n}" for n in pools}}

    def calls(pool):
        return [(variants.get(c.kernel, {}).get(pool, c.kernel),
                 [(a.backing, a.offset, a.shape, a.dtype, a.strides) for a in c.args])
                for c in desc.calls]
    t0 = time.perf_counter()
    build_plan({name: calls(pool) for pool, name in names.items()}, desc.backings, target,
               path)
    log(f"plan function: {len(desc.calls)} kernel calls over {desc.backings} buffers, "
        f"compiled in {time.perf_counter() - t0:.1f} s")
    return {"library": rm.PLAN_LIBRARY, "sha256": mf.file_sha256(path),
            "digest": desc.digest(),
            "functions": {"" if n is None else str(n): name for n, name in names.items()}}


def build_model(source, target="host", out_dir="build/model", force=False, log=None,
                tuning_logs=None, conv_algorithm="auto") -> str:
    """Build ``source`` (a ``bp.Graph``, an ONNX path or ModelProto) for ``target`` (a name;
    ``native``: the widest this CPU runs) into ``out_dir``; return ``out_dir``.
    ``conv_algorithm``: an ONNX source's convolutions (``Graph.from_onnx``'s: ``auto`` or
    ``direct``)."""
    from blockpad.codegen.build import build
    from blockpad.codegen.targets import get_target, native_target

    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    start = time.perf_counter()
    target = get_target(native_target() if target == "native" else target)
    if gpu_requirement(target.features) is not None:
        raise ArgumentError(f"target {target.name!r}: a built model runs its steps on the CPU "
                            f"(bp.Graph has no GPU execution), so it cannot use GPU kernels; "
                            f"build it for a CPU target, or its kernels alone for the GPU "
                            f"(`blockpad build spec.toml --target {target.name}`)")
    g = _graph(source, conv_algorithm)
    out_dir = os.fspath(out_dir)
    doc = rm.graph_doc(g)
    key = build_key(g, doc, target, tuning_logs)
    if not force and _up_to_date(out_dir, key):
        log(f"{out_dir}: up to date ({len(g.nodes)} ops for {target.name}, build key "
            f"{key[:12]}); nothing to do")
        return out_dir
    log(f"planning {g.name}: {len(g.nodes)} ops, inputs "
        f"{', '.join(f'{k} {list(s)}' for k, (s, _) in g.inputs.items())}")
    pins, picks = _record_pins(g, log, target, tuning_logs)
    if pins:
        g = _regraph(g, g.cache, pins)
    lines, requests = plan_kernels(g, log, target)
    log(f"the plan has {len(lines)} steps and calls {len(requests)} kernels")
    os.makedirs(out_dir, exist_ok=True)
    build(_spec(g, requests), target, out_dir, force=force, log=log, tuning_logs=tuning_logs)

    from blockpad.runtime.library import describe

    lib = describe(out_dir)   # not loaded: the target need not run here
    built = _regraph(g, KernelCache([lib], compiler=None,
                                    cache_dir=os.path.join(out_dir, "no-jit")))
    plan = built.plan(**rm.input_layouts(built))
    if plan.describe().splitlines() != lines:
        raise BuildError(f"{out_dir}: the plan over the built library differs from the probed "
                         f"one:\n{plan.describe()}")
    constants = _pack(g, plan)
    native = _native_plan(plan, built.cache, lib, constants, target, out_dir, log)
    rm.write_model(out_dir, _algorithms_picked(doc, plan), constants, lines,
                   {"build_key": key, "target": target.name, "kernels": len(requests),
                    "auto_picks": picks, "native": native})
    size = sum(m.layout.nbytes for _, ms in constants.values() for m in ms)
    log(f"wrote {out_dir}: {len(requests)} kernels, {len(lines)} steps, weights "
        f"{size / 2 ** 20:.1f} MiB packed, in {time.perf_counter() - start:.1f} s")
    return out_dir


