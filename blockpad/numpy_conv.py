"""Direct convolution in numpy, in its arguments' own type: float64 for the graph's fallback of a
float convolution (``runtime.graph.ops.conv_ref``), int64 for the exact accumulator of a
quantized one (``qlinear.conv_acc``). One loop for both, so the two cannot drift apart.

It is not the checker's reference (``blockpad.check.reference.conv``): that one is kept
separate on purpose, so the fallback is tested against code it does not use."""

from __future__ import annotations

import numpy as np


def direct_conv(x, w, stride=(1, 1), pad=((0, 0), (0, 0)), dilation=(1, 1), groups=1):
    """NCHW ``x`` and ``(K, C/groups, KH, KW)`` ``w`` (same dtype), ``pad`` per side
    ``((top, bottom), (left, right))``: ``(N, K, OH, OW)`` in that dtype."""
    k, cg, kh, kw = w.shape
    xp = np.pad(x, ((0, 0), (0, 0), *pad))
    oh = (xp.shape[2] - dilation[0] * (kh - 1) - 1) // stride[0] + 1
    ow = (xp.shape[3] - dilation[1] * (kw - 1) - 1) // stride[1] + 1
    out = np.zeros((x.shape[0], k, oh, ow), np.result_type(x, w))
    kg = k // groups
    for g in range(groups):
        xs, ws = xp[:, g * cg:(g + 1) * cg], w[g * kg:(g + 1) * kg]
        for i in range(kh):
            for j in range(kw):
                h0, w0 = i * dilation[0], j * dilation[1]
                win = xs[:, :, h0:h0 + stride[0] * (oh - 1) + 1:stride[0],
                         w0:w0 + stride[1] * (ow - 1) + 1:stride[1]]
                out[:, g * kg:(g + 1) * kg] += np.einsum("nchw,kc->nkhw", win, ws[:, :, i, j])
    return out
