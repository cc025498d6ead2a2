"""The ``blockpad`` command: build libraries, list targets, describe and benchmark them."""

from __future__ import annotations

import argparse
import json
import sys

from .errors import BlockpadError
from .models import NETWORKS


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="blockpad", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("build", help="build a spec into a shared library + manifest.json, or "
                       "an ONNX model into a folder that blockpad.load runs")
    p.add_argument("spec", help="TOML build spec, or an ONNX model (.onnx)")
    p.add_argument("--target", default="host", help="target name (see `blockpad targets`; "
                   "native: the widest this CPU runs)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--force", action="store_true", help="rebuild even if up to date")
    p.add_argument("--tuning-logs", metavar="DIR",
                   help="tuning records to use instead of the packaged tuning_logs/")
    p.add_argument("--conv-algorithm", choices=["auto", "direct"], default="auto",
                   help="ONNX models: 3x3 stride-1 convolutions as Winograd where the cost "
                   "model says it pays (auto), or all direct (for comparison)")
    p.set_defaults(run=_build)

    p = sub.add_parser("tune", help="autotune a spec's kernels into tuning_logs/<target>/")
    p.add_argument("spec", help="TOML build spec, or an ONNX model (.onnx): the kernels its "
                   "plan calls, which `blockpad build model.onnx` then applies the records to")
    p.add_argument("--target", default="host", help="target name (see `blockpad targets`; "
                   "native: the widest this CPU runs)")
    p.add_argument("--trials", type=int, required=True, help="trials per kernel (at most)")
    p.add_argument("--out", help="tuning logs folder (default: the packaged tuning_logs/)")
    p.add_argument("--rpc-tracker", metavar="HOST:PORT", help="measure on a device of this "
                   "RPC tracker (targets that cannot run here)")
    p.add_argument("--rpc-key", metavar="KEY", help="the device key registered with the tracker")
    p.set_defaults(run=_tune)

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
    p.add_argument("what", choices=["reorder", "ops", "resnet", "isa", "conv", "matmul", "model",
                                             "calls", "conv-int8", "int8", "mixed", "layers",
                                             "winograd"])
    p.add_argument("--repeat", type=int, default=5, help="timed rounds per contender")
    p.add_argument("--threads", type=int, default=None, help="kernel threads (default: all cores)")
    p.add_argument("--quick", action="store_true", help="two small shapes only")
    p.add_argument("--target", default=None,
                   help="target of blockpad's kernels (ops, resnet, conv-int8, winograd; default: "
                   "the widest this CPU runs)")
    p.add_argument("--model", default=None, choices=list(NETWORKS),
                   help="bench model, layers: the network (default resnet50); bench int8: the "
                   "network to quantize (default: resnet50 and mobilenet_v2)")
    p.add_argument("--int8", action="store_true", help="bench layers: the network's quantized "
                   "(QDQ) form, blockpad's int8 build against ONNX Runtime's int8 nodes "
                   "(as bench int8 quantizes it)")
    p.add_argument("--batch", type=int, default=1, help="bench model: batch size")
    p.add_argument("--hw", type=int, default=224, help="bench model: image height and width")
    p.add_argument("--conv-algorithm", choices=["auto", "direct"], default="auto",
                   help="bench model, resnet: blockpad's convolutions (auto: Winograd where "
                   "it pays)")
    p.add_argument("--tuning-logs", metavar="DIR", default=None,
                   help="bench model, int8: build blockpad's models with the records "
                   "`blockpad tune` wrote into DIR (default: untuned), into folders of their own")
    p.add_argument("--processes", type=_positive, default=1,
                   help="bench model, int8, resnet (at more than 1 thread): processes per "
                   "contender, round by round; each "
                   "contender's fastest process (by median) is reported (a VM can take a core "
                   "from a process for its whole life)")
    p.set_defaults(run=_bench)

    p = sub.add_parser("report", help="run a measured report")
    p.add_argument("what", choices=["padding"])
    p.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    p.add_argument("--png", metavar="FILE", default="report_padding.png", help="plot file")
    p.add_argument("--iterations", type=int, default=10, help="timed runs of the chain")
    p.add_argument("--hw", type=int, default=28, help="spatial size of the chain's tensors")
    p.set_defaults(run=_report)

    p = sub.add_parser("check", help="build and run random kernel specs against numpy "
                       "(benchdnn-like): guard regions, NaN destinations, dirty padding")
    p.add_argument("--target", default="host", help="target whose kernels run here: host, "
                   "avx512 (where the CPU has it), neon / neon-dotprod (under qemu-aarch64), "
                   "cuda-sm80 / cuda-sm90 (on a GPU, or --build-only here)")
    p.add_argument("--cases", type=int, default=100, help="how many random cases")
    p.add_argument("--seed", type=int, default=0, help="the cases are a function of the seed")
    p.add_argument("--case", type=int, default=None, metavar="K",
                   help="run case K of the seed alone (what a failure's replay line says)")
    p.add_argument("--ops", default=None, help="comma-separated ops to draw from (default: "
                   "all)")
    p.add_argument("--spec", default=None, help="check the kernels of this TOML spec (one "
                   "per entry; a failure's spec) instead of random ones")
    p.add_argument("--benchdnn", default=None, metavar="FILE", help="check the convolution "
                   "problems of this oneDNN benchdnn batch file (--dt, --attr-*, descriptors, "
                   "--batch); the ones blockpad cannot state are listed with the reason")
    p.add_argument("--shrink", action="store_true", help="simplify each failing case (a "
                   "build per try) before writing its spec")
    p.add_argument("--batch", type=int, default=25, help="kernels per built library")
    p.add_argument("--out", default="check-failures", help="folder for failing cases' specs")
    p.add_argument("--work", default=None, help="keep the built libraries here (default: a "
                   "temporary folder, removed)")
    p.add_argument("--build-only", action="store_true", help="build into --work DIR with a "
                   "plan, run nothing: for a target this machine cannot run (a GPU)")
    p.add_argument("--run-built", metavar="DIR", default=None, help="run what --build-only "
                   "built into DIR (on the machine that has the target)")
    p.set_defaults(run=_check)

    args = parser.parse_args(argv)
    try:
        return args.run(args) or 0
    except BlockpadError as e:
        print(f"blockpad: error: {e}", file=sys.stderr)
        return 2


