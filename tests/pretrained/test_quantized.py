"""SmolLM2 decoded from int8 and from the GGUF's own 4-bit groups (weights="int8" / "q4"),
against the dequantised fp32 model on held text, and against plain float products of the very
weights each layer multiplies by."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from qkv.layers.quant import Int4Linear, Int4SwiGLU, Int8Linear, TopKRefinedLinear, int4_kernels_available

pytestmark = pytest.mark.skipif(not int4_kernels_available(), reason="needs PyTorch's CPU int4 kernels")
POSITIONS = 300  # teacher-forced positions scored (the issue asks for >= 256)


@pytest.fixture(scope="module")
def held_ids(smollm2) -> torch.Tensor:
    """(1, POSITIONS + 1) tokens of English prose the tests never tuned on: Python's own docs."""
    import pydoc_data.topics

    text = " ".join(pydoc_data.topics.topics[k] for k in ("assert", "for", "while", "with"))
    ids = smollm2.tokenizer.encode(" ".join(text.split()))
    assert len(ids) > POSITIONS
    return torch.tensor([ids[: POSITIONS + 1]])


@pytest.fixture(scope="module")
def formats(smollm2) -> dict:
    return {w: copy.deepcopy(smollm2).quantize(w) for w in ("int8", "q4")}


def logits(lm, ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return lm.model(ids[:, :-1]).logits[0].float()  # (POSITIONS, V)


def perplexity(lg: torch.Tensor, ids: torch.Tensor) -> float:
    return math.exp(F.cross_entropy(lg, ids[0, 1:]).item())


def test_formats_replace_the_projections(formats) -> None:
    q4 = formats["q4"].model
    kinds = {type(m) for name, m in q4.named_modules() if name.startswith("stack.blocks.")}
    assert Int4Linear in kinds and Int4SwiGLU in kinds and nn.Linear not in kinds
    from qkv.kernels import q8_op
    from qkv.layers.quant import Q8Linear

    head = Q8Linear if q8_op() is not None else Int8Linear  # the file's Q8_0 blocks on qkv's kernel
    assert isinstance(q4.lm_head, TopKRefinedLinear) and isinstance(q4.lm_head.approx, head)
    assert q4.lm_head.weight.data_ptr() == q4.tok_emb.weight.data_ptr()  # shared, not copied
    assert all(not isinstance(m, nn.Linear) for m in formats["int8"].model.modules())
    assert formats["q4"].weights == "q4"


# Measured on 1,000 positions of the same text, these 300 first (benchmarks/pretrained_parity.py,
# BENCHMARKS.md), on PyTorch's kernels (bf16 activations): q4 99.3%, int8 96.9%, and the bf16
# model 97.6%. int8 rows cannot hold SmolLM2's 4-bit groups as they are (each row's range spans
# many groups): its top-1 agreement misses the 99% that q4 meets. On qkv's kernels (the file's
# float16 scales, activations carried to 1/256 of an int8 step, the head in the file's Q8_0
# blocks) q4 is the fp32 model to rounding: 300 of 300 here, perplexity -0.02%.
TOP1 = {"q4": 0.99, "int8": 0.965}


@pytest.mark.parametrize("weights", ["int8", "q4"])
def test_quantized_agrees_with_fp32_on_held_text(smollm2, formats, held_ids, weights: str) -> None:
    from qkv.kernels import int4_op

    ref, got = logits(smollm2, held_ids), logits(formats[weights], held_ids)
    top1 = (ref.argmax(-1) == got.argmax(-1)).float().mean().item()
    ppl_ref, ppl = perplexity(ref, held_ids), perplexity(got, held_ids)
    print(f"{weights}: top-1 agreement {top1:.2%} over {POSITIONS} positions; perplexity {ppl:.3f} "
          f"vs fp32 {ppl_ref:.3f} ({ppl / ppl_ref - 1:+.2%})")
    exact = weights == "q4" and int4_op() is not None
    assert top1 >= (0.997 if exact else TOP1[weights])
    assert abs(ppl / ppl_ref - 1) <= (0.001 if exact else 0.01)


def _reference_output(mod: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, float]:
    """(float64 output of ``mod`` from its dequantised weights, relative tolerance)."""
    x = x.reshape(-1, x.shape[-1]).bfloat16().double()  # what the kernels read
    if isinstance(mod, Int4SwiGLU):
        gu = x @ mod.gate_up.dequantize().double().T
        g, u = gu.split(mod.hidden, dim=-1)
        h = (F.silu(g) * u).bfloat16().double()  # the down product reads a bf16 hidden
        # bf16 rounding of the gate|up output, of silu and of the product before it: 2^-7
        return h @ mod.down.dequantize().double().T, 2 ** -6
    return x @ mod.dequantize().double().T, 2 ** -7  # bf16 output rounding is 2^-9


@pytest.mark.parametrize("weights", ["int8", "q4"])
def test_every_layer_equals_a_plain_product_of_its_weights(formats, held_ids, weights: str) -> None:
    """Each quantised projection (and q4's fused SwiGLU), on the activations it really sees on
    held text: the kernels' output equals the float64 product of its dequantised matrices with
    the inputs rounded to bf16 as the kernels read them, to bf16 precision."""
    lm = formats[weights]
    seen: list[tuple[str, float, float]] = []

    def check(name):
        def hook(mod, inputs, out):
            ref, tol = _reference_output(mod, inputs[0])
            err = (out.reshape(ref.shape).double() - ref).abs().max().item()
            seen.append((name, err / ref.abs().max().item(), tol))
        return hook

    from qkv.layers.quant import Q8Linear

    kinds = (Int4Linear, Int8Linear, Q8Linear, Int4SwiGLU)
    hooks = [m.register_forward_hook(check(n)) for n, m in lm.model.named_modules()
             if isinstance(m, kinds) and n.startswith("stack.")
             and not n.endswith(("mlp.gate_up", "mlp.down"))]  # inside Int4SwiGLU
    try:
        logits(lm, held_ids[:, :33])
    finally:
        for h in hooks:
            h.remove()
    worst = max(seen, key=lambda t: t[1] / t[2])
    print(f"{weights}: {len(seen)} layers, worst relative error {worst[1]:.2e} ({worst[0]})")
    assert len(seen) == 30 * (3 if weights == "q4" else 5)  # q4: qkv, out_proj, fused MLP
    assert all(err < tol for _, err, tol in seen)


@pytest.mark.parametrize("weights", ["int8", "q4"])
def test_refined_head_equals_the_fp32_product_on_top_logits(formats, held_ids, weights: str) -> None:
    lm = formats[weights]
    with torch.inference_mode():
        h = lm.model.stack(lm.model.tok_emb(held_ids[:, :-1]), rope=lm.model.rope).x  # (1, T, dim)
        got = lm.model.lm_head(h)[0]
        exact = h[0].double() @ lm.model.tok_emb.weight.double().T
    top = exact.topk(8, dim=-1).indices
    torch.testing.assert_close(got.double().gather(1, top), exact.gather(1, top), rtol=1e-5, atol=1e-4)
    assert torch.equal(got.argmax(-1), exact.argmax(-1))


@pytest.mark.parametrize("weights", ["int8", "q4"])
def test_cache_and_no_cache_agree(formats, weights: str) -> None:
    lm = formats[weights]
    with_cache = lm.generate("The capital of France is", 16, use_cache=True, stop_at_eos=False)
    without = lm.generate("The capital of France is", 16, use_cache=False, stop_at_eos=False)
    assert with_cache == without and with_cache.startswith(" Paris")


def test_q4_answers_the_chat_question(formats) -> None:
    assert "Paris" in formats["q4"].generate("What is the capital of France? Answer in one sentence.",
                                             chat=True, max_new_tokens=20)


def test_q4_keeps_the_files_own_codes(smollm2, smollm2_file) -> None:
    """The Q4_1 blocks of one matrix, read raw from the GGUF: the 4-bit layer built from the
    dequantised weights holds exactly the file's codes, scales and minima."""
    gguf = pytest.importorskip("gguf", reason="gguf not installed: pip install 'qkv[pretrained]'")
    reader = gguf.GGUFReader(str(smollm2_file))
    t = next(t for t in reader.tensors if t.name == "blk.3.ffn_down.weight")
    assert t.tensor_type.name == "Q4_1"
    blocks = np.asarray(t.data, dtype=np.uint8).reshape(-1, 20)  # [d f16][m f16][16 bytes]
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)[:, 0]
    m = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)[:, 0]
    qs = blocks[:, 4:]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=1)  # elements 0..15, then 16..31
    w = smollm2.model.stack.blocks[3].mlp.w_down.weight
    # qkv's kernel (where it builds): the file's codes, and its float16 d and m, bit for bit
    from qkv.kernels import int4_op

    layer = Int4Linear.from_float(w, 32, kernel="qkv" if int4_op() is not None else "aten")
    if layer.kernel == "qkv":
        ours = torch.stack([layer.codes & 0xF, layer.codes >> 4], dim=-1).reshape(-1, 32).numpy()
        assert (ours == codes).all()
        dm = layer.dm.float()  # (N/16, G, 2, 16): rows 16·nb + j, groups G
        for i, want in ((0, d), (1, m)):
            np.testing.assert_array_equal(dm[:, :, i].permute(0, 2, 1).reshape(-1).numpy(), want)
    # PyTorch's kernel: its (scale, zero) in the activation dtype
    layer = Int4Linear.from_float(w, 32, act_dtype=torch.float32, kernel="aten")
    ours = torch.stack([layer.codes & 0xF, layer.codes >> 4], dim=-1).reshape(-1, 32).numpy()
    assert (ours == codes).mean() > 0.999  # a code may differ where d·q + m rounded in fp32
    sz = layer.scales_zeros.float()  # (G, N, 2), rows of W in order N, groups G
    scale = sz[..., 0].t().reshape(-1).numpy()
    np.testing.assert_allclose(scale, d, rtol=1e-5, atol=1e-9)
    np.testing.assert_allclose(sz[..., 1].t().reshape(-1).numpy() - 8 * scale, m, rtol=0, atol=1e-6)


