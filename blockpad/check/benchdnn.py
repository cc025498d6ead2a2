"""oneDNN's benchdnn convolution problems as ``blockpad check`` cases (``--benchdnn FILE``).

oneDNN tests its convolutions with benchdnn batch files: options (``--dt=u8:s8:u8``,
``--attr-zero-points=src:common:5``, ``--attr-post-ops=sum:1.5+relu``) that hold until
``--reset``, and problem descriptors (``mb2ic64ih56oc64oh56kh3ph1n"res2a"``) that each make one
problem with the options in force. ``--batch=FILE`` reads another file (beside this one) under
the same options, and a comma in an option's value lists alternatives: every combination is a
problem. ``problems`` reads such a file and turns each forward problem into a conv2d checker
case, or says in words why blockpad's conv2d cannot state it (a 3-D problem, a weight zero
point, a per-channel destination zero point, an eltwise algorithm it lacks, ...), so that a
batch answers "which of oneDNN's problems can blockpad express, and are those exact?".

What a case keeps of its problem, and what it does not:

* the shape (a 1-D problem as the 2-D one of height 1), groups, strides, dilation (benchdnn
  counts 0 as dense, blockpad 1) and padding: the front pads as given (or derived as benchdnn
  derives them when left out), the back pads what the output size implies,
  ``(o - 1) * s - i + (k - 1) * (d + 1) + 1 - p``. That is asymmetric where it differs from
  the front, and negative where the output stops short of the input's end: a negative back
  pad smaller than the stride drops no output (0 here), a larger one would crop the source,
  which conv2d does not;
* data types, the direction's bias (``FWD_B``: a bias first in the chain, float32 on integer
  kernels, as oneDNN's), zero points, scales, post-ops and destination types: the attributes,
  not their values. The source and weight scales fold into conv2d's one per-channel or
  per-tensor scale, whose values the checker draws as it draws the data; the destination
  scale, the zero points and the post-ops' parameters keep benchdnn's values. A binary
  post-op's integer operand is read in the chain's float32 (exact for 8-bit values; the
  checker draws float ones);
* memory formats: ``axb`` is channels-last (``nhwc``), ``abx`` plain, ``aBcd8b``/``aBcd16b``
  blocked; ``any`` (benchdnn's default: the library picks) is the blocked layout of blockpad's
  dot-product kernels (``nChw16c`` data, ``OIhw4i16o4i`` int8, ``OIhw8i16o2i`` bf16 or
  ``OIhw16i16o`` float weights, grouped ``gOIhw...``, depthwise ``Goihw16g``);
* ``--alg=auto`` runs the direct convolution (one the library may choose); ``--alg=wino`` is
  not checked here: a Winograd kernel takes weights already transformed;
* padding policies are not benchdnn's: problem ``k`` runs under the ``k``-th of the target's
  policies, round robin, so a batch covers every one.

A case that the spec refuses (``parse_spec``) is reported with the spec's message, as not
expressible: nothing is dropped silently.
"""

from __future__ import annotations

import itertools
import os
import re
import shlex
from dataclasses import dataclass

from blockpad.errors import SpecError
from blockpad.layout import window_out_size
from blockpad.vocabulary import BINARY_POST_OPS, QUANT_DST_DTYPES, QUANTIZED_DTYPES, post_op_tensors

from .generate import PROFILES

TYPES = {"f32": "float32", "f64": "float64", "f16": "float16", "bf16": "bfloat16",
         "s32": "int32", "s8": "int8", "u8": "uint8"}
DESCRIPTOR = re.compile(r"(g|mb|ic|id|ih|iw|oc|od|oh|ow|kd|kh|kw|sd|sh|sw|pd|ph|pw|dd|dh|dw)(\d+)")
#: options that steer benchdnn's harness (which implementation, how long, how to report) and
#: mean nothing for what a problem computes
HARNESS = {"skip-impl", "impl", "allow-unimpl", "check-ref-impl", "attr-scratchpad",
           "allow-enum-tags-only", "mode", "perf-template", "engine", "fix-times-per-prb",
           "max-ms-per-prb", "repeats-per-prb", "ctx-init", "ctx-exe", "canonical", "verbose",
           "attr-deterministic", "match", "start", "cold-cache", "memory-kind", "summary",
           "num-streams", "stream-kind", "execution-mode"}