def _build(args):
    if args.spec.endswith(".onnx"):
        from .model_build import build_model

        build_model(args.spec, args.target, args.out, force=args.force,
                    tuning_logs=args.tuning_logs, conv_algorithm=args.conv_algorithm)
        return
    from .codegen.build import build
    from .codegen.targets import native_target

    target = native_target() if args.target == "native" else args.target
    build(args.spec, target, args.out, force=args.force, tuning_logs=args.tuning_logs)


def _tune(args):
    from .codegen.targets import native_target
    from .codegen.tune import Rpc, tune

    rpc = None
    if args.rpc_tracker or args.rpc_key:
        rpc = Rpc.parse(args.rpc_tracker or "", args.rpc_key)
    spec = args.spec
    target = native_target() if args.target == "native" else args.target
    if spec.endswith(".onnx"):   # the kernels the model's plan for the target calls
        from .model_build import model_spec

        spec = model_spec(spec, target=target)
    try:
        tune(spec, target, args.trials, args.out, rpc)
    except KeyboardInterrupt:
        print("blockpad tune: interrupted; every finished trial is recorded, run the same "
              "command again to continue", file=sys.stderr)
        return 130


def _targets(args):
    from .codegen.targets import TARGETS

    for t in TARGETS.values():
        print(f"{t.name:14} {t.description}\n{'':14} runs on {t.arch} with {', '.join(t.features)}")


