"""The Hedgehog feature map as Triton kernels: ``reference`` (the map in PyTorch), ``kernels``
(the kernels and their launches), ``function`` (the autograd Functions, ``DuSlot``),
``dispatch`` (whether the kernels take a call: ``hedgehog_features``)."""
