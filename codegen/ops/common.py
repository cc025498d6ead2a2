"""What every operator shares: reading sources by logical index, writing the destination under a
padding plan, and deriving from the op's own TE whether its arithmetic keeps padding zero.

An operator is written once, over logical indices (oneDNN's semantics):

    def relu(x):                              # x is a Source
        return lambda n, c, h, w: tirx.max(x(n, c, h, w), 0)

and ``materialize`` turns that into a kernel for any source and destination layouts: the index
maps place every read and write, the plan decides what happens in the padding.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import tvm
import tvm_ffi
from tvm import s_tir, te, tirx
from tvm.sym.analyzer import Analyzer

from blockpad.errors import SpecError
from blockpad.layout import Layout
from blockpad.vocabulary import ACC, DST, MASKED_READS_ATTR, WEIGHT_BITS_ATTR

from ..kernel import Arg, KernelDef, finish
from ..policy import PaddingPlan, plan


class Source:
    """A kernel input read by logical index.

    A read may lie outside the logical tensor: a convolution window over the border, or a
    destination padding element computed under the ``full`` plan. Such reads return ``pad`` (the
    value the consumer needs there: 0 for a sum, -inf for a max). Whether that costs a bounds
    check in the generated code depends on the layout and the mode:

    * ``trusted``: padding and halo that exist in the buffer are read as they are (they are
      clean: zero), so a source laid out with a halo is read with no bounds check at all
      (Arm Compute Library style pre-padded input); only reads beyond the buffer, or into padding
      when ``pad`` is not zero, are guarded.
    * ``masked``: every read that can land on padding is guarded (the ``src`` policy: source
      padding may hold garbage).

    ``trusts_padding`` records that a read was left unguarded on padding or halo, so that
    ``reads_padding`` can derive which kernels need their sources clean; ``leaves_buffer``
    that a guarded read may fall outside the buffer (see ``materialize``).
    """

    def __init__(self, name: str, layout: Layout, mode: str = "trusted", storage: str | None = None):
        self.name, self.layout, self.mode = name, layout, mode
        self.storage = storage or layout.dtype
        self.tensor = te.placeholder(layout.physical_shape, self.storage, name)
        self.bounds: dict = {}   # var -> (min, max), filled by materialize for range analysis
        self.trusts_padding = self.leaves_buffer = False

    @property
    def dtype(self):
        return self.storage

    def __call__(self, *idx, pad=0):
        lay = self.layout
        guards, blends = [], []
        for d, x in enumerate(idx):
            lo, hi = _bounds(x, self.bounds)
            before, after = lay.paddings[d]
            in_buffer = lo >= -before and hi < lay.padded_shape[d] + after
            in_logical = lo >= 0 and hi < lay.shape[d]
            if in_logical:
                continue
            if self.mode == "trusted" and in_buffer and _is_zero_const(pad):
                self.trusts_padding = True
                continue   # clean padding or halo in the buffer reads as the pad value itself
            if lo >= 0 and hi < lay.padded_shape[d] and lay.block_of(d) > 1 \
                    and self.dtype.startswith("float"):
                # only a block's padding: the load stays in the buffer, so a Select (a blend)
                # masks it; an if_then_else whose condition differs between a vector's lanes
                # (the channels of a block) makes TVM's vectoriser emit scalar code: the `src`
                # policy's 40 -> 41 convolutions ran 15-18x slower than dst_fused's (AVX-512,
                # the weights' output-channel padding guarded). Integer sources keep the
                # if_then_else the dot-product rules recognise (schedules/dot_rewrites.py).
                blends.append(x < lay.shape[d])
                continue
            if lo < 0:
                guards.append(x >= 0)
            if hi >= lay.shape[d]:
                guards.append(x < lay.shape[d])
            self.leaves_buffer |= not in_buffer
        load = self.tensor(*lay.to_physical(idx))
        fill = tirx.const(pad, self.dtype)
        if blends:
            load = tirx.Select(tirx.all(*blends), load, fill)
        if not guards:
            return load
        return tirx.if_then_else(tirx.all(*guards), load, fill)


@dataclass
class OpDef:
    """An operator instantiated for concrete layouts, ready to be materialised.

    ``value(*idx)`` gives the destination element at logical ``idx``; when ``reduce`` is true it
    returns a ``te.sum``/``te.max`` (TE wants reductions at the top of a stage) and ``epilogue``
    (post-ops: bias, eltwise, sum) is applied to the reduced value in a second, fused stage.
    """

    op: str
    sources: Sequence[Source]
    value: Callable
    reduce: bool = False
    epilogue: Callable | None = None
    params: dict | None = None
    axes: Sequence = ()         # the te.reduce_axis the value uses (their ranges bound reads)
    extra_args: Sequence = ()   # (te.Tensor, Arg) pairs that are not layouts' sources (scales)


def plan_for(policy: str, opdef: OpDef, dst: Layout,
             reduces_over_padding: bool = False) -> PaddingPlan:
    """The policy's plan for ``opdef`` (declared with ``trusted`` sources), with what the plan
    depends on derived from its TE: ``propagates_zero`` and ``reads_padding``."""
    return plan(policy, propagates_zero=propagates_zero(opdef, dst),
                reads_padding=reads_padding(opdef, dst),
                reduces_over_padding=reduces_over_padding)


def reads_padding(opdef: OpDef, dst: Layout) -> bool:
    """Derived from the TE: does a logical destination element read a source's padding or
    halo without a guard (a reduction over whole padded blocks, a convolution or an average
    window over a pre-padded halo, a staged copy of such a halo)? Then its sources must be
    clean: a kernel that trusts padding must never be recorded as accepting dirty sources.
    Conservative: a read made while declaring a stage of the kernel counts whatever it
    computes."""
    idx = [tirx.Var(f"i{d}", "int32") for d in range(dst.rank)]
    bounds = {v: (0, n - 1) for v, n in zip(idx, dst.shape)}
    bounds.update(_axis_bounds(opdef))
    for s in opdef.sources:
        s.bounds = bounds
    val = opdef.value(*idx)
    if opdef.epilogue is not None:
        opdef.epilogue(tirx.Var("acc", dtype_of(val)), idx)
    return any(s.trusts_padding for s in opdef.sources)


def propagates_zero(opdef: OpDef, dst: Layout) -> bool:
    """Derived from the TE: with zero source padding, is the op's value zero at every
    destination padding element? Each padded region of the destination is checked symbolically:
    the logical index along the padded dim is constrained to the padding, sources are read with
    their padding as zero, and TVM's simplifier must reduce the value to the constant 0.
    relu(0), a*0 and a bias-free convolution against zero weight padding pass; sigmoid(0),
    exp(0), a*x+b with b != 0 and a convolution with bias do not."""
    masked = [_as_masked(s) for s in opdef.sources]
    opdef_masked = OpDef(**{**opdef.__dict__, "sources": masked})
    idx = [tirx.Var(f"i{d}", "int32") for d in range(dst.rank)]
    for d in range(dst.rank):
        before, after = dst.paddings[d]
        regions = []
        if dst.padded_shape[d] != dst.shape[d] or after:
            regions.append((dst.shape[d], dst.padded_shape[d] + after - 1))
        if before:
            regions.append((-before, -1))
        for lo, hi in regions:
            bounds = {v: (0, n - 1) for v, n in zip(idx, dst.shape)}
            bounds[idx[d]] = (lo, hi)
            if not _value_is_zero(opdef_masked, idx, bounds):
                return False
    return True


def materialize(opdef: OpDef, dst: Layout, plan: PaddingPlan, name: str,
                out_storage: str | None = None) -> list[KernelDef]:
    """The kernel computing ``opdef`` into ``dst`` as ``plan`` says, plus, under ``dst_stage``,
    the separate zero-pad kernel the runtime runs after it.

    A reduction takes two stages, ``acc`` (the reduction, in the accumulator type) and ``dst``
    (epilogue, cast and padding store); schedules fuse the second into the first's tiles."""
    out_storage = out_storage or dst.dtype
    bounds = _axis_bounds(opdef)
    for s in opdef.sources:
        s.bounds = bounds

    def logical(p):
        bounds.update({v: (0, n - 1) for v, n in zip(p, dst.physical_shape)})
        return dst.to_logical(p)

    stages = []
    if opdef.reduce:
        acc = te.compute(dst.physical_shape, lambda *p: opdef.value(*logical(p)), name=ACC)
        stages.append(acc)

        def value(p):
            return acc(*p)
    else:
        def value(p):
            return opdef.value(*logical(p))

    def finished(p):
        for s in opdef.sources:
            s.leaves_buffer = False
        v = value(p)
        if opdef.epilogue is not None:
            v = opdef.epilogue(v, logical(p))
        v = _cast(v, out_storage)
        if plan.dst_writes == "select" and dst.has_padding:
            # TVM simplifies a Select's branches under its condition, which drops the guards of
            # reads that would leave their buffer at padding elements, and a Select evaluates
            # both branches: a vector load past a buffer (undefined behaviour LLVM exploits on
            # a stage's allocation). if_then_else evaluates only the branch taken.
            select = tirx.if_then_else if any(s.leaves_buffer for s in opdef.sources) \
                else tirx.Select
            v = select(dst.is_padding(p), tirx.const(0, out_storage), v)
        return v

    out = te.compute(dst.physical_shape, lambda *p: finished(p), name=DST)
    extra_tensors = [t for t, _ in opdef.extra_args]
    func = te.create_prim_func([*[s.tensor for s in opdef.sources], *extra_tensors, out])
    if plan.dst_writes == "valid" and dst.has_padding:
        func = _predicate_valid(func, dst, {DST})   # acc is scratch: predicating it breaks
        # the reduction-block form schedules rely on
    args = [Arg(s.name, s.layout, "in", s.storage) for s in opdef.sources]
    args += [a for _, a in opdef.extra_args]
    args.append(Arg("dst", dst, "out", out_storage))
    kernel = finish(func, name, opdef.op, args)
    kernel.params = dict(opdef.params or {})
    if kernel.params.get("weight_bits", 8) != 8:   # the promise the schedule rules may use
        kernel.func = kernel.func.with_attr(WEIGHT_BITS_ATTR, kernel.params["weight_bits"])
    if plan.reads == "masked":   # what the schedule rules may not assume of source padding
        kernel.func = kernel.func.with_attr(MASKED_READS_ATTR, True)
    kernel.contract = plan.contract()
    kernels = [kernel]
    if plan.dst_stage and dst.has_padding:
        from .reorder import zero_pad

        kernels.append(zero_pad(dst, f"{name}__zero_pad_dst"))
        kernel.contract["dst_stage"] = kernels[-1].name
    else:
        kernel.contract["dst_stage"] = None
    return kernels


