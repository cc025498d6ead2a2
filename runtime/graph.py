"""Graphs of ops run on numpy inputs, the way a framework integrates blocked kernels (seed 004):

    g = Graph(policy="tracked")
    x = g.input("x", (1, 30, 14, 14))
    w = g.constant("w", weights)                  # reordered once to a blocked layout, kept
    y = g.relu(g.conv2d(x, w, pad=1))
    z = g.softmax(g.add(y, x), axis=1)
    g.output(z)
    res = g.run(x=array)                          # kernels from the cache (JIT on first use)
    res["softmax_0"].numpy()                      # reordered to plain now, not before
    print(res.report)

Planning (once per set of input layouts) runs the passes:

* **post-op fusion** (``passes.fuse_post_ops``): an eltwise that is a convolution's only reader
  runs inside the convolution's kernel (oneDNN's eltwise post-op; the sum post-op, for an add,
  on request: ``fuse=("eltwise", "sum")``);
* **in place** (``passes.inplace_pass``, seed 003): eltwise, softmax and binary ops overwrite
  their input where the seed's rules allow;
* **layout propagation**: convolutions run on blocked layouts (``nChw16c``/``nChw8c`` and blocked
  weights); eltwise, binary and softmax follow their input's layout, so data stays blocked
  between ops; a reorder is inserted only where a consumer needs a layout no version of the
  value has (each version made once, shared by every consumer); results are reordered to plain
  only when the caller reads them; weights are reordered once and kept, and re-reordered when
  the caller's array changes (``weights="check"``: each run compares the caller's array byte
  for byte with a copy kept at the reorder: a checksum such as adler32 can be fooled by a few
  sign flips, a compare cannot, and it is the cheaper of the two) or when told
  (``weights="frozen"``: a snapshot, refreshed by ``set_constant``);
* **fallback**: an op whose blocked kernel cannot be had (not prebuilt, not compilable) runs on
  plain layouts; one with no kernel at all runs its numpy reference;
* **memory planning**: buffers of intermediate values share slots of an arena once their last
  reader has run; in-place ops share their input's buffer, which lowers the peak.

Padding policy: every memory the graph makes follows the graph's policy (its kernels are built
or picked for it): a buffer is given to its memory (``set_data_handle``) when its producer is
about to write it, so ``on_handle`` zero-pads there, and ``tracked`` zero-pads only where a
consumer needs clean padding that its producer did not leave. ``user`` is seed 001's option
B/C: the graph tells each ``set_data_handle`` whether the buffer is clean (an arena buffer
whose zeros an earlier run left and nothing overwrote since), the caller says which inputs are
(``run(..., clean=["x"])``), and the zero-pads that remain go on ``run(..., stream=)``,
asynchronously.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from blockpad import winograd
from blockpad.errors import ArgumentError
from blockpad.layout import Layout, dtype_name, numpy_dtype, pad_sides
from blockpad.vocabulary import DEFAULT_POLICY, POLICIES, POST_OP_DEFAULTS, with_defaults

from . import counters
from .cache import KernelCache, Request, default_cache
from .graph_ops import ELTWISE, GRAPH_OPS, plain
from .memory import CLEAN, UNKNOWN, Memory, aligned_empty
from .padding import zero_pad
from .passes import InplaceResult, Node, fuse_post_ops, inplace_pass

WINOGRAD_TILES = winograd.TILES


class Tensor:
    """A value of a graph under construction."""

    __slots__ = ("graph", "name", "shape", "dtype")

    def __init__(self, graph, name, shape, dtype):
        self.graph, self.name, self.shape, self.dtype = graph, name, tuple(shape), dtype

    def __add__(self, other):
        return self.graph.add(self, other)

    def __mul__(self, other):
        return self.graph.mul(self, other)

    def __repr__(self):
        return f"<Tensor {self.name} {list(self.shape)} {self.dtype}>"


# ---- the report -------------------------------------------------------------------------------

@dataclass
class Report:
    policy: str
    ops: int = 0                    # graph ops run
    kernels: int = 0                # kernel calls (reorders included)
    reorders: int = 0               # activation reorders run (inserted by layout propagation)
    weight_reorders: int = 0        # weight reorders run (first run, or after a change)
    output_reorders: int = 0        # results reordered to plain because the caller read them
    inplace: list = field(default_factory=list)     # ops run in place
    fused: list = field(default_factory=list)       # ops run as a convolution's post-op
    fallbacks: dict = field(default_factory=dict)   # op -> "plain" / "numpy": no blocked kernel
    zero_pad_calls: int = 0
    zero_pad_bytes: int = 0
    zero_pad_blocking: int = 0
    peak_bytes: int = 0             # peak of live intermediate and result buffers (liveness)
    arena_bytes: int = 0            # bytes the planned arena holds (slots reused)
    weight_bytes: int = 0           # prepared (reordered) weights, kept between runs
    cache: dict = field(default_factory=dict)       # kernel-cache counters during this run
    seconds: float = 0.0            # the whole run() call: plan_seconds + run_seconds
    plan_seconds: float = 0.0       # planning, with the kernels it compiled or loaded (a first
    #                                 run for these input layouts; a lookup afterwards)
    run_seconds: float = 0.0        # weights checked/reordered, the steps run

    def as_dict(self):
        return dict(self.__dict__)

    def __str__(self):
        kib = lambda n: f"{n / 1024:.1f} KiB"  # noqa: E731
        cache = ", ".join(f"{k} {v}" for k, v in self.cache.items() if v)
        lines = [
            f"policy {self.policy}: {self.ops} ops, {self.kernels} kernel calls, "
            f"{1e3 * self.seconds:.2f} ms ({1e3 * self.plan_seconds:.2f} ms planning and "
            f"compiling, {1e3 * self.run_seconds:.2f} ms running)",
            f"  reorders      {self.reorders} activation, {self.weight_reorders} weight, "
            f"{self.output_reorders} result (lazy)",
            f"  in place      {len(self.inplace)}: {', '.join(self.inplace) or '-'}",
            f"  fused         {', '.join(self.fused) or '-'}",
            f"  fallbacks     {', '.join(f'{k} ({v})' for k, v in self.fallbacks.items()) or '-'}",
            f"  zero-pads     {self.zero_pad_calls} calls, {self.zero_pad_bytes} bytes, "
            f"{self.zero_pad_blocking} blocking",
            f"  memory        peak {kib(self.peak_bytes)} live, arena {kib(self.arena_bytes)}, "
            f"weights {kib(self.weight_bytes)}",
            f"  kernel cache  {cache or '-'}",
        ]
        return "\n".join(lines)


# ---- results ----------------------------------------------------------------------------------

class Result:
    """A graph result: held in whatever layout its producer wrote (``memory``), reordered to
    plain only when ``numpy()`` is called (then kept)."""

    def __init__(self, name, memory: Memory, plan, report: Report, lock):
        self.name = name
        self.memory = memory
        self._plan = plan
        self._report = report
        self._array = None
        self._lock = lock

    @property
    def layout(self) -> Layout:
        return self.memory.layout

    @property
    def shape(self):
        return self.memory.layout.shape

    def numpy(self) -> np.ndarray:
        with self._lock:
            if self._array is None:
                self._array = self._plan.to_plain(self.memory, self._report)
            return self._array

    def __array__(self, dtype=None, copy=None):
        a = self.numpy()
        return a.astype(dtype) if dtype is not None else a

    def __repr__(self):
        return f"<Result {self.name} {self.layout}>"


class Results(dict):
    """``{output name: Result}`` plus the run's ``report``."""

    def __init__(self, items, report):
        super().__init__(items)
        self.report = report

    def numpy(self) -> dict:
        return {k: v.numpy() for k, v in self.items()}


