"""qkv's version, in a module of its own that imports nothing: the training lifecycle records it
in every run's config.json without importing the package root (whose ``load`` reaches up to the
inference layer)."""

__version__ = "0.1.0"