def nan_max(a, b):
    """``max(a, b)`` that returns a NaN from either side, as PyTorch and oneDNN do (TVM's
    ``max`` is ``a > b ? a : b``, which drops a NaN ``a``). With a constant ``b`` (relu, clip)
    ``b > a ? b : a``, which keeps a NaN ``a``: one ``maxps`` on x86; else (``a`` a reduction's
    accumulator) ``a > b ? a : b``, which keeps a NaN ``b``, and a NaN test of ``a``."""
    if isinstance(b, tirx.FloatImm):
        return tirx.Select(b > a, b, a)
    return tirx.Select(is_nan(a), a, tirx.Select(a > b, a, b))


def nan_min(a, b):
    """``min(a, b)`` that returns a NaN from either side (see ``nan_max``)."""
    if isinstance(b, tirx.FloatImm):
        return tirx.Select(b < a, b, a)
    return tirx.Select(is_nan(a), a, tirx.Select(a < b, a, b))


def is_nan(x):
    """``x`` is a NaN, as an integer test of its bits (exponent all ones, mantissa not zero):
    TVM's simplifier folds ``x != x`` to false, and ``tirx.isnan`` scalarises a vector loop.
    An integer is never a NaN (an integer ``nan_max`` is a plain max)."""
    dtype = dtype_of(x)
    mantissa = {"float16": 10, "bfloat16": 7, "float32": 23, "float64": 52}.get(dtype)
    if mantissa is None:
        return tirx.const(False, "bool")
    bits = tvm_ffi.dtype(dtype).bits
    magnitude = tirx.reinterpret(f"int{bits}", x) & tirx.const((1 << bits - 1) - 1, f"int{bits}")
    return magnitude > tirx.const(((1 << bits - 1 - mantissa) - 1) << mantissa, f"int{bits}")


