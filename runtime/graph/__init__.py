"""Graphs of ops run on numpy inputs, the way a framework integrates blocked kernels (seed 004):

    g = Graph(policy="tracked")
    x = g.input("x", (1, 30, 14, 14))
    w = g.constant("w", weights)                  # reordered once to a blocked layout, kept
    y = g.relu(g.conv2d(x, w, pad=1))
    z = g.softmax(g.add(y, x), axis=1)
    g.output(z)
    res = g.run(x=array)                          # kernels from the cache (JIT on first use)
    res["softmax_0"].numpy()                      # reordered to plain now, not before
    print(res.report)

The package, one job a module, each seam a small documented interface:

* ``api``: ``Graph`` and ``Tensor``, what a user builds and runs;
* ``ops``: what the runtime knows of each op (shapes, layout choices, kernel requests, in-place
  inputs, a numpy reference); ``passes``: the in-place pass and post-op fusion on the op list;
* ``planning``: ``Plan``, the passes' result for one set of input layouts (layouts, fusion,
  in place, reorders, fallbacks, the arena); it reads the graph through ``PlanSource``;
* ``execution``: ``Runner``, a plan's arenas, bound kernels and runs;
* ``weights``: ``WeightCache``, the constants and their prepared layouts;
* ``results``: ``Report``, ``Result``, ``Results``; ``kernels``: reorders and zero-pad kernels
  shared by the others.
"""

from .api import Graph, Tensor
from .planning import Plan
from .results import Report, Result, Results

__all__ = ["Graph", "Plan", "Report", "Result", "Results", "Tensor"]
