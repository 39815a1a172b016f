"""GGUF files written by llama.cpp's own converter, read by qkv: one per architecture.

Each Hugging Face checkpoint folder is converted to an f32 GGUF by ``convert_hf_to_gguf.py``
(llama.cpp's, from the llama-cpp-python 0.3.36 sdist; needs ``pip install sentencepiece``) and
loaded with ``qkv.load(FILE)``; the reference is ``transformers`` on the folder itself:

- bert: the bundled all-MiniLM-L6-v2 folder; its sentence embeddings (mean of the last states,
  unit length) from qkv on the GGUF against transformers' ``AutoModel`` on the folder;
- llama: SmolLM2-135M-Instruct as a folder (written once by transformers from the bundled GGUF);
- qwen2, mistral, gpt2: tiny random models made here with SmolLM2's tokenizer (the converter
  recognises its pre-tokenizer); gemma: a tiny random Gemma with a SentencePiece vocabulary
  trained here on Shakespeare (the converter reads ``tokenizer.model``; the reference
  tokenizer is ``sentencepiece`` itself); llama-spm: a tiny random Llama with a Llama-2-style
  SentencePiece vocabulary trained here (TinyLlama's layout). qwen2 cannot be made offline (see
  make_folders).

For each: the tokenizer's ids on ``TEXTS`` (equal or not), the largest logit (or embedding)
difference, the first 20 greedy tokens of qkv on the GGUF against transformers on the folder,
and, where llama.cpp's ``llama-simple`` is built (see benchmarks/_llama_cpp.py), its greedy
text on the GGUF against ``qkv generate FILE --temperature 0`` (what each adds after the prompt).

    python benchmarks/gguf_conversions.py        # ~3 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import _common as C
import _llama_cpp

NAME = "gguf_conversions"
TEXTS = ["The cat sat on the mat.", "Paris is the capital of France!", "  two  spaces\nand a newline",
         "3333 12345 I'M you'RE", "naïve café ½ 東京 🙂", "ROMEO: But soft, what light?"]
PROMPT = "ROMEO: But soft"
N_GREEDY = 20


def _quiet(fn, *args, **kwargs):
    with contextlib.redirect_stderr(io.StringIO()):
        return fn(*args, **kwargs)


def make_folders(tmp: Path) -> dict[str, Path | str]:
    """architecture -> its Hugging Face folder (or why it could not be made)."""
    import torch
    import transformers

    from qkv.assets import asset_path

    folders: dict[str, Path | str] = {"bert": Path(asset_path("minilm"))}
    gguf = asset_path("smollm2")
    folder, name = os.path.split(gguf)
    smol = _quiet(transformers.AutoModelForCausalLM.from_pretrained, folder, gguf_file=name,
                  dtype=torch.float32)
    cfg = transformers.AutoConfig.for_model(**{k: v for k, v in smol.config.to_dict().items()
                                               if k != "quantization_config"})
    plain = transformers.AutoModelForCausalLM.from_config(cfg).float()
    plain.load_state_dict(smol.state_dict())
    plain.save_pretrained(tmp / "llama")
    tok = _quiet(transformers.AutoTokenizer.from_pretrained, folder, gguf_file=name)
    tok.save_pretrained(tmp / "llama")
    tok = _with_smollm2_split(tmp / "llama")
    folders["llama"] = tmp / "llama"
    small = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, max_position_embeddings=256)
    # qwen2 is left out: the converter knows a vocabulary by the hash of its tokenizer's output,
    # and transformers builds a qwen2 folder's tokenizer as Qwen2Tokenizer whatever it is given
    # (SmolLM2's vocabulary then has a hash the converter does not know; no Qwen2 vocabulary
    # is offline). qkv's qwen2 GGUF reading is checked in tests/pretrained/ and export_parity.py.
    folders["qwen2"] = "not converted: no offline Qwen2 vocabulary the converter recognises"
    configs = {
               "mistral": transformers.MistralConfig(**small, num_key_value_heads=2),
               "gpt2": transformers.GPT2Config(vocab_size=len(tok), n_embd=64, n_layer=2, n_head=4,
                                               n_positions=256, n_ctx=256)}  # the converter reads n_ctx
    for arch, config in configs.items():
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config).float()
        model.save_pretrained(tmp / arch)
        tok.save_pretrained(tmp / arch)
        folders[arch] = tmp / arch
    folders["gemma"] = _gemma_folder(tmp / "gemma")
    folders["llama-spm"] = _sentencepiece_llama_folder(tmp / "llama-spm")
    return folders


def _train_sentencepiece(folder: Path, **settings) -> None:
    """A 1,000-piece SentencePiece BPE trained on Shakespeare into ``folder``/tokenizer.model."""
    import sentencepiece as spm

    from qkv.data.corpora import load_text

    folder.mkdir(parents=True)
    (folder / "text.txt").write_text(load_text(None).text[:400_000], encoding="utf-8")
    _quiet(spm.SentencePieceTrainer.train, input=str(folder / "text.txt"),
           model_prefix=str(folder / "tokenizer"), vocab_size=1000, model_type="bpe", byte_fallback=True,
           minloglevel=2, **settings)
    (folder / "text.txt").unlink()


def _sentencepiece_llama_folder(folder: Path) -> Path | str:
    """A tiny random Llama with a Llama-2-style SentencePiece vocabulary (dummy prefix, spaces
    kept, whitespace-only pieces, digits split; <unk> 0, <s> 1, </s> 2), as TinyLlama ships."""
    try:
        import sentencepiece  # noqa: F401
    except ImportError:
        return "needs `pip install sentencepiece`"
    import torch
    import transformers

    _train_sentencepiece(folder, add_dummy_prefix=True, remove_extra_whitespaces=False,
                         normalization_rule_name="identity", allow_whitespace_only_pieces=True,
                         split_digits=True, unk_id=0, bos_id=1, eos_id=2, pad_id=-1)
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=256, bos_token_id=1, eos_token_id=2)
    transformers.AutoModelForCausalLM.from_config(cfg).float().save_pretrained(folder)
    return folder


def _with_smollm2_split(folder: Path):
    """The folder's tokenizer with SmolLM2's own pre-tokenizer (its tokenizer.json on the Hub:
    single digits, then GPT-2's byte-level split): transformers' GGUF reader, which wrote the
    folder, does not know the file's ``smollm`` split and uses GPT-2's alone. Returns it loaded."""
    import json

    import transformers

    path = folder / "tokenizer.json"
    data = json.loads(path.read_text(encoding="utf-8"))
    data["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Digits", "individual_digits": True},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}]}
    path.write_text(json.dumps(data), encoding="utf-8")
    return _quiet(transformers.AutoTokenizer.from_pretrained, folder)


def _gemma_folder(folder: Path) -> Path | str:
    """A tiny random Gemma with a 1,000-piece SentencePiece BPE trained on Shakespeare with
    Gemma's tokenizer settings and special ids (pad 0, eos 1, bos 2, unk 3)."""
    try:
        import sentencepiece  # noqa: F401
    except ImportError:
        return "needs `pip install sentencepiece`"
    import torch
    import transformers

    _train_sentencepiece(folder, pad_id=0, eos_id=1, bos_id=2, unk_id=3, pad_piece="<pad>", eos_piece="<eos>",
                         bos_piece="<bos>", unk_piece="<unk>",
                         # Gemma's settings: no prefix space, spaces kept as they are, no NFKC
                         add_dummy_prefix=False, remove_extra_whitespaces=False,
                         normalization_rule_name="identity")
    tok = transformers.GemmaTokenizer(vocab_file=str(folder / "tokenizer.model"))
    tok.save_pretrained(folder)
    torch.manual_seed(0)
    cfg = transformers.GemmaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
                                   head_dim=16, max_position_embeddings=256, pad_token_id=0,
                                   eos_token_id=1, bos_token_id=2)
    transformers.AutoModelForCausalLM.from_config(cfg).float().save_pretrained(folder)
    return folder