def test_q4_answers_the_readme_chat_question(formats) -> None:
    """README: ``qkv.load("smollm2")`` (q4) answers the bare question, whose first answer token
    is a near tie in fp32 ("The" vs "L", margin 0.08) that bf16 rounding can flip."""
    assert formats["q4"].generate("What is the capital of France?", chat=True,
                                  max_new_tokens=20) == "The capital of France is Paris."


def test_q4_refuses_a_file_not_stored_in_4_bits(smollm2) -> None:
    lm = copy.copy(smollm2)
    lm.weights, lm.stored_as = "fp32", ("Q6_K", "Q8_0")
    with pytest.raises(ValueError, match=r"all Q4_0 or all Q4_1.*Q6_K, Q8_0.*int8"):
        lm.quantize("q4")
    with pytest.raises(ValueError, match="weights must be one of"):
        lm.quantize("q3")


def test_cli_generates_from_q4_by_default_and_names_the_format(smollm2_file) -> None:
    from helpers import call

    rc, out, err = call(["generate", "smollm2", "--prompt", "The capital of France is",
                         "--temperature", "0", "--max-new-tokens", "3"])
    assert rc == 0, err
    assert out.startswith("The capital of France is Paris")
    assert "weights q4" in err  # auto picked the file's own 4-bit groups
    rc, out, err = call(["generate", "smollm2", "--prompt", "The capital of France is",
                         "--temperature", "0", "--max-new-tokens", "3", "--weights", "fp32"])
    assert rc == 0 and out.startswith("The capital of France is Paris") and "weights fp32" in err


