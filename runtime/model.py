"""Models built ahead of time: ``blockpad build model.onnx --out DIR`` (or
``blockpad.model_build.build_model(graph, ...)``) writes into DIR

* ``kernels.so`` + ``manifest.json``: every kernel the model's plan calls, one library;
* ``weights.bin``: the constants, weights already packed into the blocked layouts their
  convolutions read (64-byte aligned, raw), and plain where a kernel reads them plain;
* ``model.json``: the graph (ops, attributes, inputs, outputs, options), where each constant
  lies in ``weights.bin``, and the plan the build made (one line per step);
* ``plan.so`` (with its TVMScript, ``plan.so.py``): the plan's kernel calls as one compiled
  function (``graph/native.py``), where the plan is kernel calls only; ``model.json`` records
  its hash, the digest of the calls it makes and its function for each pool size.

``blockpad.load(DIR)`` returns a ``Model``: the graph rebuilt over that library alone (no
compiler, no JIT cache, no ``onnx``), its constants the packed bytes as they are. Planning again
at load must give the recorded plan, step for step; a runtime that would plan differently
refuses to load and says to rebuild, rather than run something the build never checked.

This module is the one place of the folder's format: the build side writes through
``write_model``."""

from __future__ import annotations

import json
import os
import threading
import zlib

import numpy as np

from blockpad.errors import ArgumentError, LoadError
from blockpad.layout import Layout, numpy_dtype

from . import library
from .cache import KernelCache
from .graph import Graph
from .graph.ops import plain
from .loadable import check_digest
from .memory import CLEAN, Memory, aligned_empty
from .tvm_runtime import load_module, pool_threads

FORMAT = 2   # 2: the weights checked by CRC-32 (1: SHA-256)
MODEL = "model.json"
WEIGHTS = "weights.bin"
PLAN_LIBRARY = "plan.so"   # the plan's kernel calls as one function (graph/native.py)
ALIGN = 64


# ---- the graph as JSON ------------------------------------------------------------------------

def graph_doc(g: Graph) -> dict:
    """The graph's ops, inputs, outputs and options as JSON (constants apart: see
    ``write_model``). Ops that run Python functions (``custom``) cannot be written."""
    nodes = []
    for n in g.nodes:
        if n.op == "custom":
            raise ArgumentError(f"{n.name}: a custom op runs a Python function, which a model "
                                f"built ahead of time cannot hold; express it with blockpad ops")
        nodes.append({"name": n.name, "op": n.op, "inputs": list(n.inputs),
                      "outputs": list(n.outputs), "attrs": n.attrs})
    options = {"policy": g.policy, "inplace": g.inplace, "layouts": g.layouts,
               "block": g.block, "fuse": sorted(g.fuse), "name": g.name}
    doc = {"options": options, "inputs": {k: [list(s), d] for k, (s, d) in g.inputs.items()},
           "outputs": list(g.outputs), "nodes": nodes}
    # numpy scalars (an importer's attribute values) as the Python numbers they hold
    return json.loads(json.dumps(doc, default=_scalar))


def _scalar(value):
    if isinstance(value, np.generic):
        return value.item()
    raise ArgumentError(f"graph attribute {value!r} ({type(value).__name__}) cannot be written "
                        f"as JSON")


def _tuples(value):
    """JSON lists back to the tuples the graph's attributes hold (tables stay tables)."""
    if isinstance(value, list):
        return tuple(_tuples(v) for v in value)
    if isinstance(value, dict):
        return {k: _tuples(v) for k, v in value.items()}
    return value


def input_layouts(g: Graph) -> dict:
    """The layouts a model's inputs come in: plain arrays."""
    return {name: plain(shape, dtype) for name, (shape, dtype) in g.inputs.items()}


def plan_lines(g: Graph) -> list:
    """The plan for plain inputs, one line per step: what the build records and the load
    checks."""
    return g.plan(**input_layouts(g)).describe().splitlines()


