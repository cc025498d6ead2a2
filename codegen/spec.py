"""Build specs: a TOML file listing kernels by op, layouts, shapes and dtypes.

    [[kernel]]
    op = "reorder"
    shapes = [[2, 30, 5, 7], [1, 64, 56, 56]]   # or shape = [...]
    dtypes = ["float32", "bfloat16"]             # or dtype = "..."
    src = "nchw"
    dst = { tag = "nChw16c", paddings = { h = [1, 1] } }

Each entry expands to one kernel per shape x dtype."""

from __future__ import annotations

import hashlib
import itertools
import json
import tomllib
from dataclasses import dataclass

from blockpad.errors import BlockpadError, SpecError
from blockpad.layout import Layout
from blockpad.vocabulary import DEFAULT_POLICY

from .kernel import check_inplace
from .ops import OPS
from .policy import check_policy

_SHORT = {"float64": "f64", "float32": "f32", "float16": "f16", "bfloat16": "bf16", "int64": "s64",
          "int32": "s32", "int16": "s16", "int8": "s8", "uint64": "u64", "uint32": "u32",
          "uint16": "u16", "uint8": "u8"}


@dataclass(frozen=True)
class KernelRequest:
    name: str
    op: str
    layouts: tuple      # (tensor name, Layout) pairs in the op's call order
    params: tuple = ()  # (name, value) pairs, values JSON-able
    policy: str = DEFAULT_POLICY
    entry: int = 0      # which [[kernel]] entry of the spec (1-based) asked for it

    @property
    def layout(self) -> dict:
        return dict(self.layouts)

    def describe(self) -> dict:
        return {"name": self.name, "op": self.op, "policy": self.policy,
                "params": dict(self.params),
                "layouts": {t: l.describe() for t, l in self.layouts}}


