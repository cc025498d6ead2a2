"""Random kernel specs for ``blockpad check``, each a function of ``(seed, case number)`` only.

A case is one ``[[kernel]]`` entry of a build spec (a dict ``bp.build`` takes through
``parse_spec``): an op, its parameters, a padding policy and a layout per tensor. Case ``k`` of
seed ``s`` is drawn from its own generator (``numpy.random.default_rng((s, k))``), so any case
can be rebuilt alone from the pair that names it, whatever batch it first ran in.

What is drawn, and why:

* ops: reorder, zero_pad, eltwise, binary, conv2d (groups, depthwise, int8, bf16), matmul,
  softmax / log-softmax, pool, inverted_residual (MobileNetV2's fused block: its three weight
  tensors, eltwise chains inside, conv2d's post-ops after); post-op chains on conv2d, matmul
  and inverted_residual; on integer ones the
  quantization attributes (zero points, per-tensor scales, int32 bias, destination scale and
  type), drawn last so that a case's layouts do not depend on them;
* shapes small (the checker runs thousands) but never block multiples by design: a partial last
  block, dims of 1, odd spatial sizes are where padding code goes wrong;
* layouts: plain, channels-last, blocked once or twice (``4i16o4i``), blocked on a spatial
  dim, outer dims permuted, with a halo (``paddings``) or with gaps between dims (``strides``);
* every padding policy, in place where the op has an in-place form, every dtype the op takes;
  for a CUDA target (``Profile``) only the policies a GPU library honours (``dst_fused``,
  ``dst_stage``) and no layout with gaps between dims.

Where a drawn combination is invalid *by design* (the spec would be rejected with a
``SpecError`` that is right to reject it), the generator does not produce it; each such rule
says why next to it."""

from __future__ import annotations

import math

import numpy as np

from blockpad.codegen.targets import TARGETS
from blockpad.errors import LayoutError
from blockpad.layout import Layout
from blockpad.vocabulary import (
    BINARY_OPERANDS,
    BINARY_POST_OPS,
    KERNEL_ZEROS,
    POLICIES,
    QUANTIZED_ADD,
    QUANTIZED_DTYPES,
    post_op_tensors,
)

CHECKED_OPS = ("reorder", "zero_pad", "eltwise", "binary", "conv2d", "matmul", "softmax", "pool",
               "inverted_residual")
# how often each op is drawn: the dot-product ops have the most code paths (and post-ops)
WEIGHTS = {"reorder": 1.0, "zero_pad": 0.5, "eltwise": 1.5, "binary": 1.0, "conv2d": 2.5,
           "matmul": 1.5, "softmax": 1.0, "pool": 1.0, "inverted_residual": 1.0}
# ops added after the first long runs reported failures by (seed, case): whether a case is one
# of them is drawn from a generator of its own, ``(seed, k, 2)`` (the case's data uses
# ``(seed, k, 1)``), with the same odds as the weights give; a case that is not one of them is
# drawn exactly as it was before they came, so a reported (seed, case) still names its case
ADDED_OPS = ("inverted_residual",)
ELTWISE = ("relu", "gelu_erf", "gelu_tanh", "sigmoid", "exp", "tanh", "clip", "linear")
REORDER_DTYPES = ("float32", "float32", "bfloat16", "float16", "float64", "int8", "uint8",
                  "int32")
ELTWISE_DTYPES = ("float32", "float32", "float32", "float16", "float64")
BINARY_DTYPES = ("float32", "float32", "float16", "float64", "int32")
GENERIC = "abcdef"


class Profile:
    """What a target's kernels are drawn with: block sizes its vectors like, the dot-product
    dtypes it computes (repeated: drawn that much more often), the padding policies its
    runtime honours and whether its arguments may have gaps between dims (``strides``): a GPU
    library takes plain tensors without padding state, so only the policies whose kernels
    zero the padding themselves, and dense layouts."""

    def __init__(self, blocks, dot_dtypes, policies=POLICIES, strides=True):
        self.blocks = blocks
        self.dot_dtypes = dot_dtypes
        self.policies = policies
        self.strides = strides


