"""Winograd F(m x m, 3 x 3) facts both sides of blockpad share (pure Python): the transform
matrices, the Winograd-domain weights layout, the accuracy bound, and the cost model that
``algorithm = "auto"`` falls back on where no tuning record decides. The kernels themselves
are declared in ``blockpad.codegen.ops.winograd``.

Transform matrices: Cook-Toom on the points 0, +-1, +-2, +-1/2 and infinity (``POINTS``),
exact (``fractions``): A^T[i, j] = a_j^i, G[j, k] = a_j^k / prod_{l != j} (a_j - a_l), and B^T
solved from the identity A^T [(G g) (.) (B^T d)] = g * d itself (``matrices``). F(4x4) gives
Lavin's B^T (rows 4 0 -5 0 1 0, ...).

Accuracy. The error measured is max |y_computed - y| / max |y| over a layer's outputs, y
computed in float64 by the direct definition (oneDNN's benchdnn compares its Winograd kernels
with a reference computed in Winograd order instead, because its bound is loose; blockpad
states its bound against the direct definition). Derivation:

* worst case (Higham's analysis of sums of products): every term of an output carries at most
  n u of relative error (u = 2^-24, n the roundings on its path), and the terms are bounded by
  products of the matrices' absolute values, so |err| <= n u (||A^T|| ||G|| ||B^T||)^2 C
  max|d| max|g| with ||.|| the largest row sum: factors 81, 36100, 1.6e6 for m = 2, 4, 6 over
  the direct convolution's 9. The bound grows with the tile because the points (and so the
  matrices' norms) grow, but it is far too loose to use (F(4x4) on 64 channels: 200% of the
  largest output);
* typical case, the bound used: roundings have independent signs, so their errors add in
  quadrature. A transformed product U V of position (eps, nu) carries a relative error of
  about u ||G_eps|| ||G_nu|| ||B_eps|| ||B_nu|| (2-norms of the rows that formed it: U =
  G g G^T, V = B^T d B), and the output transform weighs it by A^T[i, eps] A^T[j, nu]; summed
  in quadrature over the positions, the worst output position gives the amplification

      kappa(m) = max_ij sqrt( sum_{eps, nu} (A^T_i,eps A^T_j,nu ||G_eps|| ||G_nu||
                                              ||B_eps|| ||B_nu||)^2 )

  (5.0, 94.3, 138.8 for m = 2, 4, 6; ``amplification``), while the sums over 9 C products
  (channels in the GEMM, taps in the transforms) add the direct convolution's own
  u sqrt(9 C). The largest of many outputs lies a few standard deviations out, so

      error_bound(m, C) = 5 u (kappa(m) + sqrt(9 C))

  Measured on normal data (C = 64): 3.0e-7, 6.1e-6, 8.9e-6 for m = 2, 4, 6 (u kappa: 3.0e-7,
  5.6e-6, 8.3e-6); tests/test_winograd.py checks every kernel it runs against it.

``algorithm = "auto"`` never picks a variant whose ``error_bound`` exceeds ``TOLERANCE``, the
error ``blockpad bench conv`` accepts of any kernel (1e-4: F(6x6) up to ~5000 channels).
"""

from __future__ import annotations

import functools
import math
from fractions import Fraction

import numpy as np

from .errors import SpecError
from .layout import Layout

TILES = (2, 4, 6)          # m of F(m x m, 3 x 3)
DEFAULT_TILE = 4
POINTS = {2: (0, 1, -1), 4: (0, 1, -1, 2, -2),
          6: (0, 1, -1, 2, -2, Fraction(1, 2), Fraction(-1, 2))}
U32 = 2.0 ** -24           # unit roundoff of float32
TOLERANCE = 1e-4           # max |err| / max |y| that auto accepts (bench conv's, of any kernel)


@functools.cache
def matrices(m: int, r: int = 3) -> tuple:
    """(A^T, G, B^T) of F(m, r) as exact fractions (tuples of rows): m x a, a x r, a x a with
    a = m + r - 1. Cached: loading a model asks for them once per convolution (``choose``);
    B^T is solved for all its columns in one elimination (7 ms for F(6x6) where a solve per
    column took 60)."""
    if m not in POINTS:
        raise SpecError(f"winograd_tile: expected one of {', '.join(map(str, TILES))} (F(m x m, "
                        f"3 x 3)); got {m!r}")
    pts = [Fraction(p) for p in POINTS[m]]
    a = m + r - 1
    at = [[p ** i for p in pts] + [Fraction(int(i == m - 1))] for i in range(m)]
    f = [math.prod(pj - pl for pl in pts if pl != pj) for pj in pts]
    g = [[pj ** k / fj for k in range(r)] for pj, fj in zip(pts, f)]
    g.append([Fraction(int(k == r - 1)) for k in range(r)])
    # sum_j AT[i][j] G[j][k] BT[j][col] = [col == i + k]: one system, a right-hand side per col
    rows = [[at[i][j] * g[j][k] for j in range(a)] + [Fraction(int(col == i + k))
                                                      for col in range(a)]
            for i in range(m) for k in range(r)]
    bt = _solve(rows, a)
    return tuple(tuple(tuple(row) for row in mat) for mat in (at, g, bt))


