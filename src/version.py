"""The package's version: a leaf module, so that any module may record it without importing the
package root (which registers the hybrid classes, ``models.hf``)."""

__version__ = "0.1.0"