def test_cli_refuses_q4_for_a_run_qkv_trained(tiny_run) -> None:
    from helpers import assert_one_line_error, call

    run = tiny_run("gpt")  # the session's: generating reads a run, never writes it
    rc, _, err = call(["generate", str(run), "--weights", "q4", "--prompt", "a"])
    assert "--weights int8" in assert_one_line_error(rc, err)
    rc, _, err = call(["generate", str(run), "--weights", "int8", "--prompt", "a",
                         "--max-new-tokens", "5", "--temperature", "0"])
    assert rc == 0, err


@pytest.mark.slow  # compiles SmolLM2's decoding step: ~50 s with an empty inductor cache
def test_compiled_q4_step_agrees_with_the_eager_one_on_held_text(formats, held_ids) -> None:
    """Teacher-forced through the compiled 1-token step (`generate(mode="build")`) vs the eager
    q4 model: the step fuses the bf16 casts around each 4-bit product differently, so the
    logits agree to bf16 rounding and the top-1 token at >= 99% of positions."""
    from qkv.generation.compiled import CompiledDecoder

    m = formats["q4"].model
    dec = CompiledDecoder(m, cache_len=POSITIONS + 8)
    ids = held_ids[:, :POSITIONS]
    with torch.inference_mode():
        dec.begin()
        cache = dec.make_cache(1)
        first = m(ids[:, :1], cache=cache).logits[0]
        steps = [dec.step(ids[:, t:t + 1], cache)[0] for t in range(1, POSITIONS)]
    got = torch.cat([first, *steps]).float()  # (POSITIONS, V)
    want = logits(formats["q4"], held_ids)
    assert dec.failed is None
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.99
    assert abs(perplexity(got, held_ids) / perplexity(want, held_ids) - 1) < 0.01