@dataclass(frozen=True)
class Spec:
    name: str
    kernels: tuple
    policy: str = DEFAULT_POLICY

    def digest(self) -> str:
        text = json.dumps([k.describe() for k in self.kernels], sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()


def load_spec(path) -> Spec:
    try:
        with open(path, "rb") as f:
            doc = tomllib.load(f)
    except OSError as e:
        raise SpecError(f"{path}: cannot read the spec ({e.strerror})") from None
    except tomllib.TOMLDecodeError as e:
        raise SpecError(f"{path}: not valid TOML ({e})") from None
    return parse_spec(doc, str(path))


def as_spec(spec) -> Spec:
    """A parsed Spec from what ``build`` takes: a Spec, a dict shaped like the TOML (the
    ``[library]`` table and the ``[[kernel]]`` list), or a path to a TOML file."""
    if isinstance(spec, Spec):
        return spec
    if isinstance(spec, dict):
        return parse_spec(spec, "spec dict")
    return load_spec(spec)


def parse_spec(doc: dict, where: str = "spec") -> Spec:
    """Check every entry, and every kernel it expands to, before anything is built: each
    problem names its entry (and kernel, once it has a name), and all of them are listed in
    one SpecError rather than the first hiding the others."""
    if not isinstance(doc, dict):
        raise SpecError(f"{where}: expected a table (dict) with a 'kernel' list; got "
                        f"{type(doc).__name__}")
    entries = doc.get("kernel")
    if not isinstance(entries, list) or not entries:
        raise SpecError(f"{where}: expected one or more [[kernel]] tables; found none")
    library = doc.get("library", {})
    policy = check_policy(library.get("policy", DEFAULT_POLICY))
    kernels, seen, errors = [], {}, []
    for i, entry in enumerate(entries, 1):
        for req in _expand(entry, i, f"{where}: kernel #{i}", policy, errors):
            if req.name in seen:
                errors.append(f"{where}: kernel #{i} makes {req.name!r}, which kernel "
                              f"#{seen[req.name]} already makes; give one a distinct name")
                continue
            seen[req.name] = i
            kernels.append(req)
    if errors:
        raise SpecError(errors[0] if len(errors) == 1 else
                        f"{where}: {len(errors)} problems:\n  " + "\n  ".join(errors))
    return Spec(library.get("name", "kernels"), tuple(kernels), policy)


def _expand(entry, index: int, where: str, library_policy: str, errors: list):
    """The kernel requests of one entry; what is wrong with it goes to ``errors``."""
    if not isinstance(entry, dict):
        errors.append(f"{where}: expected a table; got {entry!r}")
        return
    op_name = entry.get("op")
    if op_name not in OPS:
        errors.append(f"{where}: op: expected one of {', '.join(OPS)}; got {op_name!r}")
        return
    op = OPS[op_name]
    known = {"op", "name", "shape", "shapes", "dtype", "dtypes", "policy", *op.tensors, *op.params}
    if op.inplace:
        known.add("inplace")
    unknown = sorted(set(entry) - known)
    if unknown:
        errors.append(f"{where}: unknown key {', '.join(unknown)} for op {op_name!r}; "
                      f"expected {', '.join(sorted(known))}")
        return
    try:
        shapes = _one_or_many(entry, "shape", "shapes", where)
        dtypes = _one_or_many(entry, "dtype", "dtypes", where, default=["float32"])
        policy = library_policy if op.policy_free else \
            check_policy(entry.get("policy", library_policy))
    except BlockpadError as e:
        errors.append(str(e) if str(e).startswith(where) else f"{where}: {e}")
        return
    params = {k: entry.get(k, v) for k, v in op.params.items()}
    if entry.get("inplace"):
        params["inplace"] = True
    combos = list(itertools.product(shapes, dtypes))
    if "name" in entry and len(combos) > 1:
        errors.append(f"{where}: 'name' names one kernel, but the entry expands to "
                      f"{len(combos)} (shapes x dtypes)")
        return
    for shape, dtype in combos:
        at = where if len(combos) == 1 else f"{where} (shape {shape}, {dtype})"
        try:
            layouts = tuple(_layouts(op, op_name, entry, shape, dtype, params))
        except BlockpadError as e:
            errors.append(f"{at}: {e}")
            continue
        name = entry.get("name") or _default_name(op_name, layouts, params, op.params,
                                                  None if op.policy_free else policy)
        if not isinstance(name, str) or not name.isidentifier():
            errors.append(f"{at}: name must be a C identifier; got {name!r}")
            continue
        try:
            op.validate(dict(layouts), params)
            if params.get("inplace"):
                check_inplace(op.inplace, dict(layouts).get(op.inplace), dict(layouts)["dst"])
        except BlockpadError as e:
            errors.append(f"{where} ({name}): {e}")
            continue
        yield KernelRequest(name, op_name, layouts, tuple(sorted(params.items())), policy,
                            entry=index)


def _layouts(op, op_name, entry, shape, dtype, params):
    signature = op.shapes(shape, dtype, params)
    for t in op.tensors:
        if t not in signature:
            continue          # an optional tensor the parameters switched off
        # default tags are 1-D ones: a tensor of higher rank (a full binary operand) needs its own
        default = op.default_tags.get(t) if len(signature[t][0]) == 1 else None
        if t not in entry and default is None:
            raise SpecError(f"op {op_name!r} needs a layout for {t}")
        yield t, _layout(entry.get(t, default), *signature[t])


def _one_or_many(entry, one, many, where, default=None):
    if one in entry and many in entry:
        raise SpecError(f"{where}: give {one!r} or {many!r}, not both")
    if one in entry:
        return [entry[one]]
    if many in entry:
        if not isinstance(entry[many], list) or not entry[many]:
            raise SpecError(f"{where}: {many!r} must be a non-empty list")
        return entry[many]
    if default is None:
        raise SpecError(f"{where}: expected {one!r} or {many!r}")
    return default


def _layout(value, shape, dtype) -> Layout:
    if isinstance(value, str):
        return Layout(value, shape, dtype)
    if isinstance(value, dict) and "tag" in value:
        extra = sorted(set(value) - {"tag", "paddings", "strides"})
        if extra:
            raise SpecError(f"layout table: unknown key {', '.join(extra)}; expected tag, "
                            f"paddings, strides")
        return Layout(value["tag"], shape, dtype, value.get("paddings"), value.get("strides"))
    raise SpecError(f"layout: expected a tag string or a table with 'tag'; got {value!r}")


def _default_name(op: str, layouts, params, defaults, policy) -> str:
    """``op_tags_dtype_shape``, plus a short hash of whatever else makes the kernel differ
    (parameters, halos, strides, a policy other than the default)."""
    lay = layouts[0][1]
    parts = [op, *(l.tag for _, l in layouts), _SHORT[lay.dtype], "x".join(map(str, lay.shape))]
    name = "_".join(parts)
    extra = {"layouts": [l.describe() for _, l in layouts
                         if l.describe().keys() - {"tag", "shape", "dtype"}],
             "params": {k: v for k, v in params.items() if v != defaults.get(k)},
             "policy": policy if policy not in (None, DEFAULT_POLICY) else None}
    if extra["layouts"] or extra["params"] or extra["policy"]:
        text = json.dumps(extra, sort_keys=True, default=str)
        name += "_" + hashlib.sha256(text.encode()).hexdigest()[:8]
    return name