DEFAULTS = {"dir": "FWD_B", "dt": "f32", "mb": "0", "alg": "direct", "stag": "any",
            "wtag": "any", "dtag": "any", "attr-scales": "", "attr-zero-points": "",
            "attr-post-ops": "", "attr": ""}
#: benchdnn's eltwise algorithms that conv2d's eltwise post-op computes, by blockpad's name
ELTWISE = {"relu": "relu", "linear": "linear", "clip": "clip", "clip_v2": "clip",
           "tanh": "tanh", "logistic": "sigmoid", "exp": "exp", "gelu_erf": "gelu_erf",
           "gelu_tanh": "gelu_tanh", "bounded_relu": "clip", "abs": "abs", "round": "round",
           "swish": "swish"}
DATA_TAGS = {"any": None, "axb": "nhwc", "abx": "nchw", "abcd": "nchw", "acdb": "nhwc",
             "aBcd8b": "nChw8c", "aBcd16b": "nChw16c", "aBcd4b": "nChw4c"}


class Unsupported(Exception):
    """What a problem asks that blockpad's conv2d does not state."""


@dataclass(frozen=True)
class Problem:
    """One benchdnn problem: where it was read, the problem as a benchdnn line (the options
    in force that differ from the defaults, then the descriptor), and either its checker case
    or why there is none."""

    where: str
    line: str
    entry: dict | None
    reason: str | None = None


def problems(path: str, target: str) -> list[Problem]:
    """Every problem of the batch file ``path`` (and the files it includes), for ``target``."""
    out: list[Problem] = []
    _read(path, dict(DEFAULTS), out, target, depth=0)
    return out


def _read(path, opts, out, target, depth):
    if depth > 8:
        raise SpecError(f"{path}: --batch nests more than 8 deep (a file that includes itself?)")
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise SpecError(f"benchdnn batch {path}: cannot read it ({e})") from None
    for n, line in enumerate(lines, 1):
        try:
            tokens = shlex.split(line, comments=True)
        except ValueError as e:
            raise SpecError(f"{path}:{n}: cannot split the line ({e})") from None
        for tok in tokens:
            where = f"{os.path.basename(path)}:{n}"
            if not tok.startswith("--"):
                for combo in _alternatives(opts):
                    out.append(_problem(where, combo, tok, len(out), target))
                continue
            key, _, value = tok[2:].partition("=")
            if key == "reset":
                opts.clear()
                opts.update(DEFAULTS)
            elif key == "batch":
                inc = os.path.join(os.path.dirname(path), value)
                if os.path.isfile(inc):
                    _read(inc, opts, out, target, depth + 1)
                else:       # its problems are unknown: say so where they would be
                    out.append(Problem(where, tok, None, f"batch file {value} is missing "
                                       f"beside {os.path.basename(path)}"))
            elif key == "cfg":
                opts["dt"] = value
            elif key not in HARNESS:
                opts[key] = value       # an unknown option makes its problems unsupported


def _alternatives(opts) -> list[dict]:
    """Every combination of the options' comma-separated values."""
    keys = list(opts)
    values = [opts[k].split(",") if opts[k] else [""] for k in keys]
    return [dict(zip(keys, combo)) for combo in itertools.product(*values)]


def _problem(where, opts, desc, k, target) -> Problem:
    line = " ".join([*(f"--{key}={v}" for key, v in opts.items()
                       if v != DEFAULTS.get(key)), desc])
    try:
        entry = case(opts, desc, k, target)
    except (Unsupported, SpecError) as e:
        return Problem(where, line, None, str(e))
    return Problem(where, line, entry)


