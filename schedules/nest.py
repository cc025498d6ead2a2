"""A loop nest seen from the block inside it, for the rules that cut loops where a condition
changes (padding edges, block predicates): loop vars and ranges, an analyzer that knows every
enclosing loop, and the profile of a condition along one loop."""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import s_tir, tirx
from tvm.sym.analyzer import Analyzer

MAX_PROFILE = 1 << 13   # analyzer queries allowed to find where one loop's conditions change

_realize = tvm.get_global_func("s_tir.schedule.GetSBlockRealize")


class Nest:
    """The loops ``get_loops`` gives for a block (up to the nearest enclosing block), the
    block's bindings and predicate, and an analyzer bound to every enclosing loop's range, also
    those outside the blocks that wrap partitioned pieces."""

    def __init__(self, sch, block):
        self.loops = sch.get_loops(block)
        fors = [sch.get(l) for l in self.loops]
        self.vars = [f.loop_var for f in fors]
        self.mins = [int(f.min) for f in fors]
        self.extents = [int(f.extent) for f in fors]
        self.kinds = [int(f.kind) for f in fors]  # 0: serial
        realize = _realize(sch, block)
        self.block = sch.get(block)
        self.bind = {iv.var: v for iv, v in zip(self.block.iter_vars, realize.iter_values)}
        self.predicate = realize.predicate
        self.analyzer = Analyzer()
        sref = sch.get_sref(block).parent
        while sref is not None:
            if isinstance(sref.stmt, tirx.For):
                f = sref.stmt
                self.analyzer.bind(f.loop_var, tvm.ir.Range.from_min_extent(f.min, f.extent))
            sref = sref.parent

    def over_loops(self, expr):
        """``expr``, written over the block's iter vars, rewritten over the loop vars."""
        return substitute(expr, self.bind)

    def at(self, expr, values: dict):
        """``expr`` with the loop vars at positions ``values`` set to constants."""
        return substitute(expr, {self.vars[i]: tirx.const(x, str(self.vars[i].ty.dtype))
                                 for i, x in values.items()})

    def uses(self, expr, i) -> bool:
        return uses(expr, self.vars[i])

    def status(self, cond, values=None):
        """True or False where the analyzer proves ``cond`` so over the loop ranges, else None."""
        expr = self.at(cond, values) if values else cond
        if self.analyzer.can_prove(expr):
            return True
        if self.analyzer.can_prove(tirx.Not(expr)):
            return False
        return None

    def segments(self, i, conds) -> list:
        """Ranges ``(start, stop)``, relative to loop ``i``'s start, along which every condition
        takes one value per lane of the innermost loop (a profile over the lanes); the
        innermost loop itself (``i`` last) is cut where the value changes from one lane to the
        next."""
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


def uses(expr, var) -> bool:
    return any(v.same_as(var) for v in tirx.analysis.undefined_vars(expr))


def definitions(stmt) -> list:
    """The vars ``stmt`` defines: its loops', its blocks' iterators and its ``Let``s' (the
    epilogue's bound values, ``postops.Chain``). A copy of ``stmt`` beside it needs fresh ones:
    TIR defines each var once."""
    out = []
    tvm_ffi.structural_walk(stmt, [(tirx.For, lambda f: out.append(f.loop_var)),
                                   (s_tir.SBlock, lambda b: out.extend(iv.var
                                                                       for iv in b.iter_vars)),
                                   (tirx.Let, lambda e: out.append(e.var))])
    return out


def realizes(node) -> list:
    """Every ``SBlockRealize`` in ``node``."""
    out = []
    tvm_ffi.structural_map(node, (s_tir.SBlockRealize, lambda r: out.append(r) or r))
    return out


def root_stmts(func) -> list:
    """The statements of ``func``'s root block, in order."""
    body = func.body.block.body
    return list(body) if isinstance(body, tirx.SeqStmt) else [body]


def with_root(func, stmts: list, alloc_buffers):
    """``func`` with its root block's statements ``stmts`` and scratch ``alloc_buffers``."""
    root = func.body.block
    root = s_tir.SBlock(root.iter_vars, root.reads, root.writes, root.name_hint,
                        tirx.SeqStmt(stmts) if len(stmts) > 1 else stmts[0], root.init,
                        list(alloc_buffers), root.match_buffers, root.annotations)
    return func.with_body(s_tir.SBlockRealize(func.body.iter_values, func.body.predicate, root))


def substitute(expr, mapping: dict):
    """``expr`` with the vars that are keys of ``mapping`` replaced by their values."""
    return tvm_ffi.structural_map(
        expr, (tirx.Var, lambda v: next((new for old, new in mapping.items() if v.same_as(old)),
                                        v)))
