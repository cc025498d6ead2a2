"""Package attributes imported on first use (PEP 562's module ``__getattr__``).

``import blockpad`` must stay cheap and must not drag the graph, the model loader or the
compiler into a process that only loads a library; the names a package exports are therefore
resolved when they are first read, from a table of ``name -> submodule``.
"""

from __future__ import annotations

import importlib


def exports(package: str, table: dict):
    """``(__getattr__, __dir__)`` for ``package``, whose public names come from the submodules
    ``table`` maps them to (relative names, as in ``from .graph import Graph``)."""
    def __getattr__(name):
        if name not in table:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(table[name], package), name)
        setattr(importlib.import_module(package), name, value)   # later reads skip this hook
        return value

    def __dir__():
        return sorted(set(table) | set(vars(importlib.import_module(package))))

    return __getattr__, __dir__