def test_the_native_step_decodes_q4_as_the_model_does(smollm2, formats, held_ids) -> None:
    """SmolLM2 in q4 fed token by token through the native one-token step (qkv::Decoder) after a
    16-token prompt: each position's logits against the fp32 model's (the independent
    reference) as the q4 model's own forward is held above, and against that forward itself."""
    from qkv.generation import native_step

    lm = formats["q4"]
    if native_step.unsupported(lm.model) is not None:
        pytest.skip(f"no native step here: {native_step.unsupported(lm.model)}")
    n, start = 120, 16
    ids = held_ids[:, : n + 1]
    step = native_step.NativeStep(lm.model, n + 1)
    got, chosen, chosen_greedy = [], [], []
    with torch.inference_mode():
        cache, again = step.make_cache(1), step.make_cache(1)
        lm.model(ids[:, :start], cache=cache)
        lm.model(ids[:, :start], cache=again)
        for t in range(start, n):
            got.append(step.step(ids[:, t : t + 1], cache)[0, 0])
            chosen.append(int(step.greedy()))
            step.step(ids[:, t : t + 1], again, greedy=True)  # ranked by the head's 4-bit copy
            chosen_greedy.append(int(step.greedy()))
    got_t = torch.stack(got)  # (n - start, V): positions start..n-1
    # greedy steps choose the 8-bit ranking's token at every position: the exact fp32 top 64
    assert native_step.greedy_head(lm.model) is not None
    assert chosen_greedy == chosen == got_t.argmax(-1).tolist()
    ref = logits(smollm2, ids)[start:n]
    own = logits(lm, ids)[start:n]
    assert (got_t.argmax(-1) == ref.argmax(-1)).float().mean().item() >= 0.99
    assert (got_t.argmax(-1) == own.argmax(-1)).float().mean().item() >= 0.99
    kl = F.kl_div(F.log_softmax(got_t, -1), F.log_softmax(own, -1), log_target=True, reduction="batchmean")
    assert kl.item() < 1e-4
    assert ((got_t - own).abs().amax(-1) <= 0.05 * own.abs().amax(-1)).all()
