"""The ahead-of-time driver: spec + target -> one shared library and its manifest.

A build is keyed by everything that can change its output (the kernels asked for, the target,
TVM's version and blockpad's own code generator); building again with the same key does nothing
and says so."""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from blockpad import manifest as mf
from blockpad.errors import BlockpadError, BuildError, SpecError

from . import auto, tuning_records
from .kernel import alias_inplace, make_inplace
from .ops import OPS
from .spec import Spec, as_spec
from .targets import Target, check_toolchain, get_target

#: a kernel's variant for a pool of N threads is the symbol ``<kernel>__threads<N>``
POOL_VARIANT = "__threads"


def export(lib, path, target: Target) -> None:
    """Write the compiled module ``lib`` as the shared library ``path`` for ``target``
    (linked by its cross compiler where it has one), whole or not at all."""
    tmp = path + ".tmp.so"
    if target.cross_compiler:
        from tvm.support import cc

        lib.export_library(tmp, fcompile=cc.cross_compiler(target.cross_compiler))
    elif target.family == "cuda":
        from . import cuda_aot

        cuda_aot.export(lib, tmp, target)   # device code compiled by nvcc now, not at load
    else:
        lib.export_library(tmp)
    os.replace(tmp, path)


@dataclass
class BuildResult:
    out_dir: str
    manifest: dict
    rebuilt: bool


def build(spec, target="host", out_dir="build", force=False, log=None,
          tuning_logs=None) -> BuildResult:
    """Build ``spec`` (a TOML path, a dict shaped like the TOML, or a parsed Spec) for
    ``target`` into ``out_dir``, with the best tuning record per kernel from ``tuning_logs``
    (default: the packaged tuning_logs)."""
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    spec = as_spec(spec)
    target = target if isinstance(target, Target) else get_target(target)
    tuning_logs = Path(tuning_logs) if tuning_logs is not None else tuning_records.default_dir()
    key = build_key(spec, target, tuning_logs)
    out_dir = os.fspath(out_dir)
    if not force and _up_to_date(out_dir, key):
        log(f"{out_dir}: kernels up to date ({len(spec.kernels)} for {target.name}, "
            f"build key {key[:12]}); nothing to compile")
        return BuildResult(out_dir, mf.read(out_dir), rebuilt=False)

    check_toolchain(target)

    import tvm

    from blockpad.schedules import schedule_for_pools

    os.makedirs(out_dir, exist_ok=True)
    start = time.perf_counter()
    kernels, failed, entry_of, tuned_as = [], Failures(spec), {}, {}
    logs = tuning_records.Logs(tuning_logs, target)
    for warning in logs.warnings:
        log(f"warning: {warning}")
    tvm_target = target.tvm_target()
    n = len(spec.kernels)
    recorded = recorded_seconds(logs, tvm_target)
    for i, req in enumerate(spec.kernels, 1):
        t0 = time.perf_counter()
        picked = None
        if auto.is_auto(req):   # conv2d algorithm = "auto": records, else the cost model
            resolved = failed.run(req, "choosing the algorithm",
                                  lambda: auto.resolve(req, recorded, target.name))  # noqa: B023
            if resolved is None:
                log(f"[{i}/{n}] {req.name}: FAILED")
                continue
            req, picked = resolved
            tuned_as[req.name] = picked["tuned_as"]
            log(f"[{i}/{n}] {req.name}: auto picked {picked['chosen']} by {picked['by']}")
        made = failed.run(req, "code generation", lambda: make_kernels(req))  # noqa: B023 (run now)
        if made is None:
            log(f"[{i}/{n}] {req.name}: FAILED")
            continue
        if picked is not None:
            made[0].params["auto"] = picked
        kernels += made
        entry_of.update((k.name, req) for k in made)
        extra = f" + {len(made) - 1} stage kernel" if len(made) > 1 else ""
        log(f"[{i}/{n}] {req.name}{extra}: generated ({time.perf_counter() - t0:.2f} s)")
    kernels += _runtime_zero_pads(kernels)
    funcs, tuning, pools = {}, {}, {}
    t0 = time.perf_counter()
    for k in kernels:
        req = entry_of.get(k.name)

        def choose_and_schedule(k=k):
            """A tuning record's schedule (measured at the tuning's thread count), else the
            rule's default and its variants for other pool sizes."""
            choice = logs.choose(tuned_as.get(k.name, k.name), k.func, tvm_target)
            func, variants = (choice.func, {}) if choice.func is not None \
                else schedule_for_pools(k.func, target)
            return choice.status, alias_inplace(func, k), \
                {n: alias_inplace(f, k) for n, f in variants.items()}
        done = failed.run(req, "scheduling", choose_and_schedule, k.name)
        if done is not None:
            tuning[k.name], funcs[k.name], variants = done
            for n, func in variants.items():
                pools.setdefault(k.name, {})[n] = symbol = f"{k.name}{POOL_VARIANT}{n}"
                funcs[symbol] = func.with_attr("global_symbol", symbol)
    failed.raise_any(target)
    log(f"scheduled {len(kernels)} kernels for {target.name} ({time.perf_counter() - t0:.2f} s)")
    _log_tuning(log, tuning, logs.dir)
    n = len(kernels)
    variants = len(funcs) - n
    log(f"compiling {n} kernels"
        + (f" (+ {variants} scheduled for other thread counts)" if variants else "")
        + f" for {target.name} ({target.description}) ...")
    t0 = time.perf_counter()
    if target.family == "cuda":
        from . import cuda_aot

        cuda_aot.register_lowerings()
    try:
        lib = tvm.compile(tvm.IRModule(funcs), target=target.tvm_target())
        lib_path = os.path.join(out_dir, mf.LIBRARY)
        export(lib, lib_path, target)
        _write_sources(out_dir, funcs, lib, target)
    except Exception as e:  # noqa: BLE001
        raise BuildError(f"compiling for {target.name} failed: {e}") from e
    log(f"compiled in {time.perf_counter() - t0:.2f} s")

    manifest = {
        "format": mf.FORMAT,
        "name": spec.name,
        "build_key": key,
        "library": mf.LIBRARY,
        "library_sha256": mf.file_sha256(lib_path),
        "tvm_version": mf.tvm_version(),
        "target": {"name": target.name, "tvm": target.tvm, "arch": target.arch,
                   "features": list(target.features)},
        "policy": spec.policy,
        "kernels": [k.record(tuned=tuning[k.name].pop("tuned"), tuning=tuning[k.name],
                             threads=pools.get(k.name)).to_json()
                    for k in kernels],
    }
    mf.write(out_dir, manifest)
    size = os.path.getsize(lib_path)
    log(f"wrote {lib_path} ({size // 1024} KiB) and {mf.MANIFEST}: {n} kernels in "
        f"{time.perf_counter() - start:.1f} s")
    return BuildResult(out_dir, manifest, rebuilt=True)


