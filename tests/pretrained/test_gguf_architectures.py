"""GGUF files by architecture: a tiny random Llama and Qwen2 from `transformers`, written as
GGUF the way llama.cpp's converter writes them (the `gguf` package's own tensor-name map and
metadata keys; llama's Q/K rows permuted, qwen2's not), loaded by `transformers`
(``gguf_file=``) and by ``qkv.load(path)``: logits equal (1e-5), greedy tokens identical."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import HF_PROMPT as PROMPT
from helpers import HF_VOCAB, assert_one_line_error, call, dev_package, tiny_hf_decoder

transformers = dev_package("transformers")
gguf = dev_package("gguf")

from pretrained.gguf_writing import (  # noqa: E402
    add_hf_tensor,
    add_sizes,
    finish,
    open_gguf,
    write_decoder_gguf,
    write_stub_gguf,
)

import qkv  # noqa: E402

V = HF_VOCAB


def write_gpt2_gguf(ref, path: Path) -> None:
    """A GPT-2 as llama.cpp's converter writes it: its Conv1D weights transposed to (out, in),
    the attention masks dropped, tanh GELU implied by the architecture."""
    c = ref.config
    w, names = open_gguf(path, gguf.MODEL_ARCH.GPT2, c.n_layer)
    add_sizes(w, context=c.n_positions, embedding=c.n_embd, blocks=c.n_layer, feed_forward=4 * c.n_embd,
              heads=c.n_head)
    w.add_layer_norm_eps(c.layer_norm_epsilon)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(["w", "0", "w0", *(f"w{i}" for i in range(3, V))])
    w.add_token_types([1] * V)
    w.add_token_merges(["w 0"])
    for hf_name, t in ref.state_dict().items():
        if hf_name.endswith((".attn.bias", ".attn.masked_bias")) or hf_name == "lm_head.weight":
            continue
        a = t.detach().float().numpy()
        if hf_name.endswith(("c_attn.weight", "c_proj.weight", "c_fc.weight")):
            a = a.T
        add_hf_tensor(w, names, hf_name, a.copy())
    finish(w)


def test_a_gpt2_gguf_loads_as_transformers_reads_it(tmp_path: Path) -> None:
    torch.manual_seed(0)  # 1,024 positions: transformers' GGUF reader builds gpt2 with that many
    cfg = transformers.GPT2Config(vocab_size=V, n_embd=64, n_layer=2, n_head=4, n_positions=1024,
                                  initializer_range=0.1, activation_function="gelu_new")
    ref = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    path = tmp_path / "tiny-gpt2.gguf"
    write_gpt2_gguf(ref, path)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name,
                                                              dtype=torch.float32).eval()
    lm = qkv.load(str(path), weights="fp32", cache=False)
    with torch.no_grad():
        want = ref(PROMPT).logits
        torch.testing.assert_close(theirs(PROMPT).logits, want, rtol=0, atol=1e-5)
        torch.testing.assert_close(lm.model(PROMPT).logits, want, rtol=0, atol=1e-5)
    assert lm.model.cfg.positions == "learned" and lm.model.cfg.norm == "layernorm"


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_gguf_of_each_architecture_loads_as_transformers_reads_it(tmp_path: Path, arch: str) -> None:
    ref = tiny_hf_decoder(arch, num_key_value_heads=2)
    path = tmp_path / f"tiny-{arch}.gguf"
    write_decoder_gguf(ref, arch, path)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name,
                                                              dtype=torch.float32).eval()
    lm = qkv.load(str(path), weights="fp32", cache=False)
    with torch.no_grad():
        want = ref(PROMPT).logits
        torch.testing.assert_close(theirs(PROMPT).logits, want, rtol=0, atol=1e-5)  # the file is right
        torch.testing.assert_close(lm.model(PROMPT).logits, want, rtol=0, atol=1e-5)
        ref_ids = ref.generate(PROMPT, max_new_tokens=10, do_sample=False, eos_token_id=None,
                               pad_token_id=0)[0, PROMPT.shape[1]:]
    from qkv.generation import generate

    ours = [int(t[0]) for t in generate(lm.model, PROMPT, 10, temperature=0.0)]
    assert ours == ref_ids.tolist()
    assert lm.name == path.name and lm.model.cfg.qkv_bias == (arch == "qwen2")


def test_a_gguf_of_another_architecture_is_one_line(tmp_path: Path) -> None:
    path = write_stub_gguf(tmp_path / "phi.gguf", "phi2")
    rc, _, err = call(["generate", str(path), "--prompt", "a"])
    line = assert_one_line_error(rc, err)
    assert "GGUF architecture 'phi2' is not supported (supported: llama, qwen2, gpt2, gemma, bert)" in line


def test_a_tensor_type_the_gguf_package_cannot_read_is_named(tmp_path: Path, monkeypatch) -> None:
    ref = tiny_hf_decoder("qwen2")
    path = tmp_path / "q.gguf"
    write_decoder_gguf(ref, "qwen2", path)

    def cannot(data, qtype):
        raise NotImplementedError(qtype)

    monkeypatch.setattr(gguf.quants, "dequantize", cannot)
    rc, _, err = call(["generate", str(path), "--prompt", "w3"])
    assert "is stored as F32, a type the gguf package cannot dequantise" in assert_one_line_error(rc, err)


def test_qkv_attend_reads_a_gguf_file(tmp_path: Path) -> None:
    """`qkv attend FILE.gguf`: the weights it draws equal transformers' eager attentions of the
    model the file was written from."""
    from qkv.inference import open_model as load_source
    from qkv.pipelines.attention import text_attention

    ref = tiny_hf_decoder("qwen2")
    ref.config._attn_implementation = "eager"
    path = tmp_path / "q.gguf"
    write_decoder_gguf(ref, "qwen2", path)
    src = load_source(str(path))
    assert src.kind == "decoder"
    ids = [3, 17, 42, 5]
    with torch.no_grad():
        want = torch.stack(ref(torch.tensor([ids]), output_attentions=True).attentions)[:, 0]
    with torch.no_grad():  # the ids themselves: this file's one-merge BPE cannot spell "w17"
        out = src.model(torch.tensor([ids]), backend="reference", return_weights=True)
    torch.testing.assert_close(torch.stack([w[0] for w in out.weights]), want, rtol=0, atol=1e-5)
    assert text_attention(src, "w0w0").weights.shape[:2] == (2, 4)  # the text path reads it too
    rc, _, err = call(["attend", str(path), "w3 w17 w42", "-o", str(tmp_path / "a.png")])
    assert rc == 0 and (tmp_path / "a.png").read_bytes()[:4] == b"\x89PNG", err


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_4_bit_gguf_decodes_in_4_bits_biases_and_all(tmp_path: Path, arch: str) -> None:
    """A Q4_0 file (Qwen2's q/k/v biases included) loads by default in qkv's 4-bit path: its
    logits near transformers' reading of the same file (which dequantises to float32), to the
    bf16 activations' precision, and the biases kept exactly."""
    ref = tiny_hf_decoder(arch, num_key_value_heads=2)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith("proj.bias"):
                p.normal_(0.0, 0.5)  # biases that matter
    path = tmp_path / f"q4-{arch}.gguf"
    write_decoder_gguf(ref, arch, path, q4_0=True)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name,
                                                              dtype=torch.float32).eval()
    lm = qkv.load(str(path), cache=False)
    assert lm.weights == "q4" and lm.stored_as == ("Q4_0",)
    x = torch.tensor([[3, 17, 42, 5, 9, 11]])
    with torch.no_grad():
        want, got = theirs(x).logits, lm.model(x).logits.float()
    assert (got - want).abs().max().item() <= 0.03 * want.abs().max().item()
    if arch == "qwen2":
        bias = lm.model.stack.blocks[0].attn.qkv.bias
        q_bias = theirs.model.layers[0].self_attn.q_proj.bias
        assert torch.equal(bias[: q_bias.shape[0]], q_bias.detach().float())


def test_a_gguf_without_a_rope_base_takes_llama_cpp_s_default(tmp_path: Path) -> None:
    """No {arch}.rope.freq_base: 10000, as llama.cpp reads it (the original RoPE's base, and
    transformers' default for the model written here), not a refusal."""
    ref = tiny_hf_decoder("qwen2")
    assert float(ref.config.rope_parameters["rope_theta"]) == 10000.0
    write_decoder_gguf(ref, "qwen2", tmp_path / "norope.gguf", rope_base=False)
    lm = qkv.load(str(tmp_path / "norope.gguf"), weights="fp32", cache=False)
    assert lm.model.cfg.rope_theta == 10000.0
    x = torch.tensor([[3, 17, 42, 5]])
    with torch.no_grad():
        assert (lm.model(x).logits - ref(x).logits).abs().max().item() <= 1e-5
