"""qkv: attention and Transformers from first principles.

Layout (data flows one way): attention/ (all attention math) -> layers/ (norms, MLPs,
Transformer blocks) -> models -> training -> generation / visualisation. See DESIGN.md.
"""

from __future__ import annotations

import os
from typing import Any

from qkv.version import __version__ as __version__


def load(name: str | os.PathLike[str], **kwargs: Any) -> Any:
    """Load a model by name or path, built by its architecture:

    - ``"minilm"``, ``"smollm2"``: the bundled pretrained models;
    - a ``.gguf`` file (llama.cpp) or a Hugging Face checkpoint folder: see
      :func:`qkv.pretrained.load` (decoders -> ``CausalLM``, bert -> ``SentenceEncoder``);
    - a run directory from ``qkv train``: the model ``qkv generate`` / ``qkv attend`` load from
      it. A GPT run gives a ``CausalLM`` (``generate``/``stream``/``quantize``, stopping at the
      run's ``<|endoftext|>``); a run of another family (vit, seq2seq, captioner, ...) gives
      that family's loaded run (``.model`` and what it needs: vocabularies, classes).

    Keyword arguments are :func:`qkv.pretrained.load`'s (``dtype``, ``weights``, ``device``,
    ...); a run of another family than GPT takes ``device`` only. A pretrained name always means
    the pretrained model, never a folder of that name: give ``"./smollm2"`` for the folder.
    """
    from pathlib import Path

    from qkv.pretrained import PRETRAINED
    from qkv.viz.sources import run_family

    path = Path(os.fspath(name))
    # a pretrained name is never a folder of that name (a folder ./minilm is "./minilm")
    family = run_family(path) if path.is_dir() and os.fspath(name) not in PRETRAINED else None
    if family is None and path.is_dir() and os.fspath(name) not in PRETRAINED:
        _check_folder(path)
    if family is None:
        from qkv.pretrained import load as _load

        return _load(os.fspath(name), **kwargs)
    return _load_run(path, family, **kwargs)


def _check_folder(path: Any) -> None:
    """A folder that is neither a qkv run (a known ``family``) nor a Hugging Face checkpoint
    (a ``model_type``): one line saying which of the two its config.json fails to be."""
    import json

    from qkv.families import family_names
    from qkv.pretrained import PretrainedFormatError

    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return  # no or unreadable config.json: the Hugging Face reader says which
    if not isinstance(config, dict) or "model_type" in config:
        return
    if "family" in config:
        raise PretrainedFormatError(f"{path} is a run of family {config['family']!r}, which this qkv does "
                                    f"not know (known: {', '.join(family_names())})")
    raise PretrainedFormatError(f"{path}/config.json names neither a qkv family nor a Hugging Face "
                                "model_type: give a run directory from `qkv train`, a Hugging Face "
                                "checkpoint folder or a .gguf file")


def _load_run(run_dir: Any, family: str, /, *, device: str = "cpu", dtype: Any = None,
              weights: str | None = None, cache: bool = True, **rest: Any) -> Any:
    """``load`` for a qkv run directory of ``family`` (``cache`` has nothing to do: a run is
    read as it is; ``path=`` is for the named models)."""
    from qkv.device import check_device
    from qkv.families import get_family

    if "path" in rest:
        raise ValueError("path= is for the named models; give the run directory itself: qkv.load(run_dir)")
    if rest:
        raise ValueError(f"qkv.load of a run takes device, dtype and weights; not {', '.join(rest)}")
    check_device(device)
    loaded = get_family(family).load(run_dir, device)
    if family != "gpt":
        if dtype is not None or weights is not None:
            raise ValueError(f"dtype= and weights= are for GPT runs and decoders; {run_dir} is a "
                             f"{family} run: cast its .model instead")
        return loaded
    from qkv.pretrained.pipelines import CausalLM
    from qkv.tokenizers import stop_ids

    tok = loaded.tokenizer
    stops = stop_ids(tok)
    lm = CausalLM(run_dir.name, loaded.model.eval(), tok, None, stops,
                  {"name": run_dir.name, "run_dir": str(run_dir), "family": family})
    if weights is not None:
        return lm.quantize(weights)
    return lm.to(dtype) if dtype is not None else lm
