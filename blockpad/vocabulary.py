"""The words the code generator, the schedules and the runtime must spell alike.

The build writes these names into kernels and manifests and the runtime reads them back; the
schedule rules find the generator's stages by them. Each is defined here once, in pure Python
(no TVM), so that every layer may import it without importing another layer
(docs/architecture.md, "Layers").
"""

from __future__ import annotations

from types import MappingProxyType

# ---- padding policies (docs/padding-contract.md) ------------------------------------------

#: The six zero-padding policies. The order is the random checker's draw order (``blockpad check
#: --seed`` reproduces a case by it) and the order reports list them in.
POLICIES = ("dst_fused", "dst_stage", "src", "on_handle", "tracked", "user")
#: Policies whose kernels write their destination's padding themselves (in the kernel, or in its
#: stage kernel): they need no padding state, the only ones a GPU library takes.
KERNEL_ZEROS = ("dst_fused", "dst_stage")
#: Policies whose zero-pads the runtime decides from a memory's handle or state (at
#: ``set_data_handle``, lazily by ``clean``/``dirty``, by the user's word): a raw call, with no
#: Memory around it (aarch64 code under qemu), honours only the others.
MEMORY_STATE = ("on_handle", "tracked", "user")
#: Policies after whose kernels a destination's padding is zero: written by the kernel, or zeroed
#: when the memory got its handle and preserved by every kernel.
CLEAN_AFTER_CALL = KERNEL_ZEROS + ("on_handle", "user")
#: What a library, a Graph or the JIT uses when nobody names a policy.
DEFAULT_POLICY = "dst_fused"

# ---- post-ops ----------------------------------------------------------------------------------

#: An eltwise op's (and an eltwise post-op's) parameters when a spec leaves them out.
ELTWISE_DEFAULTS = MappingProxyType({"algorithm": "relu", "alpha": 0.0, "beta": 0.0})
#: Each post-op kind and the defaults of its parameters: what a chain means when a field is
#: left out. Two spellings of one chain must build (and cache) as one kernel.
#: ``sum``: v += scale * (sum[idx] - zero_point), its tensor in ``dt`` (None: the
#: destination's); ``binary``: v = algorithm(v, operand), the operand a (1,) tensor, a (K,)
#: per-channel one or a destination-shaped one (oneDNN's binary post-op and its broadcast masks);
#: ``quantized_add`` (integer kernels with an 8-bit destination, last in a chain): the value,
#: rounded and saturated to the destination's type, plus an 8-bit ``addend`` tensor, summed as
#: ONNX Runtime's QLinearAdd sums them; ``scales`` and ``zero_points`` are [value, addend,
#: result]'s, ``addend_first``: the addend is QLinearAdd's first operand (its fmas round in
#: operand order), ``dt``: the addend's type (None: the destination's).
POST_OP_DEFAULTS = MappingProxyType({
    "bias": MappingProxyType({}),
    "eltwise": ELTWISE_DEFAULTS,
    "sum": MappingProxyType({"scale": 1.0, "zero_point": 0, "dt": None}),
    "binary": MappingProxyType({"algorithm": "add", "operand": "full"}),
    "quantized_add": MappingProxyType({"scales": (1.0, 1.0, 1.0), "zero_points": (0, 0, 0),
                                       "addend_first": False, "dt": None}),
})
QUANTIZED_ADD = "quantized_add"
#: A binary post-op's algorithms (prelu: v >= 0 ? v : v * operand) and its operand's shapes.
BINARY_POST_OPS = ("add", "mul", "max", "min", "prelu")
BINARY_OPERANDS = ("tensor", "channel", "full")
#: How many sums and binary post-ops one chain may hold: each reads a tensor argument of its own.
MAX_SUMS, MAX_BINARIES = 4, 8

# ---- quantization attributes of integer conv2d and matmul (codegen/ops/quant.py) ---------------

#: The 8-bit types of quantized values: integer kernels' sources and 8-bit destinations,
#: quantize's outputs, a quantized add's operands, a quantized model's activations.
QUANTIZED_DTYPES = ("uint8", "int8")
#: Each attribute and its value when a spec, a Graph call or a manifest leaves it out: no zero
#: points, a per-channel weight scale, no destination scale, the destination type the op has
#: without them (None: float32 for uint8/int8 sources), and full-range int8 weights.
QUANT_DEFAULTS = MappingProxyType({"src_zero_point": 0, "scales": "channel", "dst_scale": 1.0,
                                   "dst_zero_point": 0, "dst_dtype": None, "weight_bits": 8})
#: ``weight_bits``: 8 (any int8 weight) or 7 (every weight in [-64, 64], as ONNX Runtime's
#: ``reduce_range`` quantization writes them: one ``vpmaddubsw`` per step cannot saturate).
WEIGHT_BITS = (8, 7)
#: The weights a ``weight_bits = 7`` kernel takes: |w| <= 64, so |u8 w + u8 w| <= 32640 < 2**15.
SEVEN_BIT_RANGE = (-64, 64)
#: ``scales``: one weight scale per output channel (a (K,) ``scale``) or per tensor (a (1,) one).
SCALES = ("channel", "tensor")
#: The destination types of an integer kernel; the integer ones are rounded half to even and
#: saturated.
QUANT_DST_DTYPES = ("float32", "int32", *QUANTIZED_DTYPES)
#: the dtypes each pooling algorithm takes: the max pools 8-bit integers too (exact for a
#: quantized model's DequantizeLinear -> MaxPool -> QuantizeLinear); the average stays fp32
POOL_DTYPES = {"max": ("float32", *QUANTIZED_DTYPES), "avg": ("float32",)}

# ---- stage names: the TE stages (TIR blocks) the generator makes and the rules look up --------