def descriptor(text: str) -> dict:
    """A benchdnn convolution descriptor's 2-D geometry: ``mb ic ih iw oc oh ow kh kw sh sw
    (ph, pb) (pw, pr) dh dw g`` with benchdnn's implicit rules applied (``iw`` defaults to
    ``ih`` and so on; an absent output is computed, an absent pad derived). A 1-D problem is
    the 2-D one of height 1 (its ``(N, C, W)`` memory is the ``(N, C, 1, W)`` one of every
    layout here). Raises ``Unsupported`` for 3-D problems, ``SpecError`` for text that is no
    descriptor."""
    d = {"g": 1, "mb": 2, "sd": 1, "sh": 1, "sw": 1, "dd": 0, "dh": 0, "dw": 0,
         "pd": -1, "ph": -1, "pw": -1}
    i = 0
    while i < len(text):
        if text[i] == "_":
            i += 1
            continue
        if text[i] == "n":            # the problem's name: the rest
            break
        m = DESCRIPTOR.match(text, i)
        if m is None:
            raise SpecError(f"{text!r}: not a benchdnn convolution descriptor (at {text[i:]!r})")
        d[m[1]] = int(m[2])
        i = m.end()
    if not d.get("ic") or not d.get("oc"):
        raise SpecError(f"{text!r}: a descriptor needs ic and oc")

    def absent(x):
        return (d.get("i" + x, 0) | d.get("k" + x, 0) | d.get("o" + x, 0) | d["d" + x]) == 0 \
            and d["s" + x] == 1 and d["p" + x] < 1

    if not absent("d"):
        raise Unsupported("a 3-D convolution (id/kd/od given): conv2d is 2-D")
    if absent("h"):     # 1-D: the same memory as a 2-D problem of height 1
        if absent("w"):
            raise SpecError(f"{text!r}: a descriptor needs ih or iw")
        d.update(ih=1, kh=1, oh=1, ph=0)
    elif absent("w"):
        for a in ("i", "k", "o", "s", "p", "d"):
            d[a + "w"] = d.get(a + "h", 0) if a in "iko" else d[a + "h"]
    geo = {"mb": d["mb"], "ic": d["ic"], "oc": d["oc"], "g": d["g"]}
    for x in "hw":
        i_, k_ = d.get("i" + x, 0), d.get("k" + x, 0)
        if not i_ or not k_:
            raise SpecError(f"{text!r}: a descriptor needs i{x} and k{x}")
        s, dil, p, o = d["s" + x], d["d" + x], d["p" + x], d.get("o" + x, 0)
        span = (k_ - 1) * (dil + 1) + 1
        if not o:
            p = max(p, 0)
            o = _trunc(i_ - span + 2 * p, s) + 1
        elif p < 0:
            p = _trunc((o - 1) * s - i_ + span, 2)
        back = (o - 1) * s - i_ + span - p
        if o < 1 or p < 0:
            raise Unsupported(f"{text}: output {o}, pad {p} along {x}: no valid window")
        if back < 0:
            if -back >= s:
                raise Unsupported(f"back padding {back} along {x} (the output stops "
                                  f"{-back} rows short of the source's end): conv2d's pads "
                                  f"are >= 0")
            back = 0        # fewer than a stride: no output is lost
        geo.update({"i" + x: i_, "o" + x: o, "k" + x: k_, "s" + x: s, "d" + x: dil + 1,
                    "p" + x: (p, back)})
    return geo


def _trunc(a: int, b: int) -> int:
    """C's integer division (toward zero), as benchdnn computes."""
    q = abs(a) // b
    return q if a >= 0 else -q


def _types(dt: str) -> tuple:
    parts = dt.split(":") if ":" in dt else re.findall(r"bf16|f16|f32|f64|s32|s8|u8", dt)
    if "".join(parts) != dt.replace(":", "") or len(parts) not in (1, 3):
        raise Unsupported(f"data types {dt!r}")
    unknown = [p for p in parts if p not in TYPES]
    if unknown:
        raise Unsupported(f"data type {unknown[0]}")
    src, wei, dst = (TYPES[p] for p in (parts * 3 if len(parts) == 1 else parts))
    if src in QUANTIZED_DTYPES:
        if wei != "int8":
            raise Unsupported(f"{wei} weights on a {src} source: int8 weights only")
        if dst not in QUANT_DST_DTYPES:
            raise Unsupported(f"a {dst} destination of an integer convolution "
                              f"({', '.join(QUANT_DST_DTYPES)})")
    elif src != wei or not (dst == src or (src == "bfloat16" and dst == "float32")):
        raise Unsupported(f"types {dt}: a {src} convolution takes {src} weights and writes "
                          f"{src}" + (" or float32" if src == "bfloat16" else ""))
    return src, dst