# ---- the graph --------------------------------------------------------------------------------

class Graph:
    """A graph of ops; see the module docstring.

    ``policy``: the padding policy its kernels are built for (default: the first library's, else
    ``dst_fused``). ``cache``: the KernelCache (default: a private one over ``libraries`` if
    given, else the process-wide one). ``inplace``: run the in-place pass. ``layouts``:
    ``"blocked"`` (propagate blocked layouts) or ``"plain"`` (every op on plain layouts: the
    baseline). ``block``: the channel block of blocked activations (8 or 16; None: 16 unless
    every channel count fits 8 better). ``weights``: ``"check"`` or ``"frozen"`` (see the
    module docstring). ``fuse``: which of a convolution's only readers run inside its kernel
    as oneDNN post-ops: ``"eltwise"``, ``"sum"`` (an add), both, or none (False/()). ``sum`` is
    off by default: on the ResNet block (1x62x56x56, avx512, 1 thread) it measured no faster
    end to end (3.80 vs 3.81 ms), though its kernels take 0.15-0.2 ms less than a convolution
    plus a separate add and relu."""

    def __init__(self, policy=None, cache: KernelCache | None = None, libraries=(),
                 inplace=True, layouts="blocked", block=None, weights="check",
                 fuse=("eltwise",), name="graph"):
        libraries = list(libraries)
        if policy is None:
            policy = next((lib.policy for lib in libraries if lib.policy), DEFAULT_POLICY)
        if policy not in POLICIES:
            raise ArgumentError(f"policy: expected one of {', '.join(POLICIES)}; got {policy!r}")
        if layouts not in ("blocked", "plain"):
            raise ArgumentError(f"layouts: expected 'blocked' or 'plain'; got {layouts!r}")
        if weights not in ("check", "frozen"):
            raise ArgumentError(f"weights: expected 'check' or 'frozen'; got {weights!r}")
        if block not in (None, 8, 16):
            raise ArgumentError(f"block: expected 8, 16 or None; got {block!r}")
        if cache is None:
            if libraries:
                base = default_cache()
                cache = KernelCache(libraries, compiler=base.compiler, cache_dir=base.cache_dir,
                                    target=base.target)
            else:
                cache = default_cache()
        else:
            for lib in libraries:
                cache.add_library(lib)
        self.name = name
        self.policy = policy
        self.cache = cache
        self.inplace = inplace
        self.layouts = layouts
        self.block = block
        self.weights = weights
        if fuse is True:
            fuse = ("eltwise", "sum")
        unknown = set(fuse or ()) - {"eltwise", "sum"}
        if unknown:
            raise ArgumentError(f"fuse: expected 'eltwise' and/or 'sum'; got {sorted(unknown)}")
        self.fuse = frozenset(fuse or ())
        self.nodes: list[Node] = []
        self.inputs: dict = {}        # name -> (shape, dtype)
        self.constants: dict = {}     # name -> array (the caller's, or a snapshot if frozen)
        self.outputs: list = []
        self._types: dict = {}        # var name -> (shape, dtype) of its latest definition
        self._counts: dict = {}
        self._plans: dict = {}
        self._lock = threading.RLock()
        self._weights: dict = {}      # (constant, Layout) -> prepared Memory
        self._weight_bytes: dict = {}  # constant -> a copy of its bytes when it was reordered
        self._stale: set = set()
        self._prepacked: set = set()  # constants held only in packed layouts (see prepacked)

    # ---- building -----------------------------------------------------------------------------
    def _fresh(self, base):
        while True:
            n = self._counts.get(base, 0)
            self._counts[base] = n + 1
            name = f"{base}_{n}"
            if name not in self._types:
                return name

    def _changed(self):
        self._plans.clear()

    def _var(self, t) -> str:
        if isinstance(t, Tensor):
            if t.graph is not self:
                raise ArgumentError(f"{t.name} belongs to another graph")
            return t.name
        if isinstance(t, str) and t in self._types:
            return t
        raise ArgumentError(f"expected a Tensor of this graph (or a variable name); got {t!r}")

    def input(self, name, shape, dtype="float32") -> Tensor:
        """A value the caller passes to ``run`` (a numpy array, or a Memory in any layout)."""
        if name in self._types:
            raise ArgumentError(f"{name!r} is already a variable of this graph")
        dtype = dtype_name(dtype)
        self.inputs[name] = (tuple(int(s) for s in shape), dtype)
        self._types[name] = self.inputs[name]
        self._changed()
        return Tensor(self, name, shape, dtype)

    def constant(self, name, array) -> Tensor:
        """A weight: reordered to the layout its consumer wants once, and kept. Never written."""
        if name in self._types:
            raise ArgumentError(f"{name!r} is already a variable of this graph")
        array = np.asarray(array)
        dtype_name(array.dtype)
        self.constants[name] = self._keep(array)
        self._types[name] = (array.shape, dtype_name(array.dtype))
        self._changed()
        return Tensor(self, name, array.shape, dtype_name(array.dtype))

    def prepacked(self, name, shape, dtype, memories) -> Tensor:
        """A constant known only in the layouts its consumers read: ``memories`` (clean
        Memories of its logical shape), e.g. the packed weights of an ahead-of-time model
        build. They are used as they are, never reordered, and no plain copy is held (a
        model's weights would otherwise take twice their memory); a plan that would read the
        constant in another layout raises ArgumentError. ``set_constant`` gives it a plain
        array again."""
        if name in self._types:
            raise ArgumentError(f"{name!r} is already a variable of this graph")
        shape, dtype = tuple(int(s) for s in shape), dtype_name(dtype)
        for mem in memories:
            if mem.layout.dtype != dtype or math.prod(mem.layout.shape) != math.prod(shape):
                raise ArgumentError(f"{name}: a prepacked memory of {list(shape)} {dtype} has "
                                    f"layout {mem.layout}")
            self._weights[(name, mem.layout)] = mem
        # shape and dtype for planning, no data: a stride-0 view of one zero
        self.constants[name] = np.broadcast_to(np.zeros((), numpy_dtype(dtype)), shape)
        self._types[name] = (shape, dtype)
        self._prepacked.add(name)
        self._changed()
        return Tensor(self, name, shape, dtype)

    def _keep(self, array):
        if self.weights == "frozen":
            array = np.array(array, order="C")       # a snapshot: the caller's later writes
            array.setflags(write=False)              # do nothing until set_constant
        return array

    def set_constant(self, name, array) -> None:
        """Give a constant new values (same shape and dtype): its prepared weights are
        re-reordered before the next run. The way to refresh under ``weights="frozen"``."""
        if name not in self.constants:
            raise ArgumentError(f"{name!r} is not a constant of this graph")
        array = np.asarray(array)
        if (array.shape, dtype_name(array.dtype)) != self._types[name]:
            raise ArgumentError(f"{name}: expected {self._types[name]}; got {array.shape} "
                                f"{array.dtype}")
        with self._lock:
            self.constants[name] = self._keep(array)
            self._stale.add(name)
            self._prepacked.discard(name)

    def add_op(self, op, inputs, attrs=None, name=None, outputs=None, n_outputs=1):
        """Append an op (``op`` a key of graph_ops.GRAPH_OPS) and return its output Tensor(s)."""
        if op not in GRAPH_OPS:
            raise ArgumentError(f"op: expected one of {', '.join(GRAPH_OPS)}; got {op!r}")
        ins = [self._var(t) for t in inputs]
        name = name or self._fresh(op)
        if any(n.name == name for n in self.nodes):
            raise ArgumentError(f"an op named {name!r} exists already")
        node = Node(name, op, ins, [], dict(attrs or {}))
        types = GRAPH_OPS[op].infer(node, [self._types[v] for v in ins])
        if outputs is None:
            outputs = [name] if len(types) == 1 else [f"{name}:{i}" for i in range(len(types))]
            taken = [o for o in outputs if o in self._types]
            if taken:
                raise ArgumentError(f"{name}: {taken[0]!r} is already a variable; name the op "
                                    f"differently (or pass out= to write a variable again)")
        outputs = [o if isinstance(o, str) else o.name for o in outputs]
        if len(outputs) != len(types):
            raise ArgumentError(f"{name}: {op} makes {len(types)} outputs; got names {outputs}")
        for o, t in zip(outputs, types):
            if o in self.inputs or o in self.constants:
                raise ArgumentError(f"{name}: cannot write {o!r}, a graph input or constant")
            self._types[o] = (tuple(t[0]), dtype_name(t[1]))
        node.outputs = list(outputs)
        node.orig_outputs = list(outputs)
        self.nodes.append(node)
        self._changed()
        tensors = [Tensor(self, o, *self._types[o]) for o in outputs]
        return tensors[0] if len(tensors) == 1 else tuple(tensors)

    def eltwise(self, x, algorithm="relu", alpha=0.0, beta=0.0, name=None, out=None) -> Tensor:
        if algorithm not in ELTWISE:
            raise ArgumentError(f"eltwise algorithm: expected one of {', '.join(ELTWISE)}; "
                                f"got {algorithm!r}")
        return self.add_op("eltwise", [x], {"algorithm": algorithm, "alpha": float(alpha),
                                            "beta": float(beta)}, name, _outs(out))

    # Every op method takes ``name`` (the op's name, and its output's unless ``out`` is given)
    # and ``out`` (a variable to write: a new name, or an existing one written again).
    def relu(self, x, alpha=0.0, name=None, out=None):
        return self.eltwise(x, "relu", alpha, name=name, out=out)

    def gelu(self, x, approximate="erf", name=None, out=None):
        return self.eltwise(x, "gelu_" + approximate, name=name, out=out)

    def sigmoid(self, x, name=None, out=None):
        return self.eltwise(x, "sigmoid", name=name, out=out)

    def tanh(self, x, name=None, out=None):
        return self.eltwise(x, "tanh", name=name, out=out)

    def exp(self, x, name=None, out=None):
        return self.eltwise(x, "exp", name=name, out=out)

    def linear(self, x, alpha=1.0, beta=0.0, name=None, out=None):
        return self.eltwise(x, "linear", alpha, beta, name=name, out=out)

    def binary(self, a, b, algorithm="add", name=None, out=None) -> Tensor:
        if algorithm not in ("add", "mul"):
            raise ArgumentError(f"binary algorithm: expected add or mul; got {algorithm!r}")
        a_t, b_t = self._types[self._var(a)], self._types[self._var(b)]
        if a_t[0] != b_t[0] and len(a_t[0]) == len(b_t[0]) and \
                all(x >= y for x, y in zip(b_t[0], a_t[0])):
            a, b = b, a      # commutative: the full-shape operand first (the kernel's src0)
        return self.add_op("binary", [a, b], {"algorithm": algorithm}, name, _outs(out))

    def add(self, a, b, name=None, out=None):
        return self.binary(a, b, "add", name, out)

    def mul(self, a, b, name=None, out=None):
        return self.binary(a, b, "mul", name, out)

    def softmax(self, x, axis=1, name=None, out=None, log=False) -> Tensor:
        """Softmax over ``axis`` (the blocked channel axis by default); ``log``: log-softmax."""
        rank = len(self._types[self._var(x)][0])
        if not -rank <= axis < rank:
            raise ArgumentError(f"softmax axis {axis}: the input has {rank} dims")
        return self.add_op("softmax", [x], {"axis": axis % rank, "log": bool(log)}, name,
                           _outs(out))

    def log_softmax(self, x, axis=1, name=None, out=None) -> Tensor:
        return self.softmax(x, axis, name, out, log=True)

    def conv2d(self, x, weights, bias=None, stride=1, pad=0, dilation=1, groups=1,
               post_ops=(), sum=None, name=None, out=None,  # noqa: A002 (oneDNN's)
               algorithm="direct", winograd_tile=None) -> Tensor:
        """2-D convolution, NCHW source, OIHW weights (``groups`` > 1: O x I/groups x H x W).
        ``pad``: symmetric, an int or (h, w), or per side ((top, bottom), (left, right)).
        ``post_ops``: oneDNN's chain
        fused into the kernel, e.g. ``["bias", "relu"]`` or dicts ``{"kind": "eltwise",
        "algorithm": "relu"}``, ``{"kind": "sum", "scale": 1.0}`` (reads ``sum``). A ``bias``
        given without a chain is applied first; a ``sum`` tensor has no such default place in
        the chain (before or after an activation differ), so it needs its ``"sum"`` entry.
        ``algorithm``: ``"direct"``, ``"winograd"``
        (3x3, stride 1, fp32: F(m x m, 3x3), ``winograd_tile`` m = 2, 4 (default) or 6; the
        constant weights are transformed once, by the library's ``winograd_weights`` kernel)
        or ``"auto"`` (the cost model of ``blockpad.winograd`` picks, within its error
        bound)."""
        if algorithm not in ("direct", "winograd", "auto"):
            raise ArgumentError(f"conv2d: algorithm must be 'direct', 'winograd' or 'auto'; "
                                f"got {algorithm!r}")
        if winograd_tile not in (None, *WINOGRAD_TILES):
            raise ArgumentError(f"conv2d: winograd_tile must be one of {WINOGRAD_TILES}; got "
                                f"{winograd_tile!r}")
        chain = [_post_op(p) for p in post_ops]
        if bias is not None and not any(p["kind"] == "bias" for p in chain):
            chain.insert(0, {"kind": "bias"})
        if any(p["kind"] == "bias" for p in chain) and bias is None:
            raise ArgumentError("conv2d: a 'bias' post-op needs the bias tensor")
        if any(p["kind"] == "sum" for p in chain) and sum is None:
            raise ArgumentError("conv2d: a 'sum' post-op needs the tensor to add (sum=...)")
        if sum is not None and not any(p["kind"] == "sum" for p in chain):
            raise ArgumentError("conv2d: sum= was given but post_ops has no 'sum' entry, so the "
                                "tensor would not be added; put 'sum' in post_ops where it "
                                "applies, e.g. post_ops=['sum', 'relu']")
        inputs = [x, weights] + ([bias] if bias is not None else []) + \
            ([sum] if sum is not None else [])
        attrs = {"stride": _pair(stride), "pad": pad_sides(pad), "dilation": _pair(dilation),
                 "groups": int(groups), "post_ops": chain, "bias": bias is not None,
                 "sum": sum is not None, "algorithm": algorithm, "winograd_tile": winograd_tile}
        return self.add_op("conv2d", inputs, attrs, name, _outs(out))

    def pool(self, x, algorithm="max", kernel=2, stride=None, pad=0, dilation=1,
             exclude_pad=True, ceil_mode=False, name=None, out=None) -> Tensor:
        """Max or average pooling (``algorithm``), the kernels' parameters: ``pad`` symmetric
        or per side ``((top, bottom), (left, right))``; ``stride`` defaults to the window;
        ``exclude_pad``: the average divides by the cells in the image, else by those in the
        padded image; ``ceil_mode``: PyTorch's and ONNX's."""
        if algorithm not in ("max", "avg"):
            raise ArgumentError(f"pool algorithm: expected 'max' or 'avg'; got {algorithm!r}")
        kernel = _pair(kernel)
        attrs = {"algorithm": algorithm, "kernel": kernel,
                 "stride": _pair(stride) if stride is not None else kernel,
                 "pad": pad_sides(pad), "dilation": _pair(dilation),
                 "exclude_pad": bool(exclude_pad), "ceil_mode": bool(ceil_mode)}
        return self.add_op("pool", [x], attrs, name, _outs(out))

    def global_avg_pool(self, x, name=None, out=None) -> Tensor:
        """The mean over H and W (a classifier's global average pooling): one window."""
        shape = self._types[self._var(x)][0]
        if len(shape) != 4:
            raise ArgumentError(f"global_avg_pool takes an NCHW value; got {shape}")
        return self.pool(x, "avg", shape[2:], name=name, out=out)

    def matmul(self, x, weights, bias=None, post_ops=(), name=None, out=None) -> Tensor:
        """``x (M, K) @ weights (K, N)`` (+ ``bias`` (N,)), with a post-op chain as conv2d's
        (``bias`` and eltwise kinds)."""
        chain = [_post_op(p) for p in post_ops]
        if bias is not None and not any(p["kind"] == "bias" for p in chain):
            chain.insert(0, {"kind": "bias"})
        if any(p["kind"] == "sum" for p in chain):
            raise ArgumentError("matmul: the graph's matmul takes bias and eltwise post-ops")
        if any(p["kind"] == "bias" for p in chain) and bias is None:
            raise ArgumentError("matmul: a 'bias' post-op needs the bias tensor")
        inputs = [x, weights] + ([bias] if bias is not None else [])
        return self.add_op("matmul", inputs, {"post_ops": chain, "bias": bias is not None},
                           name, _outs(out))

    def reshape(self, x, shape, name=None, out=None) -> Tensor:
        """The same elements in ``shape`` (one -1 is inferred): no copy when the input has no
        other reader."""
        old = self._types[self._var(x)][0]
        shape = [int(s) for s in shape]
        if shape.count(-1) == 1:
            rest = math.prod(s for s in shape if s != -1)
            shape[shape.index(-1)] = math.prod(old) // rest if rest else 0
        return self.add_op("reshape", [x], {"shape": tuple(shape)}, name, _outs(out))

    def flatten(self, x, axis=1, name=None, out=None) -> Tensor:
        """(prod of dims before ``axis``, prod of the rest): a classifier head's flatten."""
        shape = self._types[self._var(x)][0]
        return self.reshape(x, (math.prod(shape[:axis]), math.prod(shape[axis:])), name, out)

    def concat(self, inputs, axis=1, name=None, out=None) -> Tensor:
        """Concatenation along ``axis`` (channels by default), kept blocked on blocked inputs
        whatever the channel offsets."""
        inputs = list(inputs)
        rank = len(self._types[self._var(inputs[0])][0])
        if not -rank <= axis < rank:
            raise ArgumentError(f"concat axis {axis}: the inputs have {rank} dims")
        return self.add_op("concat", inputs, {"axis": axis % rank}, name, _outs(out))

    def custom(self, fn, inputs, outputs, name=None, output_names=None, out=None):
        """An op blockpad has no kernel for: ``fn(*arrays)`` on plain numpy arrays returns one
        array per ``outputs`` entry (``(shape, dtype)``). ``out`` (or ``output_names``): the
        variables it writes, one per output."""
        if out is not None and output_names is not None:
            raise ArgumentError("custom: give out= or output_names=, not both")
        outs = [(tuple(s), dtype_name(d)) for s, d in outputs]
        names = output_names if out is None else \
            [o if isinstance(o, str) else o.name for o in (out if isinstance(out, (list, tuple))
                                                           else [out])]
        return self.add_op("custom", inputs, {"fn": fn, "outputs": outs}, name, outputs=names)

    def output(self, *tensors) -> None:
        """Results the caller reads (by variable name)."""
        for t in tensors:
            name = self._var(t)
            if name not in self.outputs:
                self.outputs.append(name)
        self._changed()

    @classmethod
    def from_ops(cls, ops, inputs=None, constants=None, outputs=(), **options) -> Graph:
        """A graph from a list of op tables (a framework's program), e.g.::

            [{"op": "eltwise", "inputs": ["x"], "outputs": ["a"], "algorithm": "relu"},
             {"op": "binary", "inputs": ["a", "y"], "outputs": ["b"], "algorithm": "add"}]

        ``inputs``: {name: (shape, dtype) or shape}; ``constants``: {name: array}. Variable
        names may be written again by later ops (memory reuse), as frameworks' programs do."""
        g = cls(**options)
        for name, t in (inputs or {}).items():
            shape, dtype = (t, "float32") if isinstance(t[0], (int, np.integer)) else t
            g.input(name, shape, dtype)
        for name, a in (constants or {}).items():
            g.constant(name, a)
        for i, entry in enumerate(ops):
            entry = dict(entry)
            op = entry.pop("op")
            ins = entry.pop("inputs")
            outs = entry.pop("outputs", None) or [entry.pop("output")]
            name = entry.pop("name", None) or f"{op}_{i}"
            if op == "custom":
                g.custom(entry["fn"], ins, entry["shapes"], name=name, output_names=outs)
                continue
            method = {"eltwise": g.eltwise, "binary": g.binary, "softmax": g.softmax,
                      "conv2d": g.conv2d}.get(op)
            if method is None:
                raise ArgumentError(f"op #{i}: expected eltwise, binary, softmax, conv2d or "
                                    f"custom; got {op!r}")
            method(*ins, name=name, out=outs[0], **entry)
        g.output(*outputs)
        return g

    @classmethod
    def from_onnx(cls, model, input_shapes=None, **options) -> Graph:
        """The graph of an ONNX inference model (a path, bytes or ``onnx.ModelProto``; opset
        13+), inputs and outputs named as the model's: see ``blockpad.onnx``. Needs the
        ``onnx`` package; ``options`` are the Graph's."""
        from blockpad.onnx import from_onnx

        return from_onnx(model, input_shapes, **options)

    # ---- planning -----------------------------------------------------------------------------
    def conv_blocks(self, c_in, c_out, groups):
        """Channel blocks to try for a convolution, preferred first. Grouped and depthwise
        convolutions block too (``weight_tag``): the kernel indexes the source by logical
        channel, so channels per group need not be a block multiple (30 channels in 2 groups
        on ``nChw16c`` is fine), and keeping them blocked saves the reorders around them
        (MobileNet's and EfficientNet's depthwise layers between blocked 1x1 convolutions)."""
        if self.layouts == "plain":
            return []
        if self.block:
            return [self.block]
        return [16, 8] if max(c_in, c_out) > 8 else [8, 16]

    @staticmethod
    def weight_tag(block, groups, depthwise):
        """The weights' tag beside an ``nChw<block>c`` source: ``OIhw<b>i<b>o`` for
        ``groups = 1``; depthwise (groups = C = K) ``Goihw<b>g``, the groups blocked as the
        source's channels are; other grouped ``gOIhw<b>i<b>o`` (each group's K/G x C/G
        padded to whole blocks)."""
        if groups == 1:
            return f"OIhw{block}i{block}o"
        return f"Goihw{block}g" if depthwise else f"gOIhw{block}i{block}o"

    def plan(self, **inputs) -> Plan:
        """The plan for inputs like these (arrays, Memories or Layouts): the passes' result."""
        return self._plan_for(self._input_layouts(inputs))

    def _input_layouts(self, given) -> tuple:
        missing = [n for n in self.inputs if n not in given]
        extra = [n for n in given if n not in self.inputs]
        if missing or extra:
            raise ArgumentError(f"{self.name}: inputs are {', '.join(self.inputs) or 'none'}; "
                                f"missing {missing}, unknown {extra}")
        out = []
        for name, (shape, dtype) in self.inputs.items():
            v = given[name]
            if isinstance(v, Layout):
                lay = v
            elif isinstance(v, Memory):
                lay = v.layout
            else:
                arr = v if hasattr(v, "dtype") and hasattr(v, "shape") else np.asarray(v)
                lay = plain(tuple(arr.shape), dtype_name(arr.dtype))
            if lay.shape != shape or lay.dtype != dtype:
                raise ArgumentError(f"{self.name}: input {name!r} is {list(shape)} {dtype}; got "
                                    f"{list(lay.shape)} {lay.dtype}")
            out.append(lay)
        return tuple(out)

    def _plan_for(self, layouts) -> Plan:
        with self._lock:
            plan = self._plans.get(layouts)
            if plan is None:
                if not self.outputs:
                    raise ArgumentError(f"{self.name}: no outputs; call graph.output(...)")
                plan = self._plans[layouts] = Plan(self, dict(zip(self.inputs, layouts)))
            return plan

    # ---- running ------------------------------------------------------------------------------
    def run(self, inputs=None, *, clean=(), stream=None, **kw) -> Results:
        """Run on ``inputs`` ({name: numpy array or Memory}, or keywords); return the results,
        each held in its producer's layout until read.

        ``clean``: names of Memory inputs whose padding the caller knows is zero (their state
        may say ``unknown``): they are not zero-padded. ``stream`` (``user`` policy only, seed
        001 option B): the zero-pads the run needs at set_data_handle time (inputs not known
        clean, buffers whose padding the graph cannot vouch for) go on it, asynchronously;
        each kernel waits only for its own arguments' zero-pads."""
        given = dict(inputs or {}, **kw)
        clean = (clean,) if isinstance(clean, str) else tuple(clean)
        unknown = [n for n in clean if n not in self.inputs]
        if unknown:
            raise ArgumentError(f"{self.name}: clean= names inputs; {unknown} are not inputs "
                                f"(inputs: {', '.join(self.inputs) or 'none'})")
        if stream is not None and self.policy != "user":
            raise ArgumentError(f"{self.name}: stream= queues the user policy's zero-pads "
                                f"(set_data_handle's stream); this graph's policy is "
                                f"{self.policy!r}")
        before_cache = self.cache.stats()
        start = time.perf_counter()
        plan = self._plan_for(self._input_layouts(given))
        return plan.run(given, before_cache, time.perf_counter() - start, frozenset(clean),
                        stream)

    def __call__(self, inputs=None, **kw):
        """Run and return the results as numpy arrays (one array for one output)."""
        res = self.run(inputs, **kw).numpy()
        return next(iter(res.values())) if len(res) == 1 else res

    def _prepare_weight(self, cname, layout, report) -> Memory:
        """The constant ``cname`` in ``layout``, reordered once (and again after a change)."""
        key = (cname, layout)
        with self._lock:
            mem = self._weights.get(key)
            if mem is not None:
                return mem
            if cname in self._prepacked:
                raise ArgumentError(_unpacked(cname, layout, self._weights))
            mem = Memory(layout, aligned_empty(layout.alloc_len, numpy_dtype(layout.dtype)),
                         library=_Runtime(self.policy, self.cache))
            self._weights[key] = mem
            self._reorder_weight(cname, mem, report)
            return mem

    def _reorder_weight(self, cname, mem, report):
        src = self.constants[cname]
        lay = mem.layout
        if lay.rank == np.ndim(src) == 4 and tuple(lay.shape[2:]) != tuple(np.shape(src)[2:]):
            # Winograd-domain weights (K, C, m + 2, m + 2) of 3x3 ones: transformed, not reordered
            src_mem = Memory(Layout("oihw", np.shape(src), lay.dtype),
                             np.ascontiguousarray(src).reshape(-1))
            _winograd_weights(self.cache, src_mem, mem)
        else:
            src_mem = Memory(_weight_source(lay), np.ascontiguousarray(src).reshape(-1))
            _reorder(self.cache, src_mem, mem)
        if report is not None:
            report.weight_reorders += 1
        if self.weights == "check":
            self._weight_bytes[cname] = _raw(src).copy()

    def _refresh_weights(self, report) -> None:
        """Re-reorder prepared weights whose constant changed (checked, or set_constant)."""
        with self._lock:
            stale = set(self._stale)
            if self.weights == "check":
                for cname, src in self.constants.items():
                    kept = self._weight_bytes.get(cname)
                    if kept is not None and not np.array_equal(_raw(src), kept):
                        stale.add(cname)
            for (cname, _lay), mem in self._weights.items():
                if cname in stale:
                    self._reorder_weight(cname, mem, report)
            self._stale.clear()

    def __repr__(self):
        return (f"<blockpad Graph {self.name}: {len(self.nodes)} ops, inputs "
                f"{list(self.inputs)}, outputs {self.outputs}, policy {self.policy}>")


