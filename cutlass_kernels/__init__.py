"""cutlass_kernels."""
