"""Pallas (Triton) GPU kernels; on CPU they run in interpret mode."""