def _scales(text: str, legacy_oscale: str | None) -> tuple:
    """``(scales, dst_scale, any_given)`` from ``--attr-scales`` (or the legacy oscale). A
    trailing ``*`` (oneDNN v2's scale given at run time, not at build time) is the same scale
    to blockpad: its kernels read scales as arguments on every call."""
    scales, dst_scale, given = "tensor", 1.0, False
    if legacy_oscale:
        policy = legacy_oscale.split(":")[0]
        if policy not in ("common", "per_oc"):
            raise Unsupported(f"output scale policy {policy}")
        return ("channel" if policy == "per_oc" else "tensor"), 1.0, True
    for item in filter(None, text.split("+")):
        arg, policy, *rest = item.split(":") + [""]
        given = True
        if arg == "wei" and policy in ("per_oc", "per_dim_0"):
            scales = "channel"
        elif policy != "common":
            raise Unsupported(f"a {policy} {arg} scale (per tensor only, but for the weights)")
        elif arg == "dst":
            value = rest[0].rstrip("*")
            dst_scale = float(value) if value else 1.0
        elif arg not in ("src", "wei"):
            raise Unsupported(f"a scale on {arg}")
    return scales, dst_scale, given


def _zero_points(text: str) -> dict:
    out = {}
    for item in filter(None, text.split("+")):
        arg, policy, *rest = item.split(":") + [""]
        if arg == "wei":
            raise Unsupported("a weight zero point (blockpad's int8 weights are symmetric)")
        if arg not in ("src", "dst"):
            raise Unsupported(f"a zero point on {arg}")
        if policy != "common":
            raise Unsupported(f"a {policy} {arg} zero point (per tensor only)")
        if not rest[0]:
            raise Unsupported(f"a {arg} zero point without a value (a runtime one)")
        out[f"{arg}_zero_point"] = int(rest[0])
    return out


def _post_op(item: str, mb: int) -> list:
    name, *args = item.split(":")
    if name == "sum":
        p = {"kind": "sum"}
        if args and args[0]:
            p["scale"] = float(args[0])
        if len(args) > 1 and args[1]:
            p["zero_point"] = int(args[1])
        if len(args) > 2 and args[2]:
            if args[2] not in TYPES:
                raise Unsupported(f"sum data type {args[2]}")
            p["dt"] = TYPES[args[2]]
        return [p]
    if name in ELTWISE:
        nums = [float(a) if a else 0.0 for a in args]
        alpha, beta, scale = (nums + [0.0, 0.0, 1.0][len(nums):])[:3]
        if name == "bounded_relu":
            alpha, beta = 0.0, alpha
        out = [{"kind": "eltwise", "algorithm": ELTWISE[name], "alpha": alpha, "beta": beta}]
        if scale != 1.0:        # oneDNN v1/v2's eltwise scale: scale * eltwise(v)
            out.append({"kind": "eltwise", "algorithm": "linear", "alpha": scale, "beta": 0.0})
        return out
    if name in BINARY_POST_OPS:
        if name == "prelu":
            policy = args[0] if args else "common"
        else:
            if args and args[0] not in TYPES:
                raise Unsupported(f"binary {name} operand type {args[0]}")
            policy = args[1] if len(args) > 1 and args[1] else "common"
        return [{"kind": "binary", "algorithm": name, "operand": _operand(policy, mb)}]
    raise Unsupported(f"post-op {name!r}")


def _operand(policy: str, mb: int) -> str:
    """A binary operand's broadcast, benchdnn's policy or mask (bit i: the operand has dst's
    dim i), as conv2d's operand shapes: one value, one per channel, or dst's shape."""
    masks = {"common": 0, "per_oc": 2, "per_dim_1": 2, "per_tensor": 15}
    mask = masks.get(policy, int(policy) if policy.isdigit() else None)
    if mb == 1 and mask is not None:
        mask |= 1        # a batch of one: broadcasting over it changes nothing
    shapes = {0: "tensor", 1: "tensor", 2: "channel", 3: "channel", 15: "full"}
    if mask not in shapes:
        raise Unsupported(f"a binary operand broadcast as {policy} (one value, one per "
                          f"channel or dst's shape)")
    return shapes[mask]


def _chain(opts: dict, mb: int) -> tuple:
    """The post-op chain and the legacy output scale of ``--attr-post-ops`` / ``--attr``."""
    text, oscale = opts["attr-post-ops"], None
    items = [i for i in text.split("+") if i]
    if opts["attr"]:
        fields: dict = {}
        key = None
        for seg in opts["attr"].split(";"):    # quotes are gone: a ';' may be a post-op's
            k, eq, v = seg.partition("=")
            if eq and k in ("oscale", "post_ops", "zero_points", "scales", "scratchpad"):
                key, fields[k] = k, v
            elif key is not None:
                fields[key] += ";" + seg
            else:
                raise Unsupported(f"--attr field {seg!r}")
        if "zero_points" in fields or "scales" in fields:
            raise Unsupported("the legacy --attr zero_points/scales fields")
        oscale = fields.get("oscale")
        items += [i for i in fields.get("post_ops", "").split(";") if i]
    chain = []
    for item in items:
        chain += _post_op(item, mb)
    return chain, oscale


