"""Timing helpers shared by the benchmarks.

The CPU clock of a shared VM drifts by 20% from one minute to the next, so contenders are never
timed one after the other: each round times one batch of every contender in turn, and each
contender's figure is the median over the rounds. Where each contender has a process of its
own (``run_children``), the parent still runs the rounds: every process stays alive and times
a batch when told (``child_rounds``)."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import numpy as np

BATCH_S = 0.03  # a batch lasts about this long: long enough for perf_counter, short against drift


def batch_size(fn, batch_s=BATCH_S) -> int:
    """Warm ``fn`` up, then return how many calls take about ``batch_s`` seconds."""
    fn()
    n = 1
    while True:
        t = _time(fn, n)
        if t >= batch_s / 4 or n >= 1 << 20:
            return max(1, round(n * batch_s / t))
        n *= 4


def interleaved(contenders: dict, repeat: int) -> dict:
    """``{name: fn}`` -> ``{name: median seconds per call}`` over ``interleaved_rounds``."""
    return {name: statistics.median(t) for name, t in interleaved_rounds(contenders, repeat).items()}


def interleaved_rounds(contenders: dict, repeat: int) -> dict:
    """``{name: fn}`` -> ``{name: [seconds per call, one per round]}``, timing one batch of
    each contender per round so that clock drift hits them all alike. Each round starts one
    contender later than the last: what runs right after a given contender (its caches, its
    threads going to sleep) is not always the same one's luck or burden."""
    sizes = {name: batch_size(fn) for name, fn in contenders.items()}
    times = {name: [] for name in contenders}
    names = list(contenders)
    for r in range(repeat):
        for name in names[r % len(names):] + names[:r % len(names)]:
            times[name].append(_time(contenders[name], sizes[name]) / sizes[name])
    return times


def _time(fn, n) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return time.perf_counter() - t0


