"""The words the code generator, the schedules and the runtime must spell alike.

The build writes these names into kernels and manifests and the runtime reads them back; the
schedule rules find the generator's stages by them. Each is defined here once, in pure Python
(no TVM), so that every layer may import it without importing another layer
(docs/architecture.md, "Layers").
"""

from __future__ import annotations

from types import MappingProxyType

# ---- padding policies (docs/padding-contract.md) ------------------------------------------

#: The six zero-padding policies, in the order reports list them.
POLICIES = ("on_handle", "dst_fused", "dst_stage", "src", "tracked", "user")
#: What a library, a Graph or the JIT uses when nobody names a policy.
DEFAULT_POLICY = "dst_fused"

# ---- post-ops ----------------------------------------------------------------------------------

#: An eltwise op's (and an eltwise post-op's) parameters when a spec leaves them out.
ELTWISE_DEFAULTS = MappingProxyType({"algorithm": "relu", "alpha": 0.0, "beta": 0.0})
#: Each post-op kind and the defaults of its parameters: what a chain means when a field is
#: left out. Two spellings of one chain must build (and cache) as one kernel.
POST_OP_DEFAULTS = MappingProxyType({"bias": MappingProxyType({}),
                                     "eltwise": ELTWISE_DEFAULTS,
                                     "sum": MappingProxyType({"scale": 1.0})})

# ---- stage names: the TE stages (TIR blocks) the generator makes and the rules look up --------

ACC = "acc"     #: the reduction of a convolution, matmul or pooling, before its epilogue
DST = "dst"     #: the stage that writes the destination (epilogue, cast, padding store)
#: softmax's row statistics and exponentials, in the order they are computed before ``DST``
MAX, EXP, SUM, NORM = "max", "exp", "sum", "norm"
SOFTMAX_STAGES = (MAX, EXP, SUM, NORM)

# ---- attributes of generated functions -----------------------------------------------------

#: The PrimFunc attribute naming the op a kernel computes: how a schedule rule recognises its ops.
OP_ATTR = "blockpad.op"


def with_defaults(post_op) -> dict:
    """A post-op (a mapping with ``kind``) with its kind's defaults filled in where it leaves
    them out; an unknown kind gets none (its caller rejects it)."""
    return {**POST_OP_DEFAULTS.get(post_op.get("kind"), {}), **post_op}
