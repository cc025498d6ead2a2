"""Helpers for testing libraries built for machines other than this one.

``blockpad.testing.qemu`` runs the kernels of an aarch64 library (``--target neon``,
``neon-dotprod``) on x86 under qemu-user, through a small C harness (``tvm_run.c``)."""
