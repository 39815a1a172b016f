"""The conversion cache: a converted GGUF is stored once as qkv files and read back exactly,
without touching the GGUF again; a damaged entry is ignored and rebuilt."""

from __future__ import annotations

import time

import torch

from qkv.pretrained import cache as cache_mod
from qkv.pretrained import gguf_models as smollm2_mod


def test_second_load_comes_from_the_cache_and_is_identical(smollm2, smollm2_file, monkeypatch):
    entry = cache_mod.entry_dir(smollm2_file)
    assert entry is not None and (entry / "model.safetensors").is_file()  # the fixture wrote it

    def no_gguf(*a, **k):
        raise AssertionError("a cache hit must not read the GGUF")

    monkeypatch.setattr(smollm2_mod, "read_gguf", no_gguf)
    t = time.perf_counter()
    lm = smollm2_mod.load_gguf_decoder(smollm2_file)
    model, tok = lm.model, lm.tokenizer
    seconds = time.perf_counter() - t
    ref = smollm2.model.state_dict()
    got = model.state_dict()
    assert got.keys() == ref.keys()
    assert all(torch.equal(got[k], ref[k]) for k in ref)
    assert model.lm_head.weight is model.tok_emb.weight  # still tied
    assert model.cfg == smollm2.model.cfg
    assert tok.to_dict() == smollm2.tokenizer.to_dict()
    assert lm.chat_template == smollm2.chat_template and lm.stop_ids == smollm2.stop_ids
    assert seconds < 5, f"a cache hit took {seconds:.1f} s"


def test_a_damaged_entry_is_rebuilt(smollm2, smollm2_file):
    entry = cache_mod.entry_dir(smollm2_file)
    weights = entry / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])  # truncated
    assert cache_mod.load_gpt_entry(entry) is None
    model = smollm2_mod.load_gguf_decoder(smollm2_file).model  # converts again, rewrites the entry
    assert torch.equal(model.tok_emb.weight, smollm2.model.tok_emb.weight)
    assert cache_mod.load_gpt_entry(entry) is not None


def test_cache_can_be_turned_off(monkeypatch, tmp_path):
    monkeypatch.setenv("QKV_CACHE_DIR", "off")
    assert cache_mod.cache_root() is None
    assert cache_mod.entry_dir(tmp_path) is None
    monkeypatch.setenv("QKV_CACHE_DIR", str(tmp_path))
    assert cache_mod.cache_root() == tmp_path
