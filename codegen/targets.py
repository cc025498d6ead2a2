"""The targets ``blockpad build --target`` accepts: a plain, explicit table."""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field, replace

from blockpad import machine
from blockpad.errors import BuildError, SpecError


@dataclass(frozen=True)
class Target:
    name: str
    family: str           # which schedules/ module lowers it
    tvm: dict             # TVM target, dict form
    arch: str             # machine the library runs on (platform.machine())
    features: tuple       # /proc/cpuinfo flags the code may use
    vector_bytes: int     # widest vector register the schedules target
    description: str = ""
    cross_compiler: str | None = None   # C compiler that links the shared library
    cross_package: str | None = None    # the Debian/Ubuntu package that installs it
    extra: dict = field(default_factory=dict)
    # (vendor_id, cpu family) of /proc/cpuinfo for a target tuned to one core design: `native`
    # picks it only on that CPU; None: any CPU with the features
    cpu: tuple | None = None
    # whether register-tiled convolutions reduce a panel's input channels in passes where its
    # weights outgrow L1 (schedules/register_tiled.chunk_plan); False: one pass, the passes
    # stay in the tuning space
    reduction_passes: bool = True

    @property
    def tile_registers(self) -> int:
        """Vector registers a register tile of accumulators, its weight vectors and its
        broadcast source may fill: AVX2's 16 ymm, AVX-512's 32 zmm; on AArch64 20 of the 32 q
        registers, because LLVM keeps four source elements per tile row in a q register for
        the by-element ``fmla`` (measured on the 3x3 conv of ``blockpad bench isa``: 32 gives
        11 spills per loop, 24 five, 20 none and the most FMAs per load, 3.1)."""
        return 32 if "avx512f" in self.features else 20 if self.arch == "aarch64" else 16

    def tvm_target(self, num_cores: int | None = None):
        import tvm

        spec = dict(self.tvm)
        if num_cores and "host" in spec:   # a device target (cuda): its CPU side has the cores
            spec["host"] = {**spec["host"], "num-cores": num_cores}
        elif num_cores:
            spec["num-cores"] = num_cores
        return tvm.target.Target(spec)


