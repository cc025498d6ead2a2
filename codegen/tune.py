"""Autotuning: measure every kernel's schedule variants with MetaSchedule's builder and runner
into ``tuning_logs/<target>/`` (read back by ``codegen/tuning_records.py`` when a build picks
the fastest variant).

Every variant is built first, then measured in interleaved rounds, and records are appended as
each round finishes, so an interrupted run loses at most that round and a re-run measures only
what is missing.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from blockpad import machine
from blockpad import manifest as mf
from blockpad.errors import BuildError, SpecError

from .spec import as_spec
from .targets import Target, check_toolchain, get_target
from .tuning_records import (
    DB_FILES,
    INDEX,
    ONE_VARIANT,
    ROUNDS,
    STRIDED,
    Logs,
    default_dir,
    target_key,
    variant_time,
    workload_hash,
)

#: How each variant is timed: ten single calls, each after MetaSchedule's runner flushed every
#: argument but the first from the caches (``cache_flush_cpu_non_first_arg``). A kernel in a
#: network meets its source warm (the step before just wrote it) and its weights cold (a
#: network's weights are larger than the caches), so that is what a variant is timed against;
#: timed hot instead (calls repeated for 40 ms), Winograd F(6x6) won five of the pruned
#: ResNet-50's 3x3s whose transformed weights then ran 1.3-1.4x slower in the network.
COLD = {"number": 1, "repeat": 10, "min_repeat_ms": 0, "enable_cpu_cache_flush": True}


@dataclass(frozen=True)
class Rpc:
    """Where measurements run when the target cannot run here: a device registered with TVM's
    RPC tracker under ``key``."""

    host: str
    port: int
    key: str

    @classmethod
    def parse(cls, tracker: str, key: str | None) -> Rpc:
        host, _, port = tracker.rpartition(":")
        if not host or not port.isdigit() or not key:
            raise SpecError(f"--rpc-tracker: expected HOST:PORT with --rpc-key KEY; got "
                            f"{tracker!r} and key {key!r}")
        return cls(host, int(port), key)


def build_candidate(mod, target, _params):
    """MetaSchedule's builder function: ``tirx.build``. Not MetaSchedule's default, which
    imports every tensor intrinsic in each worker (30 s; docs/tvm-0.27-notes.md 7)."""
    import tvm

    return tvm.tirx.build(mod, target=target)


def export_cross(compiler, rt_mod) -> str:
    """MetaSchedule's export function for a cross target: a shared library linked by
    ``compiler``, which the device's RPC server loads as is."""
    from tvm.support import cc

    path = os.path.join(tempfile.mkdtemp(prefix="blockpad-tune-"), "candidate.so")
    rt_mod.export_library(path, fcompile=cc.cross_compiler(compiler))
    return path


def make_builder(target: Target):
    """MetaSchedule's LocalBuilder with blockpad's build function, and for a cross target an
    export that links with the target's cross compiler."""
    from tvm.s_tir import meta_schedule as ms

    export = partial(export_cross, target.cross_compiler) if target.cross_compiler else None
    return ms.builder.LocalBuilder(f_build=build_candidate, f_export=export, timeout_sec=120)


def tune(spec, target="host", trials=16, out=None, rpc: Rpc | None = None, log=None) -> list:
    """Measure up to ``trials`` schedule variants of every kernel ``spec`` builds for ``target``
    into ``out/<target>/`` (default: the packaged tuning_logs). Returns one dict per kernel."""
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    spec = as_spec(spec)
    target = target if isinstance(target, Target) else get_target(target)
    if isinstance(trials, bool) or not isinstance(trials, int) or trials < 1:
        raise SpecError(f"--trials: expected a positive number of trials; got {trials!r}")
    _check_measurable(target, rpc)
    check_toolchain(target)
    folder = (Path(out) if out is not None else default_dir()) / target.name
    folder.mkdir(parents=True, exist_ok=True)
    _drop_torn_lines(folder, log)

    from . import auto
    from .build import _runtime_zero_pads, make_kernels

    # conv2d algorithm = "auto": every candidate, so that the build picks by their records
    reqs = [c for req in spec.kernels for c in (
        [c for _, c in auto.candidates(req)] if auto.is_auto(req) else [req])]
    kernels = [k for req in reqs for k in make_kernels(req)]
    kernels += _runtime_zero_pads(kernels)
    session = _Session(target, folder, rpc, log)
    start = time.perf_counter()
    try:
        with _interruptible():
            return [session.tune(k, progress_label(i, len(kernels), k.name,
                                                   time.perf_counter() - start), trials)
                    for i, k in enumerate(kernels, 1)]
    except KeyboardInterrupt:
        _ignore_orphaned_pools()
        raise
    finally:
        session.close()


