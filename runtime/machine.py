"""What the running machine can execute: its architecture, CPU feature flags and CUDA devices."""

from __future__ import annotations

import ctypes
import functools
import platform


def arch() -> str:
    return platform.machine()


@functools.lru_cache(maxsize=1)
def cpu_features() -> frozenset:
    """Feature flags as /proc/cpuinfo spells them (``avx2``, ``avx512f``, ``asimddp``...)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    return frozenset(value.split())
    except OSError:
        pass
    return frozenset()


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