NAN_MAX = te.comm_reducer(nan_max, lambda t: tirx.min_value(t), name="nan_max")
"""A max reduction that a NaN anywhere in the window makes NaN (pooling, like PyTorch's)."""


# the magic number 1.5 * 2**(mantissa bits), its bits, the integer type of that size, and the
# largest |x| it rounds: x + M lies where float spacing is 1, so its low bits count x's units
_ROUNDING_MAGIC = {"float32": (1.5 * 2 ** 23, 0x4B400000, "int32", 2 ** 22),
                   "float64": (1.5 * 2 ** 52, 0x4338000000000000, "int64", 2 ** 51)}


def round_clamped_float(v, lo: float, hi: float, offset: int = 0):
    """``round_clamped(v, lo, hi) + offset`` as the float32 that holds it exactly (|result| below
    2**23), for an epilogue that goes on in float32: ``(x + M) - (M - offset)`` is exact, since
    ``x + M`` holds the rounded ``x`` exactly and the difference is a float32 integer. One
    subtract instead of the integer subtract and ``vcvtdq2ps`` back. The sum goes through its
    bits (``reinterpret``) so that TVM's simplifier, which takes float arithmetic as exact,
    cannot fold it back into ``x``."""
    if dtype_of(v) != "float32" or max(abs(lo), abs(hi)) + abs(offset) > 2 ** 22:
        raise ValueError(f"round_clamped_float: float32 within 2**22 only; got {dtype_of(v)} "
                         f"in [{lo}, {hi}] + {offset}")
    magic = _ROUNDING_MAGIC["float32"][0]
    x = tirx.min(tirx.max(v, tirx.const(lo, "float32")), tirx.const(hi, "float32"))
    bits = tirx.reinterpret("int32", x + tirx.const(magic, "float32"))
    return tirx.reinterpret("float32", bits) - tirx.const(magic - offset, "float32")


