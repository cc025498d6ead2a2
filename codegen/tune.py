"""Autotuning: measure every kernel's schedule variants with MetaSchedule's builder and runner
into ``tuning_logs/<target>/``, and let builds use the fastest measured variant.

The records are MetaSchedule's own JSON database (``database_workload.json``,
``database_tuning_record.json``): one workload per scheduled variant, with an empty trace
(``schedules/space.py`` says why), so any MetaSchedule tool opens and applies them. Records are
appended as each batch of trials finishes, so an interrupted run loses at most that batch and a
re-run measures only what is missing. Beside them, ``blockpad.json`` says per kernel name which
kernel function was tuned, with which TVM: MetaSchedule's files cannot tell a build why a
kernel has no record (never tuned, or tuned before its code changed).

A build never trusts a log file: it reads it line by line, ignores what it cannot parse, what
was measured for another target or TVM version, and says so (``Logs.warnings``, each kernel's
``tuning`` status). A record only ever selects a function the schedule rules produce now.
"""

from __future__ import annotations

import contextlib
import hashlib
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

from blockpad.errors import BuildError, SpecError
from blockpad.runtime import machine
from blockpad.runtime import manifest as mf

from .spec import Spec, load_spec
from .targets import Target, get_target

DB_FILES = ("database_workload.json", "database_tuning_record.json")
INDEX = "blockpad.json"
ONE_VARIANT = "its schedule rule has one variant, nothing to choose"
STRIDED = "a strided argument (MetaSchedule's runners allocate dense tensors)"
ROUNDS = 5     # measurements of each variant, interleaved with the other variants
FAILED = 1e9   # a failed build or run is recorded as MetaSchedule does: run_secs = [1e10]


def default_dir() -> Path:
    """The packaged ``blockpad.tuning_logs`` folder: where ``tune`` writes and ``build`` reads
    unless told otherwise."""
    import blockpad.tuning_logs

    return Path(blockpad.tuning_logs.__file__).parent


def logs_digest(root, target: Target) -> str:
    """Digest of the log files a build of ``target`` reads (part of its build key: a new record
    rebuilds). Pure file hashing: the up-to-date check stays fast."""
    h = hashlib.sha256()
    for name in (*DB_FILES, INDEX):
        path = Path(root) / target.name / name
        if path.is_file():
            h.update(name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


def target_key(tvm_target) -> str:
    """A TVM target as records compare it: ``num-cores`` is left out (MetaSchedule requires it
    when tuning; it does not change the code a schedule compiles to)."""
    spec = {k: v for k, v in dict(tvm_target.export()).items() if k != "num-cores"}
    return json.dumps(spec, sort_keys=True, default=str)


def _hash(mod) -> str:
    import tvm_ffi

    return str(tvm_ffi.structural_hash(mod))


# ---- reading the logs --------------------------------------------------------------------------

@dataclass
class Choice:
    """What a build does with one kernel: the tuned func, or None (default schedule) and why."""

    func: object
    status: dict


class Logs:
    """The tuning records of one target folder, read so that a corrupt or truncated line costs
    that line (with a warning), never the build. Workloads are decoded only when a kernel's
    variant hashes to them."""

    def __init__(self, root, target: Target):
        self.dir = Path(root) / target.name
        self.target = target
        self.warnings: list[str] = []
        self.index = self._index()
        self._workloads = {}   # structural hash -> [(workload line, JSON)]
        n_workloads = 0
        for i, line in self._lines(DB_FILES[0]):
            n_workloads = i
            try:
                shash, _blob = entry = json.loads(line)
                self._workloads.setdefault(str(shash), []).append((i - 1, entry))
            except Exception as e:  # noqa: BLE001 - any malformed line
                self._warn(DB_FILES[0], i, e)
        self._records = {}     # workload line (0-based) -> [record JSON]
        for i, line in self._lines(DB_FILES[1]):
            try:
                w, rec = json.loads(line)
                if not (isinstance(w, int) and 0 <= w < n_workloads):
                    raise ValueError(f"workload index {w!r} is not a line of {DB_FILES[0]}")
                self._records.setdefault(w, []).append(rec)
            except Exception as e:  # noqa: BLE001
                self._warn(DB_FILES[1], i, e)

    def _lines(self, name):
        path = self.dir / name
        if not path.is_file():
            return []
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError) as e:
            self.warnings.append(f"{path}: unreadable, ignored ({e})")
            return []
        return [(i, line) for i, line in enumerate(text.splitlines(), 1) if line.strip()]

    def _warn(self, name, line, error):
        text = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
        self.warnings.append(f"{self.dir / name}: line {line} is corrupt and is ignored ({text})")

    def _index(self) -> dict:
        path = self.dir / INDEX
        if not path.is_file():
            return {}
        try:
            index = json.loads(path.read_text())["kernels"]
            if not isinstance(index, dict):
                raise ValueError("'kernels' is not an object")
            return index
        except Exception as e:  # noqa: BLE001
            self.warnings.append(f"{path}: unreadable ({e}); no kernel is looked up")
            return {}

    def records(self, wl) -> list:
        """MetaSchedule ``TuningRecord``s of workload module ``wl``, failed trials included."""
        import tvm_ffi
        from tvm.s_tir import meta_schedule as ms

        out = []
        for i, entry in self._workloads.get(_hash(wl), []):
            try:
                workload = ms.database.Workload.from_json(entry)
            except Exception as e:  # noqa: BLE001
                self._warn(DB_FILES[0], i + 1, e)
                continue
            if not tvm_ffi.structural_equal(workload.mod, wl):
                continue
            for rec in self._records.get(i, []):
                try:
                    out.append(ms.database.TuningRecord.from_json(rec, workload))
                except Exception as e:  # noqa: BLE001
                    self.warnings.append(f"{self.dir / DB_FILES[1]}: a record of workload "
                                         f"line {i + 1} is corrupt and is ignored ({e})")
        return out

    def choose(self, name: str, func, tvm_target) -> Choice:
        """The fastest measured variant of kernel ``name`` for this target and TVM, or why
        there is none."""
        from blockpad.schedules import space

        entry = self.index.get(name)
        if not entry:
            where = "" if (self.dir / DB_FILES[1]).is_file() else f" (no tuning logs in {self.dir})"
            return _default(f"no record{where}")
        if entry.get("skipped"):
            return _default(f"not tuned: {entry['skipped']}")
        if entry.get("tvm_version") != mf.tvm_version():
            return _default(f"recorded with TVM {entry.get('tvm_version')}, this is "
                            f"{mf.tvm_version()}")
        now = _hash(space.workload(func))
        if entry.get("workload") != now:
            return _default(f"workload hash mismatch: tuned {entry.get('workload')}, now {now} "
                            f"(the kernel's code changed since it was tuned, or another kernel "
                            f"of this name was tuned)")
        key = target_key(tvm_target)
        funcs = space.variants(func, self.target)
        best, trials, others = None, 0, set()
        for i, f in enumerate(funcs):
            mine = []
            for rec in self.records(space.workload(f)):
                if target_key(rec.target) == key:
                    mine.append(rec)
                else:
                    others.add(str(rec.target.export().get("mcpu") or rec.target.kind.name))
            trials += len(mine)
            secs = variant_time(mine)
            if secs is not None and (best is None or secs < best[1]):
                best = (i, secs)
        if best is None:
            why = (f"records only for another target ({', '.join(sorted(others))})" if others
                   and not trials else f"all {trials} trials failed" if trials else
                   f"none of the {len(funcs)} variants the schedule rules produce now was "
                   f"measured (the rules changed since tuning)")
            return _default(why)
        return Choice(funcs[best[0]], {"tuned": True, "variant": best[0],
                                       "variants": len(funcs), "trials": trials,
                                       "time_us": round(best[1] * 1e6, 3)})


