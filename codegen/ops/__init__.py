"""Operators, each declared once over logical indices and instantiated for any layouts.

``OPS`` is the table the build spec is checked against: which arguments of an op are tensors
(each given a layout in the spec) and the function that declares the kernel."""

from dataclasses import dataclass
from typing import Callable

from .reorder import reorder, zero_pad


@dataclass(frozen=True)
class Op:
    tensors: tuple      # argument names that take a layout, in call order
    make: Callable      # make(*layouts, name=...) -> Kernel


OPS = {
    "reorder": Op(("src", "dst"), reorder),
    "zero_pad": Op(("layout",), zero_pad),
}
