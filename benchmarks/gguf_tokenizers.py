"""qkv's GGUF tokenizers against llama.cpp's own tokenizer tests: every vocabulary file of its
test suite, every case.

llama.cpp ships, beside its source, ``models/ggml-vocab-NAME.gguf`` (a vocabulary as its
converter writes it) with ``.inp`` (test texts) and ``.out`` (the ids the model's original
Hugging Face tokenizer gives them, special tokens not added; written by its
``convert_hf_to_gguf_update.py``). This script rebuilds each vocabulary's tokenizer from the
GGUF as ``qkv.load`` does and counts the texts whose ids equal the original's. The files come
from the llama-cpp-python sdist's ``vendor/llama.cpp`` (downloaded once by
benchmarks/_llama_cpp.py).

    python benchmarks/gguf_tokenizers.py     # a few seconds
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

import _common as C
import _llama_cpp

NAME = "gguf_tokenizers"
SEPARATOR = "\n__ggml_vocab_test__\n"  # how llama.cpp's test-tokenizer-0 cuts an .inp file


def check(path: Path) -> dict:
    """One vocabulary: its tokenizer model and split, the cases that agree, or why it is not read."""
    from qkv.pretrained.gguf_file import read_gguf
    from qkv.pretrained.gguf_tokenizers import tokenizer_from_gguf

    name = path.name[len("ggml-vocab-"):-len(".gguf")]
    texts = Path(f"{path}.inp").read_text(encoding="utf-8").split(SEPARATOR)[:-1]
    lines = Path(f"{path}.out").read_text().split("\n")[:len(texts)]
    want = [[int(x) for x in line.split()] for line in lines]
    try:
        g = read_gguf(path)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            tok = tokenizer_from_gguf(g)
    except Exception as e:  # a tokenizer model qkv does not read: said, not counted as agreeing
        why = " ".join(str(e).replace(str(path), path.name).split())
        return {"vocabulary": name, "read": False, "why": why[:200]}
    wrong = [t for t, ids in zip(texts, want, strict=True) if tok.encode(t, add_special_tokens=False) != ids]
    return {"vocabulary": name, "read": True, "model": g.metadata.get("tokenizer.ggml.model"),
            "pre": g.metadata.get("tokenizer.ggml.pre"), "cases": len(texts),
            "equal": len(texts) - len(wrong), "warnings": [str(w.message) for w in caught],
            "different": wrong[:10]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--json", default=None, help="write results here (default benchmarks/results/)")
    args = p.parse_args()
    machine = C.machine_info()
    print(C.machine_line(machine), flush=True)
    src, how = _llama_cpp.llama_cpp_source()
    if src is None:
        print(f"{NAME}: llama.cpp's source is not available: {how}", file=sys.stderr)
        return 2
    print(f"llama.cpp source: {how}", flush=True)
    files = sorted((src / "models").glob("ggml-vocab-*.gguf"))
    rows = [check(f) for f in files if Path(f"{f}.inp").is_file()]
    C.print_table("llama.cpp's tokenizer tests: qkv's ids = the original tokenizer's",
                  ["vocabulary", "tokenizer.ggml.model", "pre", "equal"],
                  [[r["vocabulary"], r.get("model", "—"), str(r.get("pre", "—")),
                    f"{r['equal']}/{r['cases']}" if r["read"] else f"not read: {r['why'][:70]}"]
                   for r in rows])
    read = [r for r in rows if r["read"]]
    print(f"{sum(r['equal'] for r in read)}/{sum(r['cases'] for r in read)} cases equal over {len(read)} "
          f"vocabularies read ({len(rows) - len(read)} not read)")
    result = {"machine": machine, "llama_cpp": _llama_cpp.LLAMA_CPP_PYTHON, "rows": rows}
    print(f"wrote {C.write_json(NAME, result, args.json)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
