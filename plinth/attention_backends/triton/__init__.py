"""Triton paged attention for CUDA (NVIDIA and ROCm) and XPU devices.

Importing this package does not import Triton; :mod:`.backend` imports the kernels on first use.
"""
