"""Run kernels of an aarch64 library (``--target neon`` / ``neon-dotprod``) on an x86 machine,
under qemu-user, with no aarch64 Python or TVM install.

Pieces (docs/tvm-0.27-notes.md 6):

* ``tvm_run.c`` (beside this file): a small C harness that dlopens ``kernels.so``, fills the
  runtime hooks the library expects (parallel launch run serially, workspace allocation), builds
  DLTensors from files, calls ``__tvm_ffi_<kernel>`` and writes every tensor back. It is
  compiled once with ``aarch64-linux-gnu-gcc`` into the cache directory.
* ``libtvm_ffi.so`` for aarch64 (the harness links it; the library's error path calls into it),
  taken from the ``apache-tvm-ffi`` manylinux aarch64 wheel of the version installed here, which
  is fetched with pip on first use into the cache directory.
* ``qemu-aarch64 -L /usr/aarch64-linux-gnu -cpu max`` runs the harness.

Debian/Ubuntu packages: ``qemu-user`` (or ``qemu-user-static``), ``gcc-aarch64-linux-gnu``,
``libc6-dev-arm64-cross``. ``missing_tools()`` says what is absent.

Cache directory: ``$BLOCKPAD_AARCH64_DIR``, else ``$XDG_CACHE_HOME/blockpad/aarch64`` (default
``~/.cache/blockpad/aarch64``). Offline, put an aarch64 ``libtvm_ffi.so`` of the installed
apache-tvm-ffi version at ``<cache>/tvm_ffi-<version>/libtvm_ffi.so`` (or point
``$BLOCKPAD_AARCH64_LIBTVM_FFI`` at one).

``run_aarch64`` calls one kernel the way ``Kernel.run_raw`` does natively: exactly the compiled
function, no padding contract honoured around it and no Memory state changed.
"""

from __future__ import annotations

import glob
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import zipfile
from importlib import metadata
from pathlib import Path

import numpy as np

from blockpad.codegen.targets import get_target
from blockpad.errors import ArgumentError, BlockpadError
from blockpad.layout import numpy_dtype

QEMU = ("qemu-aarch64", "qemu-aarch64-static")
_NEON = get_target("neon")   # its cross compiler links the harness too
CROSS_CC = _NEON.cross_compiler
SYSROOT = "/usr/aarch64-linux-gnu"
HARNESS_SOURCE = Path(__file__).with_name("tvm_run.c")
APT_PACKAGES = "qemu-user qemu-user-static gcc-aarch64-linux-gnu libc6-dev-arm64-cross"
TASKS = 4   # tasks per parallel launch: more than one, so the kernels' split of work is run


class QemuUnavailable(BlockpadError, RuntimeError):
    """A piece needed to run aarch64 code here is missing (tool, sysroot, libtvm_ffi.so)."""


class QemuRunError(BlockpadError, RuntimeError):
    """The harness ran but a call failed (the kernel raised, or qemu died)."""


def qemu_binary() -> str | None:
    env = os.environ.get("BLOCKPAD_QEMU")
    if env:
        return shutil.which(env)
    return next((p for p in map(shutil.which, QEMU) if p), None)


def native() -> bool:
    """This machine runs aarch64 code itself: no emulator needed."""
    return platform.machine() in ("aarch64", "arm64")


def compiler() -> str | None:
    """The C compiler that makes aarch64 executables: the cross compiler, or on an aarch64
    machine its own ``cc``."""
    return shutil.which(CROSS_CC) or (shutil.which("cc") if native() else None)


def missing_tools() -> list[str]:
    """What this machine lacks to build the harness and run aarch64 libraries (empty: all
    there). Each entry names the Debian package that provides it."""
    out = []
    if not native() and qemu_binary() is None:
        out.append("qemu-aarch64 (apt-get install qemu-user)")
    if compiler() is None:
        out.append(f"{CROSS_CC} (apt-get install {_NEON.cross_package})")
    if not native() and not os.path.isfile(os.path.join(SYSROOT, "lib", "libc.so.6")):
        out.append(f"the aarch64 C library in {SYSROOT} (apt-get install libc6-dev-arm64-cross)")
    return out


