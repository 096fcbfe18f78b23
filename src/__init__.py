"""hedgecats: linear + sliding-window attention hybrids from pretrained Transformers.

Importing it registers the hybrid model classes with transformers' ``AutoConfig`` and
``AutoModelForCausalLM`` (``hedgecats.models.hf``), so that saved hybrids load with
``AutoModelForCausalLM.from_pretrained``.
"""

from .models.hf import register as _register
from .version import __version__

__all__ = ["__version__"]

_register()
