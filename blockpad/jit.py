"""The JIT compiler the kernel cache calls for kernels no prebuilt library has.

It sits above the runtime (``blockpad.runtime`` never imports the code generator or TVM's
compiler; the cache takes this module's ``compile_kernels`` as a callable), and imports
``blockpad.codegen`` only when a kernel must actually be compiled, so a process whose kernels
are all prebuilt or already in the disk cache never pays for ``import tvm``.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
from pathlib import Path


def compile_kernels(entries, policy, target, out_dir) -> None:
    """Build the spec ``entries`` (build-spec kernel tables) for ``target`` into ``out_dir``,
    as one library under ``policy`` (None: the default policy)."""
    from blockpad.codegen.build import build
    from blockpad.codegen.spec import parse_spec
    from blockpad.vocabulary import DEFAULT_POLICY

    doc = {"library": {"name": "jit", "policy": policy or DEFAULT_POLICY},
           "kernel": [dict(e) for e in entries]}
    build(parse_spec(doc, "jit request"), target, out_dir, force=True, log=lambda msg: None)


@functools.lru_cache(maxsize=1)
def fingerprint() -> str:
    """Hash of the sources that decide what a build emits (layouts, the code generator, the
    schedules) and of the tuning records builds apply, found by path so that nothing is
    imported: disk cache entries made by another version, or before a new record, are rebuilt.
    The sources are ``codegen.build.code_digest``'s file set
    (``version.GENERATOR_MODULES``)."""
    from .version import GENERATOR_MODULES, __version__

    files = [Path(__file__).parent / f"{m}.py" for m in GENERATOR_MODULES]
    for pkg, pattern in (("blockpad.codegen", "*.py"), ("blockpad.schedules", "*.py"),
                         ("blockpad.tuning_logs", "*.json")):
        spec = importlib.util.find_spec(pkg)
        for root in spec.submodule_search_locations or []:
            files += sorted(Path(root).rglob(pattern))
    h = hashlib.sha256(__version__.encode())
    for f in files:
        h.update(f.read_bytes())
    return h.hexdigest()


def target_features(target: str) -> tuple:
    """The CPU features of the blockpad target ``target`` (the cache plans for them). Imports
    ``blockpad.codegen.targets`` (plain Python, no TVM), which only a bf16 graph asks for."""
    from blockpad.codegen.targets import get_target

    return tuple(get_target(target).features)


compile_kernels.fingerprint = fingerprint
compile_kernels.target_features = target_features