# ---- writing (the build side calls this) ------------------------------------------------------

def weights_table(constants: dict) -> tuple:
    """``(table, nbytes)``: where ``write_model`` puts each layout of each constant in
    ``weights.bin`` (``table``: model.json's ``constants``, each layout at an offset aligned to
    ``ALIGN``). A loaded model's constants are views of the file's bytes at these offsets: the
    build describes its plan function over them (``native.describe``'s shared buffer)."""
    table, offset = [], 0
    for name, (shape, mems) in constants.items():
        entry = {"name": name, "shape": [int(n) for n in shape], "dtype": mems[0].layout.dtype,
                 "layouts": []}
        for mem in mems:
            nbytes = mem.layout.alloc_len * mem.buffer.dtype.itemsize
            offset += -offset % ALIGN
            entry["layouts"].append({"layout": mem.layout.describe(), "offset": offset,
                                     "nbytes": int(nbytes)})
            offset += nbytes
        table.append(entry)
    return table, offset


def write_model(out_dir, doc: dict, constants: dict, plan: list, extra: dict) -> None:
    """Write ``weights.bin`` and ``model.json``. ``constants``: name -> (the graph's shape of
    it, the Memories of the layouts the plan reads it in, plain or packed); the shape is the
    graph's, not a packed layout's (grouped weights pack as 5-D ``gOIhw16i16o``/``Goihw16g``).
    ``model.json`` is written last, whole: a folder without it is not a model, one with it is
    complete."""
    table, offset = weights_table(constants)
    tmp = os.path.join(out_dir, WEIGHTS + ".tmp")
    crc, written = 0, 0
    with open(tmp, "wb") as f:
        for (_, mems), entry in zip(constants.values(), table):
            for mem, e in zip(mems, entry["layouts"]):
                pad = b"\0" * (e["offset"] - written)
                raw = np.ascontiguousarray(mem.buffer[:mem.layout.alloc_len]).view(np.uint8)
                f.write(pad + raw.tobytes())
                crc = zlib.crc32(raw, zlib.crc32(pad, crc))
                written = e["offset"] + raw.size
    os.replace(tmp, os.path.join(out_dir, WEIGHTS))
    model = {"format": FORMAT, "graph": doc, "constants": table, "weights": WEIGHTS,
             "weights_bytes": offset, "weights_crc32": crc, "plan": plan, **extra}
    path = os.path.join(out_dir, MODEL)
    with open(path + ".tmp", "w") as f:
        json.dump(model, f, indent=1)
        f.write("\n")
    os.replace(path + ".tmp", path)


