"""hedgecats: linear + sliding-window attention hybrids from pretrained Transformers.

Importing it registers the hybrid model classes with transformers' ``AutoConfig`` and
``AutoModelForCausalLM`` (``hedgecats.models.hf``), so that saved hybrids load with
``AutoModelForCausalLM.from_pretrained``.
"""

__version__ = "0.1.0"

from .models.hf import register as _register

_register()
