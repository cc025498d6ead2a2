"""``blockpad check``'s loop: draw cases, build them a batch at a time (one library per batch:
TVM's compile cost is paid once per library, not per kernel), run each batch in a worker
process, report failures as they come with the command that replays them and a spec that
builds them.

A batch that fails to build, or kills the compiler (builds run in a child process), is split
in halves until the kernels that fail are alone (the others still run). A worker that dies (a
crashing kernel) or hangs loses only the case it was running: it announces each case before
running it, so the case is known, run again alone to confirm, and the batch goes on in a new
worker from the next case."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

from blockpad.errors import BlockpadError, MissingCPUFeatureError, SpecError

from . import generate, replay

WORKER = (sys.executable, "-m", "blockpad.check.execute")   # reads a job on stdin
FAILURES = ("wrong", "raised", "crash", "hang", "build-failed", "invalid", "checker-error")


@dataclass
class Summary:
    target: str
    seed: int
    counts: dict = field(default_factory=lambda: {s: 0 for s in ("ok", *FAILURES)})
    guard_bytes: int = 0
    failures: list = field(default_factory=list)    # (k, status, problems, spec path)

    @property
    def checked(self) -> int:
        return sum(self.counts.values())

    @property
    def failed(self) -> int:
        return self.checked - self.counts["ok"]

    def line(self) -> str:
        c = self.counts
        rest = ", ".join(f"{c[s]} {s}" for s in FAILURES[1:] if c[s])
        n = self.checked
        return (f"{n} case{'s' * (n != 1)} on {self.target} (seed {self.seed}): {c['ok']} ok, "
                f"{c['wrong']} wrong, {c['crash'] + c['hang']} crashes"
                f"{', ' + rest if rest else ''}; {self.guard_bytes} guard bytes written")


def check(target: str, cases: int = 100, seed: int = 0, ops=generate.CHECKED_OPS, only=None,
          batch: int = 25, out: str = "check-failures", work: str | None = None,
          log=print, spec: str | None = None, shrink: bool = False,
          build_only: bool = False, benchdnn: str | None = None) -> Summary:
    """Check ``cases`` random cases (or case ``only``) of ``seed`` on ``target``; with
    ``spec``, the kernels of that TOML spec instead (on random data drawn from ``seed``); with
    ``benchdnn``, the convolution problems of that benchdnn batch file that blockpad can state
    (the others are listed with the reason, ``check/benchdnn.py``).
    ``shrink``: simplify each failing case before writing its spec. ``build_only``: build the
    libraries into ``work`` with a plan of what to run (``PLAN``), to be run by ``run_built``
    on a machine that has the target (a GPU host); only build failures are reported here."""
    if build_only and work is None:
        raise BlockpadError("blockpad check --build-only needs --work DIR: the folder the "
                            "libraries and their plan are written to")
    _check_target(target, runs_here=not build_only)
    ops = tuple(ops)
    flag = "--spec"
    if benchdnn is not None:
        given = benchdnn_cases(benchdnn, target, log)
        spec, flag = benchdnn, "--benchdnn"
    elif spec is not None:
        given = spec_cases(spec)
    if spec is not None:
        if only is not None and only not in given:
            raise SpecError(f"{spec}: has no case {only} (it has {', '.join(map(str, given))})")
        ks = [only] if only is not None else list(given)
        draw, what = given.__getitem__, f"{len(ks)} kernels of {spec}"
    else:
        ks = [only] if only is not None else list(range(cases))
        draw, what = (lambda k: generate.case(seed, k, target, ops)), f"{len(ks)} cases"
    run = Run(target, seed, ops, spec, out, log,
              work or tempfile.mkdtemp(prefix="blockpad-check-"), flag)
    log(f"blockpad check: target {target}, seed {seed}, {what} in batches of {batch}"
        + ("" if spec else f" (ops: {', '.join(ops)})") + (", build only" if build_only else ""))
    batches = [ks[i:i + batch] for i in range(0, len(ks), batch)]
    plan = []
    try:
        for b, chunk in enumerate(batches):
            entries = {k: draw(k) for k in chunk}
            t0 = time.perf_counter()
            libs, results = run.build(entries, f"batch{b}")
            if build_only:
                plan += [{"dir": os.path.relpath(d, run.scratch), "cases": [[k, entries[k]]
                                                                          for k in lib_ks]}
                         for d, lib_ks in libs]
            else:
                results += run.execute(libs, entries)
            run.report(b, len(batches), chunk, results, entries, shrink,
                       time.perf_counter() - t0, len(ks), "built" if build_only else
                       "built and run")
        if build_only:
            _write_plan(run, plan)
    finally:
        if work is None:
            shutil.rmtree(run.scratch, ignore_errors=True)
    if build_only:
        built = sum(len(lib["cases"]) for lib in plan)
        log(f"{len(ks)} cases on {target} (seed {seed}): {built} built into {len(plan)} "
            f"libraries in {run.scratch}, {run.summary.failed} failed to build; run them where "
            f"{target} runs: blockpad check --run-built {run.scratch}")
    else:
        log(run.summary.line())
    return run.summary


PLAN = "check-plan.json"   # what --build-only leaves for --run-built, beside the libraries


def _write_plan(run, plan):
    os.makedirs(run.scratch, exist_ok=True)   # no batch made it: nothing to build
    with open(os.path.join(run.scratch, PLAN), "w") as f:
        json.dump({"target": run.target, "seed": run.seed, "ops": list(run.ops),
                   "spec": run.spec, "spec_flag": run.flag, "libraries": plan}, f)


def run_built(work: str, out: str = "check-failures", log=print) -> Summary:
    """Run what ``check(..., build_only=True)`` built into ``work`` (the libraries and their
    plan travel together: copy the folder to the machine that has the target) and report as
    ``check`` does. Cases that failed to build were reported by the build."""
    try:
        with open(os.path.join(work, PLAN)) as f:
            doc = json.load(f)
    except (OSError, ValueError) as e:
        raise BlockpadError(f"{work}: no readable {PLAN} ({e}); make one with blockpad check "
                            f"--build-only --work {work}") from None
    target = doc["target"]
    _check_target(target, runs_here=True)
    run = Run(target, doc["seed"], tuple(doc["ops"]), doc["spec"], out, log, work,
              doc.get("spec_flag", "--spec"))
    libs = [(os.path.join(work, lib["dir"]), {int(k): e for k, e in lib["cases"]})
            for lib in doc["libraries"]]
    log(f"blockpad check: target {target}, seed {doc['seed']}, running "
        f"{sum(len(c) for _, c in libs)} built cases of {len(libs)} libraries from {work}")
    for b, (lib_dir, entries) in enumerate(libs):
        t0 = time.perf_counter()
        results = run.execute([(lib_dir, list(entries))], entries)
        run.report(b, len(libs), list(entries), results, entries, False,
                   time.perf_counter() - t0, None, "run")
    log(run.summary.line())
    return run.summary


def spec_cases(path) -> dict:
    """``{k: entry}`` of a TOML spec's kernels, for ``--spec``: one kernel per entry, named
    ``case<k>`` (a name ``caseK`` keeps its K, so a spec written for a failure replays on the
    same data), the library's policy copied into entries that have none."""
    import re
    import tomllib

    try:
        with open(path, "rb") as f:
            doc = tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise SpecError(f"{path}: cannot read the spec ({e})") from None
    policy = doc.get("library", {}).get("policy")
    out = {}
    for i, entry in enumerate(doc.get("kernel", [])):
        if "shapes" in entry or "dtypes" in entry:
            raise SpecError(f"{path}: kernel #{i + 1}: blockpad check runs one kernel per entry; "
                            f"give 'shape' and 'dtype', not lists")
        m = re.fullmatch(r"case(\d+)", str(entry.get("name", "")))
        k = int(m[1]) if m else i
        if k in out:
            raise SpecError(f"{path}: kernel #{i + 1} would be case {k} twice; name it case<K> "
                            f"with a K of its own")
        out[k] = {**entry, "name": f"case{k}"}
        if policy:
            out[k].setdefault("policy", policy)
    if not out:
        raise SpecError(f"{path}: expected one or more [[kernel]] tables; found none")
    return out