def _default(reason) -> Choice:
    return Choice(None, {"tuned": False, "reason": reason})


def record_time(record) -> float:
    """A record's time: the median of its repeats (MetaSchedule's own queries rank by the
    mean, which one burst of another process's work on a shared machine moves)."""
    secs = [float(s) for s in (record.run_secs or [])]
    return statistics.median(secs) if secs else 2 * FAILED


def variant_time(records):
    """A variant's time: the median over its records (one per measuring round), None if
    every trial failed."""
    times = [t for t in map(record_time, records) if t < FAILED]
    return statistics.median(times) if times else None


# ---- tuning ------------------------------------------------------------------------------------

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
    imports every tensor intrinsic in each worker (30 s; tvm027.md section 6)."""
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
    spec = spec if isinstance(spec, Spec) else load_spec(spec)
    target = target if isinstance(target, Target) else get_target(target)
    if isinstance(trials, bool) or not isinstance(trials, int) or trials < 1:
        raise SpecError(f"--trials: expected a positive number of trials; got {trials!r}")
    _check_measurable(target, rpc)
    folder = (Path(out) if out is not None else default_dir()) / target.name
    folder.mkdir(parents=True, exist_ok=True)
    _drop_torn_lines(folder, log)

    from .build import _runtime_zero_pads, make_kernels

    kernels = [k for req in spec.kernels for k in make_kernels(req)]
    kernels += _runtime_zero_pads(kernels)
    session = _Session(target, folder, rpc, log)
    with _interruptible():
        return [session.tune(k, f"[{i}/{len(kernels)}] {k.name}", trials)
                for i, k in enumerate(kernels, 1)]


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

    def workers(self):
        """MetaSchedule's builder and runner, made on first use (each starts a worker process
        to check itself: a re-run with nothing left to measure need not)."""
        from tvm.s_tir import meta_schedule as ms

        if self._workers is None:
            evaluator = ms.runner.EvaluatorConfig(number=3, repeat=1, min_repeat_ms=40)
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
            "workload": _hash(wl), "tvm_version": mf.tvm_version(), "target": self.target.name,
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
