"""One-token decode steps of the hybrid layer as Triton kernels: ``kernels`` (the step),
``dispatch`` (whether it takes a call: ``decode_step``); the reference is the composed step,
``models.cache._step``."""