def threaded_copy(dst: np.ndarray, src: np.ndarray, pool: ThreadPoolExecutor, parts: int):
    """``np.copyto`` split in ``parts`` run on the pool's threads (numpy releases the GIL while
    it copies): one thread of numpy does not reach the memory bandwidth that the kernels, run on
    every core, can."""
    bounds = np.linspace(0, src.size, parts + 1).astype(int)
    s, d = src.reshape(-1), dst.reshape(-1)
    chunks = [(d[a:b], s[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]

    def run():
        futures = [pool.submit(np.copyto, *c) for c in chunks[1:]]
        np.copyto(*chunks[0])
        for f in futures:
            f.result()

    return run


# Two thread pools share the cores: TVM's workers and PyTorch's OpenMP team both spin after
# their work by default, and whichever ran last then steals the cores from the other (measured
# here: PyTorch 40x slower right after a blockpad call on 2 threads). Both are told to sleep.
# numpy's OpenBLAS workers spin too, 2^28 cycles (~0.1 s) after each call: a float64 reference
# computed on 2 threads just before a timing took the cores from PyTorch's first rounds (a 3x3
# conv 1.05 -> 2.2-2.4 ms); told to sleep after 2^4 cycles, they do not. OpenBLAS reads this
# when numpy loads it: it takes effect in a worker's environment, not set from inside a process.
BLAS_SLEEPS = {"OPENBLAS_THREAD_TIMEOUT": "4"}
QUIET_POOLS = {"TVM_THREAD_POOL_SPIN_COUNT": "0", "OMP_WAIT_POLICY": "PASSIVE", **BLAS_SLEEPS}


def quiet_thread_pools(threads: int | None = None) -> None:
    """Set, before either thread pool starts, the thread count (if given) and ``QUIET_POOLS``
    (unless the caller set them)."""
    import os

    if threads:
        os.environ["TVM_NUM_THREADS"] = str(threads)
    for k, v in QUIET_POOLS.items():
        os.environ.setdefault(k, v)


@contextmanager
def step_calls(g, inputs: dict):
    """``(label, call)`` of each step of ``g``'s plan for ``inputs``, bound by one run (every
    memory bound, every destination written once)."""
    runner = g.runner(**inputs)
    g.run(inputs)
    with runner.arena() as exe:
        yield list(zip(exe.labels, exe.calls))


def step_times(g, inputs: dict, rounds: int = 5) -> dict:
    """Seconds per run of each step of ``g``'s plan for ``inputs`` (kernels, reorders, the
    policy's zero-pads at binding), averaged over ``rounds`` runs of the plan's calls."""
    with step_calls(g, inputs) as steps:
        out = {}
        for _ in range(rounds):
            for label, call in steps:
                t0 = time.perf_counter()
                call()
                out[label] = out.get(label, 0.0) + (time.perf_counter() - t0) / rounds
        return out


def hot_step_times(g, inputs: dict, repeat: int = 3) -> dict:
    """Seconds of each step of ``g``'s plan called again right after itself (the fastest of
    ``repeat``): its data, weights and destination in cache, as a kernel benchmark sees them.
    Against ``step_times`` (the steps in plan order, as an inference runs them) it shows what
    memory costs a step inside the network: MobileNetV2's first depthwise convolution (AVX-512,
    1 thread) takes 0.19 ms in the network and 0.085 ms hot, 0.086 ms right after the stem that
    writes its source: its 1.6 MB destination's lines come from memory, evicted by the 17 MB
    of weights and activations the rest of an inference streams through the caches."""
    with step_calls(g, inputs) as steps:
        out = {}
        for label, call in steps:
            call()
            best = float("inf")
            for _ in range(repeat):
                t0 = time.perf_counter()
                call()
                best = min(best, time.perf_counter() - t0)
            out[label] = out.get(label, 0.0) + best
        return out


def table(rows: list[list], header: list[str]) -> str:
    """Left-align the first column, right-align the others."""
    cells = [header] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    fmt = lambda r: "  ".join(c.ljust(w) if i == 0 else c.rjust(w)  # noqa: E731
                              for i, (c, w) in enumerate(zip(r, widths)))
    lines = [fmt(cells[0]), "  ".join("-" * w for w in widths)]
    return "\n".join(lines + [fmt(r) for r in cells[1:]])


def _progress(msg):
    print(msg, file=sys.stderr, flush=True)


def best_of_processes(spawn, contenders, counts, processes, log=_progress) -> dict:
    """``{(contender, threads): result}``: ``spawn(contenders, threads)`` (``{contender:
    result}``, each in a process of its own: ``run_children``) run ``processes`` times at
    each thread count, keeping each contender's process with the lowest median. On a VM a
    process can lose a core for its whole life (2-thread runs measured 1.0x and 1.8x of one
    thread in separate processes of the same binary): one process per contender measures the
    machine's luck as much as the runtimes. Each kept result also holds every process's
    median (``process_ms``, ascending; ``spread`` prints it): ONNX Runtime's pruned ResNet-50
    took 55-64 ms in processes of the same hour on a Zen 4 VM, which a ratio of two best
    processes does not show. ``log``: progress lines (default: stderr)."""
    results, seen = {}, {}
    for i in range(processes):
        for t in counts:
            tag = f" (processes {i + 1} of {processes})" if processes > 1 else ""
            log(f"running {', '.join(contenders)} at {t} thread(s), rounds interleaved{tag} ...")
            for name, r in spawn(contenders, t).items():
                if "ms" in r:
                    seen.setdefault((name, t), []).append(r["ms"])
                old = results.get((name, t))
                if old is None or "error" in old or ("ms" in r and r["ms"] < old["ms"]):
                    results[(name, t)] = r
    for key, ms in seen.items():
        results[key]["process_ms"] = sorted(ms)
    return results


def spread(result: dict) -> str:
    """The range of a contender's process medians (``best_of_processes``), "" for one."""
    ms = result.get("process_ms", [])
    return f"{ms[0]:.2f}-{ms[-1]:.2f}" if len(ms) > 1 else ""


def isolation(processes: int) -> str:
    """How a process-isolated benchmark ran its contenders, for its header."""
    best = f", the best of {processes} sets of processes" if processes > 1 else ""
    return (f"each contender in its own process, their rounds interleaved{best} (figures from "
            f"a shared machine are rough)")


def child_command(module: str, name: str, threads: int, work: str, args: list,
                  env=None) -> tuple:
    """``(command, environment, output)`` that runs contender ``name`` of benchmark ``module``
    in a process of its own (``-m module --child name --threads N ... --output y.npy``), its
    result saved to ``output`` for the parent to compare. One process each: in a shared one,
    PyTorch's idle OpenMP workers spin and steal the cores from whoever runs next."""
    env = {**os.environ, "TVM_NUM_THREADS": str(threads), "OMP_NUM_THREADS": str(threads),
           **(env or {})}
    out = os.path.join(work, f"y_{name.replace(' ', '_')}_{threads}.npy")
    cmd = [sys.executable, "-m", module, "--child", name, "--threads", str(threads), *args,
           "--output", out]
    return cmd, env, out


def run_child(module: str, name: str, threads: int, work: str, args: list, env=None) -> dict:
    """Run one contender (``child_command``) alone and return the JSON its last line prints,
    with ``y`` the path of the output it saved, or ``{"error": ...}``."""
    cmd, env, out = child_command(module, name, threads, work, args, env)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_spawned(env), check=False)
    return _child_result(proc.returncode, proc.stdout, proc.stderr, out)


#: Set in a child's environment by ``run_children``: the parent runs its rounds.
ROUNDS_FROM_PARENT = "BLOCKPAD_BENCH_ROUNDS_FROM_PARENT"
#: Set in a child's environment when it is started: the wall-clock time (``spawned_at``).
SPAWNED_AT = "BLOCKPAD_BENCH_SPAWNED_AT"
#: Seconds ``run_children`` waits after a contender's round at more than one thread, for its
#: pool's workers (PyTorch's OpenMP team, TVM's) to stop spinning before the next one runs.
SETTLE_S = 0.2


def run_children(commands: dict, repeat: int, threads: int) -> dict:
    """``{name: result}``: every contender of ``commands`` (``{name: child_command(...)}``) in a
    process of its own, all alive at once, and ``repeat`` rounds that each time one batch of
    every contender in turn (``child_rounds``; each round starts one contender later than the
    last, as ``interleaved_rounds``). One after another, each in its own process, the
    contenders met different spells of a shared machine: ONNX Runtime's pruned ResNet-50 took
    55.9 ms in one run and 64.3 in the next. The processes start one at a time (each one's
    time to its first result is its own); a child's work after the rounds (blockpad's
    per-step times) runs alone too. A child that fails is reported as ``{"error": ...}``
    and the others go on."""
    procs, errors, failed = {}, {}, set()
    try:
        for name, (cmd, env, _) in commands.items():
            errors[name] = tempfile.TemporaryFile("w+")
            procs[name] = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                           stderr=errors[name], text=True,
                                           env=_spawned({**env, ROUNDS_FROM_PARENT: "1"}))
            if _reply(procs[name], "ready") is None:
                failed.add(name)
        live = [n for n in procs if n not in failed]
        for r in range(repeat if live else 0):
            for name in live[r % len(live):] + live[:r % len(live)]:
                if name in failed:
                    continue
                if _reply(procs[name], "round", ask="run") is None:
                    failed.add(name)
                if threads > 1:
                    time.sleep(SETTLE_S)
        results = {}
        for name, p in procs.items():
            try:
                p.stdin.close()
            except BrokenPipeError:
                pass
            stdout = p.stdout.read()
            p.wait()
            errors[name].seek(0)
            results[name] = _child_result(p.returncode, stdout, errors[name].read(),
                                          commands[name][2])
        return results
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
        for f in errors.values():
            f.close()