def progress_label(i: int, n: int, name: str, elapsed: float) -> str:
    """``[i/n] name``; once a run has taken ``ETA_AFTER`` seconds, also the time so far and
    about how long the rest will take (the mean time per kernel so far times the kernels left:
    rough, since kernels with one variant take none and a Winograd candidate the most; a
    channel-pruned ResNet-50's 258 kernels took 16 minutes on 2 cores)."""
    if elapsed < ETA_AFTER or i < 2:
        return f"[{i}/{n}] {name}"
    left = elapsed / (i - 1) * (n - i + 1)
    return f"[{i}/{n}, {_duration(elapsed)} so far, about {_duration(left)} left] {name}"


#: seconds a tune run takes before its progress lines estimate the rest
ETA_AFTER = 30


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.0f} min"


def _ignore_orphaned_pools():
    """After an interrupt: MetaSchedule's builder makes a process pool per batch and shuts it
    down at the batch's end; a batch cut short leaves the pool to its threads, and the last one
    to finish drops the last reference, so ``PopenPoolExecutor.__del__`` runs in that thread:
    it kills the pool's worker processes, then fails to join its own thread, and Python printed
    "Exception ignored ... RuntimeError: cannot join current thread" after blockpad's own
    "interrupted" line. Only that error, from that method, is dropped; the workers are gone by
    then."""
    default = sys.unraisablehook

    def hook(unraisable):
        if isinstance(unraisable.exc_value, RuntimeError) and \
                "cannot join current thread" in str(unraisable.exc_value) and \
                getattr(unraisable.object, "__qualname__", "") == "PopenPoolExecutor.__del__":
            return
        default(unraisable)
    sys.unraisablehook = hook