def _unpacked(cname, layout, weights) -> str:
    have = [str(lay) for c, lay in weights if c == cname]
    return (f"{cname}: the plan reads this prepacked constant as {layout}; it is held only as "
            f"{', '.join(have) or 'nothing'} (rebuild the model, or set_constant a plain array)")


def _weight_source(layout: Layout) -> Layout:
    """The caller's weight array as a layout: ``layout``'s letters in plain order (oihw,
    goihw), the same bytes."""
    return Layout(layout.dims, layout.shape, layout.dtype)


def _raw(array) -> np.ndarray:
    """The bytes of ``array`` as unsigned integers of its item size: compared exactly (a float
    compare would call NaN changed and -0.0 unchanged)."""
    a = np.ascontiguousarray(array).reshape(-1)
    return a.view(f"u{a.itemsize}") if a.itemsize in (1, 2, 4, 8) else a.view(np.uint8)


def _outs(out):
    return None if out is None else [out if isinstance(out, str) else out.name]


def _pair(v):
    if isinstance(v, (int, np.integer)):
        return (int(v), int(v))
    v = tuple(int(x) for x in v)
    if len(v) != 2:
        raise ArgumentError(f"expected an int or a pair; got {v}")
    return v


def _post_op(p):
    if isinstance(p, str):
        if p in ELTWISE:
            p = {"kind": "eltwise", "algorithm": p}
        elif p in ("bias", "sum"):
            p = {"kind": p}
        else:
            raise ArgumentError(f"post-op {p!r}: expected bias, sum or an eltwise algorithm")
    if p.get("kind") not in POST_OP_DEFAULTS:
        raise ArgumentError(f"post-op {p!r}: kind must be bias, eltwise or sum")
    p = with_defaults(p)
    for k in ("alpha", "beta", "scale"):
        if k in p:
            p[k] = float(p[k])
    return p