def _spawned(env: dict) -> dict:
    return {**env, SPAWNED_AT: repr(time.time())}


def spawned_at() -> float:
    """When the parent started this child process (wall clock, ``time.time()``): a fresh
    process's time to its first result counts the interpreter's start and the imports."""
    return float(os.environ[SPAWNED_AT])


def _reply(proc, word: str, ask: str | None = None) -> str | None:
    """The child's next stdout line that starts with ``word`` (after writing ``ask`` to its
    stdin, if given); None where it has exited or closed its end."""
    try:
        if ask is not None:
            proc.stdin.write(ask + "\n")
            proc.stdin.flush()
        for line in proc.stdout:
            if line.split()[:1] == [word]:
                return line
    except (BrokenPipeError, OSError):
        pass
    return None


def child_rounds(run, repeat: int) -> list:
    """Seconds per call of ``run``, a figure a round, in a contender's own process. Under
    ``run_children`` the parent says when: a line ``ready`` once set up, then per ``run`` on
    stdin one untimed call (the other contenders ran since this one's last round) and a timed
    batch, answered ``round <seconds per call>``, until stdin closes. Alone, ``repeat`` rounds
    one after another."""
    if not os.environ.get(ROUNDS_FROM_PARENT):
        return interleaved_rounds({"run": run}, repeat)["run"]
    n = batch_size(run)
    times = []
    print("ready", flush=True)
    for line in sys.stdin:
        if line.strip() != "run":
            break
        run()
        times.append(_time(run, n) / n)
        print(f"round {times[-1]!r}", flush=True)
    return times


def _child_result(code: int, stdout: str, stderr: str, out: str) -> dict:
    """What a child's exit says: the JSON of its last stdout line, with ``y`` its saved output
    (``out``), or ``{"error": ...}`` with the last line of its stderr."""
    lines = stdout.strip().splitlines()
    if code == 0 and lines:
        try:
            return {**json.loads(lines[-1]), "y": out}
        except ValueError:
            pass
    tail = stderr.strip().splitlines()
    return {"error": tail[-1] if tail else f"exit status {code}, no result"}
