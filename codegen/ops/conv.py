"""2-D forward convolution (oneDNN semantics), declared once over logical indices:

    dst[n, k, oh, ow] = post_ops(sum_{c, kh, kw} src[n, g*C/G + c, oh*sh - ph + kh*dh,
                                                   ow*sw - pw + kw*dw] * wei[k, c, kh, kw])

with g = k // (K/G) the group of output channel k. Weights are ``(K, C, KH, KW)`` (``oihw``
family) for ``groups = 1`` and ``(G, K/G, C/G, KH, KW)`` (``goihw``) otherwise; depthwise is
``groups = C`` (e.g. ``Goihw16g``). ``dilation = 1`` is a dense kernel (PyTorch's convention,
oneDNN's 0). ``pad``: see below. Element types as matmul's (``postops.types``): float32
(float64, float16 too); int8: ``uint8``/``int8`` source x ``int8`` weights accumulated in int32,
then ``dst = scale[k] * acc`` (+ post-ops) in float32, or with the quantization attributes
(``quant.py``: source and destination zero points, per-tensor weight scale, int32 bias,
destination scale, int8/uint8/int32 destinations); or ``bfloat16`` x ``bfloat16``
accumulated in float32, bias and post-ops in float32, a float32 destination. bf16 is kept as its
uint16 bits in the kernel's arguments (DLPack and numpy have no bfloat16) and reinterpreted where
the reduction reads it, after any spatial-padding guard or staged copy (which move bits: a zero
halo is +0.0); weights pair reduction steps for the dot products (``OIhw16i16o2i``: AMX
``tdpbf16ps``, ``vdpbf16ps``) or stay plain/blocked (``oihw``, ``OIhw16i16o``).

Spatial padding is read as zero in one of three ways, all from the same declaration:

* ``fused`` (default): ``Source`` guards the reads that can fall outside the image;
* ``stage`` (``spatial_pad = "stage"``): a separate stage copies the source into a buffer with a
  zero halo, and the convolution reads that without bounds checks;
* pre-padded: a source layout whose halo covers ``pad`` (e.g. ``paddings = {h = [1, 1], w =
  [1, 1]}``, written clean by its producer) is read without bounds checks, whatever
  ``spatial_pad`` says.

``pad`` is one integer, ``[h, w]`` (symmetric) or ``[[top, bottom], [left, right]]`` (per side:
ONNX's asymmetric ``pads`` and ``auto_pad = SAME_*``); symmetric pads are recorded as ``[h, w]``.

Channel padding: with ``groups = 1`` the reduction runs over the channels that both the source
and the weights pad to (whole blocks; for float32 at most the channels rounded up to 8),
relying on zeros there instead of a tail loop, so the kernel reads source padding
(``reduces_over_padding``) where that passes the logical channels.
"""

from __future__ import annotations

from dataclasses import dataclass

from tvm import te

from blockpad import winograd as wino
from blockpad.errors import SpecError
from blockpad.layout import Layout, pad_sides, pad_sides_param, window_out_size
from blockpad.vocabulary import QUANTIZED_DTYPES

from . import postops, quant, winograd
from .common import OpDef, Source, int_pair, materialize, plan_for, reduced_channels

TENSORS = ("src", "weights", *postops.TENSORS, "dst")
PARAMS = {"channels": None, "kernel": [1, 1], "stride": [1, 1], "pad": [0, 0],
          "dilation": [1, 1], "groups": 1, "spatial_pad": "fused", "post_ops": [],
          "algorithm": "direct", "winograd_tile": wino.DEFAULT_TILE, **quant.PARAMS}
ALGORITHMS = ("direct", "winograd", "auto")   # auto: resolved by the build (codegen.algorithm)


