"""Stage 1's attention-transfer objectives: ``losses`` (references and the dispatch),
``xent`` and ``mse`` (their Triton kernels)."""
