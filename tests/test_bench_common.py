"""The benchmarks' process bookkeeping (no process is started here)."""

from blockpad.bench.common import best_of_processes, isolation


def test_best_of_processes_interleaves_rounds_and_keeps_each_fastest():
    ms = {("a", 1): [5.0, 3.0, 4.0], ("b", 1): [2.0, 6.0, 9.0], ("a", 2): [{"error": "x"}, 1.5,
                                                                           2.5],
          ("b", 2): [7.0, {"error": "y"}, 8.0]}
    order = []

    def spawn(name, t):
        order.append((name, t))
        v = ms[(name, t)][sum(1 for o in order if o == (name, t)) - 1]
        return v if isinstance(v, dict) else {"ms": v, "run": len(order)}

    got = best_of_processes(spawn, ("a", "b"), [1, 2], 3, log=lambda m: None)
    # round by round: every contender once before any twice
    assert order == [("a", 1), ("b", 1), ("a", 2), ("b", 2)] * 3
    assert {k: v["ms"] for k, v in got.items()} == {("a", 1): 3.0, ("b", 1): 2.0,
                                                    ("a", 2): 1.5, ("b", 2): 7.0}
    assert "best of 3 processes" in isolation(3) and "best of" not in isolation(1)
