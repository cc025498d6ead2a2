"""A small ResNet block on blocked layouts, built with blockpad's graph API and checked against
numpy:

    x -> conv3x3 (30 -> 45) + batch norm -> relu -> conv3x3 (45 -> 30) + batch norm
      -> add x -> relu -> conv1x1 (30 -> 11) -> softmax over channels (a per-pixel head)

Odd channel counts: every blocked activation carries channel padding (30 -> 32, 45 -> 48,
11 -> 16 in nChw16c). Batch norm is folded into the convolutions' weights and bias, as an
inference framework does. Kernels come from the kernel cache: the first run compiles what the
cache directory (~/.cache/blockpad, or $BLOCKPAD_CACHE_DIR) lacks; later runs and later
processes load them.

    python examples/resnet_block.py [--policy tracked] [--hw 28]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import blockpad as bp
from blockpad.check.reference import conv

EPS = 1e-5


def batch_norm(k, rng):
    return {"gamma": rng.uniform(0.5, 1.5, k), "beta": rng.standard_normal(k) * 0.1,
            "mean": rng.standard_normal(k) * 0.1, "var": rng.uniform(0.5, 1.5, k)}


def fold(w, bn):
    """conv(x, w) then batch norm == conv(x, w * s) + (beta - mean * s), s = gamma / std."""
    s = bn["gamma"] / np.sqrt(bn["var"] + EPS)
    bias = bn["beta"] - bn["mean"] * s
    return (w * s[:, None, None, None]).astype("float32"), bias.astype("float32")


def reference(x, w1, bn1, w2, bn2, wh, bh):
    """The block as written, in float64 numpy, batch norm not folded."""
    def bn(h, p):
        shape = (1, -1, 1, 1)
        return (h - p["mean"].reshape(shape)) / np.sqrt(p["var"].reshape(shape) + EPS) * \
            p["gamma"].reshape(shape) + p["beta"].reshape(shape)
    def conv_ref(h, w, pad=0):   # blockpad check's convolution: none of the graph's code
        entry = {"stride": (1, 1), "pad": (pad, pad), "dilation": (1, 1), "groups": 1}
        return conv(h, w.astype(np.float64), entry)

    x = x.astype(np.float64)
    h = np.maximum(bn(conv_ref(x, w1, pad=1), bn1), 0)
    h = np.maximum(bn(conv_ref(h, w2, pad=1), bn2) + x, 0)
    logits = conv_ref(h, wh) + bh.reshape(1, -1, 1, 1)
    e = np.exp(logits - logits.max(1, keepdims=True))
    return e / e.sum(1, keepdims=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--policy", default="dst_fused", help="padding policy of the graph")
    ap.add_argument("--hw", type=int, default=28, help="height and width of the input")
    args = ap.parse_args()

    rng = np.random.default_rng(0)
    c, mid, classes = 30, 45, 11
    x = rng.standard_normal((1, c, args.hw, args.hw)).astype("float32")
    w1 = rng.standard_normal((mid, c, 3, 3)) * np.sqrt(2 / (9 * c))
    w2 = rng.standard_normal((c, mid, 3, 3)) * np.sqrt(2 / (9 * mid))
    wh = (rng.standard_normal((classes, c, 1, 1)) / np.sqrt(c)).astype("float32")
    bh = (rng.standard_normal(classes) * 0.1).astype("float32")
    bn1, bn2 = batch_norm(mid, rng), batch_norm(c, rng)
    (fw1, fb1), (fw2, fb2) = fold(w1, bn1), fold(w2, bn2)

    g = bp.Graph(policy=args.policy)
    t = g.input("x", x.shape)
    h = g.relu(g.conv2d(t, g.constant("w1", fw1), g.constant("b1", fb1), pad=1, name="conv1"),
               name="relu1")
    h = g.conv2d(h, g.constant("w2", fw2), g.constant("b2", fb2), pad=1, name="conv2")
    h = g.relu(g.add(h, t, name="add"), name="relu2")
    head = g.conv2d(h, g.constant("wh", wh), g.constant("bh", bh), name="head")
    g.output(g.softmax(head, axis=1, name="probs"))

    for run in ("first", "second"):
        t0 = time.perf_counter()
        res = g.run(x=x)
        probs = res["probs"]
        held = probs.layout
        y = probs.numpy()          # reordered to plain here, if it was held blocked
        ms = 1e3 * (time.perf_counter() - t0)
        err = float(np.abs(y - reference(x, w1, bn1, w2, bn2, wh, bh)).max())
        print(f"\n{run} run: {ms:.1f} ms, result held as {held.tag}, max |error| vs numpy "
              f"{err:.1e}")
        assert err < 1e-4, err
        print(res.report)
    print("\nplan:")
    print(g.plan(x=x).describe())


if __name__ == "__main__":
    main()
