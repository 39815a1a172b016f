"""Opening models, decided in one place: what a name means (:func:`resolve`, one precedence
rule) and the typed model it opens (:func:`open_model` -> :data:`Loaded`, one value per kind).
``qkv.load``, every command, the server and the pictures open models only through here.

    ref = resolve("smollm2")        # ModelRef: bundled / run / gguf / hf, its kind, its file
    lm = open_model(ref)            # a CausalLM (qkv.pipelines), q4 by default for that file

The layers: :mod:`qkv.pipelines` (the typed models) below :mod:`qkv.families` (runs) and
:mod:`qkv.pretrained` (foreign files), which are below this; :mod:`qkv.viz`, :mod:`qkv.serve`
and :mod:`qkv.commands` above.
"""

from qkv.errors import InputError, UnknownModelError
from qkv.inference.loading import open_model
from qkv.inference.resolve import ModelRef, bundled_names, resolve
from qkv.pipelines import Loaded

__all__ = ["InputError", "Loaded", "ModelRef", "UnknownModelError", "bundled_names", "open_model", "resolve"]