ACC = "acc"     #: the reduction of a convolution, matmul or pooling, before its epilogue
DST = "dst"     #: the stage that writes the destination (epilogue, cast, padding store)
#: softmax's row statistics and exponentials, in the order they are computed before ``DST``
MAX, EXP, SUM, NORM = "max", "exp", "sum", "norm"
SOFTMAX_STAGES = (MAX, EXP, SUM, NORM)
#: the fused inverted residual's inner stages, in order before ``ACC`` (the 1x1 projection): the
#: 1x1 expansion's reduction, its bias and activation over the depthwise window's zero halo, the
#: depthwise reduction, its bias and activation
EXPAND, EXPANDED, DEPTHWISE, DEPTHWISE_OUT = "expand", "expanded", "depthwise", "depthwise_out"
INVERTED_RESIDUAL_STAGES = (EXPAND, EXPANDED, DEPTHWISE, DEPTHWISE_OUT)
#: an integer convolution's source zero-point compensation (codegen/ops/quant.py): the weights'
#: sums per output channel and tap, and their table per border class (a matmul's: its sums)
WEIGHT_SUMS, ZP_COMP = "zp_wsum", "zp_comp"
#: a register tile's accumulators kept for their epilogue, which runs beside the next tile's
#: reduction (schedules/interleave.py): the copy's block and its scratch buffer
ACC_PREV = "acc_prev"

# ---- attributes of generated functions -----------------------------------------------------

#: The PrimFunc attribute naming the op a kernel computes: how a schedule rule recognises its ops.
OP_ATTR = "blockpad.op"
#: The PrimFunc attribute of an integer kernel whose weights are promised to fit 7 bits (the
#: ``weight_bits`` attribute): the schedule rules that may then skip the saturation care.
WEIGHT_BITS_ATTR = "blockpad.weight_bits"
#: The PrimFunc attribute of a kernel that reads its sources' padding as garbage (its padding
#: plan's ``reads`` is ``masked``): a schedule may not pull that padding into a floating sum
#: (0 x NaN is NaN), as ``dot_rewrites.pad_dot`` does for a reduction of odd length. Set only
#: where it holds, so that other kernels' structural hashes (their tuning records) stay.
MASKED_READS_ATTR = "blockpad.masked_reads"

#: The float32 functions every CPU schedule writes as vector polynomials
#: (``schedules/vector_math``), and the fewest times one of those reads its argument (sigmoid,
#: through fast_exp: 18; exp 109, tanh 19, erf 21): a post-op chain binds a value it passes to
#: one once (``codegen/ops/postops.Chain``) rather than have it copied that often.
POLYNOMIALS = ("tirx.exp", "tirx.erf", "tirx.tanh", "tirx.sigmoid")
POLYNOMIAL_READS = 18


def with_defaults(post_op) -> dict:
    """A post-op (a mapping with ``kind``) with its kind's defaults filled in where it leaves
    them out; an unknown kind gets none (its caller rejects it)."""
    return {**POST_OP_DEFAULTS.get(post_op.get("kind"), {}), **post_op}


def quantized_add_entry(post_op) -> dict:
    """A ``quantized_add`` post-op with its defaults and its parameters as plain floats and
    ints in lists: every spelling of one chain (tuples, numpy scalars) builds and caches as
    one kernel."""
    p = with_defaults({**post_op, "kind": QUANTIZED_ADD})
    return {**p, "scales": [float(v) for v in p["scales"]],
            "zero_points": [int(v) for v in p["zero_points"]]}


def qlinear_order(addend_first: bool) -> tuple:
    """The permutation between a ``quantized_add`` entry's [value, addend, result] parameters
    and QLinearAdd's [first operand, second operand, result]: the addend is QLinearAdd's
    first operand if ``addend_first`` (its fmas round in operand order). Its own inverse."""
    return (1, 0, 2) if addend_first else (0, 1, 2)


def qlinear_operands(post_op, value, addend) -> tuple:
    """A ``quantized_add`` entry's operation as QLinearAdd states it: ``(first, second)``
    operands and their [first, second, result] scales and zero points."""
    p = with_defaults(post_op)
    order = qlinear_order(p["addend_first"])
    first, second = ((addend, value) if p["addend_first"] else (value, addend))
    return (first, second), [p["scales"][k] for k in order], [p["zero_points"][k] for k in order]


def post_op_tensors(chain) -> list:
    """The tensor argument each entry of a post-op chain reads, in chain order (None for an
    eltwise): ``bias``; ``sum``, ``sum_1``, ``sum_2``, ... (the first sum keeps the name a
    chain's only sum always had); ``binary_0``, ``binary_1``, ...; ``addend`` (a quantized
    add's). Kernels, manifests and the Graph name the tensors so."""
    seen: dict = {}
    out = []
    for p in chain:
        kind = p.get("kind")
        i = seen[kind] = seen.get(kind, -1) + 1
        out.append({"bias": "bias", "sum": "sum" if i == 0 else f"sum_{i}",
                    "binary": f"binary_{i}", QUANTIZED_ADD: "addend"}.get(kind))
    return out


#: Every name ``post_op_tensors`` can give, in the order kernels take them as arguments.
POST_OP_TENSORS = ("bias", "sum", *(f"sum_{i}" for i in range(1, MAX_SUMS)),
                   *(f"binary_{i}" for i in range(MAX_BINARIES)), "addend")


#: The source an op built with ``inplace = true`` overwrites with its result (seed 003's
#: in-place ops), each result element computed from reads made before it is written; a
#: convolution's or matmul's is its first sum post-op's tensor, which oneDNN's sum post-op
#: accumulates into in the destination's own memory.
INPLACE_SOURCES = MappingProxyType({"eltwise": "src", "binary": "src0", "softmax": "src",
                                    "conv2d": "sum", "matmul": "sum"})