# a dot product's destination type by source type (float32 for the others: int8, bf16)
DST_TYPES = {"float16": "float16", "float64": "float64"}
# a sum's other data type of the destination's size (oneDNN reinterprets dst's memory)
SUM_DT = {"float32": "int32", "int32": "float32", "int8": "uint8", "uint8": "int8"}
_DOT = ("float32", "float32", "float32", "int8", "uint8", "bfloat16", "float16", "float64")
_X86 = Profile((4, 8, 16), _DOT)
_ARM = Profile((4, 8), _DOT)
_CUDA = Profile((4, 8, 16), _DOT, policies=KERNEL_ZEROS, strides=False)
# every target of a family draws the same cases
PROFILES = {name: {"x86": _X86, "arm": _ARM, "cuda": _CUDA}[t.family]
            for name, t in TARGETS.items()}


def case(seed: int, k: int, target: str, ops=CHECKED_OPS) -> dict:
    """Spec entry of case ``k`` (named ``case<k>``)."""
    rng = np.random.default_rng((seed, k))
    op = _pick(rng, seed, k, tuple(ops))
    entry = _MAKERS[op](rng, PROFILES[target])
    return {"name": f"case{k}", "op": op, **entry}


def _pick(rng, seed, k, ops) -> str:
    """The op of case ``k``, each op as often as ``WEIGHTS`` says: one of ``ADDED_OPS`` first
    (from its own generator), else one of the others from ``rng``, as before they came."""
    added = [o for o in ops if o in ADDED_OPS]
    older = [o for o in ops if o not in ADDED_OPS]
    if added:
        u = np.random.default_rng((seed, k, 2)).random() * sum(WEIGHTS[o] for o in ops)
        for o in added:
            if u < WEIGHTS[o] or not older and o == added[-1]:
                return o
            u -= WEIGHTS[o]
    w = np.array([WEIGHTS[o] for o in older])
    return older[rng.choice(len(older), p=w / w.sum())]


# ---- layouts ----------------------------------------------------------------------------------

def layout(rng, letters: str, shape, dtype: str, prof: Profile, *, block=None, halo=None,
           permute=True) -> dict | str:
    """A random layout of ``letters`` (the logical dims, in their family's order) for
    ``shape``: a tag string or a ``{tag, paddings | strides}`` table. ``block``: the dims that
    may be blocked, the first the usual one (``c`` of ``nChw16c``); ``halo``: the dims that
    may take a halo (default any; ``""`` none); ``prof``: the target's blocks and whether gaps
    between dims may be drawn."""
    for _ in range(50):
        usual = block or letters[1] + letters[0] + letters[2:]    # b, as c of nchw
        value = _draw_layout(rng, letters, shape, prof.blocks, usual, halo, prof.strides,
                             permute)
        try:
            _as_layout(value, shape, dtype)
        except LayoutError:
            continue        # e.g. strides that do not fit: draw again
        return value
    return letters


def _draw_layout(rng, letters, shape, blocks, block, halo, strides, permute):
    rank = len(letters)
    order = list(range(rank))
    r = rng.random()
    if permute and rank > 2 and r < 0.15:          # channels last: nhwc, ndhwc, acdb
        order = [0, *range(2, rank), 1]
    elif permute and r < 0.25:
        rng.shuffle(order)
    inner = []
    usual = letters.index(block[0])
    for i in range(int(rng.choice([0, 1, 2, 3], p=[0.3, 0.55, 0.12, 0.03]))):
        d = usual if i == 0 and rng.random() < 0.8 else letters.index(rng.choice(list(block)))
        # a dim blocked twice (4i16o4i, aBc16b8b): its later block stays small
        inner.append((d, int(rng.choice((2, 4))) if any(e == d for e, _ in inner)
                      else int(rng.choice(blocks))))
    rng.shuffle(inner)
    blocked = {d for d, _ in inner}
    tag = "".join(letters[d].upper() if d in blocked else letters[d] for d in order)
    tag += "".join(f"{b}{letters[d]}" for d, b in inner)
    r = rng.random()
    if r < 0.25 and halo != "":
        pads = {}
        for d in range(rank):
            if d not in blocked and (halo is None or letters[d] in halo) and rng.random() < 0.6:
                pads[letters[d]] = [int(rng.integers(0, 3)), int(rng.integers(0, 3))]
        if any(sum(p) for p in pads.values()):
            return {"tag": tag, "paddings": pads}
    if strides and r > 0.85:
        phys = Layout(tag, shape).physical_shape
        out, s = [], 1
        for n in reversed(phys):
            out.append(s)
            s = s * n + (int(rng.integers(1, 5)) if len(out) > 1 and rng.random() < 0.6 else 0)
        if s != math.prod(phys):
            return {"tag": tag, "strides": out[::-1]}
    return tag