@dataclass(frozen=True)
class Geometry:
    """Sizes of one convolution, checked."""

    n: int
    c: int
    h: int
    w: int
    k: int
    groups: int
    kernel: tuple
    stride: tuple
    pad: tuple          # ((top, bottom), (left, right))
    dilation: tuple

    @classmethod
    def of(cls, shape, channels, kernel, stride, pad, dilation, groups) -> Geometry:
        if len(shape) != 4:
            raise SpecError(f"conv2d: shape is the source's (N, C, H, W); got {list(shape)}")
        if not isinstance(channels, int) or channels < 1:
            raise SpecError(f"conv2d: channels (output channels K) must be a positive integer; "
                            f"got {channels!r}")
        g = groups
        if not isinstance(g, int) or g < 1 or shape[1] % g or channels % g:
            raise SpecError(f"conv2d: groups must divide C={shape[1]} and channels={channels}; "
                            f"got {groups!r}")
        pair = lambda v, what, least: int_pair("conv2d", v, what, least)  # noqa: E731
        geo = cls(*shape, channels, g, pair(kernel, "kernel", 1), pair(stride, "stride", 1),
                  pad_sides(pad), pair(dilation, "dilation", 1))
        if min(geo.out) < 1:
            (t, b), (l, r) = geo.pad
            raise SpecError(f"conv2d: the kernel {list(geo.kernel)} (dilation "
                            f"{list(geo.dilation)}) does not fit the padded image "
                            f"{shape[2] + t + b}x{shape[3] + l + r}")
        return geo

    @property
    def out(self) -> tuple:
        return tuple(window_out_size(n, r, s, p, d) for n, p, d, r, s in
                     zip((self.h, self.w), self.pad, self.dilation, self.kernel, self.stride))

    @property
    def weights(self) -> tuple:
        kh, kw = self.kernel
        if self.groups == 1:
            return self.k, self.c, kh, kw
        return self.groups, self.k // self.groups, self.c // self.groups, kh, kw


def signature(shape, dtype, params):
    """``shape``: the source (N, C, H, W); ``channels``: K. Integer sources take int8 weights,
    a float32 ``scale`` (per channel or per tensor) and give a ``dst_dtype`` destination
    (float32 by default); bf16 sources take bf16 weights and float32 post-op tensors and
    destination."""
    geo = Geometry.of(tuple(shape), *(params[p] for p in
                      ("channels", "kernel", "stride", "pad", "dilation", "groups")))
    wei, _, out = postops.types(dtype)
    taps = geo.c // geo.groups * geo.kernel[0] * geo.kernel[1]
    out = quant.dst_dtype(dtype, quant.check(dtype, params, taps), out)
    dst = (geo.n, geo.k, *geo.out)
    weights = geo.weights
    if params.get("algorithm") == "winograd":   # the weights come transformed (winograd.py)
        weights = wino.weights_shape(geo.k, geo.c, params.get("winograd_tile"))
    return {"src": (tuple(shape), dtype), "weights": (weights, wei),
            **postops.tensors(params["post_ops"], dst, geo.k, dtype, params),
            "dst": (dst, out)}


