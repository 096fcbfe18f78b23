"""Hedgehog feature maps as Triton kernels (``kernels``), checked against the PyTorch map."""
