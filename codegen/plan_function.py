"""A model's plan as one compiled function (``plan.so``): every kernel call of the plan, in
order, made from native code (``runtime/graph/native.py`` says why and describes the calls).

The function takes the run's backing buffers (arena slots, then inputs, the weights as one
buffer, and results) as flat byte buffers; each call passes the kernel DLTensors made on the
stack from a pointer into one of them, and finds the kernel by symbol among the modules the
runtime imports into this one (the model's ``kernels.so``): TVM's ``tvm_call_packed``, whose
lookup is made once per call site. A kernel's error returns through the function as a call from Python would.
Written as TVMScript text, which names every argument plainly in ``plan.so``'s sources.
"""

from __future__ import annotations

import os

#: TVMScript's constructor of a scalar of each dtype a kernel argument may have
_SCALAR = {"float32": "T.float32", "float16": "T.float16", "bfloat16": "T.bfloat16",
           "int8": "T.int8", "uint8": "T.uint8", "int32": "T.int32", "uint16": "T.uint16",
           "int64": "T.int64", "float64": "T.float64"}


#: TVM's passes that store bfloat16 as uint16 (``build_plan`` leaves them out)
_BF16_LEGALIZE = ("tirx.BF16ComputeLegalize", "tirx.BF16StorageLegalize")


def script(name: str, backings: int, calls) -> str:
    """TVMScript of plan function ``name`` over ``backings`` byte buffers making ``calls``:
    ``[(symbol, [(backing, byte offset, shape, dtype, element strides or None), ...]), ...]``."""
    params = ", ".join(f"b{i}: T.handle" for i in range(backings))
    lines = ["# from tvm.script import tirx as T", "", "@T.prim_func",
             f"def {name}({params}):",
             f'    T.func_attr({{"global_symbol": "{name}"}})']
    for i in range(backings):
        lines.append(f"    n{i} = T.int64()")
        lines.append(f'    B{i} = T.match_buffer(b{i}, (n{i},), "uint8")')
    for symbol, args in calls:
        packed = []
        for backing, offset, shape, dtype, strides in args:
            if dtype not in _SCALAR:
                raise ValueError(f"{symbol}: a {dtype} argument has no plan-function form")
            dims = ", ".join(str(n) for n in shape)
            stride = (f"T.tvm_stack_make_shape({', '.join(map(str, strides))})" if strides
                      else 'T.reinterpret("handle", T.uint64(0))')
            packed.append(f"T.tvm_stack_make_array(T.address_of(B{backing}[{offset}]), "
                          f"T.tvm_stack_make_shape({dims}), {stride}, {len(shape)}, "
                          f"{_SCALAR[dtype]}(0), 0)")
        lines.append(f'    T.evaluate(T.call_packed("{symbol}", {", ".join(packed)}))')
    return "\n".join(lines) + "\n"


def build_plan(functions: dict, backings: int, target, path) -> None:
    """Compile ``functions`` (plan function name -> its calls, as ``script`` takes them) for
    ``target`` into the shared library ``path``, with the TVMScript beside it
    (``<path>.py``)."""
    import tvm

    from .build import export

    sources = {name: script(name, backings, calls) for name, calls in functions.items()}
    mod = tvm.IRModule({name: tvm.script.from_source(src)
                        for name, src in sources.items()})
    # no bfloat16 legalization: it would turn a bfloat16 argument's dtype witness into uint16,
    # and the DLTensor made from it would say uint16, which a bfloat16 kernel refuses (the
    # function computes nothing in bfloat16: a witness gives its array's dtype, nothing more)
    ctx = tvm.transform.PassContext.current()
    with tvm.transform.PassContext(opt_level=ctx.opt_level, config=dict(ctx.config),
                                   disabled_pass=[*ctx.disabled_pass, *_BF16_LEGALIZE]):
        lib = tvm.compile(mod, target=target.tvm_target())
    export(lib, os.fspath(path), target)
    with open(os.fspath(path) + ".py", "w") as f:
        f.write("\n\n".join(sources.values()))