def _solve(rows, n):
    """X with M X = R, exactly, for a consistent, full-rank system given as augmented rows
    [M | R] (n unknowns a column, as many columns as R has): rows of X."""
    rows = [list(r) for r in rows]
    for c in range(n):
        p = next(i for i in range(c, len(rows)) if rows[i][c] != 0)
        rows[c], rows[p] = rows[p], rows[c]
        rows[c] = [v / rows[c][c] for v in rows[c]]
        for i in range(len(rows)):
            if i != c and rows[i][c] != 0:
                rows[i] = [a - rows[i][c] * b for a, b in zip(rows[i], rows[c])]
    if any(any(v != 0 for v in r) for r in rows[n:]):
        raise ArithmeticError("inconsistent Winograd identity")
    return [rows[i][n:] for i in range(n)]


@functools.cache
def amplification(m: int) -> float:
    """kappa(m): how much the transforms amplify rounding, typically (module docstring)."""
    at, g, bt = matrices(m)
    rows = [math.sqrt(sum(float(v) ** 2 for v in gr)) * math.sqrt(sum(float(v) ** 2 for v in br))
            for gr, br in zip(g, bt)]
    a = len(rows)
    return max(math.sqrt(sum((float(at[i][e] * at[j][n]) * rows[e] * rows[n]) ** 2
                             for e in range(a) for n in range(a)))
               for i in range(m) for j in range(m))


def error_bound(m: int, channels: int) -> float:
    """The documented bound on max |err| / max |y| of F(m x m, 3 x 3) over ``channels`` input
    channels: 5 u (kappa(m) + sqrt(9 C)) (module docstring)."""
    return 5 * U32 * (amplification(m) + math.sqrt(9 * channels))


def applicable(geo, dtype) -> str | None:
    """Why Winograd cannot compute this convolution (``codegen.ops.conv.Geometry``), or None."""
    if dtype != "float32":
        return f"dtype float32 (got {dtype})"
    if geo.kernel != (3, 3) or geo.stride != (1, 1) or geo.dilation != (1, 1) or geo.groups != 1:
        return (f"a 3x3 kernel, stride 1, dilation 1, groups 1 (got kernel {list(geo.kernel)}, "
                f"stride {list(geo.stride)}, dilation {list(geo.dilation)}, groups {geo.groups})")
    return None


def weights_shape(k: int, c: int, m: int) -> tuple:
    """Logical shape of the Winograd-domain weights U = G w G^T: (K, C, m + 2, m + 2)."""
    matrices(m)   # checks m
    return k, c, m + 2, m + 2


def weights_layout(k: int, c: int, m: int, block: int = 16, dtype="float32") -> Layout:
    """The packed Winograd-domain layout: tag ``hwOi<block>o`` over ``weights_shape``,
    physically [m + 2][m + 2][K / block][C][block]: per transformed position and panel of
    ``block`` output channels, the C x block panel the GEMM's register tile reads as
    vectors."""
    return Layout(f"hwOi{block}o", weights_shape(k, c, m), dtype)


def domain_tile(layout: Layout, weights_shape) -> int | None:
    """m if ``layout`` holds the Winograd-domain form of 3x3 weights of ``weights_shape``
    ((K, C, 3, 3) in, (K, C, m + 2, m + 2) held), else None (the weights as they are)."""
    if layout.rank == len(weights_shape) == 4 and tuple(weights_shape[2:]) == (3, 3) and \
            tuple(layout.shape[2:]) != (3, 3):
        return layout.shape[2] - 2
    return None


def transform(w, m: int):
    """U = G w G^T of (K, C, 3, 3) weights ``w`` for F(m x m, 3 x 3), in float64 (numpy): the
    reference the ``winograd_weights`` kernel is checked against, and how a model build packs
    its weights."""
    g = np.array(matrices(m)[1], dtype=np.float64)
    return np.einsum("er,kcrs,ns->kcen", g, np.asarray(w, dtype=np.float64), g)


def transform_name(kernel: str) -> str:
    """The weights-transform kernel a Winograd convolution's library holds with it."""
    return f"{kernel}__winograd_weights"


# ---- auto's cost model --------------------------------------------------------------------------

