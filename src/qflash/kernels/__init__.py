"""Triton kernels and their launchers. Importing this module imports triton."""
