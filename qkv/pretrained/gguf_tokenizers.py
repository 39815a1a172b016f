"""The tokenizer of a GGUF file, rebuilt from its metadata as a Hugging Face ``tokenizers.Tokenizer``.

A GGUF carries no ``tokenizer.json``. llama.cpp's converter stores the vocabulary as metadata:
``tokenizer.ggml.model`` names the algorithm, ``tokenizer.ggml.tokens`` lists the tokens by id,
``tokenizer.ggml.token_type`` marks each one (1 normal, 2 unknown, 3 control such as <s> or
<|im_start|>, 4 user-defined, 5 unused, 6 byte <0xNN>), and the algorithm's own keys hold the rest.
qkv reads three algorithms (:func:`tokenizer_from_gguf`):

    gpt2   byte-level BPE (SmolLM2, Qwen2, GPT-2 files): the merges are stored
           (``tokenizer.ggml.merges``); GPT-2's pre-tokenisation; control tokens matched whole.
    llama  SentencePiece BPE (Llama-2, TinyLlama, Mistral and CodeLlama files; Gemma's):
           "▁" spells a space inside pieces; a character no piece spells falls back to its
           UTF-8 bytes (<0xNN> tokens). No merges are stored: every piece that is two pieces
           joined is their merge, ranked by the joined piece's score (``tokenizer.ggml.scores``;
           Gemma's by its place in the file, as its scores do not follow its merge order).
           Llama-style files put a "▁" in front of the text (``add_space_prefix``, default true);
           Gemma's do not. <s> / <bos> goes in front (``add_bos_token``, default true).
    bert   WordPiece (all-MiniLM-L6-v2 and other embedding models), stored in llama.cpp's
           "phantom space" spelling and turned back into BERT's ``##`` pieces.

Who reads what: llama.cpp tokenizes with its own code from these keys; transformers rebuilds
gpt2 and llama vocabularies (``AutoTokenizer.from_pretrained(folder, gguf_file=...)``) much as
this module does, and qkv's builders are checked against it (``tests/pretrained/
test_gguf_llama_tokenizer.py``) or against the tokenizer the test wrote into the file
(``test_gguf_bert_gemma.py``: transformers reads no bert GGUF). Where llama.cpp and transformers
split a Llama-style text differently, qkv follows transformers: a text that begins with a space
gets no second "▁" ("▁the", llama.cpp "▁", "▁the"), and text right after a control token
written in the prompt gets no "▁" (llama.cpp adds one).
"""

from __future__ import annotations

from typing import Any

from qkv.pretrained.gguf_file import GGUFFile, PretrainedFormatError
from qkv.tokenizers.hf import HFTokenizer, hf_tokenizers

# llama.cpp's token types (its SentencePiece converter's numbering, used by every vocabulary)
GGUF_TOKEN_NORMAL = 1
GGUF_TOKEN_UNKNOWN = 2
GGUF_TOKEN_CONTROL = 3  # special tokens (<|im_start|>, <bos>, [CLS], ...)
GGUF_TOKEN_USER_DEFINED = 4


def _required(g: GGUFFile, key: str) -> Any:
    if key not in g.metadata:
        raise PretrainedFormatError(f"{g.path}: metadata key {key!r} missing: the file's tokenizer is "
                                    "incomplete")
    return g.metadata[key]


def _token_types(g: GGUFFile, tokens: list[str]) -> list[int]:
    types: list[int] = g.metadata.get("tokenizer.ggml.token_type", [GGUF_TOKEN_NORMAL] * len(tokens))
    if len(types) != len(tokens):
        raise PretrainedFormatError(f"{g.path}: {len(tokens)} tokens but {len(types)} token types")
    return types


def _special(g: GGUFFile, tokens: list[str], keys: tuple[str, ...], default: str) -> str:
    """The token the first ``tokenizer.ggml.<key>`` present names, else ``default`` if the
    vocabulary has it."""
    for key in keys:
        i = g.metadata.get(f"tokenizer.ggml.{key}")
        if isinstance(i, int) and 0 <= i < len(tokens):
            return tokens[i]
    if default not in tokens:
        raise PretrainedFormatError(f"{g.path}: no tokenizer.ggml.{keys[0]} and no {default} token")
    return default


