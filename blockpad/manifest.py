"""The manifest written beside every built library, and the checks made before loading it.

The build driver writes it with ``write``; ``read`` is the one place that decides whether a
library may be loaded on this machine."""

from __future__ import annotations

import hashlib
import json
import os
from importlib import metadata

from blockpad.errors import LoadError, MissingCPUFeatureError

from . import machine

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


def check_loadable(out_dir, manifest: dict) -> str:
    """Raise LoadError unless the library of ``manifest`` can run here; return its path."""
    lib = os.path.join(out_dir, manifest["library"])
    if not os.path.isfile(lib):
        raise LoadError(f"{out_dir}: manifest names library {manifest['library']!r}, which is missing")
    digest = file_sha256(lib)
    if digest != manifest["library_sha256"]:
        raise LoadError(f"{lib}: content hash {digest[:16]}... does not match the manifest's "
                        f"{manifest['library_sha256'][:16]}...; the file changed after the build, "
                        f"rebuild it")
    built, here = manifest["tvm_version"], tvm_version()
    if built.split(".")[:2] != here.split(".")[:2]:
        raise LoadError(f"{out_dir}: built with apache-tvm {built}; this process has {here}, "
                        f"whose runtime ABI differs; rebuild the library")
    target = manifest["target"]
    if target.get("arch") != machine.arch():
        raise LoadError(f"{out_dir}: library is for {target.get('arch')} (target "
                        f"{target.get('name')!r}); this machine is {machine.arch()}")
    features = target.get("features", [])
    missing = machine.missing_features([f for f in features if not f.startswith("sm_")])
    if missing:
        raise MissingCPUFeatureError(
            f"{out_dir}: target {target.get('name')!r} needs CPU features {', '.join(missing)}, "
            f"which this machine lacks; running it would die of an illegal instruction. Build "
            f"for a target this machine has (e.g. --target host)")
    need = machine.gpu_requirement(features)
    if need is not None:
        _check_gpu(out_dir, target, need)
    return lib


def _check_gpu(out_dir, target: dict, need: tuple) -> None:
    """A CUDA library runs on a device of compute capability ``need`` or later (its fatbin holds
    that SASS and PTX the driver compiles for newer GPUs); then TVM's CUDA runtime must load."""
    devices = machine.cuda_devices()
    want = f"an NVIDIA GPU of compute capability {need[0]}.{need[1]} or later (sm_{need[0]}{need[1]})"
    if devices is None:
        have = "this machine has no CUDA driver (libcuda.so.1 is not found), so no GPU"
    elif not devices:
        have = "the CUDA driver reports no usable device (see CUDA_VISIBLE_DEVICES)"
    elif not any(d >= need for d in devices):
        have = "this machine's CUDA devices have compute capability " + \
            ", ".join(f"{a}.{b}" for a, b in devices)
    else:
        from blockpad.runtime.tvm_runtime import cuda_runtime

        cuda_runtime()
        return
    raise LoadError(f"{out_dir}: target {target.get('name')!r} runs on {want}; {have}. Load it "
                    f"on a GPU host, or build for a CPU target here (e.g. --target host)")
