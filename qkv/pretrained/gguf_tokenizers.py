"""The tokenizer of a GGUF file, rebuilt from its metadata as a Hugging Face ``tokenizers.Tokenizer``.

A GGUF carries no ``tokenizer.json``. llama.cpp's converter stores the vocabulary as metadata:
``tokenizer.ggml.model`` names the algorithm, ``tokenizer.ggml.tokens`` lists the tokens by id,
``tokenizer.ggml.token_type`` marks each one (1 normal, 2 unknown, 3 control such as <s> or
<|im_start|>, 4 user-defined, 5 unused, 6 byte <0xNN>), and the algorithm's own keys hold the rest.
qkv reads three algorithms (:func:`tokenizer_from_gguf`):

    gpt2   byte-level BPE (SmolLM2, Qwen2, Llama-3, GPT-2 files): the merges are stored
           (``tokenizer.ggml.merges``); the text is cut into words as the model's own tokenizer
           cuts it, named by ``tokenizer.ggml.pre`` (:data:`BYTE_LEVEL_SPLITS`); control
           tokens matched whole.
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
(``test_gguf_bert_gemma.py``: transformers reads no bert GGUF). A Llama-style text tokenizes as
SentencePiece itself does (checked against sentencepiece on a vocabulary it trained, and 46/46
on llama.cpp's Llama-2 and Phi-3 vocabulary tests): the dummy prefix goes before every run of
text, one that begins with a space too (" the" is "▁", "▁the") and the text after a control
token written in the prompt, as llama.cpp puts it; transformers' GGUF reader puts it only where
the text does not begin with a space, and there qkv parts from it. A byte-level file is split into words as
its model's own tokenizer.json splits them (``test_gguf_pretokenizers.py``): transformers' reader
for the names it knows (Llama-3, Qwen2, ...), the original pre-tokenizer for those it reads with
GPT-2's split instead (SmolLM, StarCoder, Falcon, DeepSeek); Llama-3's tokenizer keeps a word
that is a token whole (``ignore_merges``), as llama.cpp does and transformers' reader does not.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

from qkv.pretrained.gguf_file import GGUFFile, PretrainedFormatError
from qkv.tokenizers.hf import HFTokenizer, hf_tokenizers

# llama.cpp's token types (its SentencePiece converter's numbering, used by every vocabulary)
GGUF_TOKEN_NORMAL = 1
GGUF_TOKEN_UNKNOWN = 2
GGUF_TOKEN_CONTROL = 3  # special tokens (<|im_start|>, <bos>, [CLS], ...)
GGUF_TOKEN_USER_DEFINED = 4


def _required(g: GGUFFile, key: str) -> Any:
    return g.require(key, "the file's tokenizer is incomplete")


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


# ---------------------------------------------------------------- byte-level BPE: the split

# The regexes below are those of the models' own tokenizer.json files (Hugging Face ``tokenizers``
# syntax; llama.cpp's llama-vocab.cpp spells the same splits for its own regex engine).
# GPT-2's (what ByteLevel(use_regex=True) uses): contractions, a word, a number or a run of
# other characters each with one optional space in front, and runs of spaces.
GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
# Llama-3's (meta-llama/Meta-Llama-3-8B): contractions in any case ("I'M"), a word with one
# non-letter in front (" the", "(the"), numbers in pieces of at most 3 digits, punctuation
# keeping the newlines after it, a run of newlines with the spaces before it.
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Qwen2's (Qwen/Qwen1.5-7B, Qwen2, Qwen2.5): Llama-3's with every digit its own word.
QWEN2_SPLIT = LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")
# Qwen3.5's (Qwen/Qwen3.5-*): Qwen2's, with combining marks (\p{M}) part of a word.
QWEN35_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
                r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Mistral's tekken (mistralai/Mistral-Nemo-Base-2407): a word is capitals then small
# letters ("Hello", "HTTPServer" -> "HTTP", "Server"), single digits, "/" kept after punctuation.
_UPPER, _LOWER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]", r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
TEKKEN_SPLIT = (rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*"
                r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# GPT-4o's o200k (and Llama-4's): tekken's words with a contraction kept on the word, numbers
# in pieces of at most 3 digits.
_CONTRACTION = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
GPT4O_SPLIT = (rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_CONTRACTION}"
               rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*{_CONTRACTION}"
               r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
DIGIT = r"\p{N}"  # one digit (any Unicode number, "½" too): Hugging Face's Digits(individual_digits=True)
# The letters that have an upper and a lower case (Latin, Greek, Coptic, Cyrillic, Armenian,
# Georgian, Cherokee, Glagolitic, Deseret, Osage, Old Hungarian, Warang Citi, Adlam and their
# letter-like symbols), as deepseek-llm's tokenizer.json lists them; written as code points, since
# an editor that normalises text would turn some of them (U+1F7D, U+212A Kelvin) into others.
CASED_LETTERS = (
    "A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af"
    "\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1"
    "\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd"
    "\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d"
    "\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4"
    "\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec"
    "\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128"
    "\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b"
    "\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787"
    "\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a"
    "\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2"
    "\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943"
)
# Runs of CJK ideographs, of anything from U+0800 to U+4E00 (kana, Indic scripts, CJK punctuation,
# ...) and of Hangul: DeepSeek's tokenizers keep these as words of their own.
CJK = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
# deepseek-ai/deepseek-llm-7b-base: newlines alone; runs of cased letters, then of punctuation
# (ASCII, full-width, quotation marks, "\u3000、。"), each with one space in front; trailing
# spaces; CJK runs; single digits. What lies between the matches is a word too.
DEEPSEEK_LLM_SPLITS = (r"[\r\n]", r"\s?[" + CASED_LETTERS + "]+",
                       r"\s?[!-/:-~" + "\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
                       r"\s+$", CJK, DIGIT)
# deepseek-ai/deepseek-coder-6.7b-base: newlines alone, letter runs and punctuation runs (one
# space in front), CJK runs, single digits.
DEEPSEEK_CODER_SPLITS = (r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", CJK, DIGIT)
# tiiuae/falcon-7b: runs of punctuation (Hugging Face's Punctuation: Unicode's and ASCII's, so
# $+<=>^`|~ too), then GPT-2's split; on the byte-level spelling, runs of digits, then each
# three digits in a row.
FALCON_PUNCTUATION = r"[\p{P}$+<=>^`|~]+"


@dataclass(frozen=True)
class ByteLevelSplit:
    """How one tokenizer cuts text into words before byte-level BPE merges inside each word.

    Every match of each ``text`` regex, in turn, becomes a word of its own, and so does the
    text between two matches (Hugging Face's ``Split(Regex(...), "isolated")``); then each word
    is spelled in GPT-2's byte alphabet (``ByteLevel(use_regex=False)``), and the ``spelled``
    regexes cut that spelling the same way (only Falcon's tokenizer has such steps).
    ``whole_words``: a word that is itself a token stays that token, whatever the merges would
    make of it (``ignore_merges`` of Llama-3's tokenizer.json, and of llama.cpp for it).
    """

    text: tuple[str, ...]
    spelled: tuple[str, ...] = ()
    whole_words: bool = False

    def pre_tokenizer(self) -> Any:
        """The ``tokenizers`` pre-tokenizer: Sequence(Split(text)..., ByteLevel, Split(spelled)...)."""
        tk = hf_tokenizers()
        pt = tk.pre_tokenizers
        return pt.Sequence([*(pt.Split(tk.Regex(r), behavior="isolated") for r in self.text),
                            pt.ByteLevel(add_prefix_space=False, use_regex=False),
                            *(pt.Split(tk.Regex(r), behavior="isolated") for r in self.spelled)])


_GPT2 = ByteLevelSplit((GPT2_SPLIT,))
_LLAMA3 = ByteLevelSplit((LLAMA3_SPLIT,), whole_words=True)

# ``tokenizer.ggml.pre`` -> the split of the model's own tokenizer. The names are those llama.cpp's
# converter writes (convert_hf_to_gguf.py, one for each tokenizer it recognises) and llama-vocab.cpp
# reads; each entry is the pre_tokenizer of the tokenizer.json named, which is also llama.cpp's
# split. transformers' GGUF reader (5.24) knows the Llama-3, Qwen2, tekken and GPT-4o names and
# gives every other one GPT-2's split, and never ``whole_words``: for the smollm, starcoder,
# command-r, falcon and deepseek names, and Llama-3's whole words, qkv follows the original
# tokenizer (and llama.cpp) instead. "default" is GPT-2's, as transformers reads it (llama.cpp's
# "default" also cuts off punctuation runs and digit triples, as Falcon's does).
BYTE_LEVEL_SPLITS: dict[str, ByteLevelSplit] = {
    # openai-community/gpt2, microsoft/phi-2, mosaicml/mpt-7b, allenai/OLMo-1.7-7B-hf, Jina's
    # embedders, ModernBERT, EXAONE-4, ...: ByteLevel(use_regex=True) alone.
    **dict.fromkeys(("default", "gpt-2", "phi-2", "mpt", "olmo", "jais", "jina-es", "jina-de",
                     "jina-v2-es", "jina-v2-de", "jina-v1-en", "jina-v2-code", "roberta-bpe", "gigachat",
                     "a.x-4.0", "mellum", "modern-bert", "exaone4", "trillion", "granite-docling"), _GPT2),
    # meta-llama/Meta-Llama-3-8B (ignore_merges: true) and those built on it: Falcon3, Falcon-H1,
    # Pixtral, LFM2, ...; DBRX and Smaug have its split without the whole words.
    **dict.fromkeys(("llama-bpe", "llama3", "llama-v3", "falcon3", "falcon-h1", "pixtral", "midm-2.0",
                     "lfm2", "jina-v5-nano"), _LLAMA3),
    **dict.fromkeys(("dbrx", "smaug-bpe"), ByteLevelSplit((LLAMA3_SPLIT,))),
    # Qwen/Qwen1.5-7B (Qwen2, Qwen2.5, Qwen3), stabilityai/stablelm-2-1_6b, DeepSeek-R1-Distill-Qwen
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "stablelm2", "megrez", "kormo", "f2llmv2"),
                    ByteLevelSplit((QWEN2_SPLIT,))),
    "qwen35": ByteLevelSplit((QWEN35_SPLIT,)),
    # HuggingFaceTB/SmolLM2-135M, bigcode/starcoder2-3b, smallcloudai/Refact-1_6-base,
    # CohereForAI/c4ai-command-r-v01, ...: Digits(individual_digits=True), then ByteLevel(use_regex=True)
    **dict.fromkeys(("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"),
                    ByteLevelSplit((DIGIT, GPT2_SPLIT))),
    "deepseek-llm": ByteLevelSplit(DEEPSEEK_LLM_SPLITS),
    "deepseek-coder": ByteLevelSplit(DEEPSEEK_CODER_SPLITS),
    # Punctuation, ByteLevel(use_regex=True), Digits(individual_digits=False), Split("[0-9][0-9][0-9]")
    "falcon": ByteLevelSplit((FALCON_PUNCTUATION, GPT2_SPLIT), spelled=(r"\p{N}+", "[0-9][0-9][0-9]")),
    "tekken": ByteLevelSplit((TEKKEN_SPLIT,), whole_words=True),
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), ByteLevelSplit((GPT4O_SPLIT,))),
}


# The splits whose models begin every text with their bos token when the file does not say
# (tokenizer.ggml.add_bos_token absent), as llama.cpp's vocabulary loader sets them: Llama-3 and
# its kin, tekken (Mistral-Nemo), chameleon. A file's own add_bos_token always wins.
BOS_BY_DEFAULT = frozenset(("llama-bpe", "llama3", "llama-v3", "falcon3", "falcon-h1", "pixtral", "lfm2",
                            "tekken", "chameleon"))


def byte_level_split(g: GGUFFile) -> ByteLevelSplit:
    """The split ``tokenizer.ggml.pre`` names (:data:`BYTE_LEVEL_SPLITS`).

    A file without the key (converted before llama.cpp wrote it, in 2024) gets GPT-2's, as
    transformers reads it. A name qkv does not know gets GPT-2's too, as transformers reads it,
    but with a warning rather than silently: the ids are still tokens of the vocabulary that
    decode to the text, only perhaps not the ones the model was trained on (llama.cpp refuses
    such a file; a refusal would keep a model that mostly works from loading at all).
    """
    pre = g.metadata.get("tokenizer.ggml.pre") or "default"
    if pre not in BYTE_LEVEL_SPLITS:
        warnings.warn(f"{g.path}: tokenizer.ggml.pre {pre!r} is not a split qkv knows; using GPT-2's "
                      "(numbers, contractions or runs of spaces may tokenize differently from the "
                      "model's own tokenizer)", stacklevel=3)
        return _GPT2
    return BYTE_LEVEL_SPLITS[pre]


def byte_bpe_from_gguf(g: GGUFFile) -> HFTokenizer:
    """Byte-level BPE as a ``tokenizers.Tokenizer``: the words of :func:`byte_level_split` (no
    prefix space), the stored merges, the control tokens (<|im_start|>, <|im_end|>, ...)
    matched whole in the text, and the bos token in front where ``add_bos_token`` says so (or,
    without the key, where llama.cpp puts it by default: :data:`BOS_BY_DEFAULT`)."""
    tk = hf_tokenizers()
    tokens: list[str] = _required(g, "tokenizer.ggml.tokens")
    types = _token_types(g, tokens)
    merges = [tuple(m.split(" ", 1)) for m in _required(g, "tokenizer.ggml.merges")]
    vocab = {t: i for i, t in enumerate(tokens)}
    split = byte_level_split(g)
    try:
        tok = tk.Tokenizer(tk.models.BPE(vocab=vocab, merges=merges, fuse_unk=False,
                                         ignore_merges=split.whole_words))
    except Exception as e:  # the tokenizers library's own error: a merge of unknown tokens, ...
        raise PretrainedFormatError(f"{g.path}: its BPE tokenizer does not build ({e})") from None
    tok.pre_tokenizer = split.pre_tokenizer()
    tok.decoder = tk.decoders.ByteLevel()
    kinds = (GGUF_TOKEN_CONTROL, GGUF_TOKEN_USER_DEFINED)
    special = [tk.AddedToken(t, special=True, normalized=False)
               for t, ty in zip(tokens, types, strict=True) if ty in kinds]
    tok.add_special_tokens(special)
    bos = g.metadata.get("tokenizer.ggml.bos_token_id")
    add_bos = g.metadata.get("tokenizer.ggml.add_bos_token",
                             (g.metadata.get("tokenizer.ggml.pre") or "default") in BOS_BY_DEFAULT)
    if add_bos and isinstance(bos, int) and 0 <= bos < len(tokens):  # <|begin_of_text|> in front
        tok.post_processor = tk.processors.TemplateProcessing(
            single=f"{tokens[bos]} $A", special_tokens=[(tokens[bos], bos)])
        return HFTokenizer(tok, add_special_tokens=True)
    return HFTokenizer(tok)


# ---------------------------------------------------------------- SentencePiece BPE


def sentencepiece_from_gguf(g: GGUFFile) -> HFTokenizer:
    """A Llama-style SentencePiece BPE (Llama-2, TinyLlama, Mistral, CodeLlama) from GGUF metadata.

    The merges are rebuilt from the vocabulary: each split of a piece into two pieces is a
    merge, ranked by the joined piece's score (higher first; for equal scores the longer left
    half first, then the piece met first in the file), as transformers' GGUF reader ranks them.
    With ``add_space_prefix`` (default true) a "▁" goes in front of the text (and of the text
    after a special token), as SentencePiece's add_dummy_prefix puts it, and the decoder drops it
    again: ids equal the original tokenizer's (llama.cpp's vocabulary tests, 46/46 for Llama-2
    and Phi-3; transformers' GGUF reader differs on a text that begins with a space); <s> goes in front
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

    Spaces become "▁" (``prefix``: one more in front of every run of text, as SentencePiece's
    add_dummy_prefix does; no split at spaces: the merges run over the whole text); characters
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
    if prefix:  # SentencePiece's add_dummy_prefix: one "▁" before every run of text, even one
        # that begins with a space (" Hello" is "▁▁Hello": "▁" + "▁Hello"), and after a special
        # token, as the original tokenizer, its Hugging Face tokenizer.json and llama.cpp do
        tok.normalizer = tk.normalizers.Sequence([tk.normalizers.Prepend("▁"),
                                                  tk.normalizers.Replace(" ", "▁")])
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
