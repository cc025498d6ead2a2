"""``algorithm = "auto"`` on conv2d: which algorithm the build compiles, decided per kernel.

The candidates are the direct convolution and each Winograd tile whose documented error
bound is within ``blockpad.winograd.TOLERANCE`` (``candidates``). Where tuning records time
some of them (``blockpad tune`` measures every candidate, under the names
``<kernel>__auto_<label>``), the fastest recorded one wins; else the cost model
(``blockpad.winograd.estimate``). The kernel keeps its name and records the choice in its
manifest params (``auto``: what was picked, by what, and each candidate's time), so that a
caller reads there which weights it takes (a Winograd choice takes the transformed weights its
``__winograd_weights`` kernel makes)."""

from __future__ import annotations

import dataclasses

from blockpad import winograd as wino

from .ops.conv import Geometry
from .spec import KernelRequest


def is_auto(req: KernelRequest) -> bool:
    return req.op == "conv2d" and dict(req.params).get("algorithm") == "auto"


def candidates(req: KernelRequest) -> list:
    """``[(label, request)]``: the direct convolution first, then each Winograd tile auto may
    pick; each request under the name tuning records it by."""
    lay = req.layout
    src, dst = lay["src"], lay["dst"]
    geo = geometry(req)
    out = [("direct", _variant(req, "direct", {"algorithm": "direct"}, lay["weights"]))]
    if wino.applicable(geo, src.dtype) is None:
        block = dst.block_of(1) if dst.block_of(1) > 1 else 16
        for m in wino.candidates(geo.c):
            wl = wino.weights_layout(geo.k, geo.c, m, block, src.dtype)
            out.append((f"winograd{m}", _variant(
                req, f"winograd{m}", {"algorithm": "winograd", "winograd_tile": m}, wl)))
    return out


def geometry(req: KernelRequest) -> Geometry:
    params = dict(req.params)
    return Geometry.of(req.layout["src"].shape, *(params[p] for p in (
        "channels", "kernel", "stride", "pad", "dilation", "groups")))


def _variant(req, label, params, weights):
    layouts = tuple((t, weights if t == "weights" else l) for t, l in req.layouts)
    merged = tuple(sorted({**dict(req.params), **params}.items()))
    return dataclasses.replace(req, name=f"{req.name}__auto_{label}", layouts=layouts,
                               params=merged)


def resolve(req: KernelRequest, recorded, target: str | None = None) -> tuple:
    """``(request, choice)``: the candidate to build under ``req``'s name, and the manifest's
    record of the choice. ``recorded(candidate request) -> seconds or None`` looks a
    candidate up in the tuning records; ``target``: the name of the target whose cost model
    decides where no record does."""
    cands = candidates(req)
    geo = geometry(req)
    times = {label: recorded(c) for label, c in cands}
    timed = {label: t for label, t in times.items() if t is not None}
    if timed:
        label, by = min(timed, key=timed.get), "tuning records"
    else:
        rates = wino.target_rates(target)
        est = {label: wino.estimate(geo.n, geo.c, geo.k, *geo.out, None if label == "direct"
                                    else dict(r.params)["winograd_tile"], rates)
               for label, r in cands}
        times = {label: round(t * 1e6, 1) for label, t in est.items()}
        label, by = min(est, key=est.get), "cost model"
    chosen = dict(cands)[label]
    choice = {"chosen": label, "by": by, "tuned_as": chosen.name,
              ("time_us" if by == "tuning records" else "estimate_us"): {
                  k: (round(v * 1e6, 1) if by == "tuning records" and v is not None else v)
                  for k, v in times.items()}}
    return dataclasses.replace(chosen, name=req.name), choice
