"""Which channel block a convolution's float32 destination takes where 16 would waste much of
its last block (pure Python, used by the graph's planner): 8 on targets whose FMA units are
256 bits wide, else the graph's usual block.

A convolution's output channels are its vector dim: in ``nChw16c`` MobileNetV2's 24-channel
projections compute 32 channels, EfficientNet-B0's 40-channel ones 48. On AMD Zen 4 every
AVX-512 FMA runs as two 256-bit halves, so a ymm FMA costs half a zmm one and ``nChw8c``
computes 24 channels as three ymm blocks for the price of 1.5 zmm ones instead of two. The
ymm tiles themselves run a little below the zmm ones (more loads and broadcasts per FLOP).
Measured on a Zen 4 (zen4, 1 thread, one kernel alone, the destinations ``nChw16c`` against
``nChw8c``): 1x1 144 -> 24 at 56x56 0.261 -> 0.213 ms, 240 -> 40 at 28x28 0.169 -> 0.161,
3x3 64 -> 37 at 28x28 0.388 -> 0.361, but 300 -> 200 at 14x14 0.226 -> 0.238 (4% fewer
channels, 9% slower tiles); MobileNetV2's fused blocks 16 -> 96 -> 24 at 112x112 stride 2
0.655 -> 0.612 and 24 -> 144 -> 24 at 56x56 0.591 -> 0.534 (their inner stages keep blocks of
16). So 8 where 16 pads at least ``RATIO`` times the channels 8 pads.

On the AVX2 target (``host``, measured on the same core: its ymm kernels) the fused blocks
gained too (0.63 -> 0.56 ms on the 56x56 one), the plain convolutions did not (3x3 64 -> 37
0.42 -> 0.50 ms), and an AVX2 core of its own was not at hand: ``host`` keeps 16. Intel's
AVX-512 cores run a zmm FMA at the rate of a ymm one (two 512-bit ports): 8 would lose there.
"""

from __future__ import annotations

#: Targets whose cores run a 256-bit FMA at twice the rate of a 512-bit one.
HALF_WIDTH_FMA = frozenset({"zen4"})
#: The least ratio of the channels 16 pads to over those 8 pads to where 8 pays: 24 (32 / 24)
#: and 40 (48 / 40) channels take 8, 37 (48 / 40) too, 200 (208 / 200) does not.
RATIO = 1.2


def narrow_block(channels: int, target_name: str) -> int | None:
    """8 where a float32 destination of ``channels`` should be ``nChw8c`` on ``target_name``'s
    cores, else None (the graph's usual blocks)."""
    if target_name not in HALF_WIDTH_FMA:
        return None
    return 8 if -(-channels // 16) * 16 >= RATIO * (-(-channels // 8) * 8) else None


def inner_block(dst_block: int) -> int:
    """The channel block of a fused inverted residual's inner stages (its expansion and
    depthwise convolution, ``codegen/ops/inverted_residual.py``) for a destination blocked by
    ``dst_block`` (1: plain): at least 16, so that an ``nChw8c`` projection keeps zmm
    expansions (the 56x56 block above: 0.554 ms with every stage on blocks of 8, 0.534 with
    the inner ones on 16); 8 for a plain destination."""
    return max(dst_block, 16) if dst_block > 1 else 8