def _as_layout(value, shape, dtype) -> Layout:
    if isinstance(value, str):
        return Layout(value, shape, dtype)
    return Layout(value["tag"], shape, dtype, value.get("paddings"), value.get("strides"))


def _shape(rng, rank, most=9):
    return [int(rng.integers(1, most + 1)) for _ in range(rank)]


def _policy(rng, prof):
    return str(rng.choice(prof.policies))


# ---- ops --------------------------------------------------------------------------------------

def _reorder(rng, prof):
    rank = int(rng.integers(2, 6))
    shape = _shape(rng, rank, 12)
    dtype = str(rng.choice(REORDER_DTYPES))
    letters = GENERIC[:rank]
    return {"shape": shape, "dtype": dtype, "src": layout(rng, letters, shape, dtype, prof),
            "dst": layout(rng, letters, shape, dtype, prof)}


def _zero_pad(rng, prof):
    rank = int(rng.integers(2, 6))
    shape = _shape(rng, rank, 12)
    dtype = str(rng.choice(REORDER_DTYPES))
    return {"shape": shape, "dtype": dtype,
            "layout": layout(rng, GENERIC[:rank], shape, dtype, prof)}


def _eltwise_params(rng):
    alg = str(rng.choice(ELTWISE))
    alpha, beta = 0.0, 0.0
    if alg == "relu" and rng.random() < 0.5:
        alpha = 0.1
    elif alg == "clip":
        alpha, beta = -0.5, float(rng.choice([0.5, 1.5]))
    elif alg == "linear":
        alpha, beta = float(rng.choice([2.0, -0.5])), float(rng.choice([0.0, 1.0]))
    return {"algorithm": alg, "alpha": alpha, "beta": beta}


def _inplace(rng, entry, src, dst="dst"):
    """In place with probability 1/4: the source's layout becomes the destination's (an
    in-place kernel has one layout for both, by design: ``inplace`` without it is refused)."""
    if rng.random() < 0.25:
        entry[src] = entry[dst]
        entry["inplace"] = True
    return entry


def _eltwise(rng, prof):
    rank = int(rng.integers(2, 6))
    shape = _shape(rng, rank)
    dtype = str(rng.choice(ELTWISE_DTYPES))
    letters = GENERIC[:rank]
    entry = {"shape": shape, "dtype": dtype, "policy": _policy(rng, prof),
             **_eltwise_params(rng),
             "src": layout(rng, letters, shape, dtype, prof),
             "dst": layout(rng, letters, shape, dtype, prof)}
    return _inplace(rng, entry, "src")


def _binary(rng, prof):
    rank = int(rng.integers(2, 6))
    shape0 = _shape(rng, rank)
    shape1 = [1 if rng.random() < 0.3 else n for n in shape0]
    if rng.random() < 0.2:   # broadcasting both ways: src0 has the 1s
        shape0, shape1 = shape1, shape0
    out = [max(a, b) for a, b in zip(shape0, shape1)]
    dtype = str(rng.choice(BINARY_DTYPES))
    letters = GENERIC[:rank]
    entry = {"shape": shape0, "shape1": shape1, "dtype": dtype, "policy": _policy(rng, prof),
             "algorithm": str(rng.choice(["add", "mul"])),
             "src0": layout(rng, letters, shape0, dtype, prof),
             "src1": layout(rng, letters, shape1, dtype, prof),
             "dst": layout(rng, letters, out, dtype, prof)}
    if shape0 == out:        # in place overwrites src0, so src0 must have dst's shape
        _inplace(rng, entry, "src0")
    return entry


def _softmax(rng, prof):
    rank = int(rng.integers(2, 6))
    shape = _shape(rng, rank)
    letters = GENERIC[:rank]
    entry = {"shape": shape, "policy": _policy(rng, prof),
             "axis": int(rng.integers(-rank, rank)),
             "log": bool(rng.random() < 0.4),
             "src": layout(rng, letters, shape, "float32", prof),
             "dst": layout(rng, letters, shape, "float32", prof)}
    return _inplace(rng, entry, "src")


def window_ok(n, k, s, p, d) -> bool:
    """Every window of a pooling holds at least one cell of the image (an average over no
    cells is undefined, and pool refuses such a geometry by design)."""
    out = (n + 2 * p - d * (k - 1) - 1) // s + 1
    return out >= 1 and all(any(0 <= o * s - p + i * d < n for i in range(k)) for o in range(out))


