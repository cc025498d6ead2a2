"""The package version, in a module of its own: the JIT's fingerprint reads it without importing
the package's top level (which imports the JIT). Beside it, the one list of the top-level modules
whose source decides what a build emits besides ``codegen/`` and ``schedules/``: the build's
``code_digest`` and the JIT cache's ``fingerprint`` both hash them (a change to, say, the
vocabulary's post-op defaults must invalidate cached kernels and recorded failures alike)."""

__version__ = "0.1.0"

GENERATOR_MODULES = ("channel_blocks", "errors", "layout", "machine", "manifest", "numpy_conv",
                     "qlinear", "vocabulary", "winograd")