def make(layouts, name, policy, channels=None, kernel=(1, 1), stride=(1, 1), pad=(0, 0),
         dilation=(1, 1), groups=1, spatial_pad="fused", post_ops=(), algorithm="direct",
         winograd_tile=wino.DEFAULT_TILE, **attrs):
    src, wei, dst = layouts["src"], layouts["weights"], layouts["dst"]
    geo = Geometry.of(src.shape, channels, kernel, stride, pad, dilation, groups)
    attrs = quant.check(src.dtype, attrs)   # quantization: refused on float sources
    if algorithm not in ALGORITHMS[:2]:
        raise SpecError(f"conv2d: algorithm must be one of {', '.join(ALGORITHMS)} ('auto' is "
                        f"resolved by the build); got {algorithm!r}")
    if algorithm == "winograd":   # its own kernels: codegen/ops/winograd.py
        return winograd.make(layouts, name, policy, geo, post_ops, winograd_tile)
    if spatial_pad not in ("fused", "stage"):
        raise SpecError(f"conv2d: spatial_pad must be 'fused' or 'stage'; got {spatial_pad!r}")
    (sh, sw), (dh, dw), (kh, kw) = geo.stride, geo.dilation, geo.kernel
    ph, pw = (before for before, _ in geo.pad)
    cg, kg = geo.c // groups, geo.k // groups
    # groups = 1: reduce over the channel blocks source and weights both have (float32: over
    # the logical channels, but a kernel of several taps where they save little)
    c_red = reduced_channels(cg, src, wei, 1 if src.dtype == "float32" else None,
                             geo.kernel[0] * geo.kernel[1]) if groups == 1 else cg
    reduces_over_padding = c_red > cg
    halo_covers = all(p[0] <= h[0] and p[1] <= h[1]
                      for p, h in zip(geo.pad, src.paddings[2:]))
    staged = spatial_pad == "stage" and not halo_covers
    bits, elem = postops.dot_operand(src.dtype)

    def opdef(mode):
        x, w = Source("src", src, mode, bits), Source("weights", wei, mode, bits)
        comp = quant.conv_compensation(w, geo, dst, c_red) if attrs["src_zero_point"] else None
        requant = quant.Requant(attrs, dst.dtype, comp) if src.dtype in QUANTIZED_DTYPES else None
        post = postops.Chain(post_ops, layouts, mode, requant)
        xs = PaddedCopy(x, geo.pad) if staged else x
        rc = te.reduce_axis((0, c_red), "rc")
        rh, rw = te.reduce_axis((0, kh), "rh"), te.reduce_axis((0, kw), "rw")

        def value(n, k, oh, ow):
            ih, iw = oh * sh - ph + rh * dh, ow * sw - pw + rw * dw
            if groups == 1:
                a, b = xs(n, rc, ih, iw), w(k, rc, rh, rw)
            else:
                g = k // kg
                a, b = xs(n, g * cg + rc, ih, iw), w(g, k % kg, rc, rh, rw)
            return te.sum(elem(a) * elem(b), axis=[rc, rh, rw])

        params = {"channels": geo.k, "kernel": list(geo.kernel), "stride": list(geo.stride),
                  "pad": pad_sides_param(geo.pad), "dilation": list(geo.dilation),
                  "groups": groups, "spatial_pad": spatial_pad, "post_ops": list(post_ops),
                  **quant.recorded(attrs)}
        return OpDef("conv2d", [x, w, *post.sources.values()], value, reduce=True,
                     epilogue=post, params=params, axes=[rc, rh, rw])

    p = plan_for(policy, opdef("trusted"), dst, reduces_over_padding=reduces_over_padding)
    return materialize(opdef(p.reads), dst, p, name)


class PaddedCopy(Source):
    """``src`` copied into its own layout grown by a zero halo of ``pad`` (per side) on h and w:
    the ``stage`` spatial padding, a stage of the kernel (``src_padded``) that writes the halo, so
    the convolution reads the copy with no bounds checks. Where the source's tag blocks h or w
    (``nchW4w``), the halo is rounded up to whole blocks, as a layout's halo must be."""

    def __init__(self, src: Source, pad):
        lay = src.layout
        halo = {d: tuple(-(-x // b) * b for x in p) for d, p, b in zip("hw", pad, lay.blocks[2:])}
        lay = Layout(lay.tag, lay.shape, lay.dtype, halo)
        super().__init__("src_padded", lay, "trusted", src.storage)
        self.src = src

        def copy(*p):
            src.bounds = {v: (0, n - 1) for v, n in zip(p, lay.physical_shape)}
            return src(*lay.to_logical(p))

        self.tensor = te.compute(lay.physical_shape, copy, name="src_padded")

    def __call__(self, *idx, pad=0):
        self.bounds = self.src.bounds   # the ranges materialize gives the kernel's sources
        return super().__call__(*idx, pad=pad)
