"""Make a failing case smaller: drop what the failure does not need (a post-op, an inner eltwise
of an inverted residual, in place, a halo, strides, a block, an exotic policy or dtype), one
step at a time, keeping each step only if the case still fails the same way. Each try builds
and runs one kernel, so the number of tries is bounded."""

from __future__ import annotations

from blockpad.layout import Layout
from blockpad.vocabulary import POST_OP_TENSORS, QUANTIZED_ADD, post_op_tensors

TENSORS = ("src", "src0", "src1", "layout", "expand_weights", "depthwise_weights", "weights",
           "dst")
INNER_CHAINS = ("expand_post_ops", "depthwise_post_ops")    # inverted_residual's: eltwise only


def simpler(entry: dict):
    """Candidate entries, each one step simpler than ``entry``."""
    chain = entry.get("post_ops", [])
    for i in range(len(chain)):
        yield _without_post_op(entry, i)
    for key in INNER_CHAINS:
        for i in range(len(entry.get(key, []))):
            yield {**entry, key: [p for j, p in enumerate(entry[key]) if j != i]}
    if entry.get("inplace"):
        yield {k: v for k, v in entry.items() if k != "inplace"}
    if entry.get("policy") not in (None, "dst_fused"):
        yield {**entry, "policy": "dst_fused"}
    if entry.get("dtype") not in (None, "float32"):
        yield {**entry, "dtype": "float32"}
    if entry.get("spatial_pad") == "stage":
        yield {**entry, "spatial_pad": "fused"}
    for t in TENSORS:
        if t not in entry:
            continue
        tag = entry[t] if isinstance(entry[t], str) else entry[t]["tag"]
        steps = [tag] if isinstance(entry[t], dict) else []       # halo / strides dropped
        plain = _plain(tag)
        if plain != tag:
            steps.append(plain)                                     # blocks dropped
        for value in steps:
            e = {**entry, t: value}
            if t == "dst":       # sums and an addend are laid out like dst, by definition
                e.update({n: value for p, n in zip(chain, post_op_tensors(chain))
                          if p["kind"] in ("sum", QUANTIZED_ADD)})
            if entry.get("inplace") and t in ("src", "src0", "dst"):
                continue                          # in place: one layout for both
            yield e


def _without_post_op(entry: dict, i: int) -> dict:
    """``entry`` with post-op ``i`` dropped: the later sums and binary operands take the names
    of the earlier ones (``sum_2`` becomes ``sum_1``), each keeping its own layout."""
    chain = entry["post_ops"]
    rest = [p for j, p in enumerate(chain) if j != i]
    old = [n for j, n in enumerate(post_op_tensors(chain)) if j != i]
    e = {k: v for k, v in entry.items() if k not in POST_OP_TENSORS}
    e.update({new: entry[name] for name, new in zip(old, post_op_tensors(rest))
              if new is not None and name in entry})
    e["post_ops"] = rest
    return e


def _plain(tag: str) -> str:
    """The unblocked, canonical-order tag of ``tag``'s dims (``nChw16c`` -> ``nchw``)."""
    rank = len({c.lower() for c in tag if c.isalpha()})
    return Layout(tag, (1,) * rank).dims


def shrink(entry: dict, fails, valid, limit: int = 12, log=print) -> dict:
    """The simplest entry reached from ``entry`` by steps that ``valid(e)`` accepts and after
    which ``fails(e)`` still holds, trying at most ``limit`` builds."""
    tries = 0
    improved = True
    while improved and tries < limit:
        improved = False
        for e in simpler(entry):
            if not valid(e):
                continue
            tries += 1
            if fails(e):
                log(f"    shrunk: {_diff(entry, e)}")
                entry, improved = e, True
                break
            if tries >= limit:
                break
    return entry


def _diff(a: dict, b: dict) -> str:
    keys = [k for k in {**a, **b} if a.get(k) != b.get(k)]
    return ", ".join(f"{k}: {a.get(k, '-')!r} -> {b.get(k, '-')!r}" for k in keys)