def _write_sources(out_dir, funcs, lib, target):
    """What ``blockpad inspect`` shows: each kernel's scheduled TIR and the module's assembly
    (a deployed library cannot regenerate them: the runtime has no compiler); for CUDA also
    the device code's CUDA C and PTX."""
    src = os.path.join(out_dir, "source")   # read by blockpad.generated
    os.makedirs(src, exist_ok=True)
    for name, func in funcs.items():
        with open(os.path.join(src, f"{name}.tir.py"), "w") as f:
            f.write(func.script())
    for fmt, ext in (("asm", "s"), ("ll", "ll")):
        try:
            text = lib.mod.inspect_source(fmt)
        except Exception:  # noqa: BLE001 - a module kind without this format
            continue
        with open(os.path.join(src, f"kernels.{ext}"), "w") as f:
            f.write(text)
    if target.family == "cuda":
        from . import cuda_aot

        cu = cuda_aot.device_source(lib)
        for ext, text in (("cu", cu), ("ptx", cuda_aot.compile_device(cu, cuda_aot.sm(target))[1])):
            with open(os.path.join(src, f"kernels.{ext}"), "w") as f:
                f.write(text)


def _log_tuning(log, tuning, logs_dir):
    """Which kernels got a tuning record and which the default schedule, and why."""
    tuned = [f"{n} ({s['time_us']} us)" for n, s in tuning.items() if s["tuned"]]
    log(f"tuning records ({logs_dir}): {len(tuned)} of {len(tuning)} kernels tuned"
        + (f": {', '.join(tuned)}" if tuned else ""))
    untuned = [(name, s["reason"]) for name, s in tuning.items() if not s["tuned"]]
    if tuned or len({reason for _, reason in untuned}) > 1:
        for name, reason in untuned:
            log(f"  {name}: default schedule ({reason})")
    elif untuned:   # one reason for every kernel (no logs for this target): said once
        log(f"  every kernel: default schedule ({untuned[0][1]})")


