"""``blockpad check``'s loop: draw cases, build them a batch at a time (one library per batch:
TVM's compile cost is paid once per library, not per kernel), run each batch in a worker
process, report failures as they come with the command that replays them and a spec that
builds them.

A batch that fails to build is split in halves until the kernels that fail are alone (the
others still run). A worker that dies (a crashing kernel) or hangs loses only the case it was
running: it announces each case before running it, so the case is known, run again alone to
confirm, and the batch goes on in a new worker from the next case."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

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
        return (f"{self.checked} cases on {self.target} (seed {self.seed}): {c['ok']} ok, "
                f"{c['wrong']} wrong, {c['crash'] + c['hang']} crashes"
                f"{', ' + rest if rest else ''}; {self.guard_bytes} guard bytes written")


def check(target: str, cases: int = 100, seed: int = 0, ops=generate.OPS, only=None,
          batch: int = 25, out: str = "check-failures", work: str | None = None,
          log=print) -> Summary:
    """Check ``cases`` random cases (or case ``only``) of ``seed`` on ``target``."""
    _check_runnable(target)
    ops = tuple(ops)
    ks = [only] if only is not None else list(range(cases))
    summary = Summary(target, seed)
    scratch = work or tempfile.mkdtemp(prefix="blockpad-check-")
    log(f"blockpad check: target {target}, seed {seed}, {len(ks)} cases in batches of "
        f"{batch} (ops: {', '.join(ops)})")
    batches = [ks[i:i + batch] for i in range(0, len(ks), batch)]
    try:
        for b, chunk in enumerate(batches):
            entries = {k: generate.case(seed, k, target, ops) for k in chunk}
            t0 = time.perf_counter()
            libs, results = _build(target, entries, os.path.join(scratch, f"batch{b}"))
            t1 = time.perf_counter()
            for lib_dir, lib_ks in libs:
                results += _execute(lib_dir, target, seed, {k: entries[k] for k in lib_ks})
            t2 = time.perf_counter()
            for r in sorted(results, key=lambda r: r["case"]):
                _record(summary, r, entries[r["case"]], target, seed, ops, out, log)
            tally = {}
            for r in results:
                tally[r["status"]] = tally.get(r["status"], 0) + 1
            log(f"batch {b + 1}/{len(batches)}: cases {chunk[0]}-{chunk[-1]} built in "
                f"{t1 - t0:.1f} s, ran in {t2 - t1:.1f} s: "
                f"{', '.join(f'{n} {s}' for s, n in sorted(tally.items()))} | total "
                f"{summary.checked}/{len(ks)}, {summary.failed} failed")
    finally:
        if work is None:
            shutil.rmtree(scratch, ignore_errors=True)
    log(summary.line())
    return summary


def _check_runnable(target: str) -> None:
    """Refuse, before building anything, a target whose kernels cannot run here."""
    from blockpad.codegen.targets import get_target
    from blockpad.errors import BlockpadError, MissingCPUFeatureError
    from blockpad.runtime import machine
    from blockpad.testing import qemu

    t = get_target(target)                # an unknown target fails here, with the list
    if target not in generate.PROFILES:
        raise BlockpadError(f"blockpad check runs CPU targets ({', '.join(generate.PROFILES)});"
                            f" got {target!r}")
    if t.arch == machine.arch():
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
    for t in ("src", "src0", "src1", "layout", "weights", "dst"):
        if t in entry:
            v = entry[t]
            bits.append(f"{t}={v if isinstance(v, str) else json.dumps(v, separators=(',', ':'))}")
    if entry.get("inplace"):
        bits.append("inplace")
    if entry.get("post_ops"):
        bits.append("post_ops=" + "+".join(p.get("algorithm", p["kind"]) for p in entry["post_ops"]))
    return " ".join(bits)


def _record(summary, r, entry, target, seed, ops, out, log):
    summary.counts[r["status"]] += 1
    summary.guard_bytes += r.get("guard_bytes", 0)
    if r["status"] == "ok":
        return
    k = r["case"]
    path = replay.write_spec(out, target, seed, k, ops, entry, r["problems"])
    summary.failures.append((k, r["status"], r["problems"], path))
    log(f"FAIL case {k} [{r['status']}] {describe(entry)}")
    for p in r["problems"]:
        log("    " + p.strip().replace("\n", "\n    "))
    log(f"    replay: {replay.command(target, seed, k, ops)}")
    log(f"    spec:   {path}")


# ---- building -----------------------------------------------------------------------------------

def _build(target, entries: dict, out_dir) -> tuple[list, list]:
    """Build ``entries`` as one library; on failure, split until the failing ones are alone.
    Returns ``([(lib_dir, [k...])...], [result of each case that failed to build])``."""
    import blockpad as bp
    from blockpad.codegen.spec import parse_spec
    from blockpad.errors import SpecError

    ks = list(entries)
    try:
        spec = parse_spec({"library": {"name": "check"},
                           "kernel": [entries[k] for k in ks]}, "blockpad check")
        bp.build(spec, target, out_dir, log=lambda m: None)
        return [(out_dir, ks)], []
    except Exception as e:  # noqa: BLE001 - any build failure of a valid spec is a finding
        if len(ks) > 1:
            half = len(ks) // 2
            a = _build(target, {k: entries[k] for k in ks[:half]}, out_dir + "a")
            b = _build(target, {k: entries[k] for k in ks[half:]}, out_dir + "b")
            return a[0] + b[0], a[1] + b[1]
        # a SpecError names an invalid case: the generator should not have drawn it
        status = "invalid" if isinstance(e, SpecError) else "build-failed"
        return [], [{"case": ks[0], "status": status, "guard_bytes": 0,
                     "problems": [f"{type(e).__name__}: {e}"]}]


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
