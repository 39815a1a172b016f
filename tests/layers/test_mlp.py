"""Feed-forward networks against the formulas written out in float64 with their own weights."""

from __future__ import annotations

import math

import pytest
import torch

from qkv.layers import MLP, SwiGLU, make_mlp

DIM, HIDDEN = 8, 24


def gelu_erf(h):
    return 0.5 * h * (1 + torch.erf(h / math.sqrt(2)))


def gelu_tanh(h):
    return 0.5 * h * (1 + torch.tanh(math.sqrt(2 / math.pi) * (h + 0.044715 * h**3)))


ACTIVATIONS = {"relu": lambda h: h.clamp(min=0), "gelu": gelu_erf, "gelu_tanh": gelu_tanh}


def linear(layer: torch.nn.Linear, x):
    y = x @ layer.weight.detach().double().T
    return y if layer.bias is None else y + layer.bias.detach().double()


@pytest.fixture
def x() -> torch.Tensor:
    return torch.randn(2, 5, DIM, generator=torch.Generator().manual_seed(0)) * 2


@pytest.mark.parametrize("activation", ["relu", "gelu", "gelu_tanh"])
@pytest.mark.parametrize("bias", [True, False])
def test_mlp_matches_manual(x, activation: str, bias: bool) -> None:
    torch.manual_seed(1)
    mlp = MLP(DIM, HIDDEN, activation, bias=bias)
    assert mlp.fc_in.weight.shape == (HIDDEN, DIM) and mlp.fc_out.weight.shape == (DIM, HIDDEN)
    assert (mlp.fc_in.bias is not None) == bias
    ref = linear(mlp.fc_out, ACTIVATIONS[activation](linear(mlp.fc_in, x.double())))
    y = mlp(x)
    assert y.shape == x.shape
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5)


def test_activations_really_differ(x) -> None:
    # Same weights, different activation: the variants must give different outputs.
    outs = {}
    for act in ("relu", "gelu", "gelu_tanh"):
        torch.manual_seed(2)
        outs[act] = MLP(DIM, HIDDEN, act)(x)
    assert (outs["relu"] - outs["gelu"]).abs().max() > 1e-2
    assert (outs["gelu"] - outs["gelu_tanh"]).abs().max() > 1e-6


@pytest.mark.parametrize("bias", [False, True])
def test_swiglu_matches_manual(x, bias: bool) -> None:
    torch.manual_seed(3)
    mlp = SwiGLU(DIM, HIDDEN, bias=bias)
    xd = x.double()
    gate = linear(mlp.w_gate, xd)
    silu = gate * (1 / (1 + torch.exp(-gate)))
    ref = linear(mlp.w_down, silu * linear(mlp.w_up, xd))
    torch.testing.assert_close(mlp(x).double(), ref, rtol=1e-5, atol=1e-5)


def test_make_mlp_builds_the_named_mlp(x) -> None:
    torch.manual_seed(5)
    sw = make_mlp("swiglu", DIM, HIDDEN, bias=False)
    assert isinstance(sw, SwiGLU) and sw.w_gate.bias is None
    m = make_mlp("gelu_tanh", DIM, HIDDEN)
    assert isinstance(m, MLP) and m.fc_in.bias is not None
    ref = linear(m.fc_out, gelu_tanh(linear(m.fc_in, x.double())))
    torch.testing.assert_close(m(x).double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["silu", "GELU", "geglu"])
def test_make_mlp_bad_kind_raises(kind: str) -> None:
    with pytest.raises(ValueError, match="mlp must be one of"):
        make_mlp(kind, DIM, HIDDEN)


def test_mlp_bad_activation_raises() -> None:
    with pytest.raises(ValueError, match="activation"):
        MLP(DIM, HIDDEN, "tanh")  # type: ignore[arg-type]