def benchdnn_cases(path, target: str, log) -> dict:
    """``{k: entry}`` of the problems of a benchdnn batch file that blockpad can state; the
    others are logged, counted by reason, each reason with its first problem."""
    from .benchdnn import problems

    probs = problems(path, target)
    out = {k: p.entry for k, p in enumerate(probs) if p.entry is not None}
    reasons: dict = {}
    for p in probs:
        if p.entry is None:
            reasons.setdefault(p.reason, []).append(p)
    log(f"benchdnn {path}: {len(probs)} problems, {len(out)} that blockpad states, "
        f"{len(probs) - len(out)} it does not:")
    for reason, ps in sorted(reasons.items(), key=lambda r: -len(r[1])):
        log(f"  {len(ps):4d} x {reason}\n         e.g. {ps[0].where}: {ps[0].line}")
    return out


class Run:
    """One ``check`` run: where it builds, what it has found, how it reports."""

    def __init__(self, target, seed, ops, spec, out, log, scratch, flag="--spec"):
        self.target, self.seed, self.ops, self.spec, self.flag = target, seed, ops, spec, flag
        self.out, self.log, self.scratch = out, log, scratch
        self.summary = Summary(target, seed)
        self.builds = 0

    def build(self, entries: dict, name: str) -> tuple[list, list]:
        """Build ``entries``, split where the build fails: ``([(lib_dir, [k...])...], [result of
        each case that failed to build])``."""
        return _build(self.target, entries, os.path.join(self.scratch, name))

    def execute(self, libs: list, entries: dict) -> list:
        """Run the built ``libs``: a result per case."""
        results = []
        for lib_dir, lib_ks in libs:
            results += _execute(lib_dir, self.target, self.seed, {k: entries[k] for k in lib_ks})
        return results

    def cases(self, entries: dict, name: str) -> list:
        """Build ``entries`` and run them: a result per case."""
        libs, results = self.build(entries, name)
        return results + self.execute(libs, entries)

    def report(self, b, batches, chunk, results, entries, shrink, seconds, total, did):
        """Record a batch's results and log its line."""
        for r in sorted(results, key=lambda r: r["case"]):
            self.record(r, entries[r["case"]], shrink)
        tally = {}
        for r in results:
            tally[r["status"]] = tally.get(r["status"], 0) + 1
        of = f"/{total}" if total is not None else ""
        self.log(f"batch {b + 1}/{batches}: cases {chunk[0]}-{chunk[-1]} {did} in {seconds:.1f} s:"
                 f" {', '.join(f'{n} {s}' for s, n in sorted(tally.items())) or 'nothing failed'}"
                 f" | total {self.summary.checked}{of}, {self.summary.failed} failed")

    def record(self, r, entry, shrink):
        self.summary.counts[r["status"]] += 1
        self.summary.guard_bytes += r.get("guard_bytes", 0)
        if r["status"] == "ok":
            return
        k = r["case"]
        cmd = replay.command(self.target, self.seed, k, self.ops, self.spec, self.flag)
        via = f" (called {r['call']})" if r.get("call") else ""
        self.log(f"FAIL case {k} [{r['status']}] {describe(entry)}{via}")
        for p in r["problems"]:
            self.log("    " + p.strip().replace("\n", "\n    "))
        self.log(f"    replay: {cmd}")
        if shrink:
            entry = self.shrink(k, entry, r["status"])
        path = replay.write_spec(self.out, self.target, self.seed, k, entry, r["problems"], cmd)
        self.summary.failures.append((k, r["status"], r["problems"], path))
        self.log(f"    spec:   {path} (replay it: "
                 f"{replay.command(self.target, self.seed, k, self.ops, path)})")

    def shrink(self, k, entry, status):
        from blockpad.codegen.spec import parse_spec

        from .shrink import shrink

        def valid(e):
            try:
                parse_spec({"kernel": [e]})
                return True
            except Exception:  # noqa: BLE001 - a step the spec refuses is just not taken
                return False

        def fails(e):
            self.builds += 1
            results = self.cases({k: e}, f"shrink{self.builds}")
            return results[0]["status"] == status

        return shrink(entry, fails, valid, log=self.log)


