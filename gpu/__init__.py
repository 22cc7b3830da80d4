"""The Triton and Gluon programs of the decode step: each one's torch reference, which is also the CPU path,
lives where its math is read (kernels.py, quant.py, prefetch.py)."""
