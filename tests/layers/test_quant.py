"""Weight-only int4/int8 linear layers against float64 products of the weights they stand for."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from qkv.layers.quant import (
    Int4Linear,
    Int4SwiGLU,
    Int8Linear,
    TopKRefinedLinear,
    int4_kernels_available,
    quantize_linears,
)

pytestmark = pytest.mark.skipif(not int4_kernels_available(), reason="needs PyTorch's CPU int4 kernels")


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def codes_scales(N: int, K: int, g: int = 32):
    q = torch.randint(0, 16, (N, K), generator=gen(1))
    d = torch.rand(N, K // g, generator=gen(2)) * 0.05 + 0.005
    m = torch.randn(N, K // g, generator=gen(3)) * 0.1
    return q, d, m


@pytest.mark.parametrize(("N", "K"), [(96, 64), (64, 192), (48, 32)])
@pytest.mark.parametrize("rows", [1, 5])
def test_int4_matches_the_dequantised_matrix_in_float64(N: int, K: int, rows: int) -> None:
    """GGUF Q4_1 groups (w = d·q + m) as torch's 4-bit groups (scale d, zero m + 8d): the
    kernel's product equals x·Wᵀ of that matrix, with x and the scales rounded to bf16 as the
    kernel reads them, to bf16 output precision."""
    q, d, m = codes_scales(N, K)
    layer = Int4Linear(q, d, m + 8 * d, 32, kernel="aten")
    # Our own dequantisation, written from the Q4_1 formula (not from the layer's):
    d16, z16 = d.bfloat16().double(), (m + 8 * d).bfloat16().double()
    w = ((q.double().view(N, K // 32, 32) - 8) * d16[..., None] + z16[..., None]).view(N, K)
    torch.testing.assert_close(layer.dequantize().double(), w, rtol=0, atol=1e-12)
    x = torch.randn(rows, K, generator=gen(4))
    ref = x.bfloat16().double() @ w.T
    y = layer(x)
    assert y.dtype == torch.float32 and y.shape == (rows, N)
    err = (y.double() - ref).abs().max().item()
    assert err <= 8e-3 * ref.abs().max().item()  # bf16 output: 2^-8 relative
    # And the float formula without bf16 scales is close, but not exactly it (what q4 costs).
    exact = x.double() @ ((q.double().view(N, K // 32, 32) * d.double()[..., None]
                           + m.double()[..., None]).view(N, K)).T
    assert (y.double() - exact).abs().max().item() < 3e-2 * exact.abs().max().item()


@pytest.mark.parametrize(("N", "K"), [(96, 64), (64, 192), (48, 32)])
@pytest.mark.parametrize("rows", [1, 5])
def test_int4_with_qkvs_kernel_is_the_file_matrix_in_float16(N: int, K: int, rows: int) -> None:
    """qkv's kernel (the default where it builds) keeps a Q4_1 group's d and m in float16, as
    the file stores them (d = scale, m = zero − 8·scale), and its product is x·Wᵀ of that matrix
    within the rounding of the activations (to dx/256 of each group's scale, tests/kernels),
    ~100x closer than bf16 activations get."""
    from qkv.kernels import int4_op, int4_status

    if int4_op() is None:
        pytest.skip(f"qkv's kernel is not available here: {int4_status()}")
    q, d, m = codes_scales(N, K)
    d, m = d.half().float(), m.half().float()  # a file's float16 d and m
    layer = Int4Linear(q, d, m + 8 * d, 32, kernel="qkv")
    assert layer.kernel == "qkv" and not hasattr(layer, "packed")
    w = (q.double().view(N, K // 32, 32) * d.double()[..., None] + m.double()[..., None]).view(N, K)
    torch.testing.assert_close(layer.dequantize().double(), w, rtol=0, atol=1e-12)
    x = torch.randn(rows, K, generator=gen(4))
    y = layer(x)
    assert y.dtype == torch.float32 and y.shape == (rows, N)
    exact = x.double() @ w.T
    dx = x.double().view(rows, K // 32, 32).abs().amax(-1) / 127  # each group's activation step
    bound = (w.abs().view(N, K // 32, 32).sum(-1) @ (dx / 256).T).T  # to dx/256 per value
    assert ((y.double() - exact).abs() <= bound + 1e-6 * (x.double().abs() @ w.abs().T)).all()
    bf16 = Int4Linear(q, d, m + 8 * d, 32, kernel="aten")(x).double()
    assert (y.double() - exact).abs().max() < (bf16 - exact).abs().max() / 20


def test_int4_keeps_leading_dims_and_input_dtype() -> None:
    q, d, m = codes_scales(32, 64)
    layer = Int4Linear(q, d, m, 32)
    x = torch.randn(2, 3, 64, generator=gen(5))
    y = layer(x)
    assert y.shape == (2, 3, 32) and y.dtype == torch.float32
    torch.testing.assert_close(y[1, 2], layer(x[1, 2:3])[0])


def test_int4_from_float_recovers_codes_from_a_grid() -> None:
    """Weights made as d·q + m with q spanning 0..15 in every group (as llama.cpp's Q4_1
    quantiser makes them) are re-grouped into exactly those codes."""
    N, K = 16, 64
    q, d, m = codes_scales(N, K)
    q = q.view(N, 2, 32)
    q[..., 0], q[..., 1] = 0, 15  # each group's min and max on the grid's ends
    q = q.view(N, K)
    w = (q.float().view(N, 2, 32) * d[..., None] + m[..., None]).view(N, K)
    layer = Int4Linear.from_float(w)
    back = torch.stack([layer.codes & 0xF, layer.codes >> 4], dim=-1).view(N, K)
    assert torch.equal(back.long(), q.long())


def test_int4_rejects_bad_shapes_and_codes() -> None:
    with pytest.raises(ValueError, match="divisible by 16"):
        Int4Linear(*codes_scales(8, 64), 32)
    q, d, m = codes_scales(16, 64)
    with pytest.raises(ValueError, match="needs scale/zero"):
        Int4Linear(q, d[:, :1], m[:, :1], 32)
    with pytest.raises(ValueError, match=r"0\.\.15"):
        Int4Linear(q + 1, d, m, 32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_matches_the_dequantised_matrix(dtype: torch.dtype) -> None:
    w = torch.randn(48, 80, generator=gen(6))
    layer = Int8Linear.from_float(w)
    wd = layer.dequantize().double()
    assert (wd - w.double()).abs().max() <= layer.scale.max() / 2 + 1e-7  # rounding: half a step
    x = torch.randn(3, 80, generator=gen(7)).to(dtype)
    ref = x.bfloat16().double() @ wd.T  # the kernel reads bf16 activations, returns bf16
    y = layer(x)
    assert y.dtype == dtype
    assert (y.double() - ref).abs().max().item() <= 8e-3 * ref.abs().max().item()


def test_refined_head_is_exact_on_its_top_k() -> None:
    w = torch.randn(500, 64, generator=gen(10))
    head = TopKRefinedLinear(Int8Linear.from_float(w), w, k=16)
    x = torch.randn(3, 64, generator=gen(11))
    y = head(x).double()
    exact = x.double() @ w.double().T
    top = exact.topk(8, dim=-1).indices
    # The true top 8 are among the approximate top 16 (bf16 errors ~0.03, smaller than the
    # gap to the 17th), so they are exact to fp32 rounding; the argmax is the true argmax.
    torch.testing.assert_close(y.gather(1, top), exact.gather(1, top), rtol=1e-6, atol=1e-5)
    assert torch.equal(y.argmax(-1), exact.argmax(-1))
    rest = (y - exact).abs().max().item()
    assert rest <= 8e-3 * exact.abs().max().item()  # the tail: within bf16 rounding


def test_quantize_linears_replaces_every_linear_but_the_skipped() -> None:
    from qkv.kernels import q8_op
    from qkv.layers.quant import Q8Linear

    model = nn.Sequential(nn.Linear(64, 32, bias=False), nn.ReLU(), nn.Linear(32, 64, bias=False),
                          nn.Linear(64, 24, bias=False))
    quantize_linears(model, "q4", skip=("2", "3"))
    assert isinstance(model[0], Int4Linear) and isinstance(model[2], nn.Linear)
    quantize_linears(model, "int8")
    # int8: groups of 32 on qkv's kernel where it builds; rows where the shape does not fit (24 outputs)
    assert isinstance(model[2], Q8Linear if q8_op() is not None else Int8Linear)
    assert isinstance(model[3], Int8Linear)
    model = quantize_linears(nn.Sequential(nn.Linear(64, 32)), "int8", kernel="aten")
    assert isinstance(model[0], Int8Linear)


@pytest.mark.parametrize("weights", ["int8", "q4"])
def test_a_linear_with_a_bias_keeps_it_in_float32(weights: str) -> None:
    """Qwen2's q/k/v and `--bias true` runs: the quantised product of the dequantised matrix
    plus the layer's own bias, in float64 (the bias exact, the product to bf16 precision)."""
    torch.manual_seed(0)
    lin = nn.Linear(64, 32)
    with torch.no_grad():
        lin.bias.mul_(20)  # a bias large beside the product, so that dropping it shows
    from qkv.layers.quant import Q8Linear

    model = quantize_linears(nn.Sequential(lin), weights)
    layer = model[0]
    assert isinstance(layer, (Int8Linear, Q8Linear) if weights == "int8" else Int4Linear)
    assert layer.bias.dtype == torch.float32 and torch.equal(layer.bias, lin.bias.detach())
    x = torch.randn(5, 64, generator=gen(12))
    product = x.bfloat16().double() @ layer.dequantize().double().T
    y = layer(x).double()
    torch.testing.assert_close(y - lin.bias.double(), product, rtol=0, atol=8e-3 * product.abs().max().item())
    assert (y - product).abs().min().item() > 0  # the bias is there


def test_int4_swiglu_equals_swiglu_of_its_dequantised_weights() -> None:
    from qkv.layers.mlp import SwiGLU

    torch.manual_seed(0)
    mlp = SwiGLU(64, 96, bias=False)
    fused = Int4SwiGLU.from_swiglu(mlp)
    x = torch.randn(3, 64, generator=gen(12))
    wgu = fused.gate_up.dequantize().double()
    g, u = (x.bfloat16().double() @ wgu.T).split(96, dim=-1)
    h = (torch.nn.functional.silu(g) * u).bfloat16().double()
    ref = h @ fused.down.dequantize().double().T
    assert (fused(x).double() - ref).abs().max().item() <= 2 ** -6 * ref.abs().max().item()
    # and it is the float SwiGLU up to 4-bit rounding of the weights
    dense = mlp(x).double()
    assert (fused(x).double() - dense).abs().max().item() <= 0.15 * dense.abs().max().item()
    # the fused matrix is [gate | up]: its first half is the gate's own 4-bit form
    torch.testing.assert_close(wgu[:96].float(), Int4Linear.from_float(mlp.w_gate.weight).dequantize())


def test_a_q4_0_matrix_is_regrouped_on_its_own_grid() -> None:
    """llama.cpp's Q4_0 (the gguf package's own quantiser and dequantiser as the reference):
    the symmetric regrouping gives back its matrix up to the bf16 rounding of each group's
    scale; the min/max (Q4_1) grid would round a second time, ~25x further off."""
    gguf = pytest.importorskip("gguf")
    import numpy as np

    kind = gguf.GGMLQuantizationType.Q4_0
    a = np.random.default_rng(0).standard_normal((64, 128)).astype(np.float32)
    w = gguf.quants.dequantize(gguf.quants.quantize(a, kind), kind).astype(np.float64)
    scale = np.abs(w.reshape(64, 4, 32)).max(-1) / 8  # llama.cpp's d, up to sign
    bound = (8 * scale * 2.0**-8).repeat(32, axis=1)  # |q − 8| ≤ 8 steps of a bf16-rounded d
    sym = Int4Linear.from_float(torch.from_numpy(w).float(), symmetric=True).dequantize().double().numpy()
    assert (np.abs(sym - w) <= bound + 1e-7).all()
    asym = Int4Linear.from_float(torch.from_numpy(w).float()).dequantize().double().numpy()
    assert np.abs(asym - w).max() > 10 * np.abs(sym - w).max()
    # An importance-matrix quantiser (llama.cpp's make_qx_quants scale search) may leave no
    # weight at code 0: groups w = d·(q − 8) with q in 1..15 come back as they are too.
    g = torch.Generator().manual_seed(1)
    d = torch.rand(64, 4, generator=g).double() * 0.05 + 0.01
    q = torch.randint(1, 16, (64, 4, 32), generator=g)
    w2 = ((q - 8).double() * d[..., None]).view(64, 128)
    back = Int4Linear.from_float(w2.float(), symmetric=True).dequantize().double()
    assert ((back - w2).abs().view(64, 4, 32) <= 8 * d[..., None] * 2.0**-8 + 1e-7).all()
