"""One typed model per kind, whatever it is opened from (qkv.inference.open_model): a run of each
family, a Hugging Face folder and a GGUF file of a decoder and of an encoder, and the bundled
models. Each typed field is checked against what the source itself says (its config.json, its
file's metadata, transformers' reading of it), and the one rule of how a decoder holds its
weights against the tensors' dtypes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from pretrained.asset_skip import require_asset

from qkv.inference import open_model, resolve
from qkv.pipelines import CausalLM, ImageCaptioner, ImageClassifier, SentenceEncoder, Translator

transformers = pytest.importorskip("transformers", reason="reference package transformers not installed: "
                                   "pip install 'qkv[reference]'")
pytest.importorskip("gguf", reason="gguf not installed: pip install 'qkv[pretrained]'")


def _config(run: Path) -> dict:
    return json.loads((run / "config.json").read_text())


def test_a_run_of_each_family_is_its_kind(tiny_run) -> None:
    gpt = open_model(tiny_run("gpt"))
    cfg = _config(tiny_run("gpt"))
    assert isinstance(gpt, CausalLM)
    assert (gpt.kind, gpt.architecture, gpt.weights) == ("decoder", "gpt", "fp32")
    assert (gpt.context, gpt.n_layers, gpt.n_heads) == (cfg["model"]["max_seq_len"], cfg["model"]["n_layers"],
                                                        cfg["model"]["n_heads"])
    assert gpt.run_dir == tiny_run("gpt") and gpt.stop_ids == () and gpt.default_prompt == "\n"
    assert gpt.chat_template is None and gpt.stored_as == ()

    vit = open_model(tiny_run("vit"))
    data = _config(tiny_run("vit"))["data"]
    assert isinstance(vit, ImageClassifier) and vit.kind == "image"
    assert (vit.classes, vit.mean, vit.std) == (data["classes"], data["mean"], data["std"])
    assert vit.dataset == data["name"]
    assert vit.context == vit.model.cfg.grid ** 2

    s2s = open_model(tiny_run("seq2seq"))
    cfg = _config(tiny_run("seq2seq"))
    assert isinstance(s2s, Translator) and s2s.kind == "seq2seq" and (s2s.n_layers, s2s.n_heads) == (1, 1)
    assert (s2s.src.symbols(), s2s.tgt.symbols()) == (cfg["src_chars"], cfg["tgt_chars"])
    assert s2s.context == cfg["model"]["max_src_len"]

    cap = open_model(tiny_run("captioner"))
    cfg = _config(tiny_run("captioner"))
    assert isinstance(cap, ImageCaptioner) and cap.kind == "image"
    assert (cap.vocab.symbols(), cap.max_len) == (cfg["words"], cfg["max_len"])
    for run in ("vit", "seq2seq", "captioner"):
        with pytest.raises(ValueError, match=f"are for GPT runs and decoders.* is a {run} run"):
            open_model(tiny_run(run), dtype="bfloat16")


def test_a_hugging_face_folder_of_a_decoder_and_of_an_encoder(tmp_path: Path) -> None:
    from helpers import HF_PROMPT as PROMPT
    from helpers import hf_bert_config, hf_decoder_folder, save_hf_folder

    ref = hf_decoder_folder("gpt2", tmp_path / "gpt2")  # bos 1, eos 2 in its config
    lm = open_model(tmp_path / "gpt2")
    assert isinstance(lm, CausalLM) and (lm.name, lm.architecture, lm.stop_ids) == ("gpt2", "gpt2", (2,))
    assert lm.weights == "fp32" and lm.stored_as == () and lm.context == ref.config.n_positions
    with torch.no_grad():
        assert (lm.model(PROMPT).logits - ref(PROMPT).logits).abs().max() <= 1e-5
    torch.manual_seed(0)
    save_hf_folder(transformers.BertModel(hf_bert_config()).float().eval(), tmp_path / "bert")
    enc = open_model(tmp_path / "bert")
    assert isinstance(enc, SentenceEncoder)
    assert (enc.kind, enc.architecture, enc.name) == ("encoder", "bert", "bert")
    assert enc.max_tokens == enc.context == 64
    with pytest.raises(ValueError, match="weights= is for decoders; bert is an encoder"):
        open_model(tmp_path / "bert", weights="int8")


def test_a_gguf_of_a_decoder_and_of_an_encoder(tmp_path: Path) -> None:
    from helpers import tiny_hf_decoder
    from pretrained.gguf_writing import bert_file, write_decoder_gguf

    path = tmp_path / "q.gguf"
    write_decoder_gguf(tiny_hf_decoder("qwen2"), "qwen2", path)
    lm = open_model(path, cache=False)
    assert isinstance(lm, CausalLM) and (lm.name, lm.architecture, lm.stop_ids) == ("q.gguf", "qwen2", (2,))
    assert lm.stored_as == ("F32",) and lm.weights == "fp32"  # auto: floats stay fp32
    q4 = tmp_path / "q4.gguf"
    write_decoder_gguf(tiny_hf_decoder("llama", num_key_value_heads=2), "llama", q4, q4_0=True)
    lm4 = open_model(q4, cache=False)
    assert (lm4.stored_as, lm4.weights) == (("Q4_0",), "q4")  # auto: the file's own 4 bits
    assert open_model(q4, cache=False, weights="fp32").weights == "fp32"
    _, _, bert = bert_file(tmp_path)
    enc = open_model(bert)
    assert isinstance(enc, SentenceEncoder) and (enc.name, enc.architecture) == ("tiny-bert.gguf", "bert")
    assert resolve(bert).kind == "encoder" and resolve(path).kind == "decoder"


def test_the_bundled_models() -> None:
    require_asset("minilm")
    enc = open_model("minilm")
    assert isinstance(enc, SentenceEncoder) and (enc.name, enc.max_tokens, enc.n_layers) == ("minilm", 256, 6)
    require_asset("smollm2")
    lm = open_model("smollm2")
    assert isinstance(lm, CausalLM)
    assert (lm.name, lm.architecture, lm.stored_as) == ("smollm2", "llama", ("Q4_1",))
    assert lm.weights == "q4" and lm.stop_ids == (2,) and "<|im_start|>" in (lm.chat_template or "")
    assert lm.context == 8192 and (lm.n_layers, lm.n_heads) == (30, 9)


def test_how_a_decoder_holds_its_weights_is_one_rule(tiny_run) -> None:
    """weights when given, else dtype, else auto; int8/q4 are refused a cast afterwards."""
    run = tiny_run("gpt")
    head = lambda lm: next(p for n, p in lm.model.named_parameters() if n.endswith("mlp.fc_in.weight"))  # noqa: E731
    bf = open_model(run, dtype="bfloat16")
    assert bf.weights == "bf16" and head(bf).dtype == torch.bfloat16
    assert open_model(run, weights="fp32", dtype="bfloat16").weights == "fp32"  # weights wins
    i8 = open_model(run, weights="int8")
    assert i8.weights == "int8"
    with pytest.raises(ValueError, match="stored as int8, which cannot be cast"):
        i8.to("float32")
    with pytest.raises(ValueError, match=r"q4 decodes from a file's own 4-bit groups.*floats \(a qkv run\)"):
        open_model(run, weights="q4")
    with pytest.raises(ValueError, match="dtype must be one of"):
        open_model(run, dtype="float16")


FREED = """
import ctypes, qkv
lm = qkv.load("smollm2")  # kept: its memory is in use
def rss():
    return int(open("/proc/self/status").read().split("VmRSS:")[1].split()[0])  # KB
before = rss()
ctypes.CDLL(None).malloc_trim(0)
print(before - rss())  # KB
"""


def test_a_load_hands_the_memory_it_freed_back():
    """Reading SmolLM2's GGUF and quantising it free float matrices that glibc keeps resident
    (378 MB of the process's 895 before the load returned them): after ``qkv.load`` a
    ``malloc_trim`` of the process's own finds little left to return (a fresh process)."""
    import subprocess
    import sys

    from helpers import child_env

    require_asset("smollm2")
    r = subprocess.run([sys.executable, "-c", FREED], env=child_env(), capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-800:]
    assert int(r.stdout.split()[-1]) < 32 * 1024, r.stdout  # KB still held after the load (89 MB without)
