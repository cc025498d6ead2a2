"""Reports that run real kernels and print measured tables (``blockpad report ...``)."""