def cache_dir() -> Path:
    env = os.environ.get("BLOCKPAD_AARCH64_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "blockpad" / "aarch64"


def tvm_ffi_version() -> str:
    return metadata.version("apache-tvm-ffi")


def libtvm_ffi() -> Path:
    """The aarch64 ``libtvm_ffi.so`` of the installed apache-tvm-ffi version, fetched (pip
    download of its manylinux aarch64 wheel) into the cache on first use."""
    env = os.environ.get("BLOCKPAD_AARCH64_LIBTVM_FFI")
    if env:
        if not os.path.isfile(env):
            raise QemuUnavailable(f"$BLOCKPAD_AARCH64_LIBTVM_FFI={env}: no such file")
        return Path(env)
    version = tvm_ffi_version()
    target = cache_dir() / f"tvm_ffi-{version}" / "libtvm_ffi.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--platform", "manylinux_2_28_aarch64", "--python-version",
               f"{sys.version_info.major}.{sys.version_info.minor}",
               f"apache-tvm-ffi=={version}", "-d", tmp]
        r = subprocess.run(cmd, capture_output=True, text=True)
        wheels = glob.glob(os.path.join(tmp, "*.whl"))
        if r.returncode != 0 or not wheels:
            raise QemuUnavailable(
                f"cannot fetch the aarch64 libtvm_ffi.so: `{' '.join(cmd)}` failed "
                f"(rc={r.returncode}): {(r.stderr or r.stdout).strip()[-800:]}\nOffline, copy "
                f"tvm_ffi/lib/libtvm_ffi.so from an apache-tvm-ffi {version} aarch64 wheel to "
                f"{target}, or set $BLOCKPAD_AARCH64_LIBTVM_FFI to its path")
        with zipfile.ZipFile(wheels[0]) as z:
            try:
                data = z.read("tvm_ffi/lib/libtvm_ffi.so")
            except KeyError:
                raise QemuUnavailable(f"{wheels[0]}: holds no tvm_ffi/lib/libtvm_ffi.so") from None
        part = target.with_suffix(f".so.{os.getpid()}")
        part.write_bytes(data)
        os.replace(part, target)   # concurrent first uses: each writes whole, one wins
    return target


def harness() -> Path:
    """The aarch64 ``tvm_run`` executable, compiled from ``tvm_run.c`` on first use, next to
    the libtvm_ffi.so it links (rpath ``$ORIGIN``)."""
    missing = missing_tools()
    if missing:
        raise QemuUnavailable("cannot run aarch64 code here; missing: " + "; ".join(missing))
    lib = libtvm_ffi()
    import tvm_ffi

    include = Path(tvm_ffi.__file__).parent / "include"
    src = HARNESS_SOURCE.read_bytes()
    key = hashlib.sha256(src + tvm_ffi_version().encode()).hexdigest()[:16]
    exe = lib.parent / f"tvm_run-{key}"
    if exe.is_file():
        return exe
    if lib.parent != cache_dir() / f"tvm_ffi-{tvm_ffi_version()}":   # a library given by path
        exe = cache_dir() / f"custom-{key}" / "tvm_run"
        exe.parent.mkdir(parents=True, exist_ok=True)
        if not (exe.parent / "libtvm_ffi.so").exists():
            shutil.copyfile(lib, exe.parent / "libtvm_ffi.so")
        lib = exe.parent / "libtvm_ffi.so"
        if exe.is_file():
            return exe
    part = exe.with_name(f"{exe.name}.{os.getpid()}")
    cmd = [compiler(), "-O2", "-std=c11", "-D_GNU_SOURCE", f"-I{include}", "-o", str(part),
           str(HARNESS_SOURCE), f"-L{lib.parent}", "-ltvm_ffi", "-ldl", "-pthread", "-Wl,-rpath,$ORIGIN"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise QemuUnavailable(f"compiling the aarch64 harness failed: {' '.join(cmd)}\n{r.stderr}")
    os.replace(part, exe)
    return exe


def run_aarch64(lib_dir, kernel_name: str, args, timeout: float = 300, tasks: int = TASKS) -> int:
    """Call kernel ``kernel_name`` of the aarch64 library built in ``lib_dir`` on ``args``
    (Memory objects or numpy arrays, one per argument of the kernel's signature, as
    ``blockpad.load(...)[kernel_name]`` takes them: a flat buffer, the physical shape of a
    compact layout, or the logical shape of a plain one). Every argument the kernel writes is
    updated in place. The harness checks the call as ``run_many`` says; returns the most
    tasks one of its parallel launches had."""
    return run_many(lib_dir, [(kernel_name, args)], timeout, tasks)[0]


def run_many(lib_dir, calls, timeout: float = 300, tasks: int = TASKS) -> list[int]:
    """``run_aarch64`` for a list of ``(kernel_name, args)`` calls, run in order in one qemu
    process (emulator start-up costs about 0.3 s). Each parallel loop is launched as ``tasks``
    tasks on as many threads; a call that writes outside its buffers (the harness puts guard
    bytes around each) or changes an ``in`` argument fails with ``QemuRunError``. Returns,
    per call, the most tasks one of its parallel launches had (0: it has none)."""
    from blockpad import manifest as mf
    from blockpad.runtime.library import Signature

    lib_dir = os.fspath(lib_dir)
    manifest = mf.read(lib_dir)
    arch = manifest["target"].get("arch")
    if arch != "aarch64":
        raise ArgumentError(f"{lib_dir}: library is for {arch} (target "
                            f"{manifest['target'].get('name')!r}); run_aarch64 runs aarch64 "
                            f"libraries only")
    signatures = {r.name: Signature(r) for r in mf.kernel_records(manifest)}
    lib = os.path.abspath(os.path.join(lib_dir, manifest["library"]))
    with tempfile.TemporaryDirectory(prefix="blockpad-aarch64-") as tmp:
        lines, outputs = [], []
        files = {}   # buffer (address, bytes) -> its file: calls in a row see each other's results
        for name, args in calls:
            if name not in signatures:
                raise ArgumentError(f"{name!r}: {lib_dir} has kernels "
                                    f"{', '.join(sorted(signatures))}")
            sig = signatures[name]
            if len(args) != len(sig.args):
                raise ArgumentError(f"{name}: expected {len(sig.args)} arguments "
                                    f"({', '.join(a.name for a in sig.args)}); got {len(args)}")
            words = [name]
            for value, (arg, role, layout, storage) in zip(args, sig.args):
                where = f"{name}: argument {arg!r}"
                flat = _flat(value, where, role, layout)
                key = (flat.ctypes.data, flat.nbytes)
                path = files.get(key)
                if path is None:
                    for addr, nbytes in files:
                        if addr < key[0] + key[1] and key[0] < addr + nbytes:
                            raise ArgumentError(f"{where}: overlaps another argument's buffer "
                                                f"without being the same buffer")
                    path = files[key] = os.path.join(tmp, f"{len(files)}.bin")
                    flat.tofile(path)
                words.append(_tensor_word(layout, storage, path, role))
                if role != "in":
                    outputs.append((path, flat))
            lines.append(" ".join(words))
        exe = harness()   # after the arguments are checked: their errors need no emulator
        calls_file = os.path.join(tmp, "calls.txt")
        with open(calls_file, "w") as f:
            f.write("\n".join(lines) + "\n")
        cmd = [str(exe), lib, calls_file]
        if not native():
            cmd = [qemu_binary(), "-L", SYSROOT, "-cpu", "max", *cmd]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                               env={**os.environ, "TVM_NUM_THREADS": str(tasks)})
        except subprocess.TimeoutExpired:
            raise QemuRunError(f"{lib}: {len(calls)} calls did not finish in {timeout} s "
                               f"under {cmd[0]}") from None
        if r.returncode != 0:
            done = r.stdout.count("ok")
            failed = calls[done][0] if done < len(calls) else "?"
            raise QemuRunError(f"{failed}: call failed under {os.path.basename(cmd[0])} "
                               f"(rc={r.returncode}): {r.stderr.strip()}")
        for path, flat in outputs:
            flat[...] = np.fromfile(path, flat.dtype, flat.size)
    return [int(line.split()[1]) for line in r.stdout.splitlines() if line.startswith("ok")]


