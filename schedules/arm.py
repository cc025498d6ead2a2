"""Arm AArch64 schedules (NEON, 128-bit vectors: 4 lanes of fp32, 16 of int8).

* Data movement (reorders, zero fills): the x86 module's ``DataMovement`` rule, which is written
  against ``target.vector_bytes`` and the block's index expressions only (tiled transpose,
  loops partitioned where padding begins, vector stores of the register width); nothing in it
  is x86-specific. On AArch64 it gives ``q``-register stores fed by lane inserts
  (``ld1 {v.s}[i]``).
* Elementwise ops (eltwise, binary): ``Elementwise``. Their kernels carry conditions that TVM's
  vectoriser cannot keep in a vector: the block predicate of a valid-region-only store
  (``dst_stage``, ``on_handle``, ``user``: padding never written) and the ``if_then_else`` of a
  masked source read (``src``: source padding ignored). A condition that differs between the
  lanes of a vector makes TVM scalarise the whole loop. So the loops are partitioned where such
  a condition changes (the last, partial channel block; a vector that straddles a tensor's end)
  until it is the same for every lane of each piece, and the simplifier folds it away. exp, erf,
  tanh and sigmoid become NEON polynomials (``vector_math``): LLVM would call libm per lane.
* int8 reductions (matmul, convolution) on ``neon-dotprod``: ``Sdot``, tensorized to ``sdot``
  when the weights come in 4 x 4 blocks (``BA4b4a``, ``OIhw4o4i``).
* Anything else: ``generic.Fallback`` (schedules/__init__.py), after ``vector_math`` where the
  kernel calls exp/erf/tanh/sigmoid (``VectorMath``).
"""

from __future__ import annotations

import functools
import math

import tvm
import tvm_ffi
from tvm import s_tir, tirx
from tvm.sym.analyzer import Analyzer

from . import generic, x86
from .common import op_of, vector_lanes

TASK_ELEMS = 4096      # a parallel task gets at least this many elements...
SERIAL_ELEMS = 16384   # ...and a kernel this small runs on one thread
MAX_PROFILE = 1 << 13  # analyzer queries allowed to find where one loop's conditions change

_realize = tvm.get_global_func("s_tir.schedule.GetSBlockRealize")


class Elementwise:
    """Eltwise and binary ops: outer loops in parallel, innermost loop vectorised to the
    register width, loops partitioned so that no condition varies across the lanes."""

    ops = ("eltwise", "binary")

    def apply(self, func, target):
        if op_of(func) not in self.ops:
            return None
        sch = s_tir.Schedule(vector_math(func))
        try:
            for block in generic.root_blocks(sch):
                _elementwise(sch, block, target)
        except s_tir.ScheduleError:
            return None   # a nest this rule did not foresee: the fallback's plain schedule
        return sch


class VectorMath:
    """Kernels no other rule took (softmax, pooling, fp32 convolution and matmul with an eltwise
    post-op) that call exp/erf/tanh/sigmoid: the generic schedule over ``vector_math``'s
    rewrite. Kernels without such calls are left to ``generic.Fallback`` as they are."""

    def apply(self, func, target):
        new = vector_math(func)
        return None if new.same_as(func) else generic.Fallback().apply(new, target)


# ---- vector transcendental functions ----------------------------------------------------------
#
# LLVM has no vector exp/erf for AArch64 without a vector math library, so a vectorised
# `exp`, `erf`, `tanh` or `sigmoid` becomes one libm call per lane (erff, expf) and the whole
# loop body is scalarised around them. Arm Compute Library and oneDNN's aarch64 JIT evaluate
# polynomials in NEON registers instead; TVM has the same ones (topi.fast_exp / fast_erf /
# fast_tanh: Cephes and Eigen, a few ulp in fp32), which replace the calls here.

_FAST = {"tirx.exp": "fast_exp", "tirx.erf": "fast_erf", "tirx.tanh": "fast_tanh"}
_TANH_CLAMP = 9.0   # beyond it tanh is +-1 in fp32 (fast_tanh's rational function is not)