def _spatial(rng, h, w):
    """kernel, stride, pad, dilation pairs (each per dim) that fit an h x w image."""
    for _ in range(100):
        kernel = [int(rng.choice([1, 2, 3, 3, 5])) for _ in range(2)]
        stride = [int(rng.choice([1, 1, 2, 3])) for _ in range(2)]
        dilation = [int(rng.choice([1, 1, 1, 2])) for _ in range(2)]
        pad = [int(rng.integers(0, (k - 1) * d + 1)) if rng.random() < 0.7 else 0
               for k, d in zip(kernel, dilation)]
        if all(window_ok(n, k, s, p, d) for n, k, s, p, d in
               zip((h, w), kernel, stride, pad, dilation)):
            return kernel, stride, pad, dilation
    return [1, 1], [1, 1], [0, 0], [1, 1]


def _pool(rng, prof):
    shape = [int(rng.integers(1, 3)), int(rng.integers(1, 21)), *_shape(rng, 2)]
    kernel, stride, pad, dilation = _spatial(rng, *shape[2:])
    out = [shape[0], shape[1], *((n + 2 * p - d * (k - 1) - 1) // s + 1 for n, k, s, p, d in
                                 zip(shape[2:], kernel, stride, pad, dilation))]
    return {"shape": shape, "policy": _policy(rng, prof),
            "algorithm": str(rng.choice(["max", "avg"])),
            "exclude_pad": bool(rng.random() < 0.5), "kernel": kernel, "stride": stride,
            "pad": pad, "dilation": dilation,
            "src": layout(rng, "nchw", shape, "float32", prof, block="chw", halo="hw"),
            "dst": layout(rng, "nchw", out, "float32", prof, block="chw", halo="hw")}


def _post_ops(rng, dst_dtype):
    """A chain of up to three entries: bias (once, by design: one bias per chain), eltwise,
    sums (a scale, a zero point, a tensor in the other type of dst's size: oneDNN's sum data
    type) and binary post-ops of every algorithm and operand shape."""
    chain = []
    for _ in range(int(rng.choice([0, 0, 1, 2, 3]))):
        kind = str(rng.choice(["bias", "eltwise", "eltwise", "sum", "binary"]))
        if kind == "bias" and any(p["kind"] == "bias" for p in chain):
            continue
        if kind == "eltwise":
            chain.append({"kind": "eltwise", **_eltwise_params(rng)})
        elif kind == "sum":
            p = {"kind": "sum", "scale": float(rng.choice([1.0, 0.5]))}
            if rng.random() < 0.3:
                p["zero_point"] = int(rng.integers(-3, 4))
            if dst_dtype in SUM_DT and rng.random() < 0.2:
                p["dt"] = SUM_DT[dst_dtype]
            chain.append(p)
        elif kind == "binary":
            chain.append({"kind": "binary", "algorithm": str(rng.choice(BINARY_POST_OPS)),
                          "operand": str(rng.choice(BINARY_OPERANDS))})
        else:
            chain.append({"kind": "bias"})
    return chain


def _dot_tensors(rng, entry, dst_letters, dst_shape, prof):
    """dst's layout; each sum post-op's: oneDNN's sum reads a tensor laid out like the
    destination (the same padded dims and halo), so it takes dst's layout, by design; a full
    binary operand's, any layout of dst's shape (per-tensor and per-channel ones are 1-D)."""
    nchw = dst_letters == "nchw"

    def draw():
        return layout(rng, dst_letters, dst_shape, "float32", prof,
                      block="chw" if nchw else "ba", halo="hw" if nchw else None)

    entry["dst"] = draw()
    chain = entry["post_ops"]
    for p, name in zip(chain, post_op_tensors(chain)):
        if p["kind"] == "sum":
            entry[name] = entry["dst"]
        elif p["kind"] == "binary" and p["operand"] == "full":
            entry[name] = draw()
    return entry