# ---- planning ---------------------------------------------------------------------------------

class _Runtime:
    """What the graph's memories see as their library: the policy, and zero-pad kernels from
    the cache (``padding.zero_pad`` asks it for one)."""

    def __init__(self, policy, cache):
        self.policy = policy
        self._cache = cache
        self._zero_pads = {}

    def zero_pad_kernel(self, layout):
        if layout not in self._zero_pads:
            self._zero_pads[layout] = self._cache.zero_pad_kernel(layout)
        return self._zero_pads[layout]


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
    """The passes' result for one set of input layouts, and the arenas that run it."""

    def __init__(self, graph: Graph, input_layouts: dict):
        self.graph = graph
        self.policy = graph.policy
        self.runtime = _Runtime(graph.policy, graph.cache)
        self._storages, self._bufs = [], []
        self.steps: list[_Step] = []
        self.fallbacks: dict = {}
        self.inplace_refused: list = []
        self.weight_bufs: list = []       # (constant name, buf) prepared once
        self._pool: list = []
        self._pool_lock = threading.Lock()
        self._build(input_layouts)
        self._plan_memory()
        for s in self._storages:      # a prepacked constant has no plain bytes to read
            if s.kind == "constant" and s.value in graph._prepacked and s.last is not None:
                raise ArgumentError(_unpacked(s.value, s.bufs[0].layout, graph._weights))

    # -- construction --
    def _storage(self, kind):
        s = _Storage(len(self._storages), kind)
        self._storages.append(s)
        return s

    def _buf(self, storage, layout):
        b = _Buf(len(self._bufs), storage, layout)
        self._bufs.append(b)
        return b

    def _build(self, input_layouts):
        g = self.graph
        env = {}
        for name, lay in input_layouts.items():
            v = env[name] = _Value(name, lay.shape, lay.dtype, "input")
            s = self._storage("input")
            s.value = name
            v.home = v.versions[lay] = self._buf(s, lay)
        for name, a in g.constants.items():
            v = env[name] = _Value(name, a.shape, dtype_name(a.dtype), "constant")
            s = self._storage("constant")
            s.value = name
            lay = plain(a.shape, v.dtype)
            v.home = v.versions[lay] = self._buf(s, lay)

        # the in-place pass needs each variable's shape at each op: track through the program
        env_types = {n: (tuple(v.shape), v.dtype) for n, v in env.items()}
        node_types = {}
        for n in g.nodes:
            ins = [env_types[v] for v in n.inputs]
            node_types[n.name] = ins
            for o, t in zip(n.outputs, GRAPH_OPS[n.op].infer(n, ins)):
                env_types[o] = (tuple(t[0]), dtype_name(t[1]))

        def capable(node):
            info = GRAPH_OPS[node.op]
            return info.inplace_inputs(node, node_types[node.name]) if info.inplace_capable else []

        protected = set(g.inputs) | set(g.constants) | set(g.outputs)
        nodes = g.nodes
        self.fused = []
        if g.fuse and g.layouts == "blocked":
            nodes, self.fused = fuse_post_ops(
                nodes, protected, lambda n: len({t[0] for t in node_types[n.name]}) == 1,
                kinds=g.fuse)
        if g.inplace:
            self.inplace_result = inplace_pass(nodes, capable, protected)
        else:
            import copy

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
                g.cache.find(Request.make("reorder", [("src", lay),
                                                      ("dst", plain(lay.shape, lay.dtype))]))

    def _place(self, node, env, defs):
        """Layout propagation and kernel choice for one op, with its reorders before it."""
        g = self.graph
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
            # its reorder kernel, compiled now: planning time, not the first run's
            if v.name not in self.graph._prepacked:
                self.graph.cache.find(Request.make(
                    "reorder", [("src", _weight_source(layout)), ("dst", layout)]))
            return buf
        src = next((b for lay, b in v.versions.items() if lay == home.layout), home)
        buf = v.versions[layout] = self._buf(self._storage("arena"), layout)
        req = Request.make("reorder", [("src", src.layout), ("dst", layout)])
        kernel = self.graph.cache.find(req)
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
        for s in self._storages:
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
            for s in {b.storage for b in st.reads + st.writes}:
                if s.kind == "arena" and s.last == i:
                    live -= s.nbytes
                    free.append(s.slot)
            steps.append(st)
        self.slots = slots
        self.peak_bytes = peak
        self.arena_bytes = sum(slots)
        self.bind_at = bind_at

    # -- execution --
    def _acquire(self):
        with self._pool_lock:
            if self._pool:
                return self._pool.pop()
        return _Execution(self)

    def _release(self, exe):
        with self._pool_lock:
            self._pool.append(exe)

    def run(self, given, before_cache, plan_seconds=0.0, clean=frozenset(),
            stream=None) -> Results:
        g = self.graph
        report = Report(self.policy, plan_seconds=plan_seconds)
        start = time.perf_counter()
        with counters.scope() as zp:
            g._refresh_weights(report)
            weights = {}
            for cname, buf in self.weight_bufs:
                weights[buf.id] = g._prepare_weight(cname, buf.layout, report)
            exe = self._acquire()
            try:
                outs = exe.run(given, weights, report, clean, stream)
            finally:
                self._release(exe)
        report.zero_pad_calls = zp.calls
        report.zero_pad_bytes = zp.bytes
        report.zero_pad_blocking = zp.blocking_calls
        report.run_seconds = time.perf_counter() - start
        report.seconds = plan_seconds + report.run_seconds
        report.ops = len(g.nodes)
        report.inplace = [s.label for s in self.steps if s.inplace]
        report.fused = [f"{a} + {b}" for a, b in self.fused]
        report.fallbacks = dict(self.fallbacks)
        report.peak_bytes = self.peak_bytes
        report.arena_bytes = self.arena_bytes
        report.weight_bytes = sum(b.layout.nbytes for _, b in self.weight_bufs)
        report.cache = (g.cache.stats() - before_cache).as_dict()
        lock = threading.Lock()
        return Results({n: Result(n, m, self, report, lock) for n, m in outs.items()}, report)

    def to_plain(self, mem: Memory, report: Report) -> np.ndarray:
        lay = mem.layout
        if lay.is_plain:
            return mem.buffer[:lay.alloc_len].reshape(lay.shape)
        dst = Memory(plain(lay.shape, lay.dtype),
                     aligned_empty(int(np.prod(lay.shape)), numpy_dtype(lay.dtype)))
        _reorder(self.graph.cache, mem, dst)
        report.output_reorders += 1
        return dst.buffer.reshape(lay.shape)

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


