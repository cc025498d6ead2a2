"""The manifest written beside every built library: what the build driver writes (``write``)
and the runtime reads (``read``), so it lies below both. Whether a library may be loaded on
this machine is the runtime's check (``runtime.loadable``).

Each kernel's entry has one schema, ``KernelRecord`` with its ``ArgRecord`` arguments: the build
makes them (``codegen.kernel.KernelDef.record``) and writes their JSON form, the runtime reads
them back (``runtime.library.Signature``), and both name fields instead of reading positions."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from importlib import metadata
from typing import NamedTuple

from blockpad.errors import LoadError
from blockpad.layout import Layout

FORMAT = 1
MANIFEST = "manifest.json"
LIBRARY = "kernels.so"


class ArgRecord(NamedTuple):
    """One kernel argument: a tensor in ``layout`` the kernel reads (``role`` ``in``), writes
    (``out``) or both (``inout``), compiled as elements of ``storage`` (bfloat16 moves as
    uint16). A named tuple: its fields are read by name, and ``signature.args[i][2]`` (the
    README's positional form) still gives the layout."""

    name: str
    role: str
    layout: Layout
    storage: str

    def to_json(self) -> dict:
        return {"name": self.name, "role": self.role, "storage": self.storage,
                "layout": self.layout.describe()}

    @classmethod
    def from_json(cls, entry: dict) -> ArgRecord:
        return cls(entry["name"], entry["role"], Layout.from_dict(entry["layout"]),
                   entry["storage"])


@dataclass(frozen=True)
class KernelRecord:
    """One kernel of a library: its name in the module, the op, the op's parameters, its
    arguments in call order, and its padding contract (``codegen.policy``; None for data
    movement, which has none). ``tuned`` and ``tuning``: how the build chose its schedule
    (informative; the runtime does not read them). ``threads``: ``{pool size: symbol}``, the
    same kernel scheduled apart for a thread pool of that size (``ScheduleRule.for_threads``:
    the same arithmetic, only the tasks differ), which the runtime calls in its place when
    TVM's pool has that many threads."""

    name: str
    op: str
    args: tuple[ArgRecord, ...]
    params: dict = field(default_factory=dict)
    padding: dict | None = None
    tuned: bool | None = None
    tuning: dict | None = None
    threads: dict | None = None

    def to_json(self) -> dict:
        out = {"name": self.name, "op": self.op, "params": self.params,
               "args": [a.to_json() for a in self.args]}
        for key in ("padding", "tuned", "tuning"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        if self.threads:
            out["threads"] = {str(n): symbol for n, symbol in sorted(self.threads.items())}
        return out

    @classmethod
    def from_json(cls, entry: dict) -> KernelRecord:
        try:
            return cls(entry["name"], entry["op"],
                       tuple(ArgRecord.from_json(a) for a in entry["args"]),
                       entry.get("params", {}), entry.get("padding"), entry.get("tuned"),
                       entry.get("tuning"),
                       {int(n): str(s) for n, s in entry["threads"].items()}
                       if entry.get("threads") else None)
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise LoadError(f"a manifest kernel entry lacks or mangles {e}: "
                            f"{json.dumps(entry)[:200]}; rebuild the library") from None


def file_sha256(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def tvm_version() -> str:
    return metadata.version("apache-tvm")


def write(out_dir, manifest: dict) -> None:
    path = os.path.join(out_dir, MANIFEST)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)  # a reader never sees half a manifest


def read(out_dir) -> dict:
    """Parse the manifest of ``out_dir``; raise LoadError if it is missing or malformed."""
    path = os.path.join(out_dir, MANIFEST)
    if not os.path.isfile(path):
        raise LoadError(f"{out_dir}: expected a built library with {MANIFEST}; found none "
                        f"(build one with `blockpad build SPEC --out {out_dir}`)")
    try:
        with open(path) as f:
            manifest = json.load(f)
    except (OSError, ValueError) as e:
        raise LoadError(f"{path}: not a readable manifest ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        got = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise LoadError(f"{path}: expected manifest format {FORMAT}; got {got!r}")
    for key in ("library", "library_sha256", "tvm_version", "target", "kernels"):
        if key not in manifest:
            raise LoadError(f"{path}: manifest lacks {key!r}; rebuild the library")
    return manifest


def kernel_records(manifest: dict) -> list[KernelRecord]:
    """The kernel entries of a manifest (as ``read`` returns it), typed."""
    return [KernelRecord.from_json(k) for k in manifest["kernels"]]