def _layouts(opts, geo, src: str) -> tuple:
    tags = {}
    for t in ("stag", "dtag"):
        if opts[t] not in DATA_TAGS:
            raise Unsupported(f"--{t}={opts[t]}")
        tags[t] = DATA_TAGS[opts[t]] or "nChw16c"
    if opts["wtag"] != "any":
        raise Unsupported(f"--wtag={opts['wtag']} (weights in the kernel's own blocked layout)")
    inner = {"uint8": "4i16o4i", "int8": "4i16o4i", "bfloat16": "8i16o2i"}.get(src, "16i16o")
    g = geo["g"]
    if g == 1:
        wei = "OIhw" + inner
    elif g == geo["ic"] and g == geo["oc"]:
        wei = "Goihw16g"
    else:
        wei = "gOIhw" + inner
    return tags["stag"], wei, tags["dtag"]


def case(opts: dict, desc: str, k: int, target: str) -> dict:
    """The checker case of one problem (``opts``: one value per option), ``k``-th of its
    batch; ``Unsupported`` or ``SpecError`` say why there is none."""
    from blockpad.codegen.spec import parse_spec

    unknown = sorted(key for key in opts if key not in DEFAULTS)
    if unknown:
        raise Unsupported(f"option --{unknown[0]}")
    if opts["dir"] not in ("FWD_B", "FWD_D", "FWD_I"):
        raise Unsupported(f"direction {opts['dir']} (forward only)")
    if opts["alg"] == "wino":
        raise Unsupported("a Winograd convolution: the checker feeds a kernel random weights, "
                          "and a Winograd kernel takes them transformed (tests/test_winograd.py "
                          "checks those against a direct reference)")
    if opts["alg"] not in ("direct", "auto"):   # auto: the library's choice; direct is one
        raise Unsupported(f"algorithm {opts['alg']}")
    geo = descriptor(desc)
    if int(opts["mb"] or 0) > 0:
        geo["mb"] = int(opts["mb"])
    src, dst = _types(opts["dt"])
    chain, oscale = _chain(opts, geo["mb"])
    scales, dst_scale, scaled = _scales(opts["attr-scales"], oscale)
    zps = _zero_points(opts["attr-zero-points"])
    quant = {}
    if src in QUANTIZED_DTYPES:
        quant = {"scales": scales, "dst_dtype": dst, "dst_scale": dst_scale, **zps}
    elif scaled or zps:
        raise Unsupported(f"scales or zero points on a {src} convolution (integer ones only)")
    elif src == "bfloat16":
        quant = {"dst_dtype": dst}
    if opts["dir"] == "FWD_B":
        chain = [{"kind": "bias"}, *chain]
    g = geo["g"]
    if geo["ic"] % g or geo["oc"] % g:
        raise Unsupported(f"groups {g} do not divide ic {geo['ic']} and oc {geo['oc']}")
    stag, wtag, dtag = _layouts(opts, geo, src)
    policies = PROFILES[target].policies
    entry = {"name": f"case{k}", "op": "conv2d", "shape": [geo["mb"], geo["ic"], geo["ih"],
                                                           geo["iw"]],
             "dtype": src, "channels": geo["oc"], "groups": g,
             "kernel": [geo["kh"], geo["kw"]], "stride": [geo["sh"], geo["sw"]],
             "pad": [list(geo["ph"]), list(geo["pw"])], "dilation": [geo["dh"], geo["dw"]],
             "spatial_pad": "fused", "policy": policies[k % len(policies)],
             "post_ops": chain, "src": stag, "weights": wtag, "dst": dtag, **quant}
    for p, name in zip(chain, post_op_tensors(chain)):
        if p["kind"] == "sum" or p.get("operand") == "full":
            entry[name] = dtag
    try:
        parse_spec({"kernel": [entry]})
    except SpecError as e:
        raise Unsupported(f"blockpad's spec refuses it: {e}") from None
    if any(geo["o" + x] != window_out_size(geo["i" + x], geo["k" + x], geo["s" + x],
                                           geo["p" + x], geo["d" + x]) for x in "hw"):
        raise SpecError(f"{desc}: internal: blockpad's output size differs from benchdnn's")
    return entry
