"""``blockpad check``: random kernel specs built and run against numpy, benchdnn's role for
blockpad. ``generate`` draws cases from a seed, ``reference`` computes what they must give,
``execute`` runs them (in worker processes) with guard regions, NaN-filled destinations and
dirty padding where the contracts allow, ``driver`` batches the builds and reports, ``replay``
writes what a failure needs to be reproduced."""

from .driver import Summary, check, run_built

__all__ = ["Summary", "check", "run_built"]