def vector_math(func):
    """``func`` with fp32 exp/erf/tanh/sigmoid calls replaced by polynomial expressions that
    vectorise (unchanged when it has none)."""
    found = []

    def visit(call):
        name = getattr(call.op, "name", "")
        if (name in _FAST or name == "tirx.sigmoid") and str(call.ty.dtype) == "float32":
            found.append(call)
    tvm_ffi.structural_walk(func.body, (tvm.ir.expr.Call, visit))
    if not found:
        return func

    def rewrite(call):
        name = getattr(call.op, "name", "")
        if str(call.ty.dtype) != "float32":
            return call
        x = call.args[0] if call.args else None
        if name == "tirx.sigmoid":
            one = tirx.const(1.0, "float32")
            return one / (one + _fast("fast_exp", -x))
        if name == "tirx.tanh":
            return _fast("fast_tanh", tirx.max(tirx.min(x, tirx.const(_TANH_CLAMP, "float32")),
                                               tirx.const(-_TANH_CLAMP, "float32")))
        if name == "tirx.exp":
            return _exp(x)
        if name in _FAST:
            return _fast(_FAST[name], x)
        return call
    return tvm_ffi.structural_map(func, (tvm.ir.expr.Call, rewrite))


def _exp(x):
    """exp over the whole fp32 range: fast_exp builds 2**n in the exponent bits, so it clamps
    its input to +-88.376 (n <= 127); beyond, exp(x) = exp(x/2)**2, which overflows to inf
    past log(FLT_MAX) and underflows gradually, as expf does. One polynomial per element."""
    v = tirx.Var("x", "float32")
    big = tirx.abs(v) > tirx.const(88.3762626647949, "float32")
    half = tirx.Var("h", "float32")
    scaled = v * tirx.Select(big, tirx.const(0.5, "float32"), tirx.const(1.0, "float32"))
    return tirx.Let(v, x, tirx.Let(half, _fast("fast_exp", scaled),
                                   tirx.Select(big, half * half, half)))


def _fast(kind, x):
    """topi's ``kind`` (fast_exp, ...) of expression ``x``, with ``x`` evaluated once."""
    v = tirx.Var("x", "float32")
    return tirx.Let(v, x, _template(kind, v))


_templates = {}


def _template(kind, v):
    """topi's fp32 expression for ``kind`` with its input replaced by var ``v``."""
    if kind not in _templates:
        from tvm import te, topi

        a = te.placeholder((1,), "float32", "a")
        _templates[kind] = getattr(topi, kind)(a).op.body[0]
    body = _templates[kind]
    return tvm_ffi.structural_map(
        body, (tvm.ir.expr.Call,
               lambda c: v if getattr(c.op, "name", "") == "te.tensor_load" else c))


def _elementwise(sch, block, target):
    loops = sch.get_loops(block)
    if not loops or any(iv.iter_type != 0 for iv in sch.get(block).iter_vars):
        return
    lanes = vector_lanes(target, str(sch.get(block).writes[0].source.dtype))
    if int(sch.get(loops[-1]).extent) > lanes:
        sch.split(loops[-1], [None, lanes])   # a tail that does not divide becomes a predicate
    # threads first, over the outer loops the lane conditions do not use (those get
    # partitioned, which a fused loop cannot be); if none is left, inside each piece
    done = _parallel(sch, block, skip=0)
    for leaf in _partition(sch, block, vector=False):
        if not done:
            _parallel(sch, leaf, skip=1)
        for piece in _partition(sch, leaf, vector=True):
            vec = sch.get_loops(piece)[-1]
            if int(sch.get(vec).extent) > 1:
                sch.vectorize(vec)


def _parallel(sch, block, skip) -> bool:
    """Fuse outer loops (after the first ``skip``, before the vector loop and before any loop
    a lane condition uses) until a task holds at most TASK_ELEMS elements, and run them in
    parallel. True when the nest is done with: parallel now, or too small to want threads."""
    nest = _Nest(sch, block)
    loops, extents = nest.loops[:-1], nest.extents[:-1]
    if math.prod(nest.extents) <= SERIAL_ELEMS:
        return True
    conds = nest.lane_conditions()
    work, fused = math.prod(nest.extents[skip:]), []
    for i in range(skip, len(loops)):
        if any(nest.uses(c, i) for c in conds):
            break
        fused.append(loops[i])
        work //= extents[i]
        if work <= TASK_ELEMS:
            break
    if math.prod(extents[skip:skip + len(fused)]) < 2:
        return False
    sch.parallel(sch.fuse(*fused) if len(fused) > 1 else fused[0])
    return True


