"""The errors a user causes by what they ask a model, shared by every layer that can raise them
(a top-level helper: imports nothing of qkv).

The command line prints each as one line with exit code 2; the server answers 404
(:class:`UnknownModelError`) or 422 (:class:`InputError`). Other user errors keep their own
homes: ``PretrainedFormatError`` (a damaged checkpoint file), ``CheckpointError`` (a damaged
run), ``AssetMissingError`` (a package not installed).
"""

from __future__ import annotations


class UnknownModelError(ValueError):
    """A name that is neither a bundled model nor a path to a model (run, GGUF, Hugging Face folder)."""


class InputError(ValueError):
    """Input the model cannot take: empty text, an image for a text model, a layer it does not have..."""
