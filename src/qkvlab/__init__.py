"""qkvlab: transformers with fewer attention projections."""

__version__ = "0.1.0"
