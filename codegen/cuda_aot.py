"""CUDA ahead of time: the device code is compiled by nvcc at build time, into the library.

TVM 0.27 compiles CUDA when a library is *loaded*: ``tvm.compile`` wraps the generated CUDA C
in a device module of format ``"cuda"``, ``export_library`` embeds that source, and the CUDA
runtime hands it to the ``tvm_callback_cuda_compile`` global (nvrtc or nvcc) in ``load_module``.
Its compiler never calls that callback (the source is all it has), so overriding it at build
time changes nothing. A GPU host would then need a CUDA compiler, and every load would pay for
a compile.

blockpad instead compiles the module's source with nvcc into a fatbin (SASS for the target's
``sm_XY`` plus ``compute_XY`` PTX, which the driver JIT-compiles on newer GPUs) and swaps it in
for the source where ``export_library`` packs the device module into the shared library (its
``fpack_imports`` hook). The CUDA runtime's loader reads the format tag and loads binary
formats with ``cuModuleLoadData``: no compiler at load time.

The packed blob (``tvm_ffi/src/ffi/extra/library_module.cc``, ``ProcessLibraryBin``):
``<nbytes: u64> <indptr: vec<u64>> <child_indices: vec<u64>>`` then per module ``<kind: str>``
and, unless the kind is ``_lib``, ``<payload: bytes>``. The CUDA module's payload is
``<fmt: str> <function table> <code: bytes>``; only ``fmt`` and ``code`` change. Strings,
bytes and vectors are a u64 length followed by the data.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import shutil
import struct

from blockpad.errors import BuildError

#: First four bytes of a CUDA fatbin (``0xBA55ED50`` little-endian).
FATBIN_MAGIC = b"\x50\xed\x55\xba"


@functools.cache
def register_lowerings() -> None:
    """Lowerings TVM 0.27 has for LLVM targets only, registered for CUDA C: ``tirx.fma`` (the
    quantized add's two single-rounding fmas, ONNX Runtime's arithmetic) becomes CUDA's
    ``__fmaf_rn`` / ``__fma_rn``, which nvcc never splits or reassociates. Without it the
    CUDA code generator stops at an unresolved ``tirx.fma``.

    With a lowering registered, TVM's ``LowerIntrin`` also contracts a scalar ``a * b + c``
    into one, as it does on LLVM targets (where nvcc's default ``--fmad=true`` contracted it
    anyway); a vector one (dlight's matmul, ``float32x2``) gets None, which leaves it a
    multiply and an add (the CUDA code generator has no vector fma)."""
    from tvm import tirx

    def fma(call):
        name = {"float32": "__fmaf_rn", "float64": "__fma_rn"}.get(str(call.ty.dtype))
        return None if name is None else tirx.call_pure_extern(call.ty, name, *call.args)

    tirx.op.register_intrin_lowering("tirx.fma", target="cuda", f=fma, level=99)


def sm(target) -> str:
    """The ``sm_XY`` a cuda target compiles for."""
    return target.tvm["arch"]


@functools.lru_cache(maxsize=4)
def compile_device(source: str, arch: str) -> tuple[bytes, str]:
    """``(fatbin, ptx)`` of a CUDA module's source for ``arch`` (``sm_80``), by nvcc."""
    if shutil.which("nvcc") is None:
        raise BuildError("CUDA targets compile with nvcc at build time, and nvcc is not on "
                         "PATH; install the CUDA toolkit (or put its bin/ on PATH)")
    import tvm
    from tvm.support import nvcc

    cc = arch.removeprefix("sm_")
    gencode = ["-gencode", f"arch=compute_{cc},code=sm_{cc}",        # SASS for the target
               "-gencode", f"arch=compute_{cc},code=compute_{cc}"]  # PTX for later GPUs
    # nvcc.compile_cuda reads the compute version from the current target, whatever arch= says
    with tvm.target.Target({"kind": "cuda", "arch": arch}), _ieee_math():
        try:
            ptx = nvcc.compile_cuda(source, target_format="ptx", arch=arch, compiler="nvcc")
            fatbin = nvcc.compile_cuda(source, target_format="fatbin", arch=gencode,
                                       compiler="nvcc")
        except RuntimeError as e:
            raise BuildError(f"nvcc failed for {arch}: {_errors(str(e))}") from None
    return bytes(fatbin), bytes(ptx).decode()


def device_source(lib) -> str:
    """The CUDA C of a compiled cuda-target module (its one device import)."""
    cuda = [m for m in lib.mod.imports if m.kind == "cuda"]
    if len(cuda) != 1:
        raise BuildError(f"expected one CUDA device module; got {len(cuda)}")
    return cuda[0].inspect_source("cuda")


def export(lib, path, target) -> None:
    """``lib.export_library(path)`` with the CUDA source replaced by nvcc's fatbin."""
    source = device_source(lib)
    fatbin, _ = compile_device(source, sm(target))

    def pack(mod, is_system_lib, prefix, workspace_dir):
        import tvm_ffi

        if is_system_lib:
            raise BuildError("CUDA targets build shared libraries, not system libraries")
        blob = bytes(tvm_ffi.get_global_func("runtime.ModulePackImportsToTensor")(mod).numpy())
        symbol = prefix + tvm_ffi.get_global_func("runtime.ModuleImportsBlobName")()
        out = os.path.join(workspace_dir, f"{prefix}devc.c")
        with open(out, "w") as f:
            f.write(_c_array(symbol, with_binary(blob, source, fatbin)))
        return out

    lib.export_library(path, fpack_imports=pack)


def with_binary(blob: bytes, source: str, binary: bytes, fmt: str = "fatbin") -> bytes:
    """The packed-imports ``blob`` with its CUDA module's ``source`` replaced by ``binary``."""
    r = _Reader(blob)
    nbytes = r.u64()
    if nbytes != len(blob) - 8:
        raise BuildError(f"packed imports: {nbytes} bytes announced, {len(blob) - 8} present")
    indptr = r.vec_u64()
    children = r.vec_u64()
    out = [_vec_u64(indptr), _vec_u64(children)]
    replaced = 0
    for _ in range(len(indptr) - 1):
        kind = r.bytes().decode()
        out.append(_str(kind))
        if kind == "_lib":
            continue
        payload = r.bytes()
        if kind == "cuda":
            payload = _cuda_payload(payload, source.encode(), binary, fmt.encode())
            replaced += 1
        out.append(_str(payload))
    if r.pos != len(blob) or replaced != 1:
        raise BuildError(f"packed imports: unexpected layout ({replaced} CUDA modules, "
                         f"{len(blob) - r.pos} bytes left over); TVM's format changed?")
    body = b"".join(out)
    return struct.pack("<Q", len(body)) + body


def _cuda_payload(payload: bytes, source: bytes, binary: bytes, fmt: bytes) -> bytes:
    head, tail = _str(b"cuda"), _str(source)
    if not (payload.startswith(head) and payload.endswith(tail)):
        raise BuildError("the CUDA device module is not the <fmt 'cuda'> <functions> <source> "
                         "that TVM 0.27 writes; cannot swap in the compiled binary")
    functions = payload[len(head):len(payload) - len(tail)]
    return _str(fmt) + functions + _str(binary)


class _Reader:
    def __init__(self, data: bytes):
        self.data, self.pos = data, 0

    def u64(self) -> int:
        (v,) = struct.unpack_from("<Q", self.data, self.pos)
        self.pos += 8
        return v

    def bytes(self) -> bytes:
        n = self.u64()
        if self.pos + n > len(self.data):
            raise BuildError("packed imports: truncated")
        self.pos += n
        return self.data[self.pos - n:self.pos]

    def vec_u64(self) -> list:
        n = self.u64()
        return [self.u64() for _ in range(n)]


def _str(v) -> bytes:
    b = v.encode() if isinstance(v, str) else bytes(v)
    return struct.pack("<Q", len(b)) + b


def _vec_u64(v) -> bytes:
    return struct.pack(f"<Q{len(v)}Q", len(v), *v)


def _c_array(symbol: str, data: bytes) -> str:
    """C source defining ``symbol`` as ``data`` (what ``runtime.ModulePackImportsToC`` writes)."""
    rows = (",".join(str(b) for b in data[i:i + 32]) for i in range(0, len(data), 32))
    body = ",\n".join(rows)
    return (f'#ifdef __cplusplus\nextern "C" {{\n#endif\n'
            f"extern const unsigned char {symbol}[];\n"
            f"const unsigned char {symbol}[{len(data)}] = {{\n{body}\n}};\n"
            f"#ifdef __cplusplus\n}}\n#endif\n")


@contextlib.contextmanager
def _ieee_math():
    """nvcc without ``--use_fast_math``, which TVM passes unless told not to: it turns
    ``tanhf`` into ``tanh.approx`` and ``expf`` into ``ex2.approx`` with denormals flushed.
    On an H100 that put tanh and gelu_tanh 1e-5 away from float64, three times the
    checker's bound (the CPU kernels keep it), so every CUDA library is compiled with IEEE
    math; the GEMMs (fused multiply-adds either way) are not slowed."""
    key = "TVM_CUDA_NVCC_NO_FAST_MATH"
    before = os.environ.get(key)
    os.environ[key] = "1"
    try:
        yield
    finally:
        if before is None:
            del os.environ[key]
        else:
            os.environ[key] = before


def _errors(text: str, lines: int = 30) -> str:
    """nvcc's error lines, each with the source line after it (warnings for generated code
    come by the hundred and would hide them), else its output's last ``lines``."""
    out = text.splitlines()
    found = [i for i, ln in enumerate(out) if re.search(r"\berror\b", ln)]
    if not found:
        return "\n".join(out[-lines:])
    return "\n".join(ln for i in found[:10] for ln in out[i:i + 2])
