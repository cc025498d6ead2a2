"""``blockpad inspect``: the generated code of a built library, as the build saved it."""

from __future__ import annotations

import os
import re

from .errors import LoadError
from .runtime import manifest as mf

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
    if kind in ("asm", "ll"):
        if kind == "asm":
            blocks = re.split(r"(?m)^(?=\t\.type\t)", text)
            named = re.compile(r"\t\.type\t([^,\s]+)")
        else:
            blocks = [b.split("\n}\n")[0] + "\n}\n" for b in re.split(r"(?m)^(?=define )", text)]
            named = re.compile(r"define [^@]*@([\w.]+)\(")
        by_name = {m.group(1): b for b in blocks if (m := named.match(b))}
        own = re.compile(rf"(__tvm_ffi_)?{re.escape(kernel)}(_compute_)?")
        chosen = [n for n in by_name if own.fullmatch(n)]
        lambdas = re.compile(r"(?:\.L)?__tvm_parallel_lambda(?:\.\d+)?\b")
        for name in chosen:   # grows while it is walked: bodies launched from bodies
            for ref in lambdas.findall(by_name[name]):
                target = next((n for n in (ref, ".L" + ref, ref.removeprefix(".L"))
                               if n in by_name), None)
                if target is not None and target not in chosen:
                    chosen.append(target)
        return "".join(by_name[n] for n in chosen)
    # CUDA C / PTX: TVM names a kernel's device functions <kernel>_kernel[_N]; CUDA C declares
    # them all first (lines ending in ';'), then defines them
    start = r'extern "C" __global__|\.visible \.entry'
    name = re.compile(rf"\b{kernel}_kernel(_\d+)?\(")
    chunks = re.split(rf"(?m)^(?={start})", text)
    return "".join(c for c in chunks if re.match(start, c) and name.search(c.split("\n", 1)[0])
                   and not c.split("\n", 1)[0].rstrip().endswith(";"))
