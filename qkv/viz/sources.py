"""Where attention pictures come from: a model name or run directory in, attention weights out.

``qkv attend`` and ``qkv serve`` share this module, so the command line and the web page show
the same numbers for the same input:

    src = load_source("minilm")                    # or "smollm2", or a run directory
    att = text_attention(src, "The cat sat.")      # tokens, weights (L, H, T, T), notes
    img = image_attention(vit_src, png_bytes)      # ViT / captioner runs: maps over the grid
    ali = alignment(seq2seq_src, "8 août 1977")    # seq2seq runs: output x input
    ids, notes = encode_text(gpt_src, "Once", keep="last")
    for step in generate_steps(gpt_src, ids, 20): ...      # each new token and its attention

Every weight comes from the models' own ``backend="reference"`` forward pass (the explicit
softmax(QKᵀ/√d), which can return its weights); nothing here recomputes attention.

Shapes: L layers, H heads, T tokens (queries), S keys, g grid cells per side.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor, nn

from qkv.families.base import Kind

PRETRAINED_KINDS: dict[str, Kind] = {"minilm": "encoder", "smollm2": "decoder",
                                     # a Hugging Face checkpoint folder, by what it builds
                                     "hf-encoder": "encoder", "hf-decoder": "decoder",
                                     # a GGUF file: a decoder (llama, qwen2, gpt2, gemma), bert
                                     "gguf": "decoder", "gguf-encoder": "encoder"}
MAX_TOKENS = 512  # attention maps over more tokens than this are unreadable (and (L,H,T,T) is big)
ATTENTION_BYTES = 2 * 1024**3  # the most memory the (L, H, T, T) float32 maps of one text may take


def kind_of(family: str) -> Kind:
    """What a pretrained model or a run family reads and shows (see :mod:`qkv.families`)."""
    from qkv.families import get_family

    return PRETRAINED_KINDS.get(family) or get_family(family).kind


class UnknownModelError(ValueError):
    """A name that is neither an installed pretrained model nor a run directory."""


class InputError(ValueError):
    """Input the model cannot take: empty text, an image for a text model, unknown characters..."""


@dataclass
class Source:
    """A loaded model with what it needs to read input and label its attention.

    ``loaded``: a trained run as its family loads it (:class:`qkv.families.base.Loaded`: the
    ViT's classes and normalisation, the vocabularies of a seq2seq or captioner run); None for
    a pretrained model. ``stop_ids``: ids that end a generation (SmolLM2's end of turn);
    ``serial``: tells a reloaded model's cached results apart (the server's).
    """

    name: str
    family: str
    model: nn.Module
    tokenizer: Any = None
    loaded: Any = None
    stop_ids: tuple[int, ...] = ()
    serial: int = 0

    @property
    def kind(self) -> Kind:
        return kind_of(self.family)

    def _shape(self) -> tuple[int, int, int]:
        if self.loaded is None:  # a pretrained text model
            cfg = self.model.cfg
            return cfg.n_layers, cfg.n_heads, cfg.max_seq_len
        from qkv.families import get_family

        return get_family(self.family).shape(self.loaded)

    @property
    def input(self) -> Literal["text", "image"]:
        return "image" if self.kind == "image" else "text"

    @property
    def n_layers(self) -> int:
        """Layers with attention weights to choose from (1: one alignment, or a captioner)."""
        return self._shape()[0]

    @property
    def n_heads(self) -> int:
        return self._shape()[1]

    @property
    def context(self) -> int:
        """The most tokens (characters for seq2seq, grid cells for images) read at once."""
        return self._shape()[2]


# --------------------------------------------------------------------------- loading


def pretrained_names() -> tuple[str, ...]:
    from qkv.pretrained import PRETRAINED

    return tuple(PRETRAINED)


def run_family(run_dir: Path) -> str | None:
    """The ``family`` a run directory's config.json names (None if it is not a qkv run)."""
    from qkv.training import checkpoint as ckpt

    try:
        cfg = ckpt.read_json(Path(run_dir) / "config.json")
    except ckpt.CheckpointError:
        return None
    from qkv.families import family_names

    family = cfg.get("family") if isinstance(cfg, dict) else None
    return family if family in family_names() else None


def load_source(name_or_path: str | os.PathLike[str], display_name: str | None = None) -> Source:
    """A pretrained model by name (``minilm``, ``smollm2``) or a run directory from ``qkv train``.

    A directory wins over a pretrained name (as in ``qkv generate``). Raises UnknownModelError
    for anything else, CheckpointError for a damaged run, AssetMissingError for a model that
    is not installed.
    """
    text = os.fspath(name_or_path)
    path = Path(text)
    name = display_name or text
    if text in pretrained_names() and not path.is_dir():
        return load_pretrained(text)
    if text.lower().endswith(".gguf") and path.is_file():
        import qkv

        family = gguf_family(path)
        pipe = qkv.load(text) if family == "gguf-encoder" else qkv.load(text, weights="fp32")
        return Source(name, family, pipe.model.eval(), pipe.tokenizer,
                      stop_ids=tuple(getattr(pipe, "stop_ids", ())))
    if not path.is_dir():
        raise UnknownModelError(f"{text!r} is neither a pretrained model ({', '.join(pretrained_names())}) "
                                "nor a run directory from `qkv train`, a Hugging Face checkpoint folder "
                                "or a .gguf file")
    family = run_family(path)
    if family is None and hf_family(path) is not None:
        return load_hf_folder_source(path, name)
    if family is None:
        from qkv.training import checkpoint as ckpt

        ckpt.read_json(path / "config.json")  # names a missing or damaged config.json
        from qkv.families import family_names

        raise UnknownModelError(f"{path} is not a run of {', '.join(family_names())}; pass a run "
                                "directory from `qkv train`")
    return _load_run(path, family, name)


def gguf_family(path: Path) -> str:
    """``gguf-encoder`` for a GGUF of an encoder architecture (bert), else ``gguf`` (a decoder;
    a damaged file or an unsupported architecture is said when it loads). Remembered per file
    version: reading a file's metadata takes seconds for a large vocabulary, and the server
    asks on every model list."""
    try:
        st = Path(path).stat()
    except OSError:
        return "gguf"
    return _gguf_family(str(Path(path).resolve()), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=256)
def _gguf_family(path: str, size: int, mtime_ns: int) -> str:
    from qkv.pretrained.gguf_file import PretrainedFormatError, read_gguf
    from qkv.pretrained.gguf_models import GGUF_ENCODERS

    try:
        arch = read_gguf(path).metadata.get("general.architecture")
    except PretrainedFormatError:
        return "gguf"
    return "gguf-encoder" if arch in GGUF_ENCODERS else "gguf"


def hf_family(folder: Path) -> str | None:
    """``hf-encoder`` (bert) or ``hf-decoder`` for a Hugging Face checkpoint folder (a
    config.json with a ``model_type`` and no qkv ``family``); None for anything else. Whether
    qkv supports the architecture is said when it loads."""
    from qkv.pretrained.hf import hf_model_type

    kind = hf_model_type(folder)
    return None if kind is None else "hf-encoder" if kind == "bert" else "hf-decoder"


def load_hf_folder_source(folder: Path, name: str) -> Source:
    """A Hugging Face checkpoint folder (``config.json`` with a ``model_type``), built by
    :func:`qkv.load` into qkv's own GPT or Encoder."""
    import qkv
    from qkv.pretrained import CausalLM

    pipe = qkv.load(str(folder))
    family = "hf-decoder" if isinstance(pipe, CausalLM) else "hf-encoder"
    return Source(name, family, pipe.model.eval(), pipe.tokenizer,
                  stop_ids=tuple(getattr(pipe, "stop_ids", ())))


def load_pretrained(name: str) -> Source:
    """An installed pretrained model by name (never a folder of that name)."""
    import qkv

    pipe = qkv.load(name)
    stops = tuple(getattr(pipe, "stop_ids", ()))  # SmolLM2's end of text / end of turn
    return Source(name, name, pipe.model.eval(), pipe.tokenizer, stop_ids=stops)


def _load_run(path: Path, family: str, name: str) -> Source:
    from qkv.families import get_family
    from qkv.tokenizers import stop_ids

    loaded = get_family(family).load(path)
    tok = getattr(loaded, "tokenizer", None)
    stops = stop_ids(tok)  # a BPE run's <|endoftext|>
    return Source(name, family, loaded.model, tok, loaded, stop_ids=stops)


def _require(src: Source, kinds: tuple[Kind, ...], what: str) -> None:
    if src.kind not in kinds:
        takes = "an image" if src.input == "image" else "text"
        raise InputError(f"{src.name} is a {src.family} model: it takes {takes}, not {what}")


# --------------------------------------------------------------------------- text models


@dataclass
class TextAttention:
    """Self-attention of every layer and head over one text.

    tokens: T labels (each token decoded alone). weights: (L, H, T, T) float32, row = query,
    column = key; each row sums to 1 (causal models: zero above the diagonal).
    notes: what was changed about the input (truncation), to show the user.
    """

    tokens: list[str]
    ids: list[int]
    weights: Tensor
    notes: list[str]
    causal: bool


def encode_text(src: Source, text: str, max_tokens: int = MAX_TOKENS,
                keep: Literal["first", "last"] = "first") -> tuple[list[int], list[str]]:
    """Token ids of ``text`` for a text model, truncated to its context and to ``max_tokens``
    (keeping the first tokens, or the last: a prompt to continue), with a note saying so;
    InputError for empty text or characters the model cannot read."""
    _require(src, ("encoder", "decoder"), "text")
    if not text.strip():
        raise InputError("the text is empty; type some text to see its attention")
    try:
        ids = src.tokenizer.encode(text)
    except ValueError as e:
        raise InputError(str(e)) from None
    if not ids:
        raise InputError("the text encodes to no tokens; type some text")
    limit = max(1, min(src.context, max_tokens))
    notes = []
    if len(ids) > limit:
        why = (f"the model's context is {src.context} tokens" if limit == src.context
               else f"the limit here is {limit} tokens")
        notes.append(f"truncated to the {keep} {limit} of {len(ids)} tokens ({why})")
        if src.kind == "encoder":  # keep [CLS] ... [SEP], as BERT's own truncation does
            ids = ids[: limit - 1] + ids[-1:]
        else:
            ids = ids[:limit] if keep == "first" else ids[-limit:]
    return ids, notes


def token_labels(src: Source, ids: list[int]) -> list[str]:
    """Each token decoded on its own: 'the', '##ing', ' upon', '[CLS]', '\\n'."""
    return [src.tokenizer.decode([i]) for i in ids]


def check_attention_size(src: Source, n_tokens: int) -> None:
    """InputError, naming the memory, when the (L, H, T, T) float32 attention maps of
    ``n_tokens`` tokens would take more than ``ATTENTION_BYTES``."""
    L, H, T = src.n_layers, src.n_heads, n_tokens
    need = L * H * T * T * 4
    if need > ATTENTION_BYTES:
        fits = int((ATTENTION_BYTES / (L * H * 4)) ** 0.5)
        raise InputError(f"the attention maps of {T} tokens would need {need / 1e9:.1f} GB ({L} layers x "
                         f"{H} heads x {T}x{T} weights x 4 bytes), more than the "
                         f"{ATTENTION_BYTES / 2**30:.0f} GiB allowed: use --max-tokens {fits} or fewer")


@torch.inference_mode()
def text_attention(src: Source, text: str, max_tokens: int = MAX_TOKENS) -> TextAttention:
    """Every layer's and head's attention over ``text`` (MiniLM, SmolLM2, GPT runs)."""
    ids, notes = encode_text(src, text, max_tokens)
    check_attention_size(src, len(ids))
    device = next(src.model.parameters()).device
    x = torch.tensor([ids], dtype=torch.long, device=device)
    out = src.model(x, backend="reference", return_weights=True)
    weights = torch.stack([w[0] for w in out.weights]).float().cpu()  # (L, H, T, T)
    return TextAttention(token_labels(src, ids), ids, weights, notes, src.kind == "decoder")


@dataclass
class GenerationStep:
    """One generated token and the attention of the position that chose it (the last query
    of that step) over every token before it: (S,), in the requested layer and head (or the
    mean over heads)."""

    id: int
    token: str
    weights: Tensor


@torch.inference_mode()
def generate_steps(src: Source, prompt_ids: list[int], max_new_tokens: int, *, layer: int = -1,
                   head: int | None = None, temperature: float = 0.0, top_k: int | None = None,
                   seed: int | None = None) -> Iterator[GenerationStep]:
    """Sample up to ``max_new_tokens`` tokens after ``prompt_ids`` with a KV cache, yielding
    each token with its attention row; stops at the context's end (and at SmolLM2's end of
    turn). Use :func:`encode_text` for the prompt."""
    from qkv.generation import generate
    from qkv.generation.decode import decode_after
    from qkv.generation.sampling import make_generator

    _require(src, ("decoder",), "a prompt to continue")
    layer, head = check_layer_head(src, layer, head)
    device = next(src.model.parameters()).device
    n_new = min(max_new_tokens, src.context - len(prompt_ids))  # never past the context's end
    x = torch.tensor([prompt_ids], dtype=torch.long, device=device)
    seen = list(prompt_ids)
    for nxt, weights in generate(src.model, x, max(n_new, 0), temperature=temperature, top_k=top_k,
                                 generator=make_generator(device, seed), stop_ids=src.stop_ids,
                                 return_weights=True):
        w = weights[layer][0].float()  # (H, S): the last position's row
        row = w.mean(0) if head is None else w[head]
        tid = int(nxt[0])
        # the token as it reads after what came before (a SentencePiece "▁the" keeps its space)
        yield GenerationStep(tid, decode_after(src.tokenizer.decode, seen, [tid]), row.cpu())
        seen.append(tid)


def check_layer_head(src: Source, layer: int | None, head: int | None,
                     names: tuple[str, str] = ("layer", "head")) -> tuple[int, int | None]:
    """(layer in [0, L) (None: the last), head in [0, H) or None); negative indices count from
    the end. InputError naming the valid range (``names``: how the caller spells the two)."""
    L, H = src.n_layers, src.n_heads
    layer = L - 1 if layer is None else layer
    if not -L <= layer < L:
        raise InputError(f"{names[0]} must be in [{-L}, {L - 1}] for this {L}-layer model, got {layer}")
    if head is not None and not -H <= head < H:
        raise InputError(f"{names[1]} must be in [{-H}, {H - 1}] for this {H}-head model, got {head}")
    return layer % L, None if head is None else head % H


# --------------------------------------------------------------------------- image models


@dataclass
class ImageAttention:
    """Attention over an image's grid of patches (ViT) or CNN cells (captioner).

    image: uint8 (C, size, size), what the model saw. maps: [(caption, (g, g) weights)].
    title: the prediction (ViT) or the caption. details: family-specific numbers.
    """

    image: Tensor
    grid: int
    maps: list[tuple[str, Tensor]]
    title: str
    notes: list[str]
    details: dict[str, Any] = field(default_factory=dict)


def read_model_image(src: Source, image: str | os.PathLike[str] | bytes,
                     max_pixels: int | None = None) -> tuple[Tensor, list[str]]:
    """A file path or the bytes of an upload -> uint8 (C, size, size) as the model reads it."""
    from qkv.data.images import read_image

    _require(src, ("image",), "text")
    cfg = src.model.cfg
    return read_image(image, cfg.image_size, cfg.channels, max_pixels=max_pixels)


@torch.no_grad()
def image_attention(src: Source, image: str | os.PathLike[str] | bytes | Tensor, layer: int | None = None,
                    max_pixels: int | None = None, layer_name: str = "layer") -> ImageAttention:
    """ViT runs: the read-out's attention in each head of ``layer`` (default: the last) and the
    rollout through all layers (Abnar & Zuidema 2020). Captioner runs: the greedy caption and
    the attention of every word over the grid (Xu et al. 2015).

    ``image``: a file, its bytes, or uint8 (C, size, size) from :func:`read_model_image`.
    """
    if isinstance(image, Tensor):
        _require(src, ("image",), "text")
        x, notes = image, []
    else:
        x, notes = read_model_image(src, image, max_pixels)
    from qkv.families import get_family

    maps, title, details = get_family(src.family).image_attention(src, x, layer, layer_name)
    return ImageAttention(x, src.model.cfg.grid, maps, title, notes, details)


# --------------------------------------------------------------------------- seq2seq


@dataclass
class Alignment:
    """A seq2seq run's attention: every output character (rows) over the input characters
    (columns), (T_out, S_in) — Bahdanau et al. 2015, Fig. 3. For Transformer runs: the last
    decoder layer's cross-attention, averaged over heads."""

    source: list[str]
    output: list[str]
    weights: Tensor
    text: str
    notes: list[str]


def alignment(src: Source, text: str) -> Alignment:
    """Translate ``text`` greedily and return the alignment matrix; InputError for empty
    input and for runs without attention (``--arch rnn-noattn``)."""
    from qkv.data.dates import normalize_source
    from qkv.families.seq2seq import decode_texts

    _require(src, ("seq2seq",), "an image")
    cfg, vocab_in, vocab_out = src.loaded.cfg, src.loaded.src, src.loaded.tgt
    if cfg.arch == "rnn-noattn":
        raise InputError(f"{src.name} is arch rnn-noattn: it has no attention to show")
    t = normalize_source(text)
    if not t:
        raise InputError("the text is empty; type a date such as '8 août 1977'")
    notes = []
    if len(t) > cfg.max_src_len:
        notes.append(f"truncated to the first {cfg.max_src_len} of {len(t)} characters (the longest "
                     "input this model was trained on)")
        t = t[: cfg.max_src_len]
    unknown = vocab_in.unknown(t)
    if unknown:
        notes.append("characters never seen in training, read as unknown: "
                     + " ".join(repr(c) for c in unknown))
    with torch.no_grad():
        outs, weights = decode_texts(src.model, cfg, vocab_in, vocab_out, [t])
    if not outs[0]:
        raise InputError("the model produced an empty output; nothing to show")
    w = weights[0]
    assert w is not None
    return Alignment(list(t), list(outs[0]), w.float().cpu(), outs[0], notes)
