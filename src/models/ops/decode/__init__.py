"""One-token decode steps of the hybrid layer as Triton kernels (``kernels``)."""
