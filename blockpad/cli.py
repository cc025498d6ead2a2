"""The ``blockpad`` command: build libraries, list targets, describe and benchmark them."""

from __future__ import annotations

import argparse
import json
import sys

from .errors import BlockpadError


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="blockpad", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("build", help="build a spec into a shared library + manifest.json")
    p.add_argument("spec", help="TOML build spec")
    p.add_argument("--target", default="host", help="target name (see `blockpad targets`)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--force", action="store_true", help="rebuild even if up to date")
    p.set_defaults(run=_build)

    p = sub.add_parser("targets", help="list the targets and what each needs")
    p.set_defaults(run=_targets)

    p = sub.add_parser("info", help="list the kernels of a built library")
    p.add_argument("dir")
    p.add_argument("--json", action="store_true", help="print the manifest")
    p.set_defaults(run=_info)

    p = sub.add_parser("inspect", help="print what was generated for a built library")
    p.add_argument("dir")
    p.add_argument("--kernel", help="one kernel (default: all)")
    kind = p.add_mutually_exclusive_group()
    for k in ("tir", "asm", "ll", "cuda", "ptx"):
        kind.add_argument(f"--{k}", dest="kind", action="store_const", const=k)
    p.set_defaults(run=_inspect, kind="tir")

    p = sub.add_parser("bench", help="benchmarks that print measured figures")
    p.add_argument("what", choices=["reorder", "ops", "resnet", "isa"])
    p.add_argument("--repeat", type=int, default=5, help="timed rounds per contender")
    p.add_argument("--threads", type=int, default=None, help="kernel threads (default: all cores)")
    p.add_argument("--quick", action="store_true", help="two small shapes only")
    p.add_argument("--target", default=None,
                   help="target of blockpad's kernels (ops; default: the widest this CPU runs)")
    p.set_defaults(run=_bench)

    p = sub.add_parser("report", help="run a measured report")
    p.add_argument("what", choices=["padding"])
    p.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    p.add_argument("--png", metavar="FILE", default="report_padding.png", help="plot file")
    p.add_argument("--iterations", type=int, default=10, help="timed runs of the chain")
    p.add_argument("--hw", type=int, default=28, help="spatial size of the chain's tensors")
    p.set_defaults(run=_report)

    args = parser.parse_args(argv)
    try:
        return args.run(args) or 0
    except BlockpadError as e:
        print(f"blockpad: error: {e}", file=sys.stderr)
        return 2


def _build(args):
    from . import build

    build(args.spec, args.target, args.out, force=args.force)


def _targets(args):
    from .codegen.targets import TARGETS

    for t in TARGETS.values():
        print(f"{t.name:14} {t.description}\n{'':14} runs on {t.arch} with {', '.join(t.features)}")


def _info(args):
    from .runtime import manifest as mf

    manifest = mf.read(args.dir)
    if args.json:
        print(json.dumps(manifest, indent=1))
        return
    from .runtime.library import Signature

    print(f"{args.dir}: target {manifest['target']['name']}, apache-tvm {manifest['tvm_version']}, "
          f"{len(manifest['kernels'])} kernels")
    for k in manifest["kernels"]:
        print(" ", Signature(k))


def _inspect(args):
    from .inspect import show

    print(show(args.dir, args.kind, args.kernel))


def _report(args):
    from .report import padding

    padding.main(args.json, args.png, args.iterations, args.hw)


def _bench(args):
    if args.what == "isa":   # instruction mix per target, from the assembly (no hardware)
        from .bench import isa

        isa.main()
        return
    if args.what == "resnet":
        from .bench import resnet

        resnet.main(repeat=args.repeat, threads=args.threads, quick=args.quick)
        return
    if args.what == "ops":
        from .bench import ops

        ops.main(repeat=args.repeat, threads=args.threads, target=args.target)
        return
    from .bench import reorder

    reorder.main(repeat=args.repeat, threads=args.threads, quick=args.quick)
