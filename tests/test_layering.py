"""The layering, checked on the source: every import statement of the package (module level
and inside functions), resolved to the module it names, against the rules of
docs/architecture.md:

* ``runtime`` never imports ``codegen``, ``schedules`` or TVM's compiler package ``tvm``
  (``tvm_ffi`` is the runtime's way in);
* ``codegen`` never imports ``runtime``;
* the modules both sides share (manifest, machine, vocabulary, errors) import neither side;
* no library module imports the command line, the benchmarks or the reports.

No module is imported to check this: a violation is found even on a path the tests never run.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# package -> folder, as pyproject.toml's package-dir lays the tree out
PACKAGES = {"blockpad.codegen": "codegen", "blockpad.schedules": "schedules",
            "blockpad.runtime": "runtime", "blockpad": "blockpad"}
SHARED = ("blockpad.manifest", "blockpad.machine", "blockpad.vocabulary", "blockpad.errors")
FRONT = ("blockpad.cli", "blockpad.__main__", "blockpad.bench", "blockpad.report")


def _modules() -> dict:
    """module name -> source path, for every module of the package."""
    out = {}
    for pkg, folder in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT / folder).with_suffix("").parts
            if rel[-1] == "__init__":
                rel = rel[:-1]
            out[".".join((pkg, *rel))] = path
    return out


MODULES = _modules()


def imports(module: str) -> set:
    """Every module ``module`` imports, absolute, including ``from X import name`` as ``X.name``
    (a submodule or not: the rules test prefixes)."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1])
                base = f"{base}.{node.module}" if node.module else base
            else:
                base = node.module
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def _within(name: str, prefixes) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _violations(layer, forbidden) -> list:
    """``layer``: module prefixes, or a predicate on module names."""
    inside = layer if callable(layer) else (lambda m: _within(m, layer))
    return sorted(f"{m} imports {i}" for m in MODULES if inside(m)
                  for i in imports(m) if _within(i, forbidden))


def test_the_walk_sees_the_package():
    assert {"blockpad.runtime.graph", "blockpad.codegen.build", "blockpad.schedules.space",
            "blockpad.manifest", "blockpad.cli"} <= set(MODULES)
    assert "blockpad.runtime.tvm_runtime" in imports("blockpad.runtime.library")
    assert "blockpad.codegen.build" in imports("blockpad.jit")   # inside a function


def test_runtime_imports_no_compiler():
    assert _violations(["blockpad.runtime"],
                       ["blockpad.codegen", "blockpad.schedules", "blockpad.jit", "tvm"]) == []


def test_codegen_imports_no_runtime():
    assert _violations(["blockpad.codegen"], ["blockpad.runtime"]) == []


def test_shared_modules_import_neither_side():
    assert _violations(SHARED, ["blockpad.runtime", "blockpad.codegen", "blockpad.schedules",
                                "tvm"]) == []


def test_library_imports_no_front_end():
    assert _violations(lambda m: not _within(m, FRONT), FRONT) == []


def test_the_cache_fingerprints_cover_every_module_the_generator_imports():
    """A build's output depends on codegen/, schedules/ and the top-level modules they import,
    transitively; ``version.GENERATOR_MODULES`` lists those for the build digest and the JIT
    fingerprint. One left out (vocabulary.py was) lets a stale cached kernel, or a stale
    recorded failure, outlive a change to it."""
    from blockpad.version import GENERATOR_MODULES

    todo = [m for m in MODULES if m.startswith(("blockpad.codegen", "blockpad.schedules"))]
    seen = set(todo)
    while todo:
        for name in imports(todo.pop()):
            parts = name.split(".")
            top = ".".join(parts[:2])
            if parts[0] == "blockpad" and len(parts) > 1 and top in MODULES and top not in seen \
                    and MODULES[top].parent == ROOT / "blockpad" and parts[1] != "version":
                seen.add(top)
                todo.append(top)
    used = {m.split(".")[1] for m in seen if m.count(".") == 1 and MODULES[m].parent == ROOT / "blockpad"}
    assert used <= set(GENERATOR_MODULES), sorted(used - set(GENERATOR_MODULES))
