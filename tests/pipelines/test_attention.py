"""qkv.pipelines' attention values: what `qkv attend` draws and `qkv serve` sends, checked against
math written out here (softmax(QKᵀ/√d) from the model's own weights), against the model's own
full forward pass, and against qkv's generation loop."""

from __future__ import annotations

import math

import pytest
import torch

from qkv.errors import InputError, UnknownModelError
from qkv.generation import generate
from qkv.inference import open_model, resolve
from qkv.pipelines import attention as sources
from qkv.pipelines import check_layer_head

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


@pytest.fixture(scope="module")
def gpt(tiny_run):
    return open_model(tiny_run("gpt"))


def _layer0_by_hand(model, ids: list[int]) -> torch.Tensor:
    """Layer 0 of a pre-LN GPT with learned positions: (H, T, T) attention in float64."""
    x = model.tok_emb(torch.tensor(ids)) + model.pos_emb.weight[: len(ids)]  # (T, dim)
    block = model.stack.blocks[0]
    h = block.norm1(x).double()
    w = block.attn.qkv.weight.double()  # rows: [q | k | v], H * D each
    H, D = model.cfg.n_heads, model.cfg.dim // model.cfg.n_heads
    q, k, _ = (h @ w.T).split(H * D, dim=-1)
    q = q.view(-1, H, D).transpose(0, 1)  # (H, T, D)
    k = k.view(-1, H, D).transpose(0, 1)
    scores = q @ k.transpose(1, 2) / math.sqrt(D)  # (H, T, T)
    T = len(ids)
    scores = scores.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), -math.inf)
    return torch.softmax(scores, dim=-1)


def test_text_attention_equals_softmax_qk_by_hand(gpt) -> None:
    text = "ROMEO: But soft"
    att = sources.text_attention(gpt, text)
    T = len(text)  # a character tokenizer
    assert att.tokens == list(text) and att.causal and att.notes == []
    assert att.weights.shape == (gpt.n_layers, gpt.n_heads, T, T) and att.weights.dtype == torch.float32
    torch.testing.assert_close(att.weights.sum(-1), torch.ones(gpt.n_layers, gpt.n_heads, T))
    assert att.weights.triu(1).abs().max() == 0  # no position looks ahead
    with torch.no_grad():
        want = _layer0_by_hand(gpt.model, att.ids)
    torch.testing.assert_close(att.weights[0].double(), want, atol=1e-6, rtol=1e-5)


def test_long_text_is_truncated_with_a_note(gpt) -> None:
    text = "ROMEO: But soft, what light through yonder window breaks? " * 2
    att = sources.text_attention(gpt, text)
    assert len(att.tokens) == gpt.context == 32
    assert att.tokens == list(text[:32])
    assert att.notes == [f"truncated to the first 32 of {len(text)} tokens "
                         "(the model's context is 32 tokens)"]
    ids, notes = sources.encode_text(gpt, text, max_tokens=8, keep="last")
    assert ids == gpt.tokenizer.encode(text[-8:]) and "limit here is 8" in notes[0]


def test_bad_text_input(gpt) -> None:
    with pytest.raises(InputError, match="the text is empty"):
        sources.text_attention(gpt, "  \n ")
    with pytest.raises(InputError, match="never saw"):
        sources.text_attention(gpt, "ROMEO ✓")
    with pytest.raises(InputError, match="layer must be in \\[-2, 1\\]"):
        check_layer_head(gpt.n_layers, gpt.n_heads, 2, None)
    with pytest.raises(InputError, match="head must be in \\[-4, 3\\]"):
        check_layer_head(gpt.n_layers, gpt.n_heads, 0, 4)
    assert check_layer_head(gpt.n_layers, gpt.n_heads, -1, -1) == (1, 3)
    assert check_layer_head(gpt.n_layers, gpt.n_heads, None, None) == (1, None)


def test_generation_steps_match_the_full_forward_pass(gpt) -> None:
    """Each new token's row (KV cache, one token at a time) equals the last row of a full
    forward pass over everything before it, and the tokens are what greedy generate() picks."""
    prompt = gpt.tokenizer.encode("ROMEO: ")
    steps = list(sources.generate_steps(gpt, prompt, 6, layer=1, head=2, temperature=0.0))
    greedy = [int(t[0]) for t in generate(gpt.model, torch.tensor([prompt]), 6, temperature=0.0)]
    assert [s.id for s in steps] == greedy
    seq = list(prompt)
    for s in steps:
        full = sources.text_attention(gpt, gpt.tokenizer.decode(seq))
        torch.testing.assert_close(s.weights, full.weights[1, 2, -1], atol=1e-6, rtol=1e-5)
        assert s.token == gpt.tokenizer.decode([s.id])
        seq.append(s.id)
    # the mean over heads, and the context's end stops generation
    mean = next(sources.generate_steps(gpt, prompt, 1, layer=0, head=None))
    full = sources.text_attention(gpt, gpt.tokenizer.decode(prompt))
    torch.testing.assert_close(mean.weights, full.weights[0, :, -1].mean(0), atol=1e-6, rtol=1e-5)
    assert len(list(sources.generate_steps(gpt, prompt * 4, 50))) == 32 - len(prompt) * 4


def test_resolve_names_what_is_wrong(tmp_path) -> None:
    with pytest.raises(UnknownModelError, match="neither a pretrained model"):
        resolve(tmp_path / "missing")
    from qkv.pretrained import PretrainedFormatError

    with pytest.raises(PretrainedFormatError, match=r"config\.json is missing"):
        resolve(tmp_path)


def test_image_and_seq2seq_sources(tiny_run, tmp_path) -> None:
    from PIL import Image

    vit = open_model(tiny_run("vit"))
    Image.new("L", (20, 20), 200).save(tmp_path / "x.png")
    x, notes = vit.read_image(tmp_path / "x.png")
    att = vit.attention(x, layer=0)
    g = vit.model.cfg.grid
    assert att.image.shape == (1, 8, 8) and notes == ["resized 20x20 to 8x8"]
    assert [c for c, _ in att.maps] == [f"layer 0 head {h}" for h in range(4)] + ["rollout"]
    for _, m in att.maps:  # the class token's row over the patches: a share of its attention
        assert m.shape == (g, g) and 0 < float(m.sum()) <= 1 + 1e-6
    with pytest.raises(ValueError, match="is a vit run of `qkv train`, not a sentence encoder or a language"):
        open_model(tiny_run("vit"), kinds=("encoder", "decoder"))
    with pytest.raises(ValueError, match="not a readable image"):
        vit.read_image(b"GIF89a not really")

    s2s = open_model(tiny_run("seq2seq"))
    ali = s2s.alignment("  8   août 1977 ")
    assert ali.source == list("8 août 1977")  # normalised as translate does
    assert ali.weights.shape == (len(ali.output), len(ali.source))
    torch.testing.assert_close(ali.weights.sum(-1), torch.ones(len(ali.output)))
    with pytest.raises(InputError, match="the text is empty"):
        s2s.alignment("   ")
    long = s2s.alignment("1" * 200)
    assert len(long.source) == s2s.context == s2s.cfg.max_src_len and "truncated" in long.notes[0]
