"""Every error blockpad raises on purpose derives from BlockpadError; its one warning is
``FallbackWarning``.

The subclasses also derive from the builtin a Python user would catch for the same mistake
(ValueError for a bad value, TypeError for a wrong kind of object), so existing handlers work.
"""


class BlockpadError(Exception):
    """Base of all blockpad errors."""


class FallbackWarning(UserWarning):
    """An op of a ``bp.Graph`` found no kernel in any layout and runs its numpy reference:
    right, and far slower (the plan's ``fallbacks`` list it too)."""


class LayoutError(BlockpadError, ValueError):
    """A layout tag, shape, padding or stride set that cannot describe a tensor."""


class ArgumentError(BlockpadError, ValueError):
    """A kernel argument that does not match the kernel's signature."""


class SpecError(BlockpadError, ValueError):
    """A build spec that cannot be built."""


class BuildError(BlockpadError, RuntimeError):
    """Code generation or compilation failed."""


class LoadError(BlockpadError, RuntimeError):
    """A built library that cannot be loaded here (missing, corrupt, stale, or wrong machine)."""


class MissingCPUFeatureError(LoadError):
    """The library needs instructions this machine does not have."""