def recorded_seconds(logs, tvm_target):
    """``request -> seconds`` of its kernel's fastest recorded schedule (None: not tuned), what
    ``auto.resolve`` asks of the tuning records ``logs``."""
    def seconds(req):
        return logs.seconds(req.name, make_kernels(req)[0].func, tvm_target) \
            if logs.index else None
    return seconds


def make_kernels(req):
    """The kernels of one spec request (the op's kernel, plus a stage kernel under dst_stage)."""
    op = OPS[req.op]
    params = dict(req.params)
    inplace = params.pop("inplace", False)
    kernels = op.make(req.layout, req.name, req.policy, **params)
    if inplace:
        kernels[0] = make_inplace(kernels[0], op.inplace)
    return kernels


class Failures:
    """The kernels a build could not make, each named with its spec entry; the build goes on
    to the next kernel, and raises one error listing them all at the end of the step (one bad
    kernel does not hide the others)."""

    def __init__(self, spec: Spec):
        self.spec, self.messages, self.all_spec = spec, [], True

    def run(self, req, step: str, make, kernel: str | None = None):
        """``make()``, or None after recording why it failed."""
        try:
            return make()
        except Exception as e:  # noqa: BLE001 - a TVM failure is reported with the kernel's name
            self.all_spec &= isinstance(e, SpecError)
            where = f"kernel #{req.entry} ({req.name})" if req else "runtime zero-pad kernel"
            if kernel and (req is None or kernel != req.name):
                where += f", its kernel {kernel}"
            reason = str(e) if isinstance(e, BlockpadError) else f"{type(e).__name__}: {e}"
            self.messages.append(f"{where}: {step} failed: {reason}")
            return None

    def raise_any(self, target: Target) -> None:
        if not self.messages:
            return
        n = len(self.messages)
        text = (f"{self.spec.name}: {n} of {len(self.spec.kernels)} spec kernels cannot be "
                f"built for {target.name}:\n  " + "\n  ".join(self.messages))
        raise (SpecError if self.all_spec else BuildError)(text)


def _runtime_zero_pads(kernels):
    """A zero-pad kernel for every padded layout a policy-aware kernel touches, so the runtime
    can zero-pad where its policy says (on handle, lazily, before a source-trusting kernel,
    ``cleanup``) with generated code rather than numpy."""
    from .ops.reorder import zero_pad

    have = {k.args[0].layout for k in kernels if k.op == "zero_pad"}
    out = []
    for k in kernels:
        if k.contract is None:
            continue
        for a in k.args:
            if a.layout.has_padding and a.layout not in have:
                have.add(a.layout)
                digest = hashlib.sha256(json.dumps(a.layout.describe(), sort_keys=True).encode())
                out.append(zero_pad(a.layout, f"zero_pad__{a.layout.tag}_{digest.hexdigest()[:10]}"))
    return out


def build_key(spec: Spec, target: Target, tuning_logs=None) -> str:
    h = hashlib.sha256()
    h.update(spec.digest().encode())
    logs = tuning_logs or tuning_records.default_dir()
    h.update(tuning_records.logs_digest(logs, target).encode())
    h.update(json.dumps([target.name, target.tvm, list(target.features)], sort_keys=True).encode())
    h.update(mf.tvm_version().encode())
    h.update(code_digest().encode())
    return h.hexdigest()


def code_digest() -> str:
    """Hash of the sources that decide what a build emits (layouts, codegen, schedules)."""
    import blockpad.codegen
    import blockpad.schedules
    from blockpad.version import GENERATOR_MODULES

    top = Path(blockpad.__file__).parent
    files = [top / f"{m}.py" for m in GENERATOR_MODULES]
    for pkg in (blockpad.codegen, blockpad.schedules):
        files += sorted(Path(pkg.__path__[0]).rglob("*.py"))
    h = hashlib.sha256()
    for f in files:
        h.update(f.read_bytes())
    return h.hexdigest()


def _up_to_date(out_dir, key) -> bool:
    try:
        manifest = mf.read(out_dir)
        lib = os.path.join(out_dir, manifest["library"])
        return manifest.get("build_key") == key and os.path.isfile(lib) and \
            mf.file_sha256(lib) == manifest["library_sha256"]
    except BlockpadError:
        return False