def _reorder(cache, src: Memory, dst: Memory) -> None:
    """dst = src relaid out, with the cache's reorder kernel (numpy if it has none)."""
    kernel = cache.find(Request.make("reorder", [("src", src.layout), ("dst", dst.layout)]))
    if kernel is not None:
        kernel(src, dst)
        return
    dst.buffer[dst.layout.logical_offsets()] = src.to_numpy()
    if dst.layout.has_padding:
        dst.buffer[dst.layout.padding_offsets()] = 0
    dst.state = CLEAN


def _winograd_weights(cache, src: Memory, dst: Memory) -> None:
    """dst = the Winograd-domain transform of 3x3 weights ``src``, with the library's (or a
    compiled) ``winograd_weights`` kernel; in float64 numpy if there is none."""
    m = dst.layout.shape[2] - 2
    kernel = cache.find(Request.make("winograd_weights", [("src", src.layout), ("dst", dst.layout)],
                                     {"winograd_tile": m}, shape=src.layout.shape))
    if kernel is not None:
        kernel(src, dst)
        return
    g = np.array(winograd.matrices(m)[1], dtype=np.float64)
    u = np.einsum("er,kcrs,ns->kcen", g, src.to_numpy().astype(np.float64), g)
    dst.buffer[dst.layout.logical_offsets()] = u.astype(dst.buffer.dtype)
    if dst.layout.has_padding:
        dst.buffer[dst.layout.padding_offsets()] = 0
    dst.state = CLEAN


