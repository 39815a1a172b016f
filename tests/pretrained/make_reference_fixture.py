"""Write ``reference_fixture.json``: what the reference implementations compute on the inputs of
``pretrained_cases.py``, so that the parity tests stay meaningful where transformers and
sentence-transformers are not installed (``test_fixture.py`` needs only the assets).

Run by hand, with the assets and the references installed (offline; ~40 s on two cores):

    pip install 'qkv[reference]' && qkv assets install minilm smollm2
    python tests/pretrained/make_reference_fixture.py

Nothing here uses qkv's models or tokenizers: only ``qkv.assets`` to find the files.
Stored: token ids of the varied texts (both tokenizers; MiniLM's also as sentence-transformers
truncates them), chat-template ids, MiniLM embeddings (7 significant digits), SmolLM2's
last-position logits restricted to the top 20 ids, and 32-token greedy continuations.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from importlib.metadata import version
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import torch
from pretrained_cases import (
    FIXTURE,
    FIXTURE_MAX_BYTES,
    GREEDY_TOKENS,
    LOGIT_PROMPTS,
    MINILM_EMBED,
    MINILM_TEXTS,
    SMOLLM2_CHATS,
    SMOLLM2_PROMPTS,
    SMOLLM2_TEXTS,
    TOP_K,
    chat_ids,
    hf_greedy,
)


def sig(x: float, digits: int) -> float:
    return float(f"{x:.{digits}g}")


def minilm_part(folder: Path) -> dict:
    from sentence_transformers import SentenceTransformer
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder))
    st = SentenceTransformer(str(folder), device="cpu")
    # sentence-transformers' own tokenisation: truncation to its max_seq_length (256).
    pre = getattr(st, "preprocess", None) or st.tokenize
    batch = pre(MINILM_TEXTS)
    truncated = [row[mask.bool()].tolist()
                 for row, mask in zip(batch["input_ids"], batch["attention_mask"], strict=True)]
    # The Normalize module at the end of the pipeline makes these unit vectors already.
    emb = st.encode(MINILM_EMBED, convert_to_tensor=True, normalize_embeddings=False)
    return {
        "max_seq_length": st.max_seq_length,
        "token_ids": [tok(t, truncation=False)["input_ids"] for t in MINILM_TEXTS],
        "st_token_ids": truncated,
        "embeddings": [[sig(v, 7) for v in row.tolist()] for row in emb],
    }


def smollm2_part(path: Path) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(path.parent), path.name
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    logits = []
    with torch.inference_mode():
        for prompt in LOGIT_PROMPTS:
            last = model(torch.tensor([tok(prompt)["input_ids"]])).logits[0, -1]
            values, ids = last.topk(TOP_K)
            logits.append({"ids": ids.tolist(), "values": [sig(v, 9) for v in values.tolist()]})
    return {
        "token_ids": [tok(t)["input_ids"] for t in SMOLLM2_TEXTS],
        "chat_ids": [chat_ids(tok, messages) for messages in SMOLLM2_CHATS],
        "top_logits": logits,
        "greedy": [hf_greedy(model, tok(p)["input_ids"], GREEDY_TOKENS) for p in SMOLLM2_PROMPTS],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=FIXTURE)
    args = ap.parse_args(argv)
    from qkv.assets import asset_path

    torch.set_num_threads(2)
    minilm, smollm2 = asset_path("minilm"), asset_path("smollm2")
    data = {
        "about": "written by tests/pretrained/make_reference_fixture.py from transformers and "
                 "sentence-transformers on the inputs of tests/pretrained/pretrained_cases.py",
        "versions": {m: version(m) for m in
                     ("torch", "transformers", "sentence-transformers", "tokenizers", "gguf")},
        "asset_bytes": {"minilm": (minilm / "model.safetensors").stat().st_size,
                        "smollm2": smollm2.stat().st_size},
        "minilm": minilm_part(minilm),
        "smollm2": smollm2_part(smollm2),
    }
    text = json.dumps(data, ensure_ascii=False, separators=(",", ":")) + "\n"
    size = len(text.encode("utf-8"))
    if size > FIXTURE_MAX_BYTES:
        print(f"fixture would be {size} bytes, over the {FIXTURE_MAX_BYTES} limit", file=sys.stderr)
        return 1
    args.out.write_text(text, encoding="utf-8")
    print(f"wrote {args.out} ({size} bytes)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