@contextlib.contextmanager
def _interruptible():
    """Ctrl-C stops tuning as KeyboardInterrupt, also when it lands in MetaSchedule's Python
    builder or runner, called through TVM's FFI, which turns it into a bare RuntimeError."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    hit = []

    def handler(signum, frame):
        hit.append(signum)
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield
    except Exception:
        if hit:
            raise KeyboardInterrupt from None
        raise
    finally:
        signal.signal(signal.SIGINT, previous)


class _Session:
    """MetaSchedule's database, builder and runner, shared by the kernels of a tune run."""

    def __init__(self, target, folder, rpc, log):
        os.environ.setdefault("TVM_NUM_THREADS", str(os.cpu_count() or 1))  # as kernels run
        from tvm.s_tir import meta_schedule as ms

        self.target, self.folder, self.log = target, folder, log
        self.cores = int(os.environ["TVM_NUM_THREADS"])
        self.tvm_target = target.tvm_target(num_cores=self.cores)
        broken = Logs(folder.parent, target).warnings
        if broken:
            raise BuildError(f"{folder}: the tuning logs are corrupt and MetaSchedule cannot "
                             f"append to them; move them away or fix them:\n  "
                             + "\n  ".join(broken))
        self.db = ms.database.JSONDatabase(work_dir=str(folder))
        self.rpc = rpc
        self._workers = None
        # build and run errors, per kernel: kept out of the (committed) logs folder
        self.error_dir = Path(tempfile.gettempdir()) / "blockpad-tune" / target.name

    def close(self):
        """Shut the runner's process pool down now (MetaSchedule asks for it explicitly: its
        ``__del__`` may run in one of the pool's threads)."""
        pool = getattr(self._workers[1], "pool", None) if self._workers else None
        if pool is not None:
            pool.shutdown(wait=False)

    def workers(self):
        """MetaSchedule's builder and runner, made on first use (each starts a worker process
        to check itself: a re-run with nothing left to measure need not)."""
        from tvm.s_tir import meta_schedule as ms

        if self._workers is None:
            evaluator = ms.runner.EvaluatorConfig(**COLD)
            if self.rpc is None:
                runner = ms.runner.LocalRunner(evaluator_config=evaluator, timeout_sec=60)
            else:
                config = ms.runner.RPCConfig(tracker_host=self.rpc.host,
                                             tracker_port=self.rpc.port,
                                             tracker_key=self.rpc.key, session_timeout_sec=120)
                runner = ms.runner.RPCRunner(rpc_config=config, evaluator_config=evaluator)
            self._workers = make_builder(self.target), runner
        return self._workers

    def tune(self, k, label, trials) -> dict:
        from tvm.s_tir import meta_schedule as ms

        from blockpad.schedules import space

        funcs = space.variants(k.func, self.target)
        skipped = STRIDED if not _compact(k) else ONE_VARIANT if len(funcs) < 2 else None
        if skipped:
            self.log(f"{label}: skipped: {skipped}")
            self._index(k.name, space.workload(k.func), trials=0, skipped=skipped)
            return {"kernel": k.name, "measured": 0, "skipped": skipped}
        wls = [space.workload(f) for f in funcs]
        key = target_key(self.tvm_target)
        logs = Logs(self.folder.parent, self.target)
        done = {i: [r for r in logs.records(wl) if target_key(r.target) == key]
                for i, wl in enumerate(wls[:trials])}
        measured = sum(1 for recs in done.values() if recs)
        todo = [i for i, recs in done.items() if not recs]
        for i in [i for i in todo if not _well_formed(wls[i])]:
            self.log(f"{label}: variant {i} left out: ill-formed TIR, which MetaSchedule cannot "
                     f"store")
            todo.remove(i)
        best = min(filter(None, map(variant_time, done.values())), default=None)
        self._index(k.name, space.workload(k.func), trials=measured)
        if not todo:
            self.log(f"{label}: already tuned ({measured} of {len(funcs)} variants measured, "
                     f"best {_us(best)}); skipped")
            return {"kernel": k.name, "measured": 0, "best_us": _us_value(best)}
        self.log(f"{label}: {len(funcs)} schedule variants, measuring {len(todo)}"
                 + (f" ({measured} measured before)" if measured else ""))
        t0 = time.perf_counter()
        built, failed = self._build(k.name, label, wls, todo)
        times = {i: [] for i in built}
        _, runner = self.workers()
        inputs = {i: ms.runner.RunnerInput(path, "cpu", ms.arg_info.ArgInfo.from_entry_func(wls[i]))
                  for i, path in built.items()}
        for r in range(ROUNDS):   # every variant once per round: they share the clock's drift
            live = [i for i in built if i not in failed]
            for i, run in zip(live, [f.result() for f in runner.run([inputs[i] for i in live])]):
                if run.error_msg:
                    failed.add(i)
                    self._error_log(k.name).warning("variant %d: %s", i, run.error_msg)
                    self._commit(wls[i], [1e10])
                else:
                    times[i].append(statistics.median(float(t) for t in run.run_secs))
                    self._commit(wls[i], run.run_secs)
            self._index(k.name, space.workload(k.func), trials=measured + len(todo))
            best = _best_of(times, failed, best)
            self.log(f"{label}: round {r + 1}/{ROUNDS} of {len(live)} variants, best so far "
                     f"{_us(best)}")
        for path in built.values():
            shutil.rmtree(os.path.dirname(path), ignore_errors=True)
        self.log(f"{label}: done in {time.perf_counter() - t0:.0f} s, best {_us(best)}"
                 + (f"; {len(failed)} variants failed (see {self.error_dir})" if failed else ""))
        return {"kernel": k.name, "measured": len(todo), "failed": len(failed),
                "best_us": _us_value(best)}

    def _build(self, name, label, wls, todo):
        """Compile variants ``todo`` (a batch at a time); a failed build is recorded as
        MetaSchedule does (run_secs [1e10]), so that it is not tried again. Returns the
        artifact paths by variant, and the variants that failed."""
        from tvm.s_tir import meta_schedule as ms

        builder, _ = self.workers()
        built, failed = {}, set()
        batch = 2 * self.cores
        for n in range(0, len(todo), batch):
            chunk = todo[n:n + batch]
            inputs = [ms.builder.BuilderInput(wls[i], self.tvm_target) for i in chunk]
            for i, result in zip(chunk, builder.build(inputs)):
                if result.error_msg:
                    failed.add(i)
                    self._error_log(name).warning("variant %d: %s", i, result.error_msg)
                    self._commit(wls[i], [1e10])
                else:
                    built[i] = result.artifact_path
            self.log(f"{label}: built {n + len(chunk)}/{len(todo)} variants")
        return built, failed

    def _commit(self, wl, run_secs):
        """Append one trial's record to the database (MetaSchedule flushes each line)."""
        from tvm.s_tir import meta_schedule as ms

        self.db.commit_tuning_record(ms.database.TuningRecord(
            _trace(wl), self.db.commit_workload(wl), [float(t) for t in run_secs],
            self.tvm_target, ms.arg_info.ArgInfo.from_entry_func(wl)))

    def _index(self, name, wl, trials, skipped=None):
        """Record which kernel function ``name`` was tuned as, with which TVM (before the
        first trial too, so that an interrupted run is indexed), atomically."""
        path = self.folder / INDEX
        try:
            index = json.loads(path.read_text()) if path.is_file() else {}
        except ValueError:
            index = {}
        index["format"] = 1
        index.setdefault("kernels", {})[name] = {
            "workload": workload_hash(wl), "tvm_version": mf.tvm_version(), "target": self.target.name,
            "trials": trials, **({"skipped": skipped} if skipped else {})}
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(index, indent=1, sort_keys=True) + "\n")
        os.replace(tmp, path)

    def _error_log(self, name):
        self.error_dir.mkdir(parents=True, exist_ok=True)
        logger = logging.getLogger(f"blockpad.tune.{self.target.name}.{name}")
        logger.propagate = False
        if not logger.handlers:
            handler = logging.FileHandler(self.error_dir / f"{name}.log")
            handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
            logger.addHandler(handler)
        return logger