def tokenizer_from_gguf(g: GGUFFile) -> HFTokenizer:
    """The tokenizer stored in GGUF metadata, by ``tokenizer.ggml.model``: "gpt2" byte-level BPE
    (:func:`byte_bpe_from_gguf`), "llama" SentencePiece BPE (:func:`sentencepiece_from_gguf`;
    Gemma's: :func:`gemma_sentencepiece_from_gguf`), "bert" WordPiece (:func:`wordpiece_from_gguf`)."""
    model = g.metadata.get("tokenizer.ggml.model")
    if model == "bert":
        return wordpiece_from_gguf(g)
    if model == "llama":
        if g.metadata.get("general.architecture") == "gemma":
            return gemma_sentencepiece_from_gguf(g)
        return sentencepiece_from_gguf(g)
    if model != "gpt2":
        raise PretrainedFormatError(f"{g.path}: tokenizer model {model!r} unsupported (read: gpt2 "
                                    "byte-level BPE, llama SentencePiece BPE, bert WordPiece)")
    return byte_bpe_from_gguf(g)


def byte_bpe_from_gguf(g: GGUFFile) -> HFTokenizer:
    """Byte-level BPE as a ``tokenizers.Tokenizer``: GPT-2 byte-level pre-tokenisation (no
    prefix space), the stored merges, and the control tokens (<|im_start|>, <|im_end|>, ...)
    matched whole in the text."""
    tk = hf_tokenizers()
    tokens: list[str] = _required(g, "tokenizer.ggml.tokens")
    types = _token_types(g, tokens)
    merges = [tuple(m.split(" ", 1)) for m in _required(g, "tokenizer.ggml.merges")]
    vocab = {t: i for i, t in enumerate(tokens)}
    try:
        tok = tk.Tokenizer(tk.models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    except Exception as e:  # the tokenizers library's own error: a merge of unknown tokens, ...
        raise PretrainedFormatError(f"{g.path}: its BPE tokenizer does not build ({e})") from None
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = tk.decoders.ByteLevel()
    kinds = (GGUF_TOKEN_CONTROL, GGUF_TOKEN_USER_DEFINED)
    special = [tk.AddedToken(t, special=True, normalized=False)
               for t, ty in zip(tokens, types, strict=True) if ty in kinds]
    tok.add_special_tokens(special)
    return HFTokenizer(tok)


def sentencepiece_from_gguf(g: GGUFFile) -> HFTokenizer:
    """A Llama-style SentencePiece BPE (Llama-2, TinyLlama, Mistral, CodeLlama) from GGUF metadata.

    The merges are rebuilt from the vocabulary: each split of a piece into two pieces is a
    merge, ranked by the joined piece's score (higher first; for equal scores the longer left
    half first, then the piece met first in the file), as transformers' GGUF reader ranks them.
    With ``add_space_prefix`` (default true) a "▁" goes in front of the text unless it begins
    with a space already, and the decoder drops it again; <s> goes in front
    (``add_bos_token``, default true), </s> at the end only with ``add_eos_token``.
    """
    tokens: list[str] = _required(g, "tokenizer.ggml.tokens")
    types = _token_types(g, tokens)
    scores = g.metadata.get("tokenizer.ggml.scores")
    if scores is None or len(scores) != len(tokens):
        n = "no" if scores is None else len(scores)
        raise PretrainedFormatError(f"{g.path}: {len(tokens)} SentencePiece tokens but {n} "
                                    "tokenizer.ggml.scores (the merges are ranked by them)")
    vocab = {t: i for i, t in enumerate(tokens)}  # a repeated piece: its last id, as llama.cpp
    score = dict(zip(tokens, scores, strict=True))
    ranked = []  # (-score of the joined piece, -len(left), -len(right), its place, left, right)
    for place, t in enumerate(vocab):
        ranked += [(-score[t], -k, k - len(t), place, t[:k], t[k:]) for k in range(1, len(t))
                   if t[:k] in vocab and t[k:] in vocab]
    ranked.sort()
    return _byte_fallback_bpe(g, tokens, types, vocab, [(a, b) for *_, a, b in ranked], ("<s>", "</s>"),
                              prefix=bool(g.metadata.get("tokenizer.ggml.add_space_prefix", True)))


def gemma_sentencepiece_from_gguf(g: GGUFFile) -> HFTokenizer:
    """Gemma's SentencePiece BPE from GGUF metadata (``tokenizer.ggml.model`` "llama").

    The file lists no merges: every normal or user-defined piece that is two such pieces joined
    is their merge, ranked by the piece's place in the file (as transformers' GGUF reader does
    for Gemma, whose scores do not follow its merge order). llama.cpp's converter stores Gemma's
    runs of spaces (user-defined pieces "▁▁", ...) with real spaces: they are spelled with "▁"
    again. No prefix space; <bos> in front (``tokenizer.ggml.add_bos_token``, default true).
    """
    if g.metadata.get("tokenizer.ggml.add_space_prefix", False):
        raise PretrainedFormatError(f"{g.path}: a gemma SentencePiece vocabulary with add_space_prefix "
                                    "is not read (Gemma's own has none)")
    stored: list[str] = _required(g, "tokenizer.ggml.tokens")
    types = _token_types(g, stored)
    tokens = ["▁" * len(t) if t and not t.strip(" ") else t for t in stored]
    vocab = {t: i for i, t in reversed(list(enumerate(tokens)))}  # a repeated piece: its first id
    pieces = {t for t, ty in zip(tokens, types, strict=True)
              if ty in (GGUF_TOKEN_NORMAL, GGUF_TOKEN_USER_DEFINED)}
    merges = []  # (rank of the joined piece, -len(left), left, right)
    for t in pieces:
        merges += [(vocab[t], -k, t[:k], t[k:]) for k in range(1, len(t))
                   if t[:k] in pieces and t[k:] in pieces]
    merges.sort()
    return _byte_fallback_bpe(g, tokens, types, vocab, [(a, b) for *_, a, b in merges], ("<bos>", "<eos>"),
                              prefix=False)


def _byte_fallback_bpe(g: GGUFFile, tokens: list[str], types: list[int], vocab: dict[str, int],
                       merges: list[tuple[str, str]], ends: tuple[str, str], prefix: bool) -> HFTokenizer:
    """The SentencePiece BPE both spellings share; ``ends``: the (bos, eos) tokens a file without
    their ids is taken to mean.

    Spaces become "▁" (``prefix``: one more in front, as Hugging Face's Metaspace with its
    "first" scheme puts it: not after a leading space, not after a control token); characters
    no piece spells, <0xNN> byte tokens; control and unknown tokens, and those the file names
    bos/eos/unk/padding, are special tokens matched whole in the text, user-defined ones plain
    added tokens. Decoding turns "▁" back into spaces, bytes into characters, and drops the
    prefix space.
    """
    tk = hf_tokenizers()
    unk = _special(g, tokens, ("unknown_token_id",), "<unk>")
    try:
        tok = tk.Tokenizer(tk.models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True,
                                         byte_fallback=True))
    except Exception as e:  # the tokenizers library's own error
        raise PretrainedFormatError(f"{g.path}: its SentencePiece tokenizer does not build ({e})") from None
    decoders = [tk.decoders.Replace("▁", " "), tk.decoders.ByteFallback(), tk.decoders.Fuse()]
    if prefix:
        tok.pre_tokenizer = tk.pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
        decoders.append(tk.decoders.Strip(" ", 1, 0))
    else:
        tok.normalizer = tk.normalizers.Replace(" ", "▁")
    tok.decoder = tk.decoders.Sequence(decoders)
    ids = [g.metadata.get(f"tokenizer.ggml.{key}") for key in
           ("bos_token_id", "eos_token_id", "unknown_token_id", "padding_token_id")]
    kinds = (GGUF_TOKEN_CONTROL, GGUF_TOKEN_UNKNOWN)
    special = {t for t, ty in zip(tokens, types, strict=True) if ty in kinds}
    special |= {tokens[i] for i in ids if isinstance(i, int) and 0 <= i < len(tokens)}
    tok.add_special_tokens([tk.AddedToken(t, special=True, normalized=False) for t in tokens if t in special])
    tok.add_tokens([tk.AddedToken(t, special=False, normalized=False)  # <start_of_turn>, "\n\n", ...
                    for t, ty in zip(tokens, types, strict=True)
                    if ty == GGUF_TOKEN_USER_DEFINED and t.strip("▁") and t not in special])
    template = ["$A"]
    if g.metadata.get("tokenizer.ggml.add_bos_token", True):
        template.insert(0, _special(g, tokens, ("bos_token_id",), ends[0]))
    if g.metadata.get("tokenizer.ggml.add_eos_token", False):
        template.append(_special(g, tokens, ("eos_token_id",), ends[1]))
    tok.post_processor = tk.processors.TemplateProcessing(
        single=" ".join(template), special_tokens=[(t, vocab[t]) for t in template if t != "$A"])
    return HFTokenizer(tok, add_special_tokens=True)