def _info(args):
    from . import manifest as mf

    manifest = mf.read(args.dir)
    if args.json:
        print(json.dumps(manifest, indent=1))
        return
    from .runtime.library import Signature

    print(f"{args.dir}: target {manifest['target']['name']}, apache-tvm {manifest['tvm_version']}, "
          f"{len(manifest['kernels'])} kernels")
    for record in mf.kernel_records(manifest):
        print(" ", Signature(record))
        for n, symbol in sorted((record.threads or {}).items()):
            print(f"    with {n} thread{'s' if n > 1 else ''} in the pool: {symbol}")


def _check(args):
    from .check import check, generate, run_built

    if args.run_built:
        return 1 if run_built(args.run_built, args.out).failed else 0
    ops = generate.CHECKED_OPS
    if args.ops:
        ops = tuple(o.strip() for o in args.ops.split(","))
        unknown = [o for o in ops if o not in generate.CHECKED_OPS]
        if unknown:
            raise BlockpadError(f"--ops: expected some of {', '.join(generate.CHECKED_OPS)}; got "
                                f"{', '.join(unknown)}")
    summary = check(args.target, args.cases, args.seed, ops, args.case, args.batch, args.out,
                    args.work, spec=args.spec, shrink=args.shrink, build_only=args.build_only,
                    benchdnn=args.benchdnn)
    return 1 if summary.failed else 0


def _inspect(args):
    from .generated import show

    print(show(args.dir, args.kind, args.kernel))


def _report(args):
    from .report import padding

    padding.main(args.json, args.png, args.iterations, args.hw)


def _positive(value: str) -> int:
    n = int(value)
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1; got {value}")
    return n


def _bench(args):
    if args.what in ("conv", "matmul"):
        from .bench import conv

        conv.main(args.what, repeat=args.repeat, threads=args.threads, quick=args.quick)
        return
    if args.what == "conv-int8":   # int8 and bf16 against fp32 on the same layers
        from .bench import conv_int8

        conv_int8.main(repeat=args.repeat, threads=args.threads, quick=args.quick,
                       target=args.target)
        return
    if args.what == "isa":   # instruction mix per target, from the assembly (no hardware)
        from .bench import isa

        isa.main()
        return
    if args.what == "resnet":
        from .bench import resnet

        resnet.main(repeat=args.repeat, threads=args.threads, quick=args.quick,
                    target=args.target, algorithm=args.conv_algorithm,
                    processes=args.processes)
        return
    if args.what == "model":
        from .bench import model

        model.main(args.model or "resnet50", args.batch, args.hw, repeat=args.repeat,
                   threads=args.threads, target=args.target,
                   conv_algorithm=args.conv_algorithm, processes=args.processes,
                   tuning_logs=args.tuning_logs)
        return
    if args.what == "layers":   # a network layer by layer against ONNX Runtime, 1 thread
        from .bench import layers

        layers.main(args.model or "resnet50", rounds=args.repeat, target=args.target,
                    int8=args.int8)
        return
    if args.what == "int8":   # int8 networks: blockpad, ONNX Runtime int8, blockpad fp32
        from .bench import int8

        int8.main((args.model,) if args.model else int8.MODELS, args.batch, args.hw,
                  repeat=args.repeat, threads=args.threads, target=args.target,
                  processes=args.processes, tuning_logs=args.tuning_logs)
        return
    if args.what == "mixed":   # blockpad and PyTorch calling in turn in one process
        from .bench import mixed

        mixed.main(repeat=args.repeat, threads=args.threads, target=args.target)
        return
    if args.what == "winograd":   # the Winograd cost model's rates on this machine
        from .bench import winograd

        winograd.main(target=args.target, repeat=args.repeat, threads=args.threads,
                      quick=args.quick)
        return
    if args.what == "calls":   # the Python call path's cost per call
        from .bench import calls

        calls.main(repeat=args.repeat, threads=args.threads)
        return
    if args.what == "ops":
        from .bench import ops

        ops.main(repeat=args.repeat, threads=args.threads, target=args.target)
        return
    from .bench import reorder

    reorder.main(repeat=args.repeat, threads=args.threads, quick=args.quick)
