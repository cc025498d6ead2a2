"""``blockpad bench isa``: the instruction mix of each kernel's hot loop, per target, from the
assembly the build keeps, so that a schedule can be judged on a machine without the hardware.

For every non-host target a small library of convolutions and matmuls is built (fp32, int8,
bf16 where the target has a unit for it; fp32 PTX for CUDA where nvcc is installed). In each
kernel (its entry point and the parallel bodies TVM outlines; for CUDA its ``.entry``
kernels), the innermost loops are found from the backward branches; the hot loop is the
innermost loop with the most dot-product instructions (a kernel whose reduction LLVM unrolled
whole has none: then the whole kernel is counted, and says so). For that loop it prints:

* ``dot``: vector FMAs, dot products and multiply-adds (``vfmadd*``, ``vpdpbusd``,
  ``vpmadd*``, ``tdp*``, ``fmla``, ``sdot``, ``smlal``, ``fma.rn``, ``mma``), the work;
* ``loads`` / ``stores``: instructions that read / write memory (a folded load operand counts);
* ``spills``: loads and stores of vector registers from and to the stack: a register tile
  that did not fit, or a stack buffer written with vector stores (AMX's 64-byte tile
  configuration); PTX: ``.local``. Scalar stack traffic (loop state kept in the frame) is not
  counted;
* ``dot/load``: the ratio a register-blocked kernel raises (oneDNN's and BLIS's aim). For AMX
  it is tile multiplies per tile load (``tiles``): each multiply needs an A and a B tile, so
  0.5 is the ceiling short of reusing tiles across multiplies, and the accumulator tile's load
  per output tile pulls it below.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile

from blockpad.assembly import functions, kernel_code

from .common import table

# targets measured here, and the kernels each gets (spec fields; name: what it shows)
_CONV = {"op": "conv2d", "shape": [1, 32, 8, 16], "channels": 32, "kernel": [3, 3], "pad": [1, 1]}
_MM = {"op": "matmul", "shape": [32, 128], "n": 64}
X86_KERNELS = {
    "conv_f32": {**_CONV, "dtype": "float32", "src": "nChw16c", "weights": "OIhw16i16o",
                 "dst": "nChw16c"},
    "conv_s8": {**_CONV, "dtype": "int8", "src": "nChw16c", "weights": "OIhw4i16o4i",
                "dst": "nChw16c"},
    # channels last, 64 channels a row, OW = 16: the convolution AMX tiles take
    "conv_u8_nhwc": {**_CONV, "dtype": "uint8", "shape": [1, 64, 4, 18], "pad": [0, 0],
                     "src": "nhwc", "weights": "OIhw16i16o4i", "dst": "nChw16c"},
    # awkward channels (C = 20, K = 24: both padded to 32 in 16-channel blocks)
    "conv_s8_c20": {**_CONV, "dtype": "int8", "shape": [1, 20, 8, 16], "channels": 24,
                    "src": "nChw16c", "weights": "OIhw4i16o4i", "dst": "nChw16c"},
    "mm_f32": {**_MM, "dtype": "float32", "src": "ab", "weights": "BA16a16b", "dst": "ab"},
    "mm_u8": {**_MM, "dtype": "uint8", "src": "ab", "weights": "BA16b4a", "dst": "ab"},
    # N = 13 and K = 18: one padded vector of columns, a reduction padded to whole dwords
    "mm_s8_odd": {**_MM, "dtype": "int8", "shape": [32, 18], "n": 13, "src": "ab",
                  "weights": "BA16b4a", "dst": "ab"},
    "mm_bf16": {**_MM, "dtype": "bfloat16", "src": "ab", "weights": "BA16b2a", "dst": "ab"},
    # 16 outputs x 2 input channels a zmm: vdpbf16ps where the target has avx512_bf16
    "conv_bf16": {**_CONV, "dtype": "bfloat16", "src": "nChw16c", "weights": "OIhw8i16o2i",
                  "dst": "nChw16c"},
}
ARM_KERNELS = {
    "conv_f32": {**_CONV, "dtype": "float32", "src": "nChw4c", "weights": "OIhw4i4o",
                 "dst": "nChw4c"},
    "conv_s8": {**_CONV, "dtype": "int8", "src": "nChw4c", "weights": "OIhw4o4i",
                "dst": "nChw4c"},
    # awkward channels (C = 30, K = 10: both padded to 32 / 12 in 4-channel blocks)
    "conv_s8_c30": {**_CONV, "dtype": "int8", "shape": [1, 30, 8, 16], "channels": 10,
                    "src": "nChw4c", "weights": "OIhw4o4i", "dst": "nChw4c"},
    "mm_f32": {**_MM, "dtype": "float32", "src": "ab", "weights": "Ba4b", "dst": "ab"},
    "mm_s8": {**_MM, "dtype": "int8", "src": "ab", "weights": "BA4b4a", "dst": "ab"},
    "mm_s8_odd": {**_MM, "dtype": "int8", "shape": [32, 18], "n": 13, "src": "ab",
                  "weights": "BA4b4a", "dst": "ab"},
}
# CUDA: fp32 only; the fp16/bf16 tensor-core kernels need TVM's own tensor intrinsics, whose
# import costs a minute (docs/tvm-0.27-notes.md 2), too much for a quick look
CUDA_KERNELS = {k: X86_KERNELS[k] for k in ("conv_f32", "mm_f32")}
TARGETS = {"avx512": X86_KERNELS, "avx512-vnni": X86_KERNELS, "avx512-bf16": X86_KERNELS,
           "amx": X86_KERNELS,
           "neon": ARM_KERNELS, "neon-dotprod": ARM_KERNELS, "cuda-sm80": CUDA_KERNELS}

_DOT = re.compile(r"^(v?fn?madd\w*|vpdp\w+|vpmadd\w+|vdpbf16ps|tdp\w+|fmla|[su]mlal2?|mla"
                  r"|sdot|udot|smmla|ummla|bfdot|bfmmla|fma\.rn\S*|w?mma\S*)$")
_X86_MEM = re.compile(r"\((%\w+)?(,|\))")
_ARM_LOAD = re.compile(r"^(ld[1-4]r?|ldr\w*|ldp\w*|ldur\w*)$")
_ARM_STORE = re.compile(r"^(st[1-4]|str\w*|stp\w*|stur\w*)$")
_BRANCH = re.compile(r"^(j\w+|b|b\.\w+|cbn?z|tbn?z|bra(\.uni)?)$")


def innermost_loops(lines: list) -> list:
    """The innermost loops of one function: instruction lists between a label and a branch
    back to it, containing no other such loop."""
    labels = {l[:-1]: i for i, l in enumerate(lines) if l.endswith(":")}
    loops = []
    for i, line in enumerate(lines):
        parts = [p for p in line.split() if not p.startswith("@")]   # PTX: @%p bra
        if len(parts) >= 2 and _BRANCH.match(parts[0]):
            target = parts[-1].split(",")[-1]
            if target in labels and labels[target] < i:
                loops.append((labels[target], i))
    inner = [(a, b) for a, b in loops
             if not any((c, d) != (a, b) and a <= c and d <= b for c, d in loops)]
    return [[l for l in lines[a:b + 1] if not l.endswith(":")] for a, b in inner]


def mix(instrs: list, arch: str) -> dict:
    """Counts of dot instructions, loads, stores and vector spills (stack loads and stores of
    vector registers) in ``instrs``."""
    out = {"instrs": len(instrs), "dot": 0, "loads": 0, "stores": 0, "spills": 0,
           "tile_loads": 0}
    for ins in instrs:
        op, rest = (ins.split(None, 1) + [""])[:2]
        if _DOT.match(op.split("@")[-1]):
            out["dot"] += 1
        if arch == "x86_64":
            operands = _split_operands(rest)
            mem = [i for i, o in enumerate(operands) if _X86_MEM.search(o)]
            if not mem or op.startswith(("lea", "nop", "prefetch", "push", "pop", "call")):
                continue
            last = len(operands) - 1
            out["tile_loads"] += op.startswith("tileload")
            if op.startswith("tilestore"):
                out["stores"] += 1
            elif op.startswith(("cmp", "test", "ucomi", "vucomi", "comi", "tileload")) \
                    or last == 0 or any(i < last for i in mem):
                out["loads"] += 1          # AT&T: a memory operand before the last is read
            else:
                out["stores"] += 1         # ...and the last one written
            out["spills"] += any(re.search(r"\(%(rsp|rbp)\b", operands[i]) for i in mem) and \
                bool(re.search(r"%[xyzt]mm", rest))
        elif arch == "ptx":
            if op.startswith("@"):
                op, rest = (rest.split(None, 1) + [""])[:2]
            if op.startswith("ld.") and not op.startswith("ld.param"):
                out["loads"] += 1
            elif op.startswith("st."):
                out["stores"] += 1
            else:
                continue
            out["spills"] += ".local" in op
        else:
            if _ARM_LOAD.match(op):
                out["loads"] += 1
            elif _ARM_STORE.match(op):
                out["stores"] += 1
            else:
                continue
            out["spills"] += "[sp" in rest and bool(re.match(r"\{?\s*[qdsv]\d", rest))
    return out


def _split_operands(rest: str) -> list:
    """AT&T operands, split at the commas outside parentheses."""
    out, depth, cur = [], 0, ""
    for ch in rest:
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
            continue
        depth += ch == "("
        depth -= ch == ")"
        cur += ch
    if cur.strip():
        out.append(cur.strip())
    return out


def hot_loop(funcs: dict, kernel: str, arch: str) -> tuple[str, dict]:
    """``(where, mix)`` of ``kernel``'s hot loop: the innermost loop with the most dot
    instructions, or the whole kernel (``where = 'unrolled'``) when no loop has any."""
    code = kernel_code(funcs, kernel)
    best = None
    for lines in code.values():
        for loop in innermost_loops(lines):
            m = mix(loop, arch)
            if m["dot"] and (best is None or m["dot"] > best["dot"]):
                best = m
    if best is not None:
        return "loop", best
    flat = [l for lines in code.values() for l in lines if not l.endswith(":")]
    return "unrolled", mix(flat, arch)


def measure(target: str, out_dir: str) -> list:
    """Build ``target``'s kernels into ``out_dir`` and return one row per kernel."""
    from blockpad.codegen import build
    from blockpad.codegen.spec import parse_spec
    from blockpad.codegen.targets import get_target

    t = get_target(target)
    kernels = [{"name": name, **fields} for name, fields in TARGETS[target].items()]
    build.build(parse_spec({"library": {"name": f"isa-{target}"}, "kernel": kernels}), t,
                out_dir, log=lambda m: None)
    gpu = t.family == "cuda"
    with open(os.path.join(out_dir, "source", "kernels.ptx" if gpu else "kernels.s")) as f:
        funcs = functions(f.read())
    rows = []
    for k in kernels:
        where, m = hot_loop(funcs, k["name"], "ptx" if gpu else t.arch)
        loads = m["tile_loads"] or m["loads"]   # AMX: the tiles feed the tile multiplies
        ratio = f"{m['dot'] / loads:.2f}{' tiles' if m['tile_loads'] else ''}" if loads else "-"
        rows.append([f"{target} {k['name']}", where, m["instrs"], m["dot"], m["loads"],
                     m["stores"], m["spills"], ratio])
    return rows


def main(out_dir=None, targets=None):
    targets = targets or list(TARGETS)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for target in targets:
            if target.startswith("cuda") and shutil.which("nvcc") is None:
                print(f"{target}: skipped, nvcc is not installed (it compiles the PTX)")
                continue
            rows += measure(target, os.path.join(out_dir or tmp, target))
    print("instruction mix of each kernel's hot loop (innermost loop with the most dot "
          "instructions), from the generated assembly")
    print(table(rows, ["target kernel", "where", "instrs", "dot", "loads", "stores", "spills",
                       "dot/load"]))
    return rows