def _partition(sch, block, vector):
    """Partition ``block``'s loops where a condition that depends on the innermost (vector)
    loop changes value, until each piece sees it the same in every lane; return the leaf blocks
    (each piece's nest begins with its piece of the partitioned loop). ``vector``: partition
    the vector loop itself (the last step) rather than the loops around it. Loops are cut where
    they are: ``reorder`` refuses the padding predicates (not an affine binding)."""
    nest = _Nest(sch, block)
    conds = nest.lane_conditions()
    if not conds:
        return [block]
    lane = len(nest.loops) - 1
    candidates = [lane] if vector else [
        i for i in range(lane) if nest.extents[i] > 1 and any(nest.uses(c, i) for c in conds)]
    for i in candidates:
        segments = nest.segments(i, conds)
        if len(segments) < 2:
            continue
        parts = sch.loop_partition(nest.loops[i], [b - a for a, b in segments[:-1]])
        return [leaf for part in parts for child in sch.get_child_blocks(part)
                for leaf in _partition(sch, child, vector)]
    return [block]


class _Nest:
    """A block seen from its loops, with the conditions of its body rewritten over the loop
    vars and an analyzer that knows every enclosing loop's range."""

    def __init__(self, sch, block):
        self.loops = sch.get_loops(block)
        fors = [sch.get(l) for l in self.loops]
        self.vars = [f.loop_var for f in fors]
        self.mins = [int(f.min) for f in fors]
        self.extents = [int(f.extent) for f in fors]
        realize, blk = _realize(sch, block), sch.get(block)
        bind = {iv.var: v for iv, v in zip(blk.iter_vars, realize.iter_values)}
        self.conditions = []
        if not (isinstance(realize.predicate, tirx.IntImm) and realize.predicate.value == 1):
            self.conditions.append(realize.predicate)

        def visit(call):
            if getattr(call.op, "name", "").endswith("if_then_else"):
                self.conditions.append(_substitute(call.args[0], bind))
        tvm_ffi.structural_walk(blk.body, (tvm.ir.expr.Call, visit))
        self.analyzer = Analyzer()
        sref = sch.get_sref(block).parent
        while sref is not None:
            if isinstance(sref.stmt, tirx.For):
                f = sref.stmt
                self.analyzer.bind(f.loop_var, tvm.ir.Range.from_min_extent(f.min, f.extent))
            sref = sref.parent

    def uses(self, cond, i) -> bool:
        return any(v.same_as(self.vars[i]) for v in tirx.analysis.undefined_vars(cond))

    def lane_conditions(self) -> list:
        lane = len(self.loops) - 1
        return [c for c in self.conditions if self.uses(c, lane)] if self.loops else []

    def status(self, cond, values):
        expr = _substitute(cond, {self.vars[i]: tirx.const(x, str(self.vars[i].ty.dtype))
                                  for i, x in values.items()})
        if self.analyzer.can_prove(expr):
            return True
        if self.analyzer.can_prove(tirx.Not(expr)):
            return False
        return None

    def segments(self, i, conds) -> list:
        """Ranges ``(start, stop)``, relative to loop ``i``'s start, along which every condition
        has one value per lane (a profile over the lanes); the vector loop itself (``i`` last)
        is cut where the value changes from one lane to the next."""
        lane = len(self.loops) - 1
        lanes = [None] if i == lane else \
            range(self.mins[lane], self.mins[lane] + self.extents[lane])
        if self.extents[i] * len(lanes) * len(conds) > MAX_PROFILE:
            return [(0, self.extents[i])]
        out, last = [], None
        for k in range(self.extents[i]):
            x = self.mins[i] + k
            p = tuple(self.status(c, {i: x} if u is None else {i: x, lane: u})
                      for u in lanes for c in conds)
            if out and p == last:
                out[-1] = (out[-1][0], k + 1)
            else:
                out.append((k, k + 1))
            last = p
        return out


def _substitute(expr, mapping: dict):
    return tvm_ffi.structural_map(
        expr, (tirx.Var, lambda v: next((new for old, new in mapping.items() if v.same_as(old)),
                                        v)))


# ---- int8 dot products: sdot ------------------------------------------------------------------

SPATIAL, REDUCE = 0, 2   # IterVar types


