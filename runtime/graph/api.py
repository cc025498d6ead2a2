"""The user API of graphs: ``Graph`` (building: inputs, constants, op methods, ``from_ops``,
the ``from_onnx`` hook; running: ``plan``, ``run``) and ``Tensor``, the values of a graph
under construction. The package docstring shows it in use.

A Graph keeps the program (``nodes``, ``inputs``, ``outputs``), its options, and its constants
in a ``WeightCache``; it hands the passes ``self`` as their ``planning.PlanSource`` and caches
one ``execution.Runner`` per set of input layouts."""

from __future__ import annotations

import math
import threading
import time

import numpy as np

from blockpad import channel_blocks, winograd
from blockpad.errors import ArgumentError
from blockpad.layout import Layout, dtype_name, numpy_dtype, pad_sides
from blockpad.vocabulary import (
    BINARY_POST_OPS,
    DEFAULT_POLICY,
    MAX_BINARIES,
    MAX_SUMS,
    POLICIES,
    POST_OP_DEFAULTS,
    POST_OP_TENSORS,
    QUANT_DEFAULTS,
    QUANTIZED_ADD,
    QUANTIZED_DTYPES,
    post_op_tensors,
    quantized_add_entry,
    with_defaults,
)

from ..cache import KernelCache, default_cache
from ..memory import Memory
from .execution import Runner
from .ops import ELTWISE, GRAPH_OPS, dot_steps, plain
from .passes import FUSIONS, Node
from .planning import Plan
from .results import Results
from .weights import WeightCache

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


# ---- the graph --------------------------------------------------------------------------------

