"""``blockpad inspect``: the generated code of a built library, as the build saved it."""

from __future__ import annotations

import os
import re

from . import manifest as mf
from .assembly import functions, reachable
from .errors import LoadError

SOURCES = "source"
_FILES = {"asm": "kernels.s", "ll": "kernels.ll", "cuda": "kernels.cu", "ptx": "kernels.ptx"}


def show(out_dir, kind="tir", kernel=None) -> str:
    manifest = mf.read(out_dir)
    names = [k["name"] for k in manifest["kernels"]]
    if kernel is not None and kernel not in names:
        raise LoadError(f"{out_dir}: no kernel {kernel!r}; it has {', '.join(names)}")
    src = os.path.join(out_dir, SOURCES)
    if kind == "tir":
        chosen = [kernel] if kernel else names
        return "\n".join(_read(os.path.join(src, f"{n}.tir.py")) for n in chosen)
    text = _read(os.path.join(src, _FILES[kind]), f"this library has no {kind} source "
                                                  f"(target {manifest['target']['name']})")
    return _functions_of(text, kernel, kind) if kernel else text


def _read(path, missing=None) -> str:
    if not os.path.isfile(path):
        raise LoadError(missing or f"{path} is missing; rebuild the library with --force")
    with open(path) as f:
        return f.read()


def _functions_of(text, kernel, kind) -> str:
    """The parts of a module's source that belong to ``kernel``: its entry, the functions TVM
    derived from it (``<kernel>_compute_``), and the parallel bodies those launch
    (``__tvm_parallel_lambda.N``, where a parallel kernel's hot loop is)."""
    if kind == "asm":
        # printed as written, but walked over instructions only: the text after a function
        # (directives, data) names other kernels' functions
        blocks = re.split(r"(?m)^(?=\t\.type\t)", text)
        by_name = {m.group(1): b for b in blocks
                   if (m := re.match(r"\t\.type\t([^,\s]+),@function", b))}
        code = reachable(functions(text), f"__tvm_ffi_{kernel}")
        return "".join(by_name[n] for n in code)
    if kind == "ll":
        blocks = [b.split("\n}\n")[0] + "\n}\n" for b in re.split(r"(?m)^(?=define )", text)]
        by_name = {m.group(1): b for b in blocks if (m := re.match(r"define [^@]*@([\w.]+)\(", b))}
        code = reachable({n: [b] for n, b in by_name.items()}, f"__tvm_ffi_{kernel}")
        return "".join(by_name[n] for n in code)
    # CUDA C / PTX: TVM names a kernel's device functions <kernel>_kernel[_N]; CUDA C declares
    # them all first (lines ending in ';'), then defines them
    start = r'extern "C" __global__|\.visible \.entry'
    name = re.compile(rf"\b{kernel}_kernel(_\d+)?\(")
    chunks = re.split(rf"(?m)^(?={start})", text)
    return "".join(c for c in chunks if re.match(start, c) and name.search(c.split("\n", 1)[0])
                   and not c.split("\n", 1)[0].rstrip().endswith(";"))
