"""The compiled decoding step (qkv.generation.compiled) against the eager model it compiles:
the same greedy tokens and logits to float rounding, one compiled program across positions and
requests, a fresh compile when the model is changed after compiling (the guards it skips), and
no sharing between two models of different structure. Reference: the eager forward pass, which
test_decode.py checks against the no-cache forward."""

from __future__ import annotations

import pytest
import torch

from qkv.generation import generate
from qkv.generation.compiled import CompiledDecoder, compiled_decoder
from qkv.models.gpt import GPT, GPTConfig

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py

V = 48


LLAMA = dict(positions="rope", norm="rmsnorm", bias=False)  # SmolLM2's kind of block
GPT2 = dict(positions="learned", norm="layernorm", bias=True)  # what `qkv train` builds


def model(mlp: str = "swiglu", seed: int = 0, ctx: int = 64, kind: dict = LLAMA) -> GPT:
    torch.manual_seed(seed)
    m = GPT(GPTConfig(vocab_size=V, max_seq_len=ctx, dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                      mlp=mlp, mlp_hidden=64, **kind))
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() >= 2:  # large weights: greedy decoding sees varied contexts
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return m.eval()


def tokens(m: GPT, x: torch.Tensor, n: int, **kw) -> list[int]:
    return [int(t[0]) for t in generate(m, x, n, temperature=0.0, **kw)]


@pytest.mark.parametrize("kind", [LLAMA, GPT2], ids=["llama", "gpt2"])
@torch.inference_mode()
def test_compiled_steps_equal_eager_logits_at_every_position(kind):
    m = model("swiglu" if kind is LLAMA else "gelu", kind=kind)
    dec = CompiledDecoder(m, cache_len=40)
    dec.begin()
    x = torch.randint(0, V, (1, 5), generator=torch.Generator().manual_seed(3))
    c_eager, c_comp = m.make_cache(1, 40), dec.make_cache(1)
    m(x, cache=c_eager)
    m(x, cache=c_comp)  # the prompt runs eagerly in both
    for i in range(12):  # positions 5..16: the first steps compile, later ones reuse
        tok = torch.tensor([[(7 * i + 1) % V]])
        want = m(tok, cache=c_eager, last_only=True).logits
        got = dec.step(tok, c_comp)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert c_comp.pos == c_eager.pos == 17
    assert dec.compilations == 1 and dec.compile_seconds > 0


def test_generate_compile_gives_the_eager_tokens_and_compiles_once_per_model():
    m = model(seed=4)
    x = torch.randint(0, V, (1, 6), generator=torch.Generator().manual_seed(5))
    want = tokens(m, x, 20)
    assert tokens(m, x, 20, mode="jit") == want
    dec = compiled_decoder(m)
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert tokens(m, x, 20, mode="jit") == want  # a second request: no new compilation
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == before
    assert dec.compilations == 1
    # Longer than the fixed cache: decodes eagerly, same tokens.
    small = model(seed=4, ctx=64)
    compiled_decoder(small, cache_len=8)
    assert tokens(small, x, 20, mode="jit") == want


def test_a_model_changed_after_compiling_is_compiled_again():
    m = model(seed=6)
    x = torch.randint(0, V, (1, 4), generator=torch.Generator().manual_seed(7))
    tokens(m, x, 8, mode="jit")
    dec = compiled_decoder(m)
    other = model(seed=9)
    m.load_state_dict(other.state_dict())  # in place: the same tensors, new values
    assert tokens(m, x, 8, mode="jit") == tokens(other, x, 8)
    assert dec.compilations == 1  # in-place values need no new compile
    m.to(torch.float64)  # new tensors: the skipped guards would have caught this
    want = tokens(other.to(torch.float64), x, 8)
    assert tokens(m, x, 8, mode="jit") == want
    assert dec.compilations == 2


def test_two_models_of_different_structure_do_not_share_a_compiled_program():
    a, b = model("swiglu", seed=1), model("gelu", seed=2)  # same cache shape, different blocks
    x = torch.randint(0, V, (1, 4), generator=torch.Generator().manual_seed(8))
    for m in (a, b, a):
        with torch.inference_mode():
            dec = compiled_decoder(m)
            dec.begin()
            c_eager, c_comp = m.make_cache(1, 64), dec.make_cache(1)
            m(x, cache=c_eager)
            m(x, cache=c_comp)
            for t in range(4):
                tok = torch.tensor([[t + 1]])
                torch.testing.assert_close(dec.step(tok, c_comp),
                                           m(tok, cache=c_eager, last_only=True).logits,
                                           rtol=1e-5, atol=1e-5)


def test_step_refuses_a_cache_of_another_length():
    m = model()
    dec = CompiledDecoder(m, cache_len=16)
    dec.begin()
    with pytest.raises(ValueError, match="16 positions"):
        dec.step(torch.tensor([[1]]), m.make_cache(1, 32))


@pytest.mark.parametrize("weights", ["q4", "int8", "bf16"])
def test_compiled_quantized_steps_agree_with_eager(weights):
    """SmolLM2's decoding formats on a tiny Llama-style model (widths the 4-bit kernel takes):
    the compiled step fuses the casts around each quantised product differently, so logits
    agree to bf16 rounding, not bit for bit, and the greedy token is the same."""
    from qkv.pipelines import CausalLM

    torch.manual_seed(11)
    m = GPT(GPTConfig(vocab_size=64, max_seq_len=64, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                      mlp="swiglu", mlp_hidden=128, **LLAMA)).eval()
    lm = CausalLM("tiny", m, tokenizer=None, stored_as=("Q4_1",)).quantize(weights)
    dec = CompiledDecoder(lm.model, cache_len=32)
    x = torch.randint(0, 64, (1, 6), generator=torch.Generator().manual_seed(12))
    with torch.inference_mode():
        dec.begin()
        c_eager, c_comp = m.make_cache(1, 32), dec.make_cache(1)
        m(x, cache=c_eager)
        m(x, cache=c_comp)
        for t in range(8):
            tok = torch.tensor([[(5 * t + 3) % 64]])
            want = m(tok, cache=c_eager, last_only=True).logits.float()
            got = dec.step(tok, c_comp).float()
            scale = want.abs().max()
            assert (got - want).abs().max() <= 0.02 * scale
            assert int(got.argmax()) == int(want.argmax())
    assert dec.failed is None