def _check_target(target: str, runs_here: bool) -> None:
    """Refuse, before building anything, a target the checker cannot draw for, or (with
    ``runs_here``) one whose kernels cannot run here."""
    from blockpad import machine
    from blockpad.codegen.targets import get_target
    from blockpad.testing import qemu

    t = get_target(target)                # an unknown target fails here, with the list
    if target not in generate.PROFILES:
        raise BlockpadError(f"blockpad check draws kernels for {', '.join(generate.PROFILES)};"
                            f" got {target!r}")
    if not runs_here:
        return
    need = machine.gpu_requirement(t.features)
    if need is not None:
        devices = machine.cuda_devices()
        if not devices or not any(d >= need for d in devices):
            raise BlockpadError(f"target {target} runs on a GPU of compute capability "
                                f"{need[0]}.{need[1]} or later, which this machine lacks. Build "
                                f"here with --build-only --work DIR, then run blockpad check "
                                f"--run-built DIR on a GPU host")
    elif t.arch == machine.arch():
        missing = machine.missing_features(t.features)
        if missing:
            raise MissingCPUFeatureError(f"target {target}: this CPU lacks {', '.join(missing)};"
                                         f" check a target it runs (host) or run on a device "
                                         f"that has them")
    elif t.arch == "aarch64":
        missing = qemu.missing_tools()
        if missing:
            raise BlockpadError(f"target {target} runs here under qemu-aarch64, but this machine "
                                f"lacks: {'; '.join(missing)}")
    else:
        raise BlockpadError(f"target {target} is for {t.arch}; this machine is "
                            f"{machine.arch()} and has no emulator for it")


