"""What a failure leaves behind: the command that replays it and a one-kernel TOML spec that
builds it (``blockpad build FILE --target T``)."""

from __future__ import annotations

import json
import os

from .generate import CHECKED_OPS


def command(target: str, seed: int, k: int, ops, spec=None, flag="--spec") -> str:
    """``blockpad check`` for case ``k`` alone (the same data: it is drawn from seed and case),
    of the generated cases or of ``spec`` (a TOML spec, or with ``flag = "--benchdnn"`` a
    benchdnn batch file)."""
    cmd = f"blockpad check --target {target} --seed {seed}"
    if spec is not None:
        return f"{cmd} {flag} {spec} --case {k}"
    cmd += f" --case {k}"
    if tuple(ops) != CHECKED_OPS:
        cmd += " --ops " + ",".join(ops)
    return cmd


def toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)           # a TOML basic string for the ASCII names used here
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{k} = {toml_value(x)}" for k, x in v.items()) + " }"
    raise TypeError(f"no TOML form for {v!r}")


def spec_text(entry: dict, header: list[str]) -> str:
    """A build spec holding ``entry`` alone, under ``header`` comment lines."""
    lines = [f"# {h}" for h in header] + ["", "[[kernel]]"]
    lines += [f"{k} = {toml_value(v)}" for k, v in entry.items()]
    return "\n".join(lines) + "\n"


def write_spec(out_dir, target, seed, k, entry, problems, replayed_by) -> str:
    """Write ``<out_dir>/<target>-seed<seed>-case<k>.toml``; return its path."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{target}-seed{seed}-case{k}.toml")
    header = [f"blockpad check: case {k} of seed {seed} failed on target {target}:",
              *(f"  {p.splitlines()[0]}" for p in problems),
              f"found by: {replayed_by}",
              f"replay this spec: {command(target, seed, k, (), path)}",
              (f"build it alone: blockpad build {os.path.basename(path)} --target {target} "
              f"--out build/case{k}")]
    with open(path, "w") as f:
        f.write(spec_text(entry, header))
    return path
