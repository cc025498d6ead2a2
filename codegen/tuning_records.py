"""Tuning records as builds read them: ``tuning_logs/<target>/``, written by ``blockpad tune``
(``codegen/tune.py``).

The records are MetaSchedule's own JSON database (``database_workload.json``,
``database_tuning_record.json``): one workload per scheduled variant (``schedules/space.py``
says why), so any MetaSchedule tool opens and applies them. Beside them, ``blockpad.json`` says
per kernel name which kernel function was tuned, with which TVM: MetaSchedule's files cannot
tell a build why a kernel has no record (never tuned, or tuned before its code changed).

A build never trusts a log file: it reads it line by line, ignores what it cannot parse, what
was measured for another target or TVM version, and says so (``Logs.warnings``, each kernel's
``tuning`` status). A record only ever selects a function the schedule rules produce now.
"""

from __future__ import annotations

import hashlib
import json
import statistics
from dataclasses import dataclass
from pathlib import Path

from blockpad import manifest as mf

from .targets import Target

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
    when tuning; it does not change the code a schedule compiles to), and so are LLVM's own
    options (``cl-opt``: what LLVM does after TVM, not which schedule variant is fastest)."""
    spec = {k: v for k, v in dict(tvm_target.export()).items() if k not in ("num-cores", "cl-opt")}
    return json.dumps(spec, sort_keys=True, default=str)


def workload_hash(mod) -> str:
    import tvm_ffi

    return str(tvm_ffi.structural_hash(mod))


# ---- reading the logs --------------------------------------------------------------------------

@dataclass
class TuningDecision:
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
        for i, entry in self._workloads.get(workload_hash(wl), []):
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

    def choose(self, name: str, func, tvm_target) -> TuningDecision:
        """The fastest measured variant of kernel ``name`` for this target and TVM, or why
        there is none. Records are found by name, else by the function itself (its workload
        hash) under any name."""
        from blockpad.schedules import space

        entry = self.index.get(name)
        now = workload_hash(space.workload(func)) if self.index else None
        if not entry or entry.get("workload") != now:
            # the same function tuned under another name: a model's kernels are numbered by
            # its plan, which the records themselves can change (auto's candidates)
            entry = next((e for e in self.index.values() if e.get("workload") == now
                          and not e.get("skipped") and e.get("tvm_version") == mf.tvm_version()),
                         entry)
        if not entry:
            where = "" if (self.dir / DB_FILES[1]).is_file() else f" (no tuning logs in {self.dir})"
            return _default(f"no record{where}")
        if entry.get("skipped"):
            return _default(f"not tuned: {entry['skipped']}")
        if entry.get("tvm_version") != mf.tvm_version():
            return _default(f"recorded with TVM {entry.get('tvm_version')}, this is "
                            f"{mf.tvm_version()}")
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
        return TuningDecision(funcs[best[0]], {"tuned": True, "variant": best[0],
                                               "variants": len(funcs), "trials": trials,
                                               "time_us": round(best[1] * 1e6, 3)})


    def seconds(self, name: str, func, tvm_target) -> float | None:
        """The time of ``func``'s fastest recorded variant, None if it was not tuned."""
        status = self.choose(name, func, tvm_target).status
        return status["time_us"] * 1e-6 if status["tuned"] else None


def _default(reason) -> TuningDecision:
    return TuningDecision(None, {"tuned": False, "reason": reason})


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
