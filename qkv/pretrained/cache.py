"""A cache of converted checkpoints, so that a GGUF is parsed and dequantised only once.

Reading SmolLM2's GGUF takes ~8 s on two cores (the ``gguf`` package parses ~100k metadata
strings, then every block is dequantised). The result — a qkv GPT, its tokenizer and the chat
settings — is saved once as qkv files (``config.json``, ``tokenizer.json``, safetensors) under
``$QKV_CACHE_DIR`` (default ``$XDG_CACHE_HOME/qkv`` or ``~/.cache/qkv``), keyed by the source
file's path, size and modification time and by the converter's version; later loads read
those in about a second. Entries are written to a temporary folder and renamed into place,
so a crash never leaves half an entry; an entry that cannot be read is ignored and rebuilt.
``QKV_CACHE_DIR=off`` turns the cache off.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from qkv.models.gpt import GPT, GPTConfig
from qkv.paths import cache_root
from qkv.pipelines.text import CausalLM
from qkv.tokenizers.base import load_tokenizer, save_tokenizer
from qkv.tokenizers.hf import HFTokenizer

CONVERTER_VERSION = 5  # bump when a converter's output changes (2: info records weight types;
# 3: byte-level GGUF tokenizers split by tokenizer.ggml.pre; 4: SentencePiece's dummy prefix
# before every run of text; 5: the decoder's typed fields instead of an info dict)


def entry_dir(source: Path) -> Path | None:
    """Where the conversion of the file ``source`` is cached (None when the cache is off): named
    by the file and keyed by its resolved path, size and modification time, never by a model's
    name (two files of one name never share an entry)."""
    root = cache_root()
    if root is None:
        return None
    st = source.stat()
    key = f"{source.resolve()}|{st.st_size}|{st.st_mtime_ns}|{CONVERTER_VERSION}"
    return root / "converted" / f"{source.stem[:40]}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def save_gpt_entry(folder: Path, lm: CausalLM) -> None:
    """Write a converted decoder atomically (a temporary sibling folder renamed into place)."""
    from safetensors.torch import save_model

    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    fields = {"name": lm.name, "architecture": lm.architecture, "chat_template": lm.chat_template,
              "stop_ids": list(lm.stop_ids), "stored_as": list(lm.stored_as)}
    try:
        (tmp / "config.json").write_text(
            json.dumps({"model": lm.model.cfg.to_dict(), "decoder": fields}), encoding="utf-8")
        save_tokenizer(lm.tokenizer, tmp / "tokenizer.json")
        save_model(lm.model, str(tmp / "model.safetensors"))  # tied weights stored once
        os.replace(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def load_gpt_entry(folder: Path) -> CausalLM | None:
    """Read an entry (float32, eval mode); None if it is missing or unreadable (the caller
    converts again)."""
    from safetensors.torch import load_model

    from qkv.pretrained._build import skip_init

    try:
        data = json.loads((folder / "config.json").read_text(encoding="utf-8"))
        cfg = GPTConfig(**data["model"])
        tok = load_tokenizer(folder / "tokenizer.json")
        if not isinstance(tok, HFTokenizer):
            return None
        with skip_init():
            model = GPT(cfg)
        load_model(model, str(folder / "model.safetensors"), strict=True)
        d: dict[str, Any] = data["decoder"]
        return CausalLM(str(d["name"]), model.eval(), tok, d["chat_template"],
                        tuple(int(i) for i in d["stop_ids"]), str(d["architecture"]),
                        tuple(str(t) for t in d["stored_as"]))
    except Exception:  # any damage: ignore the entry, it is rebuilt from the source file
        return None