def _trace(wl):
    """The record's trace: one annotation of the root block. The variant is the workload
    itself, but MetaSchedule's queries skip a record whose trace does nothing."""
    from tvm import s_tir

    sch = s_tir.Schedule(wl)
    sch.annotate(sch.get_sblock("root"), "blockpad.tuned", True)
    return sch.trace


def _well_formed(wl) -> bool:
    """Whether MetaSchedule can store ``wl``: it opens every record as a Schedule, which
    verifies the TIR (loop partitioning can leave a block variable defined twice: it
    compiles, but no Schedule takes it)."""
    from tvm import s_tir

    try:
        s_tir.Schedule(wl)
    except Exception:  # noqa: BLE001 - TVM raises InternalError/ValueError variants
        return False
    return True


def _best_of(times, failed, best):
    """The fastest median over rounds of the variants measured so far, or ``best`` (the
    fastest recorded before) if that is faster."""
    medians = [statistics.median(t) for i, t in times.items() if t and i not in failed]
    return min([*medians, *([best] if best is not None else [])], default=None)


def _us(secs) -> str:
    return "none" if secs is None else f"{secs * 1e6:.1f} us"


def _us_value(secs):
    return None if secs is None else round(secs * 1e6, 3)


def _compact(kernel) -> bool:
    """Whether every argument is a dense array of its physical shape (what MetaSchedule's
    runners allocate)."""
    for a in kernel.args:
        expect = 1
        for n, s in zip(reversed(a.layout.physical_shape), reversed(a.layout.physical_strides)):
            if s != expect:
                return False
            expect *= n
    return True


def _check_measurable(target, rpc):
    if target.family == "cuda":
        raise SpecError(f"tuning {target.name}: only CPU targets can be tuned (host, avx512, "
                        f"neon, neon-dotprod)")
    if rpc is not None:
        return
    missing = machine.missing_features(target.features)
    if target.arch != machine.arch() or missing:
        raise SpecError(f"tuning {target.name}: this machine cannot run its kernels ("
                        f"{'it lacks ' + ', '.join(missing) if missing else target.arch}); "
                        f"measure on a device with --rpc-tracker HOST:PORT --rpc-key KEY")


def _drop_torn_lines(folder, log):
    """A run killed while a line was appended leaves it without its newline: cut it off, so
    that the database opens and takes appends again."""
    for name in DB_FILES:
        path = folder / name
        if path.is_file():
            data = path.read_bytes()
            if data and not data.endswith(b"\n"):
                path.write_bytes(data[:data.rfind(b"\n") + 1])
                log(f"warning: {path}: dropped a line cut short by an interrupted run")
