"""qkv.load(FOLDER) on Hugging Face checkpoint folders, against transformers itself.

Every checkpoint is built for the test: a tiny random transformers model (seeded, float32, 2
layers, width 64; tests/helpers.py's tiny_hf_decoder for the decoders) saved with
``save_pretrained`` beside a tiny word-level ``tokenizer.json`` (helpers.save_hf_folder). qkv's
logits (or hidden states) must equal the reference's to 1e-5 and its greedy tokens must be
the same; damaged folders must give one-line PretrainedFormatErrors.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import (
    HF_DECODERS,
    HF_VOCAB,
    hf_bert_config,
    hf_decoder_config,
    hf_decoder_folder,
    save_hf_folder,
)
from helpers import HF_PROMPT as PROMPT

import qkv
from qkv.generation import generate
from qkv.pretrained import CausalLM, SentenceEncoder

transformers = pytest.importorskip("transformers", reason="reference package transformers not "
                                   "installed: pip install 'qkv[reference]'")
pytest.importorskip("safetensors")
tokenizers = pytest.importorskip("tokenizers")

V = HF_VOCAB  # vocabulary of the tiny models (ids 0..V-1 are the words "w0".."w95")


def _check_decoder(ref, lm: CausalLM) -> None:
    with torch.no_grad():
        want = ref(PROMPT).logits
        got = lm.model(PROMPT).logits
    assert got.shape == want.shape
    assert (got - want).abs().max().item() <= 1e-5
    with torch.no_grad():
        ref_ids = ref.generate(PROMPT, max_new_tokens=10, do_sample=False, eos_token_id=None,
                               pad_token_id=0, min_new_tokens=0)[0, PROMPT.shape[1]:].tolist()
    ids = [int(t[0]) for t in generate(lm.model, PROMPT, 10, temperature=0.0)]
    assert ids == ref_ids


@pytest.mark.parametrize("kind", sorted(HF_DECODERS))
def test_decoder_folder_matches_transformers(kind, tmp_path):
    ref = hf_decoder_folder(kind, tmp_path / kind)
    lm = qkv.load(str(tmp_path / kind))
    assert isinstance(lm, CausalLM)
    assert lm.architecture == hf_decoder_config(kind).model_type
    _check_decoder(ref, lm)


def test_decoder_options_are_read_from_the_config(tmp_path):
    """The config's choices reach qkv's GPTConfig (a wrong one would also fail the parity)."""
    hf_decoder_folder("llama_tied_gqa", tmp_path / "l")
    hf_decoder_folder("mistral", tmp_path / "m")
    hf_decoder_folder("qwen2", tmp_path / "q")
    llama = qkv.load(str(tmp_path / "l")).model
    assert (llama.cfg.n_kv_heads, llama.cfg.tie_embeddings, llama.cfg.rope_theta) == (2, True, 100000.0)
    assert llama.lm_head.weight is llama.tok_emb.weight
    assert qkv.load(str(tmp_path / "m")).model.cfg.max_seq_len == 32  # the sliding window
    qwen = qkv.load(str(tmp_path / "q")).model.stack.blocks[0].attn
    assert qwen.qkv.bias is not None and qwen.out_proj.bias is None


def test_gemma_options(tmp_path):
    """Gemma's options are qkv's: GeGLU, embeddings × √dim, head_dim apart from dim / n_heads."""
    ref = hf_decoder_folder("gemma", tmp_path / "g")
    gpt = qkv.load(str(tmp_path / "g")).model
    assert (gpt.cfg.mlp, gpt.cfg.embed_scale, gpt.cfg.resolved_head_dim) == ("geglu_tanh", True, 32)
    # the stored norm weights are w - 1 (Gemma's RMSNorm multiplies by 1 + w)
    want = ref.model.layers[0].input_layernorm.weight + 1
    assert torch.equal(gpt.stack.blocks[0].norm1.weight.detach(), want.detach())


def test_sharded_folder(tmp_path):
    ref = hf_decoder_folder("llama", tmp_path / "s", max_shard_size="40KB")
    shards = sorted(p.name for p in (tmp_path / "s").glob("*.safetensors"))
    assert len(shards) > 2 and (tmp_path / "s" / "model.safetensors.index.json").is_file()
    _check_decoder(ref, qkv.load(str(tmp_path / "s")))


def test_tokenizer_stops_and_text_generation(tmp_path):
    ref = hf_decoder_folder("llama", tmp_path / "t")
    (tmp_path / "t" / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "w5", "chat_template": "{% for m in messages %}{{ m['content'] }} {% endfor %}"}))
    lm = qkv.load(str(tmp_path / "t"))
    assert lm.stop_ids == (2, 5)  # config.json's eos id 2, tokenizer_config's "w5"
    assert lm.format_chat("w1 w2") == "w1 w2 "
    prompt = " ".join(f"w{i}" for i in PROMPT[0].tolist())
    assert lm.tokenizer.encode(prompt) == PROMPT[0].tolist()
    with torch.no_grad():
        ref_ids = ref.generate(PROMPT, max_new_tokens=6, do_sample=False, eos_token_id=None,
                               pad_token_id=0)[0, PROMPT.shape[1]:].tolist()
    text = lm.generate(prompt, 6, stop_at_eos=False)
    assert text.split() == [f"w{i}" for i in ref_ids]


def test_bert_with_a_head_reads_the_bert_prefixed_names(tmp_path):
    torch.manual_seed(1)
    ref = transformers.BertForMaskedLM(hf_bert_config()).float().eval()  # bert.* and cls.* names
    save_hf_folder(ref, tmp_path / "mlm")
    enc = qkv.load(str(tmp_path / "mlm"))
    ids = torch.tensor([[2, 40, 41, 7, 3]])
    with torch.no_grad():
        want = ref.bert(input_ids=ids).last_hidden_state
        assert (enc.model(ids).hidden - want).abs().max().item() <= 1e-5


def test_bert_folder_matches_transformers(tmp_path):
    torch.manual_seed(0)
    ref = transformers.BertModel(hf_bert_config()).float().eval()
    save_hf_folder(ref, tmp_path / "b")
    enc = qkv.load(str(tmp_path / "b"))
    assert isinstance(enc, SentenceEncoder)
    ids = torch.tensor([[2, 40, 41, 7, 3, 0], [2, 11, 12, 13, 14, 3]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]])
    with torch.no_grad():
        want = ref(input_ids=ids, attention_mask=mask).last_hidden_state
        got = enc.model(ids, mask).hidden
    real = mask.bool()
    assert (got[real] - want[real]).abs().max().item() <= 1e-5
    # embed(): the mean of the real tokens' states, unit length, from text through the tokenizer.
    e = enc.embed(["w40 w41 w7"], normalize=False)
    with torch.no_grad():
        ref_mean = ref(input_ids=torch.tensor([[40, 41, 7]])).last_hidden_state.mean(dim=1)
    assert (e - ref_mean).abs().max().item() <= 1e-5


def test_qkv_embed_and_similarity_read_a_bert_folder(tmp_path):
    """`qkv embed FOLDER --json`: each text's vector is the unit-length mean of transformers'
    last hidden states; a decoder folder is refused in one line."""
    import json

    from helpers import assert_one_line_error, call

    torch.manual_seed(0)
    ref = transformers.BertModel(hf_bert_config()).float().eval()
    save_hf_folder(ref, tmp_path / "b")
    rc, out, err = call(["embed", str(tmp_path / "b"), "w40 w41 w7", "w11 w12", "--json"])
    assert rc == 0, err
    got = json.loads(out)
    for row, ids in zip(got, ([40, 41, 7], [11, 12]), strict=True):
        with torch.no_grad():
            mean = ref(input_ids=torch.tensor([ids])).last_hidden_state.mean(dim=1)[0].double()
        torch.testing.assert_close(torch.tensor(row["embedding"], dtype=torch.float64),
                                   mean / mean.norm(), rtol=0, atol=1e-5)
    rc, out, err = call(["similarity", str(tmp_path / "b"), "w40 w41", "w40 w41", "w90 w91", "--json"])
    assert rc == 0 and json.loads(out)[0]["text"] == "w40 w41", err
    hf_decoder_folder("llama", tmp_path / "l")
    rc, _, err = call(["embed", str(tmp_path / "l"), "w1"])
    assert "is a decoder (a language model), not a sentence encoder" in assert_one_line_error(rc, err)


# --------------------------------------------------------------------------- bad folders


def _one_line_error(folder: Path, *needles: str) -> str:
    # ValueError: a folder that is not a checkpoint's is PretrainedFormatError, a path that is
    # not there qkv.inference's UnknownModelError (what a name means is decided before reading)
    with pytest.raises(ValueError) as e:
        qkv.load(str(folder))
    msg = str(e.value)
    assert "\n" not in msg
    for n in needles:
        assert n in msg, msg
    return msg


def test_folder_without_config(tmp_path):
    (tmp_path / "empty").mkdir()
    _one_line_error(tmp_path / "empty", "no config.json")
    _one_line_error(tmp_path / "absent", "is not a folder")


def test_truncated_shard(tmp_path):
    hf_decoder_folder("llama", tmp_path / "s", max_shard_size="40KB")
    shard = sorted((tmp_path / "s").glob("*.safetensors"))[1]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    _one_line_error(tmp_path / "s", shard.name, "truncated")


def test_missing_weights(tmp_path):
    hf_decoder_folder("llama", tmp_path / "s", max_shard_size="40KB")
    shard = sorted((tmp_path / "s").glob("*.safetensors"))[0]
    shard.unlink()
    _one_line_error(tmp_path / "s", "weights file not found", shard.name)
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "config.json").write_text((tmp_path / "s" / "config.json").read_text())
    (tmp_path / "p" / "pytorch_model.bin").write_bytes(b"pickle")
    _one_line_error(tmp_path / "p", "no model.safetensors", "pytorch_model.bin")


def test_config_that_disagrees_with_the_tensors(tmp_path):
    hf_decoder_folder("qwen2", tmp_path / "q")
    path = tmp_path / "q" / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "intermediate_size": 128}))
    _one_line_error(tmp_path / "q", "mlp.w_gate.weight", "(96, 64)", "(128, 64)")


def test_unknown_and_refused_architectures(tmp_path):
    for arch in ("t5", "gemma2"):
        (tmp_path / arch).mkdir()
        (tmp_path / arch / "config.json").write_text(json.dumps({"model_type": arch}))
        msg = _one_line_error(tmp_path / arch, f"architecture {arch!r}", "supported: llama, mistral")
    assert "soft-cap" in msg  # the refusal says why


def test_unsupported_config_option_and_tensor_type(tmp_path):
    hf_decoder_folder("llama", tmp_path / "l")
    path = tmp_path / "l" / "config.json"
    config = json.loads(path.read_text())
    path.write_text(json.dumps({**config, "rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4}}))
    _one_line_error(tmp_path / "l", "rope_type 'llama3'")
    path.write_text(json.dumps(config))
    from safetensors.torch import load_file, save_file

    weights = tmp_path / "l" / "model.safetensors"
    tensors = load_file(str(weights))
    tensors["model.norm.weight"] = tensors["model.norm.weight"].to(torch.int8)
    save_file(tensors, str(weights))
    _one_line_error(tmp_path / "l", "model.norm.weight is int8", "float32, float16, bfloat16")


def test_qkv_generate_and_attend_read_a_folder(tmp_path):
    """`qkv generate FOLDER` (greedy) prints transformers' greedy tokens; `qkv attend FOLDER`
    draws a grid, from attention weights equal to transformers' own (eager attention)."""
    from helpers import call

    from qkv.inference import open_model as load_source
    from qkv.pipelines.attention import text_attention

    ref = hf_decoder_folder("qwen2", tmp_path / "q")
    ref.config._attn_implementation = "eager"
    prompt = " ".join(f"w{i}" for i in PROMPT[0].tolist())
    with torch.no_grad():
        ref_ids = ref.generate(PROMPT, max_new_tokens=5, do_sample=False, eos_token_id=None,
                               pad_token_id=0)[0, PROMPT.shape[1]:].tolist()
        ref_att = torch.stack(ref(PROMPT, output_attentions=True).attentions)[:, 0]  # (L, H, T, T)
    rc, out, err = call(["generate", str(tmp_path / "q"), "--prompt", prompt, "--max-new-tokens", "5",
                         "--temperature", "0", "--weights", "fp32"])
    assert rc == 0, err
    assert out.startswith(prompt)
    assert out[len(prompt):].split() == [f"w{i}" for i in ref_ids]
    src = load_source(str(tmp_path / "q"))
    assert src.kind == "decoder" and (src.n_layers, src.n_heads) == (2, 4)
    torch.testing.assert_close(text_attention(src, prompt).weights, ref_att.float(), rtol=0, atol=1e-5)
    png = tmp_path / "a.png"
    rc, out, err = call(["attend", str(tmp_path / "q"), prompt, "-o", str(png)])
    assert rc == 0 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", err
