"""LayerNorm and RMSNorm against float64 formulas and PyTorch's own modules."""

from __future__ import annotations

import pytest
import torch
from helpers import randomise

from qkv.layers import LayerNorm, RMSNorm, make_norm

DIM = 16


def layer_norm_ref(x, weight, bias, eps):
    x = x.double()
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)  # biased variance, as in the paper
    y = (x - mean) / torch.sqrt(var + eps) * weight.double()
    return y if bias is None else y + bias.double()


def rms_norm_ref(x, weight, eps):
    x = x.double()
    return x / torch.sqrt((x**2).mean(-1, keepdim=True) + eps) * weight.double()


@pytest.fixture
def x() -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randn(2, 5, DIM, generator=g) * 3 + 1.5  # off-centre, not unit scale


@pytest.mark.parametrize("bias", [True, False])
def test_layernorm_matches_formula_and_torch(x, bias: bool) -> None:
    norm = LayerNorm(DIM, eps=1e-5, bias=bias)
    assert (norm.bias is not None) == bias
    randomise(norm, scale=1.0)  # non-trivial γ (and β): a norm that ignored them fails
    y = norm(x)
    ref = layer_norm_ref(x, norm.weight.detach(), None if norm.bias is None else norm.bias, 1e-5)
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5)
    torch_norm = torch.nn.LayerNorm(DIM, eps=1e-5, bias=bias)
    torch_norm.load_state_dict(norm.state_dict())
    torch.testing.assert_close(y, torch_norm(x), rtol=1e-6, atol=1e-6)


def test_layernorm_default_is_standardisation(x) -> None:
    y = LayerNorm(DIM)(x)  # γ = 1, β = 0
    torch.testing.assert_close(y.mean(-1), torch.zeros(2, 5), rtol=0, atol=1e-5)
    torch.testing.assert_close(y.var(-1, unbiased=False), torch.ones(2, 5), rtol=0, atol=1e-4)


def test_layernorm_eps_is_used() -> None:
    x = torch.tensor([[0.0, 0.2]], dtype=torch.float64)  # variance 0.01
    y = LayerNorm(2, eps=0.03).double()(x)
    torch.testing.assert_close(y, torch.tensor([[-0.5, 0.5]], dtype=torch.float64))  # 0.1/√0.04


def test_rmsnorm_matches_formula(x) -> None:
    norm = RMSNorm(DIM, eps=1e-6)
    assert [n for n, _ in norm.named_parameters()] == ["weight"]  # no bias
    randomise(norm, scale=1.0)  # non-trivial γ (and β): a norm that ignored them fails
    ref = rms_norm_ref(x, norm.weight.detach(), 1e-6)
    torch.testing.assert_close(norm(x).double(), ref, rtol=1e-5, atol=1e-5)
    # No centring: adding a constant changes the output (unlike LayerNorm).
    assert (norm(x + 5.0) - norm(x)).abs().max() > 1e-2


def test_rmsnorm_eps_is_used() -> None:
    x = torch.tensor([[0.3, -0.4]])  # mean(x²) = 0.125
    y = RMSNorm(2, eps=0.125)(x)
    torch.testing.assert_close(y, torch.tensor([[0.6, -0.8]]))  # x / √0.25


@pytest.mark.skipif(not hasattr(torch.nn, "RMSNorm"), reason="torch.nn.RMSNorm needs torch>=2.4")
def test_rmsnorm_matches_torch(x) -> None:
    norm = RMSNorm(DIM, eps=1e-6)
    randomise(norm, seed=3, scale=1.0)
    torch_norm = torch.nn.RMSNorm(DIM, eps=1e-6)
    torch_norm.load_state_dict(norm.state_dict())
    torch.testing.assert_close(norm(x), torch_norm(x), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm"])
def test_bf16_input_keeps_dtype(x, kind: str) -> None:
    norm = make_norm(kind, DIM)
    randomise(norm, scale=1.0)  # non-trivial γ (and β): a norm that ignored them fails
    xb = x.bfloat16()
    y = norm(xb)
    assert y.dtype == torch.bfloat16
    weight = norm.weight.detach()
    if kind == "layernorm":
        ref = layer_norm_ref(xb, weight, norm.bias.detach(), norm.eps)
    else:
        ref = rms_norm_ref(xb, weight, norm.eps)
    torch.testing.assert_close(y.double(), ref, rtol=2e-2, atol=5e-2)


def test_rmsnorm_computes_in_fp32_for_bf16() -> None:
    # mean(x²) of large bf16 values overflows nothing and rounds once, at the end.
    x = torch.full((1, DIM), 300.0).bfloat16()
    y = RMSNorm(DIM)(x)
    torch.testing.assert_close(y.float(), torch.ones(1, DIM), rtol=0, atol=1e-2)


def test_make_norm_builds_the_named_norm() -> None:
    ln = make_norm("layernorm", 8, eps=1e-3, bias=False)
    assert isinstance(ln, LayerNorm) and ln.bias is None and ln.eps == 1e-3
    rms = make_norm("rmsnorm", 8, eps=1e-4)
    assert isinstance(rms, RMSNorm) and rms.eps == 1e-4 and rms.weight.shape == (8,)


@pytest.mark.parametrize("kind", ["batchnorm", "LayerNorm", ""])
def test_make_norm_bad_kind_raises(kind: str) -> None:
    with pytest.raises(ValueError, match="layernorm"):
        make_norm(kind, 8)


def test_rmsnorm_bf16_equals_the_fp32_computation_rounded_once() -> None:
    """bf16 input and weight: the result is the fp32 formula rounded to bf16 once."""
    import torch.nn.functional as F


    torch.manual_seed(0)
    norm = RMSNorm(96, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(96))
    norm = norm.to(torch.bfloat16)
    x = (torch.randn(4, 9, 96) * 3).to(torch.bfloat16)
    xf, wf = x.double(), norm.weight.double()
    exact = xf / torch.sqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5) * wf
    got = norm(x)
    assert got.dtype == torch.bfloat16
    via_fp32 = F.rms_norm(x.float(), (96,), norm.weight.float(), 1e-5).to(torch.bfloat16)
    assert torch.equal(got, via_fp32)
    assert (got.double() - exact).abs().max() <= exact.abs().max() * 2**-8