def describe(entry: dict) -> str:
    """One line naming what a case is."""
    bits = [entry["op"], entry.get("dtype", "float32"), entry.get("policy", "-")]
    for t in ("src", "src0", "src1", "layout", "expand_weights", "depthwise_weights", "weights",
              "dst"):
        if t in entry:
            v = entry[t]
            bits.append(f"{t}={v if isinstance(v, str) else json.dumps(v, separators=(',', ':'))}")
    if entry.get("inplace"):
        bits.append("inplace")
    for chain in ("expand_post_ops", "depthwise_post_ops"):     # inverted_residual's inner ones
        if entry.get(chain):
            bits.append(f"{chain}=" + "+".join(p.get("algorithm", "relu") for p in entry[chain]))
    if entry.get("post_ops"):
        bits.append("post_ops=" + "+".join(
            f"{p['kind']}:{p.get('algorithm', 'add')}:{p.get('operand', 'full')}"
            if p["kind"] == "binary" else p.get("algorithm", p["kind"])
            for p in entry["post_ops"]))
    return " ".join(bits)


# ---- building -----------------------------------------------------------------------------------

def _build(target, entries: dict, out_dir) -> tuple[list, list]:
    """Build ``entries`` as one library; on failure, split until the failing ones are alone.
    Returns ``([(lib_dir, [k...])...], [result of each case that failed to build])``."""
    ks = list(entries)
    failure = _build_library(target, [entries[k] for k in ks], out_dir)
    if failure is None:
        return [(out_dir, ks)], []
    if len(ks) > 1:
        half = len(ks) // 2
        a = _build(target, {k: entries[k] for k in ks[:half]}, out_dir + "a")
        b = _build(target, {k: entries[k] for k in ks[half:]}, out_dir + "b")
        return a[0] + b[0], a[1] + b[1]
    status, message = failure
    return [], [{"case": ks[0], "status": status, "guard_bytes": 0, "problems": [message]}]


