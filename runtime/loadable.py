"""The one place that decides whether a built library may be loaded on this machine: its file
matches the manifest, TVM's runtime ABI matches, and the CPU (or GPU) can run its code."""

from __future__ import annotations

import os

from blockpad import machine
from blockpad.errors import LoadError, MissingCPUFeatureError
from blockpad.manifest import file_sha256, tvm_version

from .tvm_runtime import cuda_runtime


def check_loadable(out_dir, manifest: dict) -> str:
    """Raise LoadError unless the library of ``manifest`` can run here; return its path."""
    lib = os.path.join(out_dir, manifest["library"])
    if not os.path.isfile(lib):
        raise LoadError(f"{out_dir}: manifest names library {manifest['library']!r}, which is missing")
    check_digest(lib, manifest["library_sha256"], "the manifest's")
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


def check_digest(path, expected: str, whose: str) -> None:
    """Raise LoadError unless the file ``path`` has the SHA-256 ``expected`` that ``whose``
    (``"the manifest's"``, ``"the model's"``) recorded at the build."""
    digest = file_sha256(path)
    if digest != expected:
        raise LoadError(f"{path}: content hash {digest[:16]}... does not match {whose} "
                        f"{expected[:16]}...; the file changed after the build, rebuild it")


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
        cuda_runtime()
        return
    raise LoadError(f"{out_dir}: target {target.get('name')!r} runs on {want}; {have}. Load it "
                    f"on a GPU host, or build for a CPU target here (e.g. --target host)")