def read_doc(path) -> dict:
    """``model.json`` of a built model folder; LoadError if it is not one."""
    file = os.path.join(os.fspath(path), MODEL)
    try:
        with open(file) as f:
            doc = json.load(f)
    except OSError as e:
        raise LoadError(f"{path}: expected a built model with {MODEL} ({e.strerror}); build one "
                        f"with `blockpad build model.onnx --out {path}`") from None
    except ValueError as e:
        raise LoadError(f"{file}: not a readable model description ({e})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        got = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
        raise LoadError(f"{file}: expected model format {FORMAT}; got {got!r}; rebuild it")
    return doc


# ---- loading ----------------------------------------------------------------------------------

class Model:
    """A model built ahead of time; ``model(x)`` runs it. See the module docstring."""

    def __init__(self, path):
        self.path = os.fspath(path)
        self.doc = doc = read_doc(self.path)
        weights, weights_read = self._read_weights(doc)
        try:
            self._load(doc, weights, weights_read)
        except BaseException:
            try:
                weights_read()   # never leave the reader running
            except LoadError:
                pass             # the load's own error is the one to report
            raise

    def _load(self, doc, weights, weights_read):
        self.library = library.load(self.path)
        # the library alone: a kernel it lacks is not looked for in any cache directory
        cache = KernelCache([self.library], compiler=None,
                            cache_dir=os.path.join(self.path, "no-jit"))
        opts = doc["graph"]["options"]
        g = Graph(policy=opts["policy"], cache=cache, inplace=opts["inplace"],
                  layouts=opts["layouts"], block=opts["block"], fuse=tuple(opts["fuse"]),
                  name=opts["name"])
        g.weight_cache.backing = weights   # every constant below is a view into it
        for name, (shape, dtype) in doc["graph"]["inputs"].items():
            g.input(name, shape, dtype)
        for c in doc["constants"]:
            mems = []
            for e in c["layouts"]:
                lay = Layout.from_dict(e["layout"])
                buf = weights[e["offset"]:e["offset"] + e["nbytes"]].view(numpy_dtype(lay.dtype))
                mems.append(Memory(lay, buf, CLEAN))
            p = plain(c["shape"], c["dtype"])
            flat = next((m for m in mems if m.layout == p), None)
            if flat is not None:        # read plain somewhere: a constant as any other
                g.constant(c["name"], flat.buffer.reshape(p.shape))
            else:
                g.prepacked(c["name"], c["shape"], c["dtype"], mems)
        for n in doc["graph"]["nodes"]:
            g.add_op(n["op"], n["inputs"], _tuples(n["attrs"]), n["name"], n["outputs"])
        g.output(*doc["graph"]["outputs"])
        self.graph = g
        if any(c["dtype"] == "int8" for c in doc["constants"]):
            weights_read()   # planning int8 convolutions reads weight bytes (weight_bits = 7)
        if doc.get("native"):   # before the plan check plans (and keeps) the runner
            g.native_plans[tuple(input_layouts(g).values())] = self._plan_function(doc["native"])
        try:
            lines = plan_lines(g)
        except ArgumentError as e:
            raise LoadError(f"{self.path}: this runtime plans the model differently from its "
                            f"build ({e}); rebuild it") from None
        if lines != doc["plan"]:
            diff = next((f"built: {a!r}; now: {b!r}" for a, b in zip(doc["plan"], lines)
                         if a != b), f"{len(doc['plan'])} steps built, {len(lines)} now")
            raise LoadError(f"{self.path}: this runtime plans the model differently from its "
                            f"build ({diff}); rebuild it")
        weights_read()
        self.inputs = dict(g.inputs)
        # the only input's name (None for several): what ``__call__`` binds one array to
        self._input = next(iter(self.inputs)) if len(self.inputs) == 1 else None
        self.outputs = list(g.outputs)

    def _plan_function(self, native: dict) -> tuple:
        """``(function, digest)``: the build's plan function for this pool size, the model's
        kernel library imported into its module (where it finds the kernels)."""
        path = os.path.join(self.path, native["library"])
        if not os.path.isfile(path):
            raise LoadError(f"{self.path}: model.json names plan function {native['library']!r}, "
                            f"which is missing; rebuild the model")
        check_digest(path, native["sha256"], "the model's")
        module = load_module(path)
        module.import_module(self.library.module)
        functions = native["functions"]
        return module[functions.get(str(pool_threads()), functions[""])], native["digest"]

    def _read_weights(self, doc) -> tuple:
        """``(buffer, wait)``: the weights file is read into ``buffer`` and its checksum checked
        on a thread of its own, while the caller builds and plans the graph over views of the
        buffer (reading and checksumming release the GIL). The checksum is a CRC-32, which
        catches a damaged or replaced file as a hash would (``model.json`` beside it is no
        better protected, so a cryptographic hash bought nothing): ResNet-50's 112 MiB took
        0.58 s to SHA-256 on a CPU without SHA extensions (Cascade Lake), 0.08 s to CRC.
        ``wait()`` joins the thread and raises the LoadError it
        found; nothing may read the weights' values before it returns.

        The buffer is numpy's, which asks Linux for transparent huge pages on arrays this
        large (``MADV_HUGEPAGE``): every inference streams the weights, and on 4 KiB pages (an
        anonymous ``mmap`` of the same size, measured) the pruned ResNet-50 ran 0.6-1.1 ms
        slower at 1 thread (37.2-37.9 against 36.4-36.8 ms, Zen 4). A file mapped instead of
        read would lose them."""
        size = doc["weights_bytes"]
        buf = aligned_empty(max(size, 1), np.uint8)[:size]
        failed = []

        def read():
            try:
                self._fill_weights(doc, buf)
            except BaseException as e:   # noqa: BLE001 - raised again by wait()
                failed.append(e)

        reader = threading.Thread(target=read, name="blockpad-weights", daemon=True)
        reader.start()

        def wait():
            reader.join()
            if failed:
                raise failed[0]
        return buf, wait

    def _fill_weights(self, doc, buf) -> None:
        file = os.path.join(self.path, doc["weights"])
        size = doc["weights_bytes"]
        try:
            with open(file, "rb") as f:
                got = f.readinto(buf)
        except OSError as e:
            raise LoadError(f"{file}: cannot read the model's weights ({e.strerror})") from None
        if got != size or os.path.getsize(file) != size:
            raise LoadError(f"{file}: expected {size} bytes of weights; the file has "
                            f"{os.path.getsize(file)}; rebuild the model")
        crc = zlib.crc32(buf)
        if crc != doc["weights_crc32"]:
            raise LoadError(f"{file}: content checksum {crc:08x} does not match the model's "
                            f"{doc['weights_crc32']:08x}; the file changed after the "
                            f"build, rebuild it")

    @property
    def target(self) -> str:
        return self.library.target

    def _given(self, args, kw) -> dict:
        names = list(self.inputs)
        if len(args) > len(names):
            raise ArgumentError(f"{self.path}: the model takes {len(names)} input(s) "
                                f"({', '.join(names)}); got {len(args)} positional")
        given = dict(zip(names, args), **kw)
        return {k: _host_array(v, k) for k, v in given.items()}

    def run(self, *args, **kw):
        """Run on the inputs (positional in the model's order, or by name) and return the
        graph's ``Results`` (each held blocked until read, with the run's ``report``)."""
        return self.graph.run(self._given(args, kw))

    def __call__(self, *args, **kw):
        """Run and return the output as a numpy array (a dict of them for several outputs).
        Inputs: numpy arrays or any CPU DLPack tensor (PyTorch's, zero-copy)."""
        if len(args) == 1 and not kw and type(args[0]) is np.ndarray and self._input:
            given = {self._input: args[0]}   # the common call, without _given's general work
        else:
            given = self._given(args, kw)
        res = self.graph.run_arrays(given)
        if res is None:
            res = self.graph.run(given).numpy()
        return res[self.outputs[0]] if len(self.outputs) == 1 else res

    def __repr__(self):
        shapes = ", ".join(f"{k} {list(s)} {d}" for k, (s, d) in self.inputs.items())
        return (f"<blockpad model {self.path} target={self.target} inputs: {shapes}; "
                f"{len(self.graph.nodes)} ops, {len(self.library.kernels)} kernels>")


def _host_array(value, name):
    if isinstance(value, (np.ndarray, Memory)):
        return value
    if hasattr(value, "__dlpack__"):
        try:
            return np.from_dlpack(value)
        except (TypeError, RuntimeError, BufferError, ValueError) as e:
            raise ArgumentError(f"input {name!r}: DLPack tensor not readable as a CPU array "
                                f"({e}); pass .detach() of a CPU tensor") from e
    return np.asarray(value)


def is_model(path) -> bool:
    return os.path.isfile(os.path.join(os.fspath(path), MODEL))


def load(path):
    """A built folder: a ``Model`` if it holds one (``model.json``), else a kernel
    ``Library``."""
    return Model(path) if is_model(path) else library.load(path)


__all__ = ["Model", "graph_doc", "is_model", "load", "read_doc", "write_model"]
