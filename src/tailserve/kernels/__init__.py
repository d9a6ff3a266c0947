"""tailserve.kernels: the fused C kernels and their loader, and the oneDNN / OpenMP glue.

The bottom layer: imports nothing of tailserve but errors and user_cache, never a model or a runner.
"""
