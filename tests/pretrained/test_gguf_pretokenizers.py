"""Byte-level BPE GGUF files (``tokenizer.ggml.model`` "gpt2") cut text into words by
``tokenizer.ggml.pre``, as the model's own tokenizer does (``BYTE_LEVEL_SPLITS`` in
qkv/pretrained/gguf_tokenizers.py).

One small vocabulary is trained here with ``tokenizers``' BpeTrainer on TEXTS with no split at
all (each text one word), so its merges cross every boundary some split draws: digit runs, a
space before a digit, contractions, spaces before newlines, case changes. Three merges are
added last that make "zqz" a token the merges never reach ("z", "qz"): only a whole-word lookup
(Llama-3's ``ignore_merges``) finds it. The vocabulary goes into a GGUF as llama.cpp's converter
writes a byte-level one (tokens, token types, merges, ``tokenizer.ggml.pre``), once per name.

The references:
- transformers' reader of the same file (``AutoTokenizer.from_pretrained(folder, gguf_file=...)``)
  for the names it knows (its ``GGUF_PRE_TOKENIZER_SPLITS``) and for GPT-2's split; for Llama-3
  and tekken with ``ignore_merges`` turned on, as meta-llama/Meta-Llama-3-8B's tokenizer.json
  has it and llama.cpp does (transformers' reader leaves it off: ``test_llama3_keeps_...``).
- for names transformers reads with GPT-2's split, the ``pre_tokenizer`` of the model's own
  tokenizer.json (ORIGINAL, cited per entry), built here with ``tokenizers`` over the same
  vocabulary and merges.

Not in the suite (llama.cpp's own files are not shipped): on llama.cpp's ggml-vocab-*.gguf with
their .inp/.out ids (which convert_hf_to_gguf_update.py writes from the original tokenizers),
qkv's ids equal all 46 cases of llama-bpe, qwen2, falcon, starcoder, refact, command-r,
deepseek-llm, deepseek-coder, mpt and gpt-2, and all 50 of qwen35.
"""

from __future__ import annotations

import itertools
import json
import warnings
from pathlib import Path

import pytest
from helpers import dev_package

transformers = dev_package("transformers")
gguf = dev_package("gguf")
tk = dev_package("tokenizers")

from pretrained.gguf_writing import CONTROL, NORMAL, finish, transformers_tokenizer  # noqa: E402
from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS  # noqa: E402

from qkv.pretrained.gguf_file import read_gguf  # noqa: E402
from qkv.pretrained.gguf_tokenizers import BYTE_LEVEL_SPLITS, byte_bpe_from_gguf  # noqa: E402

TEXTS = [
    "3333 12345 3.14159",  # digit runs: up to 3 (Llama-3), single digits (Qwen2, SmolLM), triples (Falcon)
    "ied 4 ½ months x²",  # numbers that are no digits, after a space
    "I'M you'RE don't",  # contractions in both cases
    "a  \n\n b   \n\t c\r\n",  # runs of spaces before newlines, a tab
    "中文字符，日本語のテキスト 한국어",  # CJK, full-width punctuation, kana, Hangul
    "😀🎉 emoji",
    "HTTPServer isOK",  # tekken / GPT-4o: words end where the case changes
    "Hello, world!! ...ok $+<=>^~|`",  # punctuation runs and ASCII symbols (Falcon's Punctuation)
    "cafe\u0301 नमस्ते",  # combining marks: part of a word for Qwen3.5
    "مرحبا بالعالم",  # letters without case: outside DeepSeek-LLM's letter class
    "zqz, 3zqz",  # a word that is a token the merges never reach
]
UNREACHABLE = [("q", "z"), ("z", "q"), ("zq", "z")]  # "zqz" merges to "z", "qz"; whole, it is "zqz"

_BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
_DIGITS_THEN_BYTE_LEVEL = {"type": "Sequence", "pretokenizers": [
    {"type": "Digits", "individual_digits": True}, _BYTE_LEVEL]}