def _conv2d(rng, prof):
    dtype = str(rng.choice(prof.dot_dtypes))
    n, h, w = int(rng.integers(1, 3)), *_shape(rng, 2)
    r = rng.random()
    if r < 0.6:
        groups, c, k = 1, int(rng.integers(1, 41)), int(rng.integers(1, 41))
    elif r < 0.8:
        groups = int(rng.choice([2, 3, 4]))
        c, k = groups * int(rng.integers(1, 9)), groups * int(rng.integers(1, 9))
    else:                                            # depthwise, with a channel multiplier
        c = int(rng.integers(1, 25))
        groups, k = c, c * int(rng.choice([1, 1, 2]))
    kernel, stride, pad, dilation = _spatial(rng, h, w)
    out = [(m + 2 * p - d * (q - 1) - 1) // s + 1
           for m, q, s, p, d in zip((h, w), kernel, stride, pad, dilation)]
    wdtype = "int8" if dtype in QUANTIZED_DTYPES else dtype
    if groups == 1:
        wshape, wletters, wblock = [k, c, *kernel], "oihw", "io"
    else:
        wshape, wletters = [groups, k // groups, c // groups, *kernel], "goihw"
        wblock = "g" if c == groups else "io"
    entry = {"shape": [n, c, h, w], "dtype": dtype, "channels": k, "groups": groups,
             "kernel": kernel, "stride": stride, "pad": pad, "dilation": dilation,
             "spatial_pad": str(rng.choice(["fused", "stage"])), "policy": _policy(rng, prof),
             "post_ops": _post_ops(rng, DST_TYPES.get(dtype, "float32")),
             "src": layout(rng, "nchw", [n, c, h, w], dtype, prof, block="chw",
                           halo="hw"),
             "weights": layout(rng, wletters, wshape, wdtype, prof, block=wblock,
                               halo="", permute=False)}
    return _sum_inplace(rng, _quant(rng, _dot_tensors(rng, entry, "nchw", [n, k, *out], prof)))


def _sum_inplace(rng, entry):
    """In place over the first sum with probability 1/4, where it has dst's type (its layout
    is dst's already): oneDNN's sum post-op accumulating into the destination's memory."""
    sums = [p for p in entry["post_ops"] if p["kind"] == "sum"]
    return _inplace(rng, entry, "sum") if sums and "dt" not in sums[0] else entry


def _quant(rng, entry):
    """oneDNN's quantization attributes on an integer kernel (a quarter keep today's
    defaults): half promise 7-bit weights (``weight_bits = 7``), a source zero point over the
    source type's range, per-tensor or per-channel
    scales, a destination type with a zero point inside its range and a scale that spreads
    the chain's values (of order one) over it, saturating some; an int32 bias, first in the
    chain by design (it is added to the accumulator)."""
    if entry["dtype"] not in QUANTIZED_DTYPES or rng.random() < 0.25:
        return entry
    lo, hi = np.iinfo(entry["dtype"]).min, np.iinfo(entry["dtype"]).max
    dst = str(rng.choice(["float32", "int32", "int8", "uint8"]))
    zlo, zhi = {"int8": (-20, 20), "uint8": (0, 255)}.get(dst, (-1000, 1000))
    if rng.random() < 0.5:   # weights in [-64, 64]: x86 takes one vpmaddubsw a step
        entry["weight_bits"] = 7
    entry.update(src_zero_point=int(rng.integers(lo, hi + 1)) if rng.random() < 0.8 else 0,
                 scales=str(rng.choice(["channel", "tensor"])), dst_dtype=dst,
                 # 0.5: a power of two, a multiply to LLVM (other code: targets._X86_LLVM)
                 dst_scale=float(rng.choice([1.0, 0.05, 0.02, 0.5])),
                 dst_zero_point=int(rng.integers(zlo, zhi + 1)) if rng.random() < 0.7 else 0)
    chain = entry["post_ops"]
    for p in chain:
        if "dt" in p:    # drawn for a float32 destination: now dst's other type of its size
            p["dt"] = SUM_DT[dst]
    bias = [p for p in chain if p["kind"] == "bias"]
    if bias and rng.random() < 0.5:
        entry["post_ops"] = [{"kind": "bias", "dtype": "int32"},
                             *(p for p in chain if p["kind"] != "bias")]
    if dst in QUANTIZED_DTYPES and rng.random() < 0.5:   # last in the chain by design
        entry["post_ops"].append(_quantized_add(rng, dst, entry["dst_zero_point"]))
        entry["addend"] = entry["dst"]   # laid out like dst, as a sum's tensor
    return entry


def _quantized_add(rng, dst, value_zero_point):
    """A quantized model's residual add after the destination's rounding: an addend of either
    8-bit type, zero points inside each operand's type (the value's is the destination's, as
    a graph fuses it), scales of the size a quantized network has (the two operands' sum of
    order one lands inside the result's range, the larger ones saturate), either operand
    order."""
    addend = str(rng.choice(QUANTIZED_DTYPES))

    def zero_point(t):
        return int(rng.integers(np.iinfo(t).min, np.iinfo(t).max + 1))
    return {"kind": QUANTIZED_ADD,
            "scales": [float(rng.choice([0.01, 0.02, 0.05, 0.1])) for _ in range(3)],
            "zero_points": [value_zero_point, zero_point(addend), zero_point(dst)],
            "addend_first": bool(rng.random() < 0.5), "dt": addend}


def _matmul(rng, prof):
    dtype = str(rng.choice(prof.dot_dtypes))
    m, kk, n = int(rng.integers(1, 18)), int(rng.integers(1, 71)), int(rng.integers(1, 41))
    wdtype = "int8" if dtype in QUANTIZED_DTYPES else dtype
    entry = {"shape": [m, kk], "dtype": dtype, "n": n, "policy": _policy(rng, prof),
             "post_ops": _post_ops(rng, DST_TYPES.get(dtype, "float32")),
             "src": layout(rng, "ab", [m, kk], dtype, prof, block="ba"),
             "weights": layout(rng, "ab", [kk, n], wdtype, prof, block="ba", halo="")}
    return _sum_inplace(rng, _quant(rng, _dot_tensors(rng, entry, "ab", [m, n], prof)))


def _inner_chains(rng):
    """``expand_post_ops`` and ``depthwise_post_ops``: up to two eltwise entries each, with one
    ``exp`` at most over both, by design: an exp of an exp's sum (or of an exp) passes float32's
    largest value where float64's does not, and the reduction that follows turns the infinities
    into NaN (inf - inf) where the float64 reference has a finite value, a result no bound
    covers. One exp keeps every inner value far below it (exp of a sum of order one)."""
    chains = []
    for _ in range(2):
        chains.append([{"kind": "eltwise", **_eltwise_params(rng)}
                       for _ in range(int(rng.choice([0, 1, 1, 2])))])
    seen = False
    for chain in chains:
        for i, p in enumerate(chain):
            if p["algorithm"] == "exp":
                if seen:
                    chain[i] = {"kind": "eltwise", "algorithm": "sigmoid", "alpha": 0.0,
                                "beta": 0.0}
                seen = True
    return chains


def _inverted_residual(rng, prof):
    """MobileNetV2's block: channels C -> E -> K (none a block multiple by design, E as often
    a multiple of C as not), an odd depthwise window (its padding is kernel // 2), stride 1 or
    2; the weights in conv2d's tags: (E, C, 1, 1) and (K, E, 1, 1) like groups = 1 weights,
    (E, 1, 1, KH, KW) like depthwise ones (``Goihw8g``, ``goihw``)."""
    dtype = "float64" if rng.random() < 0.2 else "float32"
    n, h, w = int(rng.integers(1, 3)), *_shape(rng, 2, 12)
    c = int(rng.integers(1, 25))
    e = c * int(rng.choice([1, 2, 3, 4, 6])) if rng.random() < 0.5 else int(rng.integers(1, 49))
    k = int(rng.integers(1, 25))
    side = int(rng.choice([1, 3, 3, 5]))
    kernel = [side, side] if rng.random() < 0.75 else [side, int(rng.choice([1, 3, 5]))]
    s = int(rng.choice([1, 2]))
    stride = [s, s] if rng.random() < 0.8 else [s, 3 - s]
    out = [(m - 1) // q + 1 for m, q in zip((h, w), stride)]
    expand_post_ops, depthwise_post_ops = _inner_chains(rng)
    entry = {"shape": [n, c, h, w], "dtype": dtype, "expanded": e, "channels": k,
             "kernel": kernel, "stride": stride, "policy": _policy(rng, prof),
             "expand_post_ops": expand_post_ops, "depthwise_post_ops": depthwise_post_ops,
             "post_ops": _post_ops(rng, dtype),
             "src": layout(rng, "nchw", [n, c, h, w], dtype, prof, block="chw", halo="hw"),
             "expand_weights": layout(rng, "oihw", [e, c, 1, 1], dtype, prof, block="io",
                                      halo="", permute=False),
             "depthwise_weights": layout(rng, "goihw", [e, 1, 1, *kernel], dtype, prof,
                                         block="g", halo="", permute=False),
             "weights": layout(rng, "oihw", [k, e, 1, 1], dtype, prof, block="io", halo="",
                               permute=False)}
    return _dot_tensors(rng, entry, "nchw", [n, k, *out], prof)


_MAKERS = {"reorder": _reorder, "zero_pad": _zero_pad, "eltwise": _eltwise, "binary": _binary,
           "conv2d": _conv2d, "matmul": _matmul, "softmax": _softmax, "pool": _pool,
           "inverted_residual": _inverted_residual}