class Graph:
    """A graph of ops; see the module docstring.

    ``policy``: the padding policy its kernels are built for (default: the first library's, else
    ``dst_fused``). ``cache``: the KernelCache (default: a private one over ``libraries`` if
    given, else the process-wide one). ``inplace``: run the in-place pass. ``layouts``:
    ``"blocked"`` (propagate blocked layouts) or ``"plain"`` (every op on plain layouts: the
    baseline). ``block``: the channel block of blocked activations (8 or 16; None: 16 unless
    every channel count fits 8 better, and on Zen 4 8 for a convolution's output whose last
    block of 16 would be mostly padding: ``narrow_block``). ``weights``: ``"check"`` or
    ``"frozen"`` (see the module docstring). ``fuse``: what runs fused (``passes.FUSIONS``, all by default; none:
    False/()): a convolution's only reader inside its kernel as oneDNN post-ops,
    ``"eltwise"`` and ``"sum"`` (an add), and ``"inverted_residual"``: a 1x1 expansion, a
    depthwise convolution and a 1x1 projection as one kernel (MobileNetV2's blocks;
    ``passes.fuse_inverted_residuals``). A fused residual add saves a pass over the block's
    output: ResNet-50 (host, AVX2, 1 thread, best of 20 interleaved runs) 124.4 -> 120.2 ms,
    its 16 adds and 16 relus gone from the plan."""

    def __init__(self, policy=None, cache: KernelCache | None = None, libraries=(),
                 inplace=True, layouts="blocked", block=None, weights="check",
                 fuse=FUSIONS, name="graph"):
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
            fuse = FUSIONS
        unknown = set(fuse or ()) - set(FUSIONS)
        if unknown:
            raise ArgumentError(f"fuse: expected some of {', '.join(FUSIONS)}; got "
                                f"{sorted(unknown)}")
        self.fuse = frozenset(fuse or ())
        self.nodes: list[Node] = []
        self.inputs: dict = {}        # name -> (shape, dtype)
        self.weight_cache = WeightCache(policy, cache, weights)
        self.constants = self.weight_cache.arrays   # name -> array (or a snapshot if frozen)
        self.outputs: list = []
        self._types: dict = {}        # var name -> (shape, dtype) of its latest definition
        self._counts: dict = {}
        self._runners: dict = {}      # input layouts -> Runner
        # input layouts -> (compiled plan function, digest of its calls): a built model's
        # (runtime/graph/native.py); an arena whose calls differ runs them from Python
        self.native_plans: dict = {}
        self._plain_fast = None       # run_arrays' runner and input checks, once looked up
        self._lock = threading.RLock()

    # ---- building -----------------------------------------------------------------------------
    def _fresh(self, base):
        while True:
            n = self._counts.get(base, 0)
            self._counts[base] = n + 1
            name = f"{base}_{n}"
            if name not in self._types:
                return name

    def _changed(self):
        self._runners.clear()
        self._plain_fast = None

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

    def constant(self, name, array, owned=False) -> Tensor:
        """A weight: reordered to the layout its consumer wants once, and kept. Never written.
        ``owned``: the array is the graph's alone (nothing else holds or writes it, as an
        importer's): it is made read-only and, whatever ``weights`` says, neither copied nor
        compared before each run."""
        if name in self._types:
            raise ArgumentError(f"{name!r} is already a variable of this graph")
        array = np.asarray(array)
        dtype_name(array.dtype)
        self.weight_cache.add(name, array, owned=owned)
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
        self.weight_cache.add_prepacked(name, shape, dtype, memories)
        self._types[name] = (shape, dtype)
        self._changed()
        return Tensor(self, name, shape, dtype)

    def set_constant(self, name, array) -> None:
        """Give a constant new values (same shape and dtype): its prepared weights are
        re-reordered before the next run. The way to refresh under ``weights="frozen"``."""
        if name not in self.constants:
            raise ArgumentError(f"{name!r} is not a constant of this graph")
        array = np.asarray(array)
        if (array.shape, dtype_name(array.dtype)) != self._types[name]:
            raise ArgumentError(f"{name}: expected {self._types[name]}; got {array.shape} "
                                f"{array.dtype}")
        if self.weight_cache.leaves_seven_bit(name, array):
            self._changed()   # its convolutions were planned for 7-bit weights: plan again
        self.weight_cache.set(name, array)

    def add_op(self, op, inputs, attrs=None, name=None, outputs=None, n_outputs=1):
        """Append an op (``op`` a key of ops.GRAPH_OPS) and return its output Tensor(s)."""
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

    # quantized values (uint8/int8 standing for ``scale * (q - zero_point)``), with ONNX
    # Runtime's arithmetic (docs/onnxruntime-int8.md)
    def quantize(self, x, scale, zero_point=0, dtype="uint8", name=None, out=None) -> Tensor:
        """float32 -> uint8/int8 as QuantizeLinear: ``x / scale`` (a true division), round
        half to even, ``+ zero_point``, saturate; one scale and zero point per tensor."""
        return self.add_op("quantize", [x], {"scale": float(scale), "zero_point": int(zero_point),
                                             "dtype": dtype_name(dtype)}, name, _outs(out))

    def dequantize(self, x, scale, zero_point=0, name=None, out=None) -> Tensor:
        """uint8/int8 -> float32 as DequantizeLinear: ``float(x - zero_point) * scale``."""
        return self.add_op("dequantize", [x], {"scale": float(scale),
                                               "zero_point": int(zero_point)}, name, _outs(out))

    def quantized_add(self, a, b, scales, zero_points, name=None, out=None) -> Tensor:
        """The sum of the values 8-bit ``a`` and ``b`` stand for, quantized: ``scales`` and
        ``zero_points`` are ``[a, b, result]``'s, the arithmetic QLinearAdd's (two fmas). The
        operands keep their order (swapped, the fmas round differently)."""
        return self.add_op("binary", [a, b], {"algorithm": "add",
                                              "scales": [float(v) for v in scales],
                                              "zero_points": [int(v) for v in zero_points]},
                           name, _outs(out))

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
               algorithm="direct", winograd_tile=None, scale=None, src_zero_point=0,
               scales="channel", dst_scale=1.0, dst_zero_point=0, dst_dtype=None) -> Tensor:
        """2-D convolution, NCHW source, OIHW weights (``groups`` > 1: O x I/groups x H x W).
        ``pad``: symmetric, an int or (h, w), or per side ((top, bottom), (left, right)).
        ``post_ops``: oneDNN's chain
        fused into the kernel, e.g. ``["bias", "relu"]`` or dicts ``{"kind": "eltwise",
        "algorithm": "relu"}``, ``{"kind": "sum", "scale": 1.0, "zero_point": 0}`` (reads
        ``sum``), ``{"kind": "binary", "algorithm": "mul", "operand": t}`` (add, mul, max, min,
        prelu; ``t`` a (1,), (K,) or result-shaped tensor: per tensor, per channel, full). A
        sum may name its own tensor the same way (``"operand": t``), so a chain can hold
        several; ``sum=`` is the tensor of the one sum entry that names none. A ``bias``
        given without a chain is applied first; a ``sum`` tensor has no such default place in
        the chain (before or after an activation differ), so it needs its ``"sum"`` entry.
        ``algorithm``: ``"direct"``, ``"winograd"``
        (3x3, stride 1, fp32: F(m x m, 3x3), ``winograd_tile`` m = 2, 4 (default) or 6; the
        constant weights are transformed once, by the library's ``winograd_weights`` kernel)
        or ``"auto"`` (the cost model of ``blockpad.winograd`` picks, within its error
        bound). A uint8/int8 source with int8 weights takes the kernels' quantization
        attributes, by their names (README, "int8"): ``scale`` (a float32 tensor, (K,) or (1,)
        with ``scales="tensor"``), ``src_zero_point``, ``dst_scale``, ``dst_zero_point``,
        ``dst_dtype``; an int32 ``bias`` is added to the accumulator before the scale."""
        if algorithm not in ("direct", "winograd", "auto"):
            raise ArgumentError(f"conv2d: algorithm must be 'direct', 'winograd' or 'auto'; "
                                f"got {algorithm!r}")
        if winograd_tile not in (None, *WINOGRAD_TILES):
            raise ArgumentError(f"conv2d: winograd_tile must be one of {WINOGRAD_TILES}; got "
                                f"{winograd_tile!r}")
        chain, tensors = self._chain("conv2d", post_ops, bias, sum_tensor=sum)
        quant = self._quant("conv2d", x, scale, chain, bias, src_zero_point=src_zero_point,
                            scales=scales, dst_scale=dst_scale, dst_zero_point=dst_zero_point,
                            dst_dtype=dst_dtype)
        inputs = [x, weights] + ([scale] if quant else []) + tensors
        attrs = {"stride": _pair(stride), "pad": pad_sides(pad), "dilation": _pair(dilation),
                 "groups": int(groups), "post_ops": chain, "bias": bias is not None,
                 "sum": any(p["kind"] == "sum" for p in chain), "algorithm": algorithm,
                 "winograd_tile": winograd_tile, **({"quant": quant} if quant else {})}
        return self.add_op("conv2d", inputs, attrs, name, _outs(out))

    def _quant(self, op, x, scale, chain, bias, **attrs) -> dict | None:
        """The quantization attributes of an integer ``op`` (``attrs``, the kernels' names),
        or None for a floating-point one; an int32 ``bias`` marks its chain entry, which must be
        first (it is added to the int32 accumulator). The graph op checks the types."""
        integer = self._types[self._var(x)][1] in QUANTIZED_DTYPES
        given = [k for k, v in attrs.items() if v != QUANT_DEFAULTS[k]]
        if not integer:
            if scale is not None or given:
                raise ArgumentError(f"{op}: scale= and {', '.join(attrs)} need a uint8/int8 "
                                    f"source; got {self._types[self._var(x)][1]}")
            return None
        if scale is None:
            raise ArgumentError(f"{op}: an integer source needs scale= (float32, (K,) per "
                                f"channel or (1,) with scales='tensor')")
        if bias is not None and self._types[self._var(bias)][1] == "int32":
            if chain[0]["kind"] != "bias":
                raise ArgumentError(f"{op}: an int32 bias is added to the int32 accumulator, "
                                    f"before every other post-op: put 'bias' first in post_ops "
                                    f"(got {[p['kind'] for p in chain]})")
            chain[0] = {**chain[0], "dtype": "int32"}
        return dict(attrs)

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

    def matmul(self, x, weights, bias=None, post_ops=(), name=None, out=None, scale=None,
               src_zero_point=0, scales="channel", dst_scale=1.0, dst_zero_point=0,
               dst_dtype=None, sum=None) -> Tensor:  # noqa: A002 (oneDNN's)
        """``x (M, K) @ weights (K, N)`` (+ ``bias`` (N,)), with a post-op chain as conv2d's
        (per-channel binary operands are (N,)), and conv2d's quantization attributes for a
        uint8/int8 source."""
        chain, tensors = self._chain("matmul", post_ops, bias, sum_tensor=sum)
        quant = self._quant("matmul", x, scale, chain, bias, src_zero_point=src_zero_point,
                            scales=scales, dst_scale=dst_scale, dst_zero_point=dst_zero_point,
                            dst_dtype=dst_dtype)
        inputs = [x, weights] + ([scale] if quant else []) + tensors
        return self.add_op("matmul", inputs, {"post_ops": chain, "bias": bias is not None,
                                              "sum": any(p["kind"] == "sum" for p in chain),
                                              **({"quant": quant} if quant else {})},
                           name, _outs(out))

    def _chain(self, op, post_ops, bias, sum_tensor):
        """A conv2d's or matmul's chain (defaults filled in, a binary entry's ``operand`` the
        shape of the tensor it names) and the tensors it reads, in the kernel's argument order
        (``vocabulary.POST_OP_TENSORS``: bias, sum, sum_1, ..., binary_0, ...)."""
        chain, operands = [], []
        for p in post_ops:
            entry, t = _post_op(p)
            chain.append(entry)
            operands.append(t)
        if bias is not None and not any(p["kind"] == "bias" for p in chain):
            chain.insert(0, {"kind": "bias"})
            operands.insert(0, None)
        if any(p["kind"] == "bias" for p in chain) and bias is None:
            raise ArgumentError(f"{op}: a 'bias' post-op needs the bias tensor")
        unnamed = [i for i, (p, t) in enumerate(zip(chain, operands))
                   if p["kind"] == "sum" and t is None]
        if sum_tensor is not None and not unnamed:
            raise ArgumentError(f"{op}: sum= was given but post_ops has no 'sum' entry (naming "
                                f"no operand of its own), so the tensor would not be added; put "
                                f"'sum' in post_ops where it applies, e.g. post_ops=['sum', "
                                f"'relu']")
        if len(unnamed) > 1:
            raise ArgumentError(f"{op}: sum= is the tensor of one 'sum' entry; post_ops has "
                                f"{len(unnamed)} that name no operand: give the others theirs "
                                f"({{'kind': 'sum', 'operand': t}})")
        if sum_tensor is None and unnamed:
            raise ArgumentError(f"{op}: a 'sum' post-op needs the tensor to add (sum=..., or "
                                f"its own 'operand')")
        if sum_tensor is not None:
            operands[unnamed[0]] = sum_tensor
        by_name = {} if bias is None else {"bias": bias}
        for p, t, name in zip(chain, operands, post_op_tensors(chain)):
            if p["kind"] == "binary":
                shape = self._types[self._var(t)][0]
                p["operand"] = "full" if len(shape) > 1 else "tensor" if shape == (1,) \
                    else "channel"
            if t is not None:
                by_name[name] = t
        if sum(p["kind"] == "sum" for p in chain) > MAX_SUMS or \
                sum(p["kind"] == "binary" for p in chain) > MAX_BINARIES:
            raise ArgumentError(f"{op}: a chain holds at most {MAX_SUMS} sums and "
                                f"{MAX_BINARIES} binary post-ops")
        return chain, [by_name[n] for n in POST_OP_TENSORS if n in by_name]

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

    def narrow_block(self, channels, dtype):
        """8 where a convolution's destination of ``channels`` should take ``nChw8c`` whatever
        its source's block (``blockpad.channel_blocks``: float32 on a core whose FMA units are
        256 bits wide, most of a last block of 16 empty), else None. Not where the Graph's
        ``block`` is set."""
        if self.layouts == "plain" or self.block or dtype_name(dtype) != "float32":
            return None
        return channel_blocks.narrow_block(channels, self.cache.target_name)

    def weight_tag(self, block, groups, depthwise, dtype="float32", src_block=None):
        """The weights' tag beside an ``nChw<block>c`` source: ``OIhw<b>i<b>o`` for ``groups = 1``
        (``OIhw<s>i<b>o`` for a float kernel whose source comes in blocks of ``src_block`` =
        s, its destination's of ``block``); int8 ``OIhw<b/4>i<b>o4i``, so that ``b`` outputs
        x 4 input channels are one register of the dot-product instructions (``vpmaddubsw``,
        ``vpdpbusd``, ``sdot``: with ``OIhw<b>i<b>o`` the kernel falls back to widening
        scalar multiplies, 4-6x slower than float32); bf16 ``OIhw<b/2>i<b>o2i`` where the
        cache's target has ``vdpbf16ps`` (``avx512_bf16``: 2.4x the FMAs on a ResNet 3x3
        layer), else ``OIhw<b>i<b>o``: FMAs of widened bf16 run 0.56x as fast on the pairs
        (avx512: 55 against 97 GFLOP/s); depthwise (groups = C = K) ``Goihw<b>g``, the
        groups blocked as the source's channels are; other grouped ``gOIhw<b>i<b>o`` (each
        group's K/G x C/G padded to whole blocks)."""
        if groups == 1:
            steps = dot_steps(dtype, self.cache.target_features)
            return f"OIhw{block // steps}i{block}o{steps}i" if steps \
                else f"OIhw{src_block or block}i{block}o"
        return f"Goihw{block}g" if depthwise else f"gOIhw{block}i{block}o"

    def plan(self, **inputs) -> Plan:
        """The plan for inputs like these (arrays, Memories or Layouts): the passes' result."""
        return self.runner(**inputs).plan

    def runner(self, **inputs) -> Runner:
        """The plan for inputs like these with the arenas that run it (``run`` uses it; a
        benchmark times its steps through ``Runner.arena``)."""
        return self._runner_for(self._input_layouts(inputs))

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

    def _runner_for(self, layouts) -> Runner:
        with self._lock:
            runner = self._runners.get(layouts)
            if runner is None:
                if not self.outputs:
                    raise ArgumentError(f"{self.name}: no outputs; call graph.output(...)")
                plan = Plan(self, dict(zip(self.inputs, layouts)))
                runner = self._runners[layouts] = Runner(plan, self.weight_cache, self.cache,
                                                         len(self.nodes),
                                                         self.native_plans.get(layouts))
            return runner

    # ---- running ------------------------------------------------------------------------------
    def run_arrays(self, given: dict) -> dict | None:
        """The results as numpy arrays by ``Runner.run_arrays`` (a built model's call), where
        every input is a numpy array of the graph's shape and dtype and a runner for them
        exists; None where ``run`` must. What it checks is looked up once (the inputs' numpy
        dtypes, the runner): each lookup costs microseconds with the interpreter out of cache
        after a network."""
        fast = self._plain_fast
        if fast is None:
            runner = self._runners.get(tuple(plain(s, d) for s, d in self.inputs.values()))
            if runner is None:
                return None
            fast = self._plain_fast = (runner, [(name, shape, np.dtype(numpy_dtype(dtype)))
                                                for name, (shape, dtype) in self.inputs.items()])
        runner, inputs = fast
        if len(given) != len(inputs):
            return None
        for name, shape, dtype in inputs:
            v = given.get(name)
            if type(v) is not np.ndarray or v.shape != shape or v.dtype is not dtype:
                return None
        return runner.run_arrays(given)

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
        runner = self._runner_for(self._input_layouts(given))
        return runner.run(given, before_cache, time.perf_counter() - start, frozenset(clean),
                        stream)

    def __call__(self, inputs=None, **kw):
        """Run and return the results as numpy arrays (one array for one output)."""
        res = self.run(inputs, **kw).numpy()
        return next(iter(res.values())) if len(res) == 1 else res

    def __repr__(self):
        return (f"<blockpad Graph {self.name}: {len(self.nodes)} ops, inputs "
                f"{list(self.inputs)}, outputs {self.outputs}, policy {self.policy}>")


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
    """``(entry, operand)``: a post-op as the kernels spell it, with its defaults, and the
    tensor it names under ``operand`` (a sum's or a binary entry's; None if it names none)."""
    if isinstance(p, str):
        if p in ELTWISE:
            p = {"kind": "eltwise", "algorithm": p}
        elif p in ("bias", "sum"):
            p = {"kind": p}
        else:
            raise ArgumentError(f"post-op {p!r}: expected bias, sum or an eltwise algorithm")
    if not isinstance(p, dict) or p.get("kind") not in POST_OP_DEFAULTS:
        raise ArgumentError(f"post-op {p!r}: kind must be one of {', '.join(POST_OP_DEFAULTS)}")
    p = dict(p)
    operand = p.pop("operand", None) if p["kind"] in ("sum", "binary", QUANTIZED_ADD) else None
    if p["kind"] == QUANTIZED_ADD:
        if operand is None:
            raise ArgumentError(f"post-op {p!r}: a quantized add needs its 8-bit tensor "
                                f"(\"operand\": a result-shaped Tensor)")
        p = quantized_add_entry(p)
    if p["kind"] == "binary":
        if operand is None:
            raise ArgumentError(f"post-op {p!r}: a binary post-op needs its second tensor "
                                f"(\"operand\": a (1,), (channels,) or result-shaped Tensor)")
        if p.get("algorithm", "add") not in BINARY_POST_OPS:
            raise ArgumentError(f"post-op {p!r}: algorithm must be one of "
                                f"{', '.join(BINARY_POST_OPS)}")
    p = with_defaults(p)
    for k in ("alpha", "beta", "scale"):
        if k in p:
            p[k] = float(p[k])
    if "zero_point" in p:
        if not isinstance(p["zero_point"], (int, np.integer)) or isinstance(p["zero_point"], bool):
            raise ArgumentError(f"post-op {p!r}: zero_point must be an integer")
        p["zero_point"] = int(p["zero_point"])
    return p, operand


