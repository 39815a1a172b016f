"""Opening a model: ``open_model(ref, device=, weights=, dtype=) -> Loaded``, one typed value
per kind (:mod:`qkv.pipelines`), whatever the model was read from.

    ref = resolve("smollm2")                 # or a run directory, a .gguf file, a HF folder
    lm = open_model(ref, weights="int8")     # a CausalLM: stream(), generate(), its attention

How a decoder holds its weights is decided by :meth:`~qkv.pipelines.CausalLM.set_weights`
alone (the same rule for runs, GGUF files and Hugging Face folders): ``weights`` when given,
else ``dtype`` (a cast), else ``"auto"`` (a GGUF's own 4-bit groups where it is stored so,
float32 otherwise). Encoders take ``dtype`` only; the other kinds neither.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import torch

from qkv.assets import close_names
from qkv.errors import UnknownModelError
from qkv.inference.resolve import ModelRef, bundled_names, resolve
from qkv.pipelines import WEIGHTS, CausalLM, Kind, Loaded, SentenceEncoder, Weights
from qkv.pipelines.text import weights_dtype


def nearby_runs(text: str) -> list[str]:
    """Model folders near what a user typed, as they would type them: the folders holding a
    config.json beside ``text`` (in its parent folder, else the current one) and in ./runs."""
    typed_parent = os.path.dirname(text)
    places = dict.fromkeys([typed_parent, "runs"])
    found = []
    for place in places:
        folder = Path(place or ".")
        try:
            children = sorted(folder.iterdir()) if folder.is_dir() else []
        except OSError:
            continue
        found += [os.path.join(place, c.name) if place else c.name for c in children[:500]
                  if (c / "config.json").is_file()]
    return found


def resolve_model(name_or_path: str | os.PathLike[str]) -> ModelRef:
    """:func:`~qkv.inference.resolve.resolve`, with a misspelt name (nothing at that path)
    answered by the closest of the bundled models and the run folders nearby ("'smolm2' is no
    model here: did you mean smollm2? ..."), as one line; other errors unchanged."""
    try:
        return resolve(name_or_path)
    except UnknownModelError:
        text = os.fspath(name_or_path)
        if os.path.lexists(text):  # something is there, not a misspelling: resolve's own reason
            raise
        # the last part of the name against the last part of each candidate (a shared folder
        # prefix would make every run look close), shown as the user would type it
        choices = dict.fromkeys(bundled_names())
        for path in nearby_runs(text):
            choices.setdefault(os.path.basename(path), path)
        word = os.path.basename(text.rstrip("/\\")) or text
        close = close_names(word, choices, n=1)
        if not close:
            raise
        hint = choices[close[0]] or close[0]
        raise UnknownModelError(f"{text!r} is no model here: did you mean {hint}? (bundled: "
                                f"{', '.join(bundled_names())}; or a run directory, a Hugging Face folder or "
                                "a .gguf file)") from None


def open_model(ref: ModelRef | str | os.PathLike[str], *, device: str = "cpu",
               weights: Weights | None = None, dtype: str | torch.dtype | None = None,
               cache: bool = True, kinds: tuple[Kind, ...] | None = None,
               family: str | None = None) -> Loaded:
    """The model ``ref`` names (resolved first if it is a name or path), on ``device``.

    Args:
        weights: decoders only: "auto" | "fp32" | "bf16" | "int8" | "q4" (see
            :meth:`~qkv.pipelines.CausalLM.quantize`).
        dtype: "float32" (exact to the reference) or "bfloat16"; decoders and encoders.
        cache: reuse (and store) a GGUF's conversion (:mod:`qkv.pretrained.cache`).
        kinds: the kinds the caller can use; another kind is one line, checked before loading.
        family: the one model family the caller reads (``qkv caption`` reads captioner runs);
            anything else is one line, checked before loading.

    Raises:
        ValueError: one line, for options the model cannot take; and what :func:`resolve` and
            the readers raise for names, files and runs.
    """
    from qkv.device import check_device

    check_device(device)
    ref = ref if isinstance(ref, ModelRef) else resolve_model(ref)
    if kinds is not None and ref.kind not in kinds:
        if ref.source == "gguf":  # the file's architecture, in the words its reader uses
            from qkv.inference.resolve import gguf_architecture
            from qkv.pretrained.gguf_models import GGUF_DECODERS, GGUF_ENCODERS, check_architecture

            check_architecture(ref.path, gguf_architecture(ref.path),
                               GGUF_DECODERS if "decoder" in kinds else GGUF_ENCODERS)
        wanted = " or ".join(_KIND_PHRASES[k] for k in kinds)
        raise ValueError(f"{ref.name} is {ref.description}, not {wanted}")
    if family is not None and ref.family != family:
        raise ValueError(f"{ref.name} is {ref.description}; give a run directory of `qkv train {family}`")
    _check_options(ref, weights, dtype)  # before anything loads
    if ref.kind == "decoder" and weights in (None, "auto", "q4", "int8") and device == "cpu":
        from qkv.kernels import prepare

        prepare()  # qkv's quantised kernels: compiled (once per machine) while the model loads
    loaded = _read(ref, device, cache)
    if isinstance(loaded, CausalLM):
        loaded.model.to(device)
        loaded = loaded.set_weights(weights, dtype)
    elif isinstance(loaded, SentenceEncoder):
        loaded.model.to(device=device, dtype=weights_dtype(dtype or "float32"))
    _return_freed_heap()
    return loaded


def _return_freed_heap() -> None:
    """Hand the memory a load freed back to the system. Reading a GGUF and quantising it
    allocate float matrices and free them again; glibc keeps freed heap resident, so a process
    held ~1.7x the memory it used after ``qkv.load("smollm2")`` (895 MB, 517 MB returned here) and
    3.5x after a 695 MB GGUF (5.8 GB, 1.6 GB returned), a server or a class's processes each.
    Nothing where the C library has no ``malloc_trim`` (not glibc)."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return
    trim(0)


def _check_options(ref: ModelRef, weights: Weights | None, dtype: str | torch.dtype | None) -> None:
    """The precision options a model of ``ref``'s kind can take: weights for decoders, dtype for
    decoders and encoders, neither for the other kinds; ValueError (one line) otherwise."""
    if dtype is not None:
        weights_dtype(dtype)
    if weights is not None and weights not in WEIGHTS:
        raise ValueError(f"weights must be one of {', '.join(WEIGHTS)}, got {weights!r}")
    if ref.kind == "encoder" and weights is not None:
        name = ref.name if ref.source == "bundled" else ref.path.name
        raise ValueError(f"weights= is for decoders; {name} is an encoder: give dtype=")
    if ref.kind not in ("encoder", "decoder") and (dtype is not None or weights is not None):
        raise ValueError(f"dtype= and weights= are for GPT runs and decoders; {ref.name} is a {ref.family} "
                         "run: cast its .model instead")


_KIND_PHRASES: dict[Kind, str] = {"encoder": "a sentence encoder", "decoder": "a language model",
                                  "image": "an image model", "seq2seq": "a seq2seq model"}


def _read(ref: ModelRef, device: str, cache: bool) -> Loaded:
    """The model as its reader builds it (float32; runs already on ``device``)."""
    if ref.source == "run":
        from qkv.families import get_family

        return get_family(str(ref.family)).load(ref.path, device)
    if ref.source == "bundled":
        from qkv.pretrained import load_bundled

        return load_bundled(ref.name, str(ref.path), cache=cache)
    if ref.source == "gguf":
        from qkv.pretrained.gguf_models import load_gguf

        return load_gguf(ref.path, cache=cache)
    from qkv.pretrained.hf import load_hf_folder

    return load_hf_folder(ref.path)
