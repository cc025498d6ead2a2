"""numpy references for every op, by spec entry: the checker compares kernels with these."""

from __future__ import annotations

import numpy as np
from scipy.special import erf

ELTWISE = {
    "relu": lambda x, a, b: np.where(x > 0, x, x * a),
    "gelu_erf": lambda x, a, b: 0.5 * x * (1 + erf(x / np.sqrt(2))),
    "gelu_tanh": lambda x, a, b: 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3))),
    "sigmoid": lambda x, a, b: 1 / (1 + np.exp(-x)),
    "exp": lambda x, a, b: np.exp(x),
    "tanh": lambda x, a, b: np.tanh(x),
    "clip": lambda x, a, b: np.clip(x, a, b),
    "linear": lambda x, a, b: a * x + b,
}


def eltwise(entry, src):
    return ELTWISE[entry.get("algorithm", "relu")](src.astype(np.float64), entry.get("alpha", 0.0),
                                                   entry.get("beta", 0.0))


def binary(entry, src0, src1):
    a, b = src0.astype(np.float64), src1.astype(np.float64)
    return a + b if entry.get("algorithm", "add") == "add" else a * b


REFERENCES = {"eltwise": eltwise, "binary": binary}