def _tensor_word(layout, storage, path, role="out") -> str:
    """One tensor of a harness call line (tvm_run.c): an ``in`` tensor must come back
    unchanged, an ``out`` or ``inout`` one may be written."""
    import tvm_ffi

    if " " in path:
        raise QemuRunError(f"{path}: the harness takes paths without spaces")
    dt = tvm_ffi.dtype(storage)
    shape = "x".join(map(str, layout.physical_shape))
    strides = "x".join(map(str, layout.physical_strides))
    kind = "in" if role == "in" else "out"
    return f"{kind}:{dt.type_code}:{dt.bits}:{shape}:{strides}:{path}"


def _flat(value, where, role, layout) -> np.ndarray:
    """The first ``alloc_len`` elements of the argument's buffer, as a writable view when the
    kernel writes it (so results land in the caller's array)."""
    from blockpad.runtime.memory import Memory

    if isinstance(value, Memory):
        if value.layout != layout:
            raise ArgumentError(f"{where}: expected layout {layout}; got {value.layout}")
        buf = value.buffer
    elif isinstance(value, np.ndarray):
        if value.dtype != numpy_dtype(layout.dtype):
            raise ArgumentError(f"{where}: expected dtype {layout.dtype}; got {value.dtype}")
        if not value.flags.c_contiguous:
            raise ArgumentError(f"{where}: expected a C-contiguous array")
        fits = ((value.shape == layout.shape and layout.is_plain)
                or (value.shape == layout.physical_shape and layout.strides is None)
                or value.ndim == 1)
        if not fits:
            raise ArgumentError(f"{where}: layout {layout} takes a flat buffer, the physical "
                                f"shape {layout.physical_shape} or (plain layouts) the logical "
                                f"shape; got shape {value.shape}")
        buf = value.reshape(-1)
    else:
        raise ArgumentError(f"{where}: expected a Memory or numpy array; got "
                            f"{type(value).__name__}")
    if buf.size < layout.alloc_len:
        raise ArgumentError(f"{where}: layout {layout} needs {layout.alloc_len} elements; got "
                            f"{buf.size}")
    if role != "in" and not buf.flags.writeable:
        raise ArgumentError(f"{where}: the kernel writes it, but the buffer is read-only")
    return buf[:layout.alloc_len]
