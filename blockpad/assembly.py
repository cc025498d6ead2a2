"""Reading the assembly a build keeps (``source/kernels.s``, PTX, LLVM IR): which functions
there are, and which of them are one kernel's code. Shared by ``blockpad inspect``,
``blockpad bench isa`` and the tests that assert instructions."""

from __future__ import annotations

import re


def functions(asm: str) -> dict:
    """``{function: [line, ...]}``: each function's labels (``.LBB0_3:``) and instructions,
    directives and comments dropped. Takes CPU assembly and PTX (``.entry`` kernels)."""
    funcs, current = {}, None
    for line in asm.splitlines():
        m = re.match(r"\s*\.type\s+([^,]+),@function", line) or \
            re.match(r"\s*(?:\.visible\s+)?\.entry\s+(\w+)", line)
        if m:
            current = funcs.setdefault(m.group(1), [])
        elif current is not None:
            s = re.sub(r"(//|\s#\s|^#\s).*$", "", line.strip()).strip().rstrip(";").strip()
            if re.match(r"^[.\w$]+:", s) or (line[:1].isspace() and s and s[0] not in ".{}(),"):
                current.append(s)
    return funcs


def kernel_code(funcs: dict, kernel: str) -> dict:
    """The functions of ``kernel``: for PTX its ``<kernel>_kernel*`` entries, else
    ``reachable`` from its entry point."""
    if any(f.startswith(f"{kernel}_kernel") for f in funcs):
        return {f: lines for f, lines in funcs.items()
                if re.fullmatch(rf"{re.escape(kernel)}_kernel(_\d+)?", f)}
    return reachable(funcs, f"__tvm_ffi_{kernel}")


def reachable(funcs: dict, entry: str) -> dict:
    """``entry`` and every function it reaches (``<kernel>_compute_``, the parallel bodies TVM
    outlines, where a parallel kernel's hot loop is), not the error helpers kernels share.
    ``funcs``: name -> lines of assembly or LLVM IR (where a reference is ``@name``)."""
    seen, todo = {}, [entry]
    while todo:
        f = todo.pop()
        if f in seen or f not in funcs or f.startswith("__tvm_set_raised"):
            continue
        seen[f] = funcs[f]
        text = "\n".join(funcs[f])
        todo += [g for g in funcs if g not in seen
                 and re.search(rf"[\s,:(]@?{re.escape(g)}(?![\w.])", text)]
    return seen
