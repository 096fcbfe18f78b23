"""hedgecats: linear + sliding-window attention hybrids from pretrained Transformers."""

__version__ = "0.1.0"
