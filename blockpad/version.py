"""The package version, in a module of its own: the JIT's fingerprint reads it without importing
the package's top level (which imports the JIT)."""

__version__ = "0.1.0"