#: The cost model's throughputs, by target name (``target_rates``): the direct kernel's flops, the
#: Winograd GEMM's flops, the transforms' adds and multiplies, and the bytes of transformed
#: weights streamed from memory once per call (at 7x7 with 512 channels they outweigh the
#: GEMM). ``blockpad bench winograd --target T`` measures them on the machine it runs on: the
#: 3x3 layers of the bench networks, direct and each tile, with the caches flushed before each
#: call as a network's weights are (the source read back in, as the layer before leaves it),
#: at one thread and at all cores, fitted by least squares; it prints the entry for this table
#: and what the model would pick against what is fastest. Only the ratios between the rates
#: matter, and a machine shared with other work measures them roughly.
#:
#: ``zen4``: AMD EPYC (Zen 4), 2 vCPU, the fit of two runs (92, 99, 9.7, 24.8 G); its weights
#: rate taken at 22 GB/s, within the fit's noise (a numpy sum streams 25 GB/s there), where the
#: model picks the fastest measured variant at every layer both at 1 and 2 threads but one
#: (512 channels at 7x7: F(2x2), 0.1 ms behind F(4x4) at 1 thread, ahead at 2). The default
#: rates (``DEFAULT_RATES``) picked direct there (0.44 ms slower at 1 thread, 0.18 at 2).
RATES = {
    "zen4": {"direct": 92e9, "gemm": 99e9, "transform": 9.7e9, "weights": 22e9},
}

#: The rates of a target without its own entry: measured on this project's AVX2 machine (EPYC,
#: 1 thread, ``host`` kernels): the direct kernel on C64 K64 56x56 (22 GFLOP/s: 231 MFLOP in
#: 10.4 ms), and F(4x4) on the same layer (5.8 ms) split by ``perf record`` samples over its
#: three parallel loops: the GEMM 58% (57.8 MFLOP: 17 GFLOP/s), the input transform 25% and
#: the output transform 17% (3.3 M and 2.3 M adds and multiplies: 2.3 G/s); the weights rate a
#: numpy copy of that layer's 37.7 MB F(4x4) weights (2 GB/s: that VM's memory was slow and
#: shared). With these, the model gives 10.5, 8.4, 6.1 and 7.1 ms for direct, F(2), F(4),
#: F(6) on that layer (measured: 10.4, 9.1, 5.8, 5.5).
DEFAULT_RATES = {"direct": 22e9, "gemm": 17e9, "transform": 2.3e9, "weights": 2e9}


def target_rates(target: str | None) -> dict:
    """The cost model's throughputs for the target named ``target`` (``RATES``), else the
    defaults."""
    return RATES.get(target, DEFAULT_RATES)


def _nonzeros(mat) -> int:
    return sum(1 for row in mat for v in row if v != 0)


def estimate(n, c, k, oh, ow, m=None, rates=DEFAULT_RATES) -> float:
    """Estimated seconds of a 3x3 stride-1 convolution with an ``oh`` x ``ow`` output: direct
    (``m`` None) or F(m x m, 3x3): the GEMM's 2 (m + 2)^2 C K flops per tile, the transforms'
    (2 (m + 2) nnz(B^T) C + (2 m + 2) nnz(A^T) K) per tile, the transformed weights'
    4 (m + 2)^2 C K bytes, each at its rate in ``rates`` (a target's: ``target_rates``).

    Ragged channel counts cost no more than their share: the input transform runs over whole
    channel blocks of a blocked source and the output transform selects the destination's
    channel padding (codegen/ops/winograd.py), so a channel-pruned ResNet-50's 40 -> 41 at
    56x56 takes 0.54 ms with F(4x4) against 0.88 direct (Cascade Lake, avx512, 1 thread;
    1.44 ms before, with partial vectors of logical channels)."""
    return sum(work / rates[kind] for kind, work in costs(n, c, k, oh, ow, m).items())


def costs(n, c, k, oh, ow, m=None) -> dict:
    """``estimate``'s work by kind (``{"direct": flops}``, or the GEMM's flops, the transforms'
    operations and the weights' bytes of F(m x m)): what each rate divides."""
    if m is None:
        return {"direct": 2 * 9 * c * k * n * oh * ow}
    at, _, bt = matrices(m)
    a = m + 2
    tiles = n * -(-oh // m) * -(-ow // m)
    return {"gemm": 2 * a * a * c * k * tiles,
            "transform": (2 * a * _nonzeros(bt) * c + (a + m) * _nonzeros(at) * k) * tiles,
            "weights": 4 * a * a * c * k}


def candidates(c: int) -> list:
    """The tiles ``auto`` may pick for ``c`` input channels: those within ``TOLERANCE``."""
    return [m for m in TILES if error_bound(m, c) <= TOLERANCE]


def choose(n, c, k, oh, ow, rates=DEFAULT_RATES) -> int | None:
    """``auto``'s pick by the cost model with ``rates`` (a target's: ``target_rates``): the
    tile of the fastest Winograd variant within the error bound, or None where the direct
    convolution is estimated fastest."""
    return min([None, *candidates(c)], key=lambda m: estimate(n, c, k, oh, ow, m, rates))
