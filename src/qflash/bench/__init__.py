"""Benchmarks: qflash next to its peers, timed on the GPU."""