def _split(regex: str) -> dict:
    return {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False}


_DEEPSEEK_CJK = _split("[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+")
_DEEPSEEK_TAIL = [{"type": "Digits", "individual_digits": True},
                  {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]
# deepseek-llm-7b-base's cased-letter class, as its tokenizer.json lists it (code points: a
# normalising editor would change some of the characters)
_DEEPSEEK_LETTERS = (
    "A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af\u0370-\u0373"
    "\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481"
    "\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf"
    "\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d"
    "\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4"
    "\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107"
    "\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f"
    "\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d"
    "\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17"
    "\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb"
    "\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943")

# The pre_tokenizer of each model's tokenizer.json, for the names transformers' GGUF reader gives
# GPT-2's split (the model is the one llama.cpp's convert_hf_to_gguf_update.py names for it).
ORIGINAL = {
    "smollm": _DIGITS_THEN_BYTE_LEVEL,  # HuggingFaceTB/SmolLM-135M, SmolLM2-135M (the bundled asset's)
    "starcoder": _DIGITS_THEN_BYTE_LEVEL,  # bigcode/starcoder2-3b
    "command-r": _DIGITS_THEN_BYTE_LEVEL,  # CohereForAI/c4ai-command-r-v01
    "falcon": {"type": "Sequence", "pretokenizers": [  # tiiuae/falcon-7b
        {"type": "Punctuation", "behavior": "Contiguous"}, _BYTE_LEVEL,
        {"type": "Digits", "individual_digits": False}, _split("[0-9][0-9][0-9]")]},
    "deepseek-llm": {"type": "Sequence", "pretokenizers": [  # deepseek-ai/deepseek-llm-7b-base
        _split("[\r\n]"), _split("\\s?[" + _DEEPSEEK_LETTERS + "]+"),
        _split("\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+"), _split("\\s+$"),
        _DEEPSEEK_CJK, *_DEEPSEEK_TAIL]},
    "deepseek-coder": {"type": "Sequence", "pretokenizers": [  # deepseek-ai/deepseek-coder-6.7b-base
        _split("[\r\n]"), _split("\\s?\\p{L}+"), _split("\\s?\\p{P}+"), _DEEPSEEK_CJK, *_DEEPSEEK_TAIL]},
}
# One name for each split transformers' reader gives (GPT-2's for a name it does not know).
TRANSFORMERS = ["gpt-2", "default", "llama-bpe", "dbrx", "qwen2", "qwen35", "tekken", "gpt-4o"]
WHOLE_WORDS = {"llama-bpe", "tekken"}  # ignore_merges in the original tokenizer and in llama.cpp


@pytest.fixture(scope="module")
def trained() -> tuple[dict, list[str], list[str]]:
    """(the trained tokenizer's JSON, the GGUF's tokens by id, its merges): <|endoftext|> (id 0,
    a control token), the 256 byte characters, the merged tokens, "qz", "zq", "zqz"."""
    tok = tk.Tokenizer(tk.models.BPE())
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(vocab_size=1000, special_tokens=["<|endoftext|>"], show_progress=False,
                                     initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([t for t in TEXTS if "z" not in t] * 3, trainer)
    data = json.loads(tok.to_str())
    vocab, merges = data["model"]["vocab"], data["model"]["merges"]
    assert not any("z" in t or "q" in t for t in vocab if len(t) > 1)
    for a, b in UNREACHABLE:
        vocab[a + b] = len(vocab)
        merges.append([a, b])
    tokens = sorted(vocab, key=vocab.__getitem__)
    assert [vocab[t] for t in tokens] == list(range(len(tokens))) and len(merges) > 150
    return data, tokens, [" ".join(m) for m in merges]


def write_vocab_gguf(path: Path, tokens: list[str], merges: list[str], pre: str | None,
               add_bos: bool | None = None) -> Path:
    """A vocabulary-only GGUF, as llama.cpp's converter writes a byte-level BPE vocabulary
    (``add_bos``: its tokenizer.ggml.add_bos_token, None: no such key)."""
    w = gguf.GGUFWriter(str(path), "llama")
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    w.add_tokenizer_model("gpt2")
    if pre is not None:
        w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([CONTROL] + [NORMAL] * (len(tokens) - 1))
    w.add_token_merges(merges)
    w.add_bos_token_id(0)
    w.add_eos_token_id(0)
    finish(w)
    return path


@pytest.fixture(scope="module")
def gguf_for(trained, tmp_path_factory):
    """``gguf_for(pre)``: the path of the vocabulary's GGUF with that ``tokenizer.ggml.pre``."""
    _, tokens, merges = trained
    folder = tmp_path_factory.mktemp("pretokenizers")

    def make(pre: str | None) -> Path:
        (folder / str(pre)).mkdir(exist_ok=True)
        return write_vocab_gguf(folder / str(pre) / "vocab.gguf", tokens, merges, pre)
    return make


def qkv_ids(path: Path) -> list[list[int]]:
    tok = byte_bpe_from_gguf(read_gguf(path))
    ids = [tok.encode(t, add_special_tokens=False) for t in TEXTS]  # the split alone (no BOS)
    assert [tok.decode(i) for i in ids] == TEXTS  # byte level: every text comes back exactly
    return ids


def reference_ids(tokenizer) -> list[list[int]]:
    """Ids of TEXTS from a transformers tokenizer or a ``tokenizers.Tokenizer``, no BOS/EOS."""
    if isinstance(tokenizer, tk.Tokenizer):
        return [tokenizer.encode(t, add_special_tokens=False).ids for t in TEXTS]
    return [tokenizer.encode(t, add_special_tokens=False) for t in TEXTS]


def original_tokenizer(trained, pre_tokenizer: dict, ignore_merges: bool = False):
    """The trained vocabulary and merges (with UNREACHABLE) behind ``pre_tokenizer``."""
    data, tokens, merges = trained
    data = json.loads(json.dumps(data))
    data["model"].update(vocab={t: i for i, t in enumerate(tokens)}, merges=[m.split(" ") for m in merges],
                         ignore_merges=ignore_merges)
    data["pre_tokenizer"] = pre_tokenizer
    return tk.Tokenizer.from_str(json.dumps(data))


@pytest.mark.parametrize("pre", TRANSFORMERS)
def test_split_equals_transformers_tokenizer(gguf_for, pre: str) -> None:
    """qkv's ids equal transformers' reader of the same file (Llama-3's and tekken's with the
    whole-word lookup of their tokenizer.json)."""
    path = gguf_for(pre)
    want = transformers_tokenizer(path)
    want.backend_tokenizer.model.ignore_merges = pre in WHOLE_WORDS
    assert qkv_ids(path) == reference_ids(want)


@pytest.mark.parametrize("pre", sorted(ORIGINAL))
def test_split_equals_the_original_tokenizer(trained, gguf_for, pre: str) -> None:
    """Names transformers' reader splits as GPT-2 (so it is no reference for them): qkv's ids
    equal the model's own pre_tokenizer over the same vocabulary and merges."""
    assert qkv_ids(gguf_for(pre)) == reference_ids(original_tokenizer(trained, ORIGINAL[pre]))


def test_llama3_keeps_a_word_that_is_a_token_whole(gguf_for) -> None:
    """"zqz" is a token the merges never make: Llama-3's tokenizer (ignore_merges) and llama.cpp
    keep the word whole; transformers' reader, which leaves ignore_merges off, does not; DBRX's
    split (Llama-3's regex, no ignore_merges in llama.cpp) does not either."""
    for pre, whole in [("llama-bpe", True), ("dbrx", False)]:
        path = gguf_for(pre)
        tok = byte_bpe_from_gguf(read_gguf(path))
        want = transformers_tokenizer(path)
        pieces = want.convert_ids_to_tokens(tok.encode("zqz", add_special_tokens=False))
        assert pieces == (["zqz"] if whole else ["z", "qz"]), pre
        assert want.convert_ids_to_tokens(want.encode("zqz", add_special_tokens=False)) == ["z", "qz"]


def test_the_texts_tell_every_split_apart(trained) -> None:
    """Any two different splits of the table give different ids on some text, so a wrong entry
    (another entry's split, or GPT-2's) fails the tests above. The references stand in: the
    regexes of transformers' table, the ORIGINAL pre_tokenizers."""
    def transformers_split(pre: str) -> dict:
        if pre not in GGUF_PRE_TOKENIZER_SPLITS:
            return _BYTE_LEVEL  # the reader's GPT2Tokenizer
        return {"type": "Sequence", "pretokenizers": [
            _split(GGUF_PRE_TOKENIZER_SPLITS[pre]), {**_BYTE_LEVEL, "use_regex": False}]}

    refs = {pre: reference_ids(original_tokenizer(trained, transformers_split(pre), pre in WHOLE_WORDS))
            for pre in TRANSFORMERS}
    refs |= {pre: reference_ids(original_tokenizer(trained, p)) for pre, p in ORIGINAL.items()}
    for a, b in itertools.combinations(refs, 2):
        if BYTE_LEVEL_SPLITS[a] != BYTE_LEVEL_SPLITS[b]:
            assert refs[a] != refs[b], (a, b)


def test_names_transformers_knows_have_its_split() -> None:
    """Every ``tokenizer.ggml.pre`` transformers' reader has a split for is in qkv's table with
    that split (tekken's and Llama-3's with their whole words)."""
    for pre, regex in GGUF_PRE_TOKENIZER_SPLITS.items():
        assert pre in BYTE_LEVEL_SPLITS, pre
        assert BYTE_LEVEL_SPLITS[pre].text == (regex,) and not BYTE_LEVEL_SPLITS[pre].spelled, pre


def test_an_unknown_name_warns_and_splits_as_gpt2(gguf_for) -> None:
    """A name qkv does not know (llama.cpp's poro-chat: a split of its own) loads with GPT-2's
    split, as transformers' reader does, and a warning naming it; a file without the key loads
    with GPT-2's split and no warning."""
    path = gguf_for("poro-chat")
    with pytest.warns(UserWarning, match=r"tokenizer.ggml.pre 'poro-chat' is not a split qkv knows"):
        ids = qkv_ids(path)
    assert ids == reference_ids(transformers_tokenizer(path))
    path = gguf_for(None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ids = qkv_ids(path)
    assert ids == reference_ids(transformers_tokenizer(path)) == qkv_ids(gguf_for("gpt-2"))


@pytest.mark.parametrize(("pre", "add_bos", "bos"), [
    ("llama-bpe", None, True), ("tekken", None, True), ("gpt-2", None, False), ("smollm", None, False),
    ("llama-bpe", False, False), ("gpt-2", True, True), ("qwen2", True, True)])
def test_bos_goes_in_front_as_llama_cpp_puts_it(trained, tmp_path: Path, pre: str, add_bos: bool | None,
                                                bos: bool) -> None:
    """The file's tokenizer.ggml.add_bos_token decides; without it, llama.cpp's defaults by
    split (llama-vocab.cpp: add_bos for llama-bpe and its kin, tekken, chameleon; not for
    gpt-2, smollm, ...). The rest of the ids are the split's own."""
    _, tokens, merges = trained
    tok = byte_bpe_from_gguf(read_gguf(write_vocab_gguf(tmp_path / "v.gguf", tokens, merges, pre, add_bos)))
    plain = tok.encode("Hello world", add_special_tokens=False)
    assert tok.encode("Hello world") == ([0] if bos else []) + plain
