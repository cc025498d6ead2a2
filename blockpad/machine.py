"""What the running machine can execute: its architecture, CPU feature flags and CUDA devices."""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import platform

from blockpad.errors import LoadError


def arch() -> str:
    return platform.machine()


@functools.lru_cache(maxsize=1)
def _first_cpu() -> dict:
    """The fields of /proc/cpuinfo's first processor block ({} where there is none)."""
    fields = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    if fields:
                        break
                    continue
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return fields


def cpu_features() -> frozenset:
    """Feature flags as /proc/cpuinfo spells them (``avx2``, ``avx512f``, ``asimddp``...)."""
    fields = _first_cpu()
    return frozenset((fields.get("flags") or fields.get("Features") or "").split())


def cpu_model() -> tuple | None:
    """``(vendor_id, cpu family)`` as /proc/cpuinfo gives them (``("AuthenticAMD", 25)``: Zen 3
    and Zen 4, told apart by their features), None where it gives no such lines."""
    fields = _first_cpu()
    if "vendor_id" not in fields or not fields.get("cpu family", "").isdigit():
        return None
    return fields["vendor_id"], int(fields["cpu family"])


def missing_features(required) -> list:
    have = cpu_features()
    return [f for f in required if f not in have]


@functools.lru_cache(maxsize=1)
def cuda_devices():
    """Compute capabilities ``(major, minor)`` of the CUDA devices this process can use, asked
    of the driver (``libcuda.so.1``) directly; ``None`` when there is no driver at all. Neither
    TVM nor a CUDA toolkit is needed, and CUDA_VISIBLE_DEVICES is honoured."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    count, dev, major, minor = ctypes.c_int(), ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
    if cuda.cuInit(0) != 0 or cuda.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return ()   # a driver but no usable device (CUDA_ERROR_NO_DEVICE, a broken install)
    out = []
    for i in range(count.value):
        if (cuda.cuDeviceGet(ctypes.byref(dev), i) == 0
                and cuda.cuDeviceGetAttribute(ctypes.byref(major), 75, dev) == 0    # ..._MAJOR
                and cuda.cuDeviceGetAttribute(ctypes.byref(minor), 76, dev) == 0):  # ..._MINOR
            out.append((major.value, minor.value))
    return tuple(out)


def gpu_requirement(features):
    """The compute capability ``(major, minor)`` an ``sm_XY`` feature asks for, else None."""
    for f in features:
        if f.startswith("sm_") and f[3:].isdigit():
            return int(f[3:-1]), int(f[-1])
    return None


class TilePermissionError(LoadError):
    """The operating system refused this process the AMX tile state."""


SYS_ARCH_PRCTL = 158            # x86-64 syscall number of arch_prctl
ARCH_REQ_XCOMP_PERM = 0x1023
XFEATURE_XTILEDATA = 18


@functools.lru_cache(maxsize=1)
def request_amx() -> None:
    """Ask Linux for the AMX tile data state (``arch_prctl(ARCH_REQ_XCOMP_PERM,
    XFEATURE_XTILEDATA)``, Linux 5.16+). Linux hands it out only on request, per process, so
    that processes that never touch tiles do not carry 8 KiB of register state: without it
    the first tile instruction of a kernel dies of SIGILL, on whichever thread runs it. One
    request covers every thread of the process; it is made once, and a refusal is raised as
    ``TilePermissionError`` (and asked again next time: the cache keeps only success)."""
    if arch() != "x86_64":
        raise TilePermissionError(f"AMX tile state: AMX is an x86-64 feature; this machine is "
                                  f"{arch()}")
    libc = ctypes.CDLL(None, use_errno=True)
    rc = libc.syscall(ctypes.c_long(SYS_ARCH_PRCTL), ctypes.c_long(ARCH_REQ_XCOMP_PERM),
                      ctypes.c_long(XFEATURE_XTILEDATA))
    if rc != 0:
        err = ctypes.get_errno()
        why = {errno.EOPNOTSUPP: "this CPU or kernel has no AMX tile state to give",
               errno.EINVAL: "this kernel does not know the request (Linux 5.16+ has it)",
               errno.EPERM: "the process is not allowed it (a seccomp or sigaltstack limit)"}
        raise TilePermissionError(
            f"AMX tile state: Linux refused arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) "
            f"with {errno.errorcode.get(err, err)} ({os.strerror(err)}): "
            f"{why.get(err, 'see arch_prctl(2)')}. AMX kernels cannot run in this process; "
            f"build for --target avx512-vnni or host")