class Sdot:
    """``int32 acc[..., j] += int8 a[..., r] * int8 w[..., j4, r4]`` (matmul, convolution: any
    op whose reduction has this shape) tensorized to ``sdot``: each instruction adds, to 4 int32
    lanes of ``acc``, the dot products of 4 consecutive int8 source elements with a 4x4 int8
    weight block stored lane-major (``w[j][r]``, 16 contiguous bytes: ``BA4b4a`` matmul weights,
    ``OIhw4o4i`` convolution weights). Targets with ``asimddp`` only. The rule reads the
    reduction block's index expressions, not the op: the destination's innermost dim must be
    the lane dim of the weights' second-innermost, the source's innermost and the weights'
    innermost must be walked by one reduction loop, both 4-aligned. Anything else (and
    predicated or guarded nests) is left to the next rule."""

    def apply(self, func, target):
        if "asimddp" not in target.features:
            return None
        sch = s_tir.Schedule(vector_math(func))
        blocks = generic.root_blocks(sch)
        reductions = [b for b in blocks
                      if any(int(iv.iter_type) == REDUCE for iv in sch.get(b).iter_vars)]
        if len(reductions) != 1:
            return None
        acc = reductions[0]
        try:
            if not _sdot(sch, acc):
                return None
            for b in blocks:
                if not b.same_as(acc):
                    generic.spatial_parallel_vectorize(sch, b, target)
        except (s_tir.ScheduleError, RuntimeError, ValueError):   # tensorize refused the nest
            return None
        return sch


def _sdot(sch, acc) -> bool:
    block = sch.get(acc)
    realize = _realize(sch, acc)
    if not (isinstance(realize.predicate, tirx.IntImm) and realize.predicate.value == 1):
        return False
    store = block.body
    if not isinstance(store, tirx.BufferStore) or str(store.buffer.dtype) != "int32":
        return False
    loads = []
    tvm_ffi.structural_walk(store.value, (tvm.ir.expr.TensorLoad, loads.append))
    sources = [l for l in loads if not l.source.same_as(store.buffer)]
    if len(sources) != 2 or any(str(l.source.dtype) != "int8" for l in sources) or \
            len(loads) != 3:
        return False
    kinds = [int(iv.iter_type) for iv in block.iter_vars]
    n_sp = kinds.count(SPATIAL)
    if kinds != [SPATIAL] * n_sp + [REDUCE] * (len(kinds) - n_sp):
        return False
    ivars = [iv.var for iv in block.iter_vars]
    loops = sch.get_loops(acc)
    if len(loops) != len(ivars) or any(   # one loop per iter var, in order (a fresh TE nest)
            not value.same_as(sch.get(l).loop_var) for value, l in zip(realize.iter_values, loops)):
        return False
    # j: the destination's innermost index; r: the reduction var of the weights' innermost
    j_var = store.indices[-1]
    if not isinstance(j_var, tirx.Var):
        return False
    j = next((i for i, v in enumerate(ivars) if v.same_as(j_var)), None)
    weights = next((l for l in sources
                    if len(l.indices) >= 2 and _uses_var(l.indices[-2], j_var)), None)
    if j is None or weights is None:
        return False
    src = next(l for l in sources if l is not weights)
    r = next((i for i in range(n_sp, len(ivars))
              if _uses_var(weights.indices[-1], ivars[i])
              and _uses_var(src.indices[-1], ivars[i])), None)
    extents = [int(sch.get(l).extent) for l in loops]
    if r is None or extents[j] % 4 or extents[r] % 4:
        return False
    jl, rl = loops[j], loops[r]
    jo, ji = sch.split(jl, [None, 4]) if extents[j] > 4 else (None, jl)
    ro, ri = sch.split(rl, [None, 4]) if extents[r] > 4 else (None, rl)
    outer = [l for i, l in enumerate(loops[:n_sp]) if i != j] + ([jo] if jo is not None else [])
    reduce = [l for i, l in enumerate(loops[n_sp:], n_sp) if i != r] + \
        ([ro] if ro is not None else [])
    sch.reorder(*outer, *reduce, ji, ri)
    if outer:
        sch.parallel(sch.fuse(*outer) if len(outer) > 1 else outer[0])
    if reduce:
        init = sch.decompose_reduction(acc, reduce[0])
        sch.vectorize(sch.get_loops(init)[-1])
    sch.tensorize(ji, _sdot_intrin())
    return True


def _uses_var(expr, var) -> bool:
    return any(v.same_as(var) for v in tirx.analysis.undefined_vars(expr))


@functools.cache
def _sdot_intrin() -> str:
    from .arm_intrin import register

    return register()


RULES = [x86.DataMovement(), Elementwise(), Sdot(), VectorMath()]