def round_clamped(v, lo: float, hi: float):
    """``v`` saturated to ``[lo, hi]`` (integers) and rounded half to even, as an int32: the
    integer results' conversion, in vector instructions. Where the bounds allow, ``bits(x + M)
    - bits(M)`` with ``M = 1.5 * 2**23`` (float32; 2**52 for float64) is round-half-even of
    ``x`` for |x| <= 2**22: one add and one integer subtract. A float32 reaching further (an
    int32 result) rounds its magnitude below 2**23 the same way (``bits(|x| + 2**23) -
    bits(2**23)``) and takes the sign back; from 2**23 on a float32 is an integer already.
    Never ``nearbyint``, which TVM's vectoriser scalarises in an unrolled register tile's
    epilogue (a uint8 1x1 convolution ran its requantization in scalar ``vroundss``: 44 GOP/s
    where the float32 result took 92); never ``(x + M) - M``, which TVM's simplifier, treating
    float arithmetic as exact, folds into ``x``. Clamping first and rounding after equals the
    other order: the bounds are integers."""
    dtype = dtype_of(v)
    x = tirx.min(tirx.max(v, tirx.const(lo, dtype)), tirx.const(hi, dtype))
    magic, bits, itype, reach = _ROUNDING_MAGIC[dtype]
    if max(abs(lo), abs(hi)) <= reach:
        n = tirx.reinterpret(itype, x + tirx.const(magic, dtype)) - tirx.const(bits, itype)
        return n if itype == "int32" else n.astype("int32")
    if dtype != "float32":
        raise ValueError(f"round_clamped: no rounding for {dtype} beyond {reach}")
    two23 = tirx.const(2.0 ** 23, "float32")
    a = tirx.abs(x)
    m = tirx.reinterpret("int32", a + two23) - tirx.const(0x4B000000, "int32")
    small = tirx.Select(x < tirx.const(0.0, "float32"), -m, m)
    return tirx.Select(a < two23, small, x.astype("int32"))