# x86-64-v3 is the AVX2 level (AVX, AVX2, BMI1/2, F16C, FMA, LZCNT, MOVBE): code built for it
# runs on any Haswell-or-later Intel and Zen AMD, which is what 'host' promises.
_X86_V3 = ("avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "sse4_2", "popcnt")
_AVX512 = ("avx512f", "avx512bw", "avx512dq", "avx512vl")


# LLVM's loop vectorizer is off on x86: TVM vectorizes what the schedules say, and where it leaves
# a scalar loop because its store is predicated (a partial channel block under a policy that
# writes valid elements only), LLVM turned the loop into AVX-512 masked stores that also wrote
# lanes past the predicate: an int8 conv into uint8 with dst_scale 2 and a relu, 25 channels in
# nChw16c, wrote channels 25-27 (oneDNN's harness_conv_attrs_int8 under blockpad check
# --benchdnn; the TIR predicate is right, the kernel is right with the loop vectorizer off).
_X86_LLVM = {"kind": "llvm", "mtriple": "x86_64-linux-gnu", "cl-opt": ["-vectorize-loops=false"]}


# the aarch64 GNU toolchain links Arm libraries (and blockpad.testing.qemu's harness)
_AARCH64_GCC = {"cross_compiler": "aarch64-linux-gnu-gcc", "cross_package": "gcc-aarch64-linux-gnu"}


def _cuda(cc: int, gpu: str) -> Target:
    """NVIDIA GPU of compute capability ``cc`` / 10 or later: kernels compiled by nvcc at build
    time to a fatbin of sm_<cc> SASS plus compute_<cc> PTX (which the driver JIT-compiles for
    newer GPUs); the host side is x86-64-v3 code. Features: the host CPU's, and ``sm_<cc>``,
    which the runtime checks against the CUDA devices present."""
    return Target(f"cuda-sm{cc}", "cuda",
                  {"kind": "cuda", "arch": f"sm_{cc}", "max_threads_per_block": 1024,
                   "max_shared_memory_per_block": 49152, "thread_warp_size": 32,
                   "host": {**_X86_LLVM, "mcpu": "x86-64-v3"}},
                  "x86_64", _X86_V3 + (f"sm_{cc}",), 16,
                  f"NVIDIA GPU, compute capability {cc // 10}.{cc % 10}+ ({gpu} and later); "
                  f"cubin + PTX compiled ahead of time with nvcc")


_AVX512_BF16 = Target("avx512-bf16", "x86", {**_X86_LLVM, "mcpu": "cooperlake"},
                      "x86_64", _X86_V3 + _AVX512 + ("avx512_vnni", "avx512_bf16"), 64,
                      "x86-64 with AVX-512 VNNI and BF16 (Cooper Lake, Zen 4 and later): "
                      "int8 dot products with vpdpbusd, bf16 pairs with vdpbf16ps")

TARGETS = {
    "host": Target("host", "x86", {**_X86_LLVM, "mcpu": "x86-64-v3"},
                   "x86_64", _X86_V3, 32, "x86-64 with AVX2 and FMA (x86-64-v3)"),
    "avx512": Target("avx512", "x86", {**_X86_LLVM, "mcpu": "skylake-avx512"},
                     "x86_64", _X86_V3 + _AVX512, 64,
                     "x86-64 with AVX-512 (Skylake-SP and later)"),
    # int8 convolution and matmul tensorized to vpdpbusd (schedules/x86_tensorized.py)
    "avx512-vnni": Target("avx512-vnni", "x86", {**_X86_LLVM, "mcpu": "cascadelake"},
                          "x86_64", _X86_V3 + _AVX512 + ("avx512_vnni",), 64,
                          "x86-64 with AVX-512 VNNI (Cascade Lake, Ice Lake and later): "
                          "int8 dot products with vpdpbusd"),
    # and bf16 convolution and matmul tensorized to vdpbf16ps
    "avx512-bf16": _AVX512_BF16,
    # avx512-bf16's instructions with the schedule defaults measured on AMD Zen 4: reduction in
    # passes, which the Cascade Lake needs (1.15-1.38x on its 1x1s), lost 1-10% per layer there
    # and 2-3% on ResNet-50 (docs/performance.md, "A target for Zen 4"). Built with LLVM's own
    # Zen 4 model (mcpu znver4) ResNet-50 ran 1.3x slower (91.4 against 70.9 ms, 1 thread), so
    # the code generator keeps cooperlake's.
    "zen4": replace(_AVX512_BF16, name="zen4", description=(
        "AMD Zen 4 (EPYC 9004, Ryzen 7000): avx512-bf16's instructions, its convolutions reduce "
        "each panel's channels in one pass"), cpu=("AuthenticAMD", 25), reduction_passes=False),
    # int8 and bf16 matmul / convolution on AMX tiles; the runtime asks Linux for the tile state
    # (arch_prctl) before the first call, because the kernel would die of SIGILL without it
    "amx": Target("amx", "x86", {**_X86_LLVM, "mcpu": "sapphirerapids"},
                  "x86_64", _X86_V3 + _AVX512 + ("avx512_vnni", "avx512_bf16", "amx_tile",
                                                 "amx_int8", "amx_bf16"), 64,
                  "x86-64 with AMX (Sapphire Rapids and later): int8 and bf16 tile multiply "
                  "(tdpbusd, tdpbssd, tdpbf16ps)"),
    # Arm: cross-compiled (the aarch64 GNU toolchain links the .so); on an x86 machine such a
    # library is run under qemu-aarch64 (blockpad.testing.qemu), never loaded.
    "neon": Target("neon", "arm", {"kind": "llvm", "mtriple": "aarch64-linux-gnu",
                                   "mattr": ["+neon"]},
                   "aarch64", ("asimd",), 16, "Arm AArch64 with NEON (Advanced SIMD)",
                   **_AARCH64_GCC),
    "neon-dotprod": Target("neon-dotprod", "arm", {"kind": "llvm", "mtriple": "aarch64-linux-gnu",
                                                   "mattr": ["+neon", "+dotprod"]},
                           "aarch64", ("asimd", "asimddp"), 16,
                           "Arm AArch64 with NEON and the dot-product extension (sdot/udot; "
                           "Armv8.2-A+dotprod: Cortex-A55/A76, Neoverse N1 and later)",
                           **_AARCH64_GCC),
    **{f"cuda-sm{cc}": _cuda(cc, gpu) for cc, gpu in ((80, "Ampere A100"), (90, "Hopper H100"))},
}


def get_target(name: str) -> Target:
    try:
        return TARGETS[name]
    except KeyError:
        raise SpecError(f"target: expected one of {', '.join(TARGETS)}; got {name!r}") from None


def check_toolchain(target: Target) -> None:
    """A cross target links with its cross compiler: refuse before any work when it is not
    installed, saying which package provides it."""
    if target.cross_compiler and shutil.which(target.cross_compiler) is None:
        raise BuildError(f"target {target.name} links with {target.cross_compiler}, which is not "
                         f"on PATH; install it (Debian/Ubuntu: apt-get install "
                         f"{target.cross_package})")


def native_target() -> str:
    """The widest CPU target this machine runs (``--target native``). The benchmarks build for
    it: PyTorch and ONNX Runtime pick their kernels' ISA at run time (AVX-512, VNNI's
    ``vpdpbusd``, AMX where the CPU has them), so a fair comparison builds blockpad for the same.
    Each wider target is a superset of the one after it, so fp32 kernels build for all of them;
    a target tuned to one core design (``zen4``) is taken on that CPU only."""
    for name in ("amx", "zen4", "avx512-bf16", "avx512-vnni", "avx512", "host"):
        t = TARGETS[name]
        if t.arch == machine.arch() and not machine.missing_features(t.features) \
                and t.cpu in (None, machine.cpu_model()):
            return name
    return "host"