def compare(arch: str, folder: Path, gguf: Path, simple: Path | None) -> dict:
    """One row: tokenizer ids, largest difference, greedy tokens, llama.cpp's text."""
    import torch
    import transformers

    import qkv

    if arch in ("gemma", "llama-spm"):  # the original tokenizer itself (transformers 5 builds none
        # from a .model alone)
        import sentencepiece as spm

        sp = spm.SentencePieceProcessor(model_file=str(folder / "tokenizer.model"))
        encode = (lambda t: [sp.bos_id(), *sp.encode(t)])  # noqa: E731
    else:
        hf_tok = _quiet(transformers.AutoTokenizer.from_pretrained, folder)
        encode = (lambda t: hf_tok(t).input_ids)  # noqa: E731
    if arch == "bert":
        ours = _quiet(qkv.load, str(gguf))
        ref = _quiet(transformers.AutoModel.from_pretrained, folder).float().eval()
        ids_equal = [ours.tokenizer.encode(t) == encode(t) for t in TEXTS]
        enc = hf_tok(TEXTS, padding=True, return_tensors="pt")
        with torch.no_grad():
            states = ref(**enc).last_hidden_state
        mask = enc["attention_mask"].unsqueeze(-1).float()
        want = torch.nn.functional.normalize((states * mask).sum(1) / mask.sum(1), dim=-1)
        got = torch.as_tensor(ours.embed(TEXTS))
        return {"architecture": arch, "ids_equal": sum(ids_equal), "texts": len(TEXTS),
                "max_difference": (got - want).abs().max().item(), "compared": "unit embeddings"}
    ours = _quiet(qkv.load, str(gguf), weights="fp32", cache=False)
    ref = _quiet(transformers.AutoModelForCausalLM.from_pretrained, folder).float().eval()
    ids_equal = [ours.tokenizer.encode(t) == encode(t) for t in TEXTS]
    x = torch.tensor([encode(PROMPT)])
    with torch.no_grad():
        gap = (ours.model(x).logits - ref(x).logits).abs().max().item()
        hf_new = ref.generate(x, max_new_tokens=N_GREEDY, do_sample=False, eos_token_id=None,
                              pad_token_id=0)[0, x.shape[1]:].tolist()
    from qkv.generation import generate

    qkv_new = [int(t[0]) for t in generate(ours.model, x, N_GREEDY, temperature=0.0)]
    row = {"architecture": arch, "ids_equal": sum(ids_equal), "texts": len(TEXTS), "max_difference": gap,
           "compared": "logits", "greedy_equal": qkv_new == hf_new,
           "greedy_agree_first": next((i for i, (a, b) in enumerate(zip(qkv_new, hf_new, strict=True))
                                       if a != b), N_GREEDY)}
    if simple is not None:
        r = subprocess.run([sys.executable, "-m", "qkv", "generate", str(gguf), "--prompt", PROMPT,
                            "--temperature", "0", "--max-new-tokens", str(N_GREEDY), "--weights", "fp32"],
                           capture_output=True, text=True)
        mine = r.stdout.rstrip("\n") if r.returncode == 0 else f"(failed: {r.stderr.strip()[-200:]})"
        theirs = _llama_cpp.simple_text(simple, gguf, PROMPT, N_GREEDY)
        # the continuations after the prompt: llama-simple echoes the prompt's pieces (a
        # SentencePiece prompt with its dummy-prefix space in front)
        row.update(qkv_text=mine, llama_cpp_text=theirs,
                   llama_cpp_same=PROMPT in theirs and mine.startswith(PROMPT)
                   and theirs.split(PROMPT, 1)[1] == mine[len(PROMPT):])
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--no-build", action="store_true", help="do not build llama.cpp's llama-simple")
    p.add_argument("--json", default=None, help="write results here (default benchmarks/results/)")
    args = p.parse_args()
    if not C.have_reference(NAME, ("minilm", "smollm2")):
        return 2
    machine = C.machine_info()
    print(C.machine_line(machine), flush=True)
    simple, how = _llama_cpp.llama_tool("llama-simple", build=not args.no_build)
    print(f"llama.cpp llama-simple: {how}", flush=True)
    meter = C.LoadMeter()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for arch, folder in make_folders(Path(tmp)).items():
            if isinstance(folder, str):
                rows.append({"architecture": arch, "skipped": folder})
                continue
            gguf = Path(tmp) / f"{arch}.gguf"
            why = _llama_cpp.convert_hf_to_gguf(folder, gguf)
            if why is not None:
                rows.append({"architecture": arch, "skipped": why})
                continue
            rows.append(compare(arch, folder, gguf, simple))
            print(f"{arch}: {rows[-1]}", flush=True)
    load = meter.stop()
    C.print_table("llama.cpp's converter -> GGUF -> qkv.load, against transformers on the folder",
                  ["architecture", "tokenizer ids equal", "largest difference", "greedy 20 equal",
                   "llama.cpp text = qkv's"],
                  [[r["architecture"],
                    f"{r['ids_equal']}/{r['texts']}" if "texts" in r else r.get("skipped", ""),
                    f"{r['max_difference']:.1e} ({r['compared']})" if "max_difference" in r else "—",
                    str(r.get("greedy_equal", "—")), str(r.get("llama_cpp_same", "—"))] for r in rows])
    result = {"machine": machine, "llama_simple": how, "texts": TEXTS, "prompt": PROMPT, "rows": rows,
              "load": load}
    print(C.load_line(load))
    print(f"wrote {C.write_json(NAME, result, args.json)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