def _wordpiece_spelling(token: str, kind: int) -> str:
    """llama.cpp's "phantom space" spelling of a BERT token back to BERT's own: "▁word" begins
    a word ("word"), a bare "piece" continues one ("##piece"). "[...]" tokens are stored as they
    are by older converters, control tokens ([CLS], <extra>) by newer ones."""
    if token.startswith("[") and token.endswith("]"):
        return token
    if token.startswith("▁"):
        return token[1:]
    return token if kind == GGUF_TOKEN_CONTROL else "##" + token


def wordpiece_from_gguf(g: GGUFFile) -> HFTokenizer:
    """BERT's WordPiece from GGUF metadata (``tokenizer.ggml.model`` "bert"), as Hugging Face's
    BertTokenizerFast builds it: lower-cased and accent-stripped text (llama.cpp's default for
    a bert vocabulary), split at spaces and punctuation, greedy longest-match pieces
    ("##" continues a word), "[CLS] … [SEP]" around each text; [UNK] for a word no piece spells.
    Newer converters store a cased vocabulary's ``tokenizer.ggml.normalizer.lowercase`` false."""
    tk = hf_tokenizers()
    stored: list[str] = _required(g, "tokenizer.ggml.tokens")
    types = _token_types(g, stored)
    tokens = [_wordpiece_spelling(t, ty) for t, ty in zip(stored, types, strict=True)]
    vocab = {t: i for i, t in reversed(list(enumerate(tokens)))}
    unk = _special(g, tokens, ("unknown_token_id",), "[UNK]")
    # Older files name [CLS] cls_token_id; llama.cpp's converter now stores it as bos ([SEP]: eos).
    cls = _special(g, tokens, ("cls_token_id", "bos_token_id"), "[CLS]")
    sep = _special(g, tokens, ("seperator_token_id", "eos_token_id"), "[SEP]")  # sic: llama.cpp's key
    tok = tk.Tokenizer(tk.models.WordPiece(vocab, unk_token=unk, max_input_chars_per_word=100))
    lowercase = bool(g.metadata.get("tokenizer.ggml.normalizer.lowercase", True))
    strip_accents = bool(g.metadata.get("tokenizer.ggml.normalizer.strip_accents", lowercase))
    tok.normalizer = tk.normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True,
                                                   strip_accents=strip_accents, lowercase=lowercase)
    tok.pre_tokenizer = tk.pre_tokenizers.BertPreTokenizer()
    tok.post_processor = tk.processors.TemplateProcessing(
        single=f"{cls} $A {sep}", pair=f"{cls} $A {sep} $B:1 {sep}:1",
        special_tokens=[(cls, vocab[cls]), (sep, vocab[sep])])
    tok.decoder = tk.decoders.WordPiece(prefix="##")
    tok.add_special_tokens([tk.AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types, strict=True) if ty == GGUF_TOKEN_CONTROL])
    return HFTokenizer(tok, add_special_tokens=True)
