"""Stage 1's attention-transfer objectives: ``losses`` (the objectives), ``reference`` (their
losses in PyTorch), ``xent`` and ``mse`` (the losses' Triton kernels), ``dispatch`` (whether
the kernels take a call)."""
