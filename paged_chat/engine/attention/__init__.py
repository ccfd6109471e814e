"""Paged attention backends: plain torch (CPU and GPU reference) and Triton kernels (CUDA)."""