# The build runs in a child process: a compiler that dies (TVM has segfaulted inside a schedule
# primitive on a drawn case) costs that case, not the whole run.
BUILDER = """
import json, sys
import blockpad as bp
from blockpad.errors import SpecError
try:
    bp.build(json.load(sys.stdin), sys.argv[1], sys.argv[2], log=lambda m: None)
except Exception as e:
    print(json.dumps({"spec_error": isinstance(e, SpecError), "message": f"{type(e).__name__}: {e}"}))
    sys.exit(1)
"""


def _build_library(target, kernels: list, out_dir) -> tuple[str, str] | None:
    """``None`` when the kernels build as one library, else ``(status, message)``: ``invalid``
    for a SpecError (the generator should not have drawn the case), ``build-failed`` for any
    other error of a valid spec or a compiler that died."""
    spec = json.dumps({"library": {"name": "check"}, "kernel": kernels})
    proc = subprocess.run([sys.executable, "-c", BUILDER, target, str(out_dir)], input=spec,
                          capture_output=True, text=True)
    if proc.returncode == 0:
        return None
    lines = proc.stdout.strip().splitlines()
    if proc.returncode == 1 and lines:
        msg = json.loads(lines[-1])
        return ("invalid" if msg["spec_error"] else "build-failed"), msg["message"]
    how = f"signal {-proc.returncode}" if proc.returncode < 0 else f"exit status {proc.returncode}"
    err = proc.stderr.strip().splitlines()
    # TVM's crash handler prints a backtrace: its frames inside TVM say where it died
    where = [ln.strip() for ln in err if " in tvm::" in ln][:2] or err[-3:]
    return "build-failed", f"the compiler died ({how}): {' | '.join(where)}"


# ---- running ------------------------------------------------------------------------------------

def _execute(lib_dir, target, seed, entries: dict) -> list:
    """Run the cases in worker processes; a crash or hang costs the case it hit only."""
    todo = list(entries)
    results = []
    while todo:
        done, running, failure = _worker(lib_dir, target, seed, entries, todo)
        results += done
        if running is None:
            break
        # confirm alone: a crash after other cases may be theirs (memory they corrupted)
        alone = _worker(lib_dir, target, seed, entries, [running])
        note = "" if alone[1] is not None else " (it passes when run alone: an earlier case " \
                                                "of the batch may have corrupted memory)"
        results.append({"case": running, "status": failure[0], "guard_bytes": 0,
                        "problems": [failure[1] + note]})
        todo = todo[todo.index(running) + 1:]
    return results


def _worker(lib_dir, target, seed, entries, ks):
    """One worker over ``ks``: ``(results, case it died in or None, (status, message))``."""
    job = json.dumps({"dir": lib_dir, "target": target, "seed": seed,
                      "cases": [[k, entries[k]] for k in ks]})
    timeout = 120 + 30 * len(ks)
    proc = subprocess.Popen(list(WORKER),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = proc.communicate(job, timeout=timeout)
        status = "crash"
        why = f"the worker died (exit status {proc.returncode}"
        why += f", signal {-proc.returncode})" if proc.returncode < 0 else ")"
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
        status, why = "hang", f"no result in {timeout} s"
    results, running = [], None
    for line in stdout.splitlines():
        msg = json.loads(line)
        if "start" in msg:
            running = msg["start"]
        else:
            results.append(msg)
            running = None
    if running is None and proc.returncode == 0:
        return results, None, None
    if running is None:   # died between cases, or before the first
        running = next((k for k in ks if k not in {r["case"] for r in results}), None)
        if running is None:
            return results, None, None
    tail = stderr.strip().splitlines()[-3:]
    return results, running, (status, why + (": " + " | ".join(tail) if tail else ""))
