"""Load the library built from examples/reorders.toml and run it next to numpy.

    blockpad build examples/reorders.toml --target host --out build/reorders
    python examples/run_reorders.py build/reorders
"""

import sys

import numpy as np

import blockpad as bp

lib = bp.load(sys.argv[1] if len(sys.argv) > 1 else "build/reorders")
print(lib)

x = np.random.default_rng(0).standard_normal((2, 30, 5, 7)).astype("float32")
blocked = bp.Memory.empty(bp.Layout("nChw16c", shape=x.shape))
blocked.buffer[:] = np.nan                       # garbage, padding included
lib["reorder_nchw_nChw16c_f32_2x30x5x7"](x, blocked)
print("nchw -> nChw16c: equal to input:", np.array_equal(blocked.to_numpy(), x),
      "| channels 30, 31 (padding) zero:", blocked.padding_is_zero())

back = np.empty_like(x)
lib["reorder_nChw16c_nchw_f32_2x30x5x7"](blocked, back)
print("nChw16c -> nchw: round trip exact:", np.array_equal(back, x))

halo_layout = lib.kernels["pad_halo"].args[1][2]  # the destination layout, from the manifest
halo = bp.Memory.empty(halo_layout)
lib["pad_halo"](x, halo)
print(f"nchw -> {halo_layout}: equal:", np.array_equal(halo.to_numpy(), x),
      "| halo zero:", halo.padding_is_zero(), f"| first element at offset {halo_layout.elem_offset}")