#: A kernel of several taps reduces over whole channel blocks where rounding its channels up
#: to ``step`` instead saves less than 1 / WHOLE_BLOCKS_SAVING of them (``reduced_channels``)
WHOLE_BLOCKS_SAVING = 20


def reduced_channels(c: int, src: Layout, weights: Layout, step: int | None,
                     taps: int = 1) -> int:
    """The channels a convolution's reduction runs over, of ``c`` logical ones: the channels
    both the source and the weights pad to (whole blocks, zeros there), at most ``c`` rounded
    up to ``step`` (None: whole blocks). Floating-point direct convolutions take ``step`` 1,
    the last block's channels a tail their schedule peels off (``register_tiled``'s
    ``_block_steps``); the inverted residual's expansion takes 8 (its schedule has no tail).
    Measured on a Zen 4 (avx512, 1 thread, one kernel alone, medians of 200 calls, us, over
    the logical channels / rounded up to 8 / whole blocks): 1x1 41 -> 213 at 56x56 620 / 722 /
    708, 3x3 stride 2 101 -> 90 at 56x56 1506 / 1530 / 1608, 166 -> 175 at 28x28 1068 / 1096 /
    1110; the channel-pruned ResNet-50 with every 1x1 over its logical channels 0.991x (whole
    inferences alternating) of the build that rounded them up to 8, 0.992x of one that took
    whole blocks where they add under 5%. Rounding up to 8 first paid on AVX2 (24 channels on
    ``nChw16c`` multiplied 8 zeros a pixel: a 1x1 24 -> 144 at 56x56 0.395 -> 0.312 ms).
    But a kernel of several ``taps`` takes whole blocks where they add under 5%: its panel's
    weights may overflow L2, and its reduction passes (``chunk_plan``) take whole blocks
    (the pruned ResNet-50's 3x3 450 -> 334 stride 2 at 14x14: 1.454 -> 1.282 ms in the network
    over 464 channels instead of 456). Integer and bf16 kernels keep whole blocks: their dot
    products take 4 or 2 channels a step from packed weights."""
    whole = min(src.padded_shape[1], weights.padded_shape[1])
    if step is None:
        return whole
    stepped = -(-c // step) * step
    if taps > 1 and (whole - stepped) * WHOLE_BLOCKS_SAVING < stepped:
        return whole
    return min(whole, stepped)


def int_pair(op: str, value, what: str, least: int) -> tuple:
    """A spec's ``kernel``/``stride``/``pad``/``dilation``: one integer or a pair, each >= least."""
    pair = (value, value) if isinstance(value, int) else tuple(value)
    if len(pair) != 2 or not all(isinstance(v, int) and v >= least for v in pair):
        raise SpecError(f"{op}: {what} must be an integer >= {least} or a pair of them; "
                        f"got {value!r}")
    return pair


# ---- helpers ------------------------------------------------------------------------------

def _as_masked(s: Source) -> Source:
    m = Source.__new__(Source)
    m.__dict__.update(s.__dict__)
    m.mode = "masked"
    return m


def _value_is_zero(opdef: OpDef, idx, bounds) -> bool:
    bounds = {**bounds, **_axis_bounds(opdef)}
    for s in opdef.sources:
        s.bounds = bounds
    ana = Analyzer()
    for v, (lo, hi) in bounds.items():
        ana.bind(v, tvm.ir.Range(lo, hi + 1))
    val = opdef.value(*idx)
    if opdef.reduce:
        zero = _reduce_is_zero(val, ana)
        if opdef.epilogue is None:
            return zero
        acc = tirx.const(0, dtype_of(val)) if zero else tirx.Var("acc", dtype_of(val))
        val = opdef.epilogue(acc, idx)
    elif opdef.epilogue is not None:   # materialize applies it to a plain value too
        val = opdef.epilogue(val, idx)
    return _is_zero_const(_simplify(ana, val))


def _axis_bounds(opdef: OpDef) -> dict:
    return {ax.var: (int(ax.dom.min), int(ax.dom.min + ax.dom.extent) - 1) for ax in opdef.axes}


def _reduce_is_zero(red, ana: Analyzer) -> bool:
    if not isinstance(red, tirx.Reduce):
        return _is_zero_const(_simplify(ana, red))
    identity = red.combiner.identity_element
    if not all(_is_zero_const(i) for i in identity):
        return False            # a max over padding is not zero
    for axis in red.axis:
        ana.bind(axis.var, axis.dom)
    return all(_is_zero_const(_simplify(ana, s)) for s in red.source)


def _simplify(ana: Analyzer, expr):
    """``ana.simplify``, also through ``reinterpret`` of an all-zero bit pattern (bf16 sources
    are read as their uint16 bits), which the simplifier leaves alone: zero bits are +0.0."""
    def fold(call):
        if getattr(call.op, "name", "") == "tirx.reinterpret" and _is_zero_const(call.args[0]):
            return tirx.const(0, dtype_of(call))
        return call

    try:
        expr = ana.simplify(expr)
    except TypeError:   # TVM cannot hash the te.ComputeOp of a stage read inside a comparison
        expr = ana.simplify(tvm_ffi.structural_map(expr, (tvm.ir.expr.Call, _opaque_stage_read)))
    return ana.simplify(tvm_ffi.structural_map(expr, (tvm.ir.expr.Call, fold)))


def _opaque_stage_read(call):
    """A read of a stage (``te.tensor_load``) as an unknown value of its type: what the
    simplifier can know of it there anyway."""
    if getattr(call.op, "name", "") == "te.tensor_load":
        return tirx.Var("stage_read", dtype_of(call))
    return call


def _is_zero_const(e) -> bool:
    if isinstance(e, (int, float)):
        return e == 0
    return isinstance(e, (tirx.IntImm, tirx.FloatImm)) and e.value == 0


def _bounds(x, known: dict):
    """Integer bounds of an index expression over the ranges of the loop and reduce vars."""
    if isinstance(x, int):
        return x, x
    ana = Analyzer()
    for v, (lo, hi) in known.items():
        ana.bind(v, tvm.ir.Range(lo, hi + 1))
    b = ana.const_int_bound(x)
    return b.min_value, b.max_value


def dtype_of(expr) -> str:
    """Element type of a TVM expression (0.27 keeps it on the expression's type)."""
    return str(expr.ty.dtype)


def _cast(value, dtype):
    if dtype is None or dtype_of(value) == dtype:
        return value
    return value.astype(dtype)


def _predicate_valid(func, dst: Layout, blocks: set):
    """Restrict the destination stages to logical elements: their block realizes get the
    predicate ``not is_padding`` over the loop values, so padding is never written."""
    def add(realize):
        if realize.block.name_hint not in blocks:
            return realize
        valid = tirx.Not(dst.is_padding(list(realize.iter_values)))
        pred = valid if _is_true(realize.predicate) else tirx.And(realize.predicate, valid)
        return s_tir.SBlockRealize(realize.iter_values, pred, realize.block)

    return tvm_ffi.structural_map(func, (s_tir.SBlockRealize, add))


def _is_true(e):
    return isinstance(e, tirx.IntImm) and e.value == 1
