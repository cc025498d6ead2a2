"""The unit the build driver compiles: a PrimFunc plus what the runtime must know to call it."""

from __future__ import annotations

from dataclasses import dataclass, field

import tvm_ffi
from tvm import te, tirx

from blockpad.layout import Layout
from blockpad.manifest import ArgRecord, KernelRecord
from blockpad.vocabulary import OP_ATTR

#: Element types whose arithmetic LLVM does not need for data movement: moved as raw bits.
_BIT_STORAGE = {"bfloat16": "uint16"}


@dataclass(frozen=True)
class Arg:
    """One kernel argument: a tensor in ``layout``, read (``in``), written (``out``) or both."""

    name: str
    layout: Layout
    role: str
    storage: str  # element type of the compiled buffer

    def record(self) -> ArgRecord:
        return ArgRecord(self.name, self.role, self.layout, self.storage)


@dataclass
class KernelDef:
    name: str
    op: str
    args: list[Arg]
    func: tirx.PrimFunc
    params: dict = field(default_factory=dict)
    contract: dict | None = None   # the padding contract (codegen.policy.PaddingPlan.contract)
    inplace_of: int | None = None  # index of the source the result overwrites

    def record(self, **build) -> KernelRecord:
        """What the manifest says of this kernel (``build``: the build's ``tuned``/``tuning``):
        an in-place kernel's destination is its ``inout`` source, so it is not listed."""
        args = self.args if self.inplace_of is None else self.args[:-1]
        return KernelRecord(self.name, self.op, tuple(a.record() for a in args), self.params,
                            self.contract, **build)

    def describe(self) -> dict:
        """The manifest entry's JSON form."""
        return self.record().to_json()


def movement_storage(dtype: str) -> str:
    """Storage type for kernels that only move bits (reorders, zero fills)."""
    return _BIT_STORAGE.get(dtype, dtype)


def placeholder(layout: Layout, name: str, storage: str) -> te.Tensor:
    """A TE tensor over the physical index space of ``layout``."""
    return te.placeholder(layout.physical_shape, storage, name)


def strided_buffer(layout: Layout, name: str, storage: str) -> tirx.Buffer:
    """The buffer a kernel parameter is declared with: the layout's physical shape and strides,
    aligned only to the element, so any view of a user's allocation is accepted (numpy gives 16
    bytes, TVM's compact default would assume 64 and crash, docs/tvm-0.27-notes.md 3).

    A stride of an extent-1 dim addresses nothing, and DLPack producers set it as they please
    (numpy's reshape makes it the row-major one whatever the layout declared, PyTorch its own):
    it is declared as a variable, so the call's argument check accepts any value there."""
    itemsize = tvm_ffi.dtype(storage).itemsize
    strides = [tirx.Var(f"{name}_stride{i}", "int32") if n == 1 else s
               for i, (n, s) in enumerate(zip(layout.physical_shape, layout.physical_strides))]
    return tirx.decl_buffer(layout.physical_shape, storage, name, strides=strides,
                            offset_factor=1, data_alignment=itemsize)


def make_inplace(kernel: KernelDef, source: str) -> KernelDef:
    """The same kernel writing its result over source ``source`` (seed 003's in-place ops):
    the source becomes one ``inout`` argument and the destination parameter goes away. Valid
    for ops whose every output element is computed from reads made before it is written
    (elementwise, binary, softmax's final stage, the epilogue of a convolution or matmul,
    which reads its sum at the element it writes). The func itself is aliased after scheduling
    (``alias_inplace``): schedule primitives want each stage to write a buffer of its own."""
    *_, dst = kernel.args
    src = next((a for a in kernel.args if a.name == source), None)
    if dst.role != "out":
        raise ValueError(f"{kernel.name}: no destination to compute in place")
    check_inplace(source, src.layout if src else None, dst.layout)
    args = [Arg(a.name, a.layout, "inout", a.storage) if a is src else a for a in kernel.args]
    params = {**kernel.params, "inplace": True}
    return KernelDef(kernel.name, kernel.op, args, kernel.func, params, kernel.contract,
                     inplace_of=kernel.args.index(src))


def check_inplace(source: str, src: Layout | None, dst: Layout) -> None:
    """In place overwrites ``source`` element by element: the kernel must have it (a
    convolution's sum tensor comes with a sum post-op) and it must be laid out as dst (checked
    when the spec is parsed, and again when the kernel is made)."""
    from blockpad.errors import SpecError

    if src is None:
        raise SpecError(f"in place overwrites {source}, which this kernel does not take"
                        + (" (it needs a sum post-op)" if source.startswith("sum") else ""))
    if src != dst:
        raise SpecError(f"in place needs {source} and dst in one layout; got {src} and {dst}")


def alias_inplace(func: tirx.PrimFunc, kernel: KernelDef) -> tirx.PrimFunc:
    """Point the scheduled func's stores to its destination at the in-place source's buffer
    and drop the destination parameter."""
    if kernel.inplace_of is None:
        return func
    src_var, dst_var = func.params[kernel.inplace_of], func.params[-1]
    body = tvm_ffi.structural_map(func.body,
                                  (tirx.Var, lambda v: src_var if v.same_as(dst_var) else v))
    return tirx.PrimFunc(list(func.params)[:-1], body, attrs=func.attrs)


def finish(func: tirx.PrimFunc, name: str, op: str, args: list[Arg]) -> KernelDef:
    """Replace the compact TE parameter buffers by the layouts' strided ones and name the func."""
    replace = {}
    for param, arg in zip(func.params, args):
        replace[param] = strided_buffer(arg.layout, arg.name, arg.storage)
    func = tvm_ffi.structural_map(
        func, (tirx.Var, lambda v: next((new for old, new in replace.items() if v.same_as(old)), v)))
    func = func.with_attr("global_symbol", name).with_attr(OP_ATTR, op)
    return KernelDef(name, op, args, func)
