"""Models ready to use: one typed value per kind of model, whatever it was loaded from.

    CausalLM          a decoder: GPT runs, SmolLM2, Llama / Qwen2 / GPT-2 / Gemma files and folders
    SentenceEncoder   an encoder: MiniLM, BERT folders and GGUFs
    ImageClassifier   a ViT run
    Translator        a seq2seq run
    ImageCaptioner    a captioner run

Each holds its model, what reads its input (tokenizer, vocabularies, classes, normalisation),
its shape (``n_layers``, ``n_heads``, ``context``) and ``kind`` (:mod:`qkv.pipelines.kinds`),
and offers its inference as methods (``stream``, ``embed``, ``classify``, ``translate``,
``caption``) and its attention as values. Nothing here reads a file or decides what a name
means: :mod:`qkv.inference` opens models (``qkv.load``), :mod:`qkv.families` and
:mod:`qkv.pretrained` build these values from run directories and foreign checkpoints.
"""

from qkv.pipelines.captioning import ImageCaptioner
from qkv.pipelines.images import ImageAttention, ImageClassifier
from qkv.pipelines.kinds import KINDS, Kind, check_layer_head
from qkv.pipelines.text import WEIGHTS, CausalLM, SentenceEncoder, StreamStats, Weights
from qkv.pipelines.translation import Alignment, Translator

Loaded = CausalLM | SentenceEncoder | ImageClassifier | Translator | ImageCaptioner

__all__ = ["KINDS", "WEIGHTS", "Alignment", "CausalLM", "ImageAttention", "ImageCaptioner",
           "ImageClassifier", "Kind", "Loaded", "SentenceEncoder", "StreamStats", "Translator",
           "Weights", "check_layer_head"]
