"""qkv: attention and Transformers from first principles.

Layout (data flows one way): attention/ (all attention math) -> layers/ (norms, MLPs,
Transformer blocks) -> models -> generation, training -> pipelines (a model ready to use, one
typed value per kind) -> pretrained, families -> inference (what a name means; ``load``) ->
serve, commands. ARCHITECTURE.md has the whole table; tests/test_import_graph.py enforces it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qkv.version import __version__ as __version__

if TYPE_CHECKING:
    from qkv.pipelines import Loaded


def load(name: str | os.PathLike[str], *, path: str | os.PathLike[str] | None = None,
         **kwargs: Any) -> Loaded:
    """Open a model by name or path, typed by its kind (:mod:`qkv.pipelines`):

    - ``"minilm"``, ``"smollm2"``: the bundled models (a ``SentenceEncoder``, a ``CausalLM``);
    - a ``.gguf`` file (llama.cpp) or a Hugging Face checkpoint folder, built by its
      architecture: decoders -> ``CausalLM``, bert -> ``SentenceEncoder``;
    - a run directory from ``qkv train``: a GPT run as a ``CausalLM`` (stopping at the run's
      ``<|endoftext|>``), a ViT run as an ``ImageClassifier``, a seq2seq run as a
      ``Translator``, a captioner run as an ``ImageCaptioner``.

    A bundled name always means the bundled model, never a folder of that name: give
    ``"./smollm2"`` for the folder (:mod:`qkv.inference.resolve` has the whole rule).
    Keyword arguments are :func:`qkv.inference.open_model`'s (``device``, ``weights``,
    ``dtype``, ``cache``); ``path``: read a bundled model's files from there instead of its
    installed asset.
    """
    from qkv.inference import open_model, resolve

    if path is None:
        return open_model(resolve(name), **kwargs)
    if not (isinstance(name, str) and name in _bundled()):
        raise ValueError("path= is for the named models; give the run directory, file or folder itself: "
                         "qkv.load(path)")
    from dataclasses import replace

    ref = resolve(name)
    return open_model(replace(ref, path=Path(path)), **kwargs)


def show(model: Any, text: str, **kwargs: Any) -> Any:
    """The lens's views of ``model`` reading ``text``, inline in a notebook (standalone SVG, no
    JavaScript, nothing fetched): see :func:`qkv.notebook.show`."""
    from qkv.notebook import show as _show

    return _show(model, text, **kwargs)


def _bundled() -> tuple[str, ...]:
    from qkv.inference import bundled_names

    return bundled_names()