class _Execution:
    """One arena of a plan: buffers and memories bound to the kernels, reused run after run
    (one per concurrent run)."""

    def __init__(self, plan: Plan):
        self.plan = plan
        rt = plan.runtime
        self.slots = [aligned_empty(n, np.uint8) for n in plan.slots]
        self.mems = {}
        for b in plan._bufs:
            s = b.storage
            dt = numpy_dtype(b.layout.dtype)
            if s.kind == "arena":
                raw = self.slots[s.slot]
                buf = raw[:b.layout.nbytes].view(dt)
            else:   # input / constant / weight / output: given per run; a placeholder now
                buf = np.zeros(b.layout.alloc_len, dt)
            self.mems[b.id] = Memory(b.layout, buf, library=rt)
        # values sharing a storage (in place) share one Memory, so their state is one state
        first = {}
        for b in plan._bufs:
            key = (b.storage.id, b.layout)
            if key in first:
                self.mems[b.id] = self.mems[first[key]]
            else:
                first[key] = b.id
        # the memories of each arena slot: binding one storage overwrites the others' bytes
        self._slot_mems = {}
        for b in plan._bufs:
            if b.storage.kind == "arena" and b.layout.has_padding:
                self._slot_mems.setdefault(b.storage.slot, set()).add(self.mems[b.id])
        self.stream = None
        self.calls = []
        self._bound = False

    def _bind(self, weights):
        plan = self.plan
        calls = []
        for i, st in enumerate(plan.steps):
            for s in plan.bind_at.get(i, ()):
                if s.kind in ("arena", "output"):
                    for b in s.bufs:
                        if b.layout.has_padding:
                            calls.append(self._binder(b))
            if st.kernel is not None:
                calls.append(st.kernel.bind(*(self.mems[b.id] for b in st.args)))
            elif st.kind == "reorder":
                calls.append(self._np_reorder(self.mems[st.reads[0].id],
                                              self.mems[st.writes[0].id]))
            else:
                calls.append(self._numpy(st))
        self.calls = calls
        self._bound = True

    def _binder(self, b):
        """The policy's work at "memory creation" for the buffer ``b`` its producer is about
        to write. Under ``user`` the graph says what it knows, as seed 001 asks of a user:
        ``clean`` when the memory's padding is still the zeros an earlier run left (kernels
        preserve padding there; binding another storage of the slot makes it unknown), and
        the zero-pad of one that is not goes on the run's stream, if it has one."""
        mem = self.mems[b.id]
        user = self.plan.policy == "user"
        others = [m for m in self._slot_mems.get(b.storage.slot, ()) if m is not mem] \
            if b.storage.kind == "arena" else []

        def bind():
            for m in others:
                m.state = UNKNOWN
            mem.set_data_handle(mem.buffer, clean=user and mem.state == CLEAN,
                                stream=self.stream)
        return bind

    @staticmethod
    def _np_reorder(src, dst):
        def run():
            dst.wait()
            dst.buffer[dst.layout.logical_offsets()] = src.to_numpy()
            if dst.layout.has_padding:
                dst.buffer[dst.layout.padding_offsets()] = 0
            dst.state = CLEAN
        return run

    def _numpy(self, st):
        info = GRAPH_OPS[st.node.op]
        ins = [self.mems[b.id] for b in st.reads]
        outs = [self.mems[b.id] for b in st.writes]

        def run():
            for m in ins + outs:
                m.wait()
            arrays = [_plain_view(m) for m in ins]
            results = info.reference(st.node, arrays)
            if len(results) != len(outs):
                raise ArgumentError(f"{st.label}: returned {len(results)} arrays; expected "
                                    f"{len(outs)}")
            for m, r in zip(outs, results):
                r = np.asarray(r)
                if r.shape != m.layout.shape:
                    raise ArgumentError(f"{st.label}: returned shape {r.shape}; expected "
                                        f"{m.layout.shape}")
                _plain_view(m)[...] = r
                m.state = CLEAN
        return run

    def run(self, given, weights, report, clean=frozenset(), stream=None):
        plan = self.plan
        self.stream = stream
        for b in plan._bufs:
            s = b.storage
            mem = self.mems[b.id]
            if s.kind == "input":
                value = given[s.value]
                mem.buffer, mem.state = _input_buffer(value, b.layout)
                if s.value in clean:
                    mem.state = CLEAN          # the caller vouches for its padding
                if mem.state != CLEAN and plan.policy == "user" and stream is not None:
                    # set_data_handle(buf, clean=False, stream): zeroed on the stream; the
                    # kernels reading it wait for that (a read-only buffer is copied there)
                    mem.set_data_handle(mem.buffer, stream=stream)
                elif mem.state != CLEAN and plan.policy not in ("tracked", "src"):
                    # the caller's memory has padding of unknown content: the policy's kernels
                    # trust it clean, so zero it now (a read-only buffer is copied, not written)
                    zero_pad(mem, blocking=True)
                    if isinstance(value, Memory) and mem.buffer is value.buffer:
                        value.state = CLEAN
            elif s.kind == "constant" and s.last is not None:   # read as it is by a step
                arr = plan.graph.constants[s.value]
                mem.buffer, mem.state = np.ascontiguousarray(arr).reshape(-1), CLEAN
            elif s.kind == "weight":
                w = weights[b.id]
                mem.buffer, mem.state = w.buffer, w.state
            elif s.kind == "output":
                if b is s.bufs[0]:
                    fresh = aligned_empty(s.nbytes, np.uint8)
                mem.buffer = fresh[:b.layout.nbytes].view(numpy_dtype(b.layout.dtype))
                mem.state = UNKNOWN                 # a new buffer: its padding is anything
        if not self._bound:
            self._bind(weights)
        for call in self.calls:
            call()
        for mem in self.mems.values():
            mem.wait()       # a zero-pad on the stream that no kernel waited for (none expected)
        report.kernels = sum(1 for s in plan.steps if s.kernel is not None)
        report.reorders = sum(1 for s in plan.steps if s.kind == "reorder")
        outs = {}
        for name, b in plan.outputs.items():
            mem = self.mems[b.id]
            # the caller gets its own Memory: the arena's is rebound to a fresh buffer next run;
            # a result that is a graph input or constant is a copy, never the caller's array
            buf = mem.buffer
            if b.storage.kind in ("input", "constant", "weight"):
                buf = aligned_empty(buf.size, buf.dtype)
                buf[...] = mem.buffer
            outs[name] = Memory(mem.layout, buf, mem.state, library=plan.runtime)
        return outs


def _input_buffer(value, layout):
    if isinstance(value, Memory):
        value.wait()
        return value.buffer, value.state
    arr = np.asarray(value)
    if arr.dtype != numpy_dtype(layout.dtype):
        raise ArgumentError(f"input: expected dtype {layout.dtype}; got {arr.dtype}")
    if not arr.flags.c_contiguous or arr.ctypes.data % arr.itemsize:
        arr = np.ascontiguousarray(arr).copy()
    return arr.reshape(-1), CLEAN


def _plain_view(mem: Memory) -> np.ndarray:
    lay = mem.layout
    return mem.buffer[:lay.alloc_len].reshape(lay.shape)
