"""The manifest written beside every built library: what the build driver writes (``write``)
and the runtime reads (``read``), so it lies below both. Whether a library may be loaded on
this machine is the runtime's check (``runtime.loadable``)."""

from __future__ import annotations

import hashlib
import json
import os
from importlib import metadata

from blockpad.errors import LoadError

FORMAT = 1
MANIFEST = "manifest.json"
LIBRARY = "kernels.so"


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
