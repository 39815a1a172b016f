"""Additive (Bahdanau) attention against the formula written out in float64.

    e_j = w_vᵀ tanh(W_q q + W_k k_j + b_k),   α = softmax(e),   c = Σ_j α_j v_j
"""

from __future__ import annotations

import pytest
import torch

from qkv.attention import AdditiveAttention

B, T, S, DQ, DK, DV, A = 2, 3, 5, 4, 6, 7, 8


def reference(m: AdditiveAttention, query, keys, values, mask=None):
    """Float64 loops over (b, t, j) with the module's parameter tensors, nothing else."""
    Wq = m.w_q.weight.detach().double()  # (A, Dq)
    Wk, bk = m.w_k.weight.detach().double(), m.w_k.bias.detach().double()  # (A, Dk), (A,)
    wv = m.w_v.weight.detach().double()[0]  # (A,)
    query, keys, values = query.double(), keys.double(), values.double()
    nb, nt, ns = query.shape[0], query.shape[1], keys.shape[1]
    ctx = torch.zeros(nb, nt, values.shape[-1], dtype=torch.float64)
    weights = torch.zeros(nb, nt, ns, dtype=torch.float64)
    for b in range(nb):
        for t in range(nt):
            e = torch.stack([wv @ torch.tanh(Wq @ query[b, t] + Wk @ keys[b, j] + bk)
                             for j in range(ns)])
            allowed = torch.ones(ns, dtype=torch.bool) if mask is None else mask[b]
            ex = torch.where(allowed, torch.exp(e - e[allowed].max()), torch.zeros(()))
            weights[b, t] = ex / ex.sum()
            ctx[b, t] = weights[b, t] @ values[b]
    return ctx, weights


@pytest.fixture
def module() -> AdditiveAttention:
    torch.manual_seed(0)
    return AdditiveAttention(DQ, DK, A).double()


@pytest.fixture
def inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    q = torch.randn(B, T, DQ, generator=g, dtype=torch.float64)
    k = torch.randn(B, S, DK, generator=g, dtype=torch.float64)
    v = torch.randn(B, S, DV, generator=g, dtype=torch.float64)
    return q, k, v


def test_parameter_shapes() -> None:
    m = AdditiveAttention(DQ, DK, A)
    assert m.w_q.weight.shape == (A, DQ) and m.w_q.bias is None
    assert m.w_k.weight.shape == (A, DK) and m.w_k.bias.shape == (A,)
    assert m.w_v.weight.shape == (1, A) and m.w_v.bias is None


def test_matches_formula(module, inputs) -> None:
    q, k, v = inputs
    ctx, w = module(q, k, v)
    ref_ctx, ref_w = reference(module, q, k, v)
    assert ctx.shape == (B, T, DV) and w.shape == (B, T, S)
    torch.testing.assert_close(ctx, ref_ctx, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(w, ref_w, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(w.sum(-1), torch.ones(B, T, dtype=torch.float64))


def test_float32_matches_float64_formula(inputs) -> None:
    torch.manual_seed(0)
    m = AdditiveAttention(DQ, DK, A)
    q, k, v = inputs
    ctx, _ = m(q.float(), k.float(), v.float())
    assert ctx.dtype == torch.float32
    torch.testing.assert_close(ctx.double(), reference(m, q, k, v)[0], rtol=1e-5, atol=1e-5)


def test_values_default_to_keys(module, inputs) -> None:
    q, k, _ = inputs
    ctx, _ = module(q, k)
    torch.testing.assert_close(ctx, reference(module, q, k, k)[0], rtol=1e-10, atol=1e-12)


def test_2d_query_equals_3d_query(module, inputs) -> None:
    q, k, v = inputs
    ctx3, w3 = module(q, k, v)
    for t in range(T):
        ctx2, w2 = module(q[:, t], k, v)  # (B, Dq): one decoder state
        assert ctx2.shape == (B, DV) and w2.shape == (B, S)
        torch.testing.assert_close(ctx2, ctx3[:, t], rtol=0, atol=1e-12)
        torch.testing.assert_close(w2, w3[:, t], rtol=0, atol=1e-12)


def test_padding_mask_zeroes_padded_keys_and_renormalises(module, inputs) -> None:
    q, k, v = inputs
    lengths = [3, 5]
    mask = torch.arange(S).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)  # (B, S)
    ctx, w = module(q, k, v, mask=mask)
    ref_ctx, ref_w = reference(module, q, k, v, mask)
    torch.testing.assert_close(ctx, ref_ctx, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(w, ref_w, rtol=1e-10, atol=1e-12)
    assert torch.equal(w[0, :, 3:], torch.zeros(T, 2, dtype=torch.float64))
    torch.testing.assert_close(w.sum(-1), torch.ones(B, T, dtype=torch.float64))
    # A padded sequence attends exactly as the unpadded one would.
    short_ctx, short_w = module(q[:1], k[:1, :3], v[:1, :3])
    torch.testing.assert_close(ctx[:1], short_ctx, rtol=0, atol=1e-12)
    torch.testing.assert_close(w[:1, :, :3], short_w, rtol=0, atol=1e-12)


def test_padding_mask_with_2d_query(module, inputs) -> None:
    q, k, v = inputs
    mask = torch.tensor([[True, True, False, False, False], [True] * S])
    ctx, w = module(q[:, 0], k, v, mask=mask)
    ref_ctx, ref_w = reference(module, q[:, :1], k, v, mask)
    torch.testing.assert_close(ctx, ref_ctx[:, 0], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(w, ref_w[:, 0], rtol=1e-10, atol=1e-12)


def test_per_query_mask_3d(module, inputs) -> None:
    q, k, v = inputs
    mask = torch.ones(B, T, S, dtype=torch.bool)
    mask[:, 1, 2:] = False  # query 1 sees only the first two keys
    _, w = module(q, k, v, mask=mask)
    assert torch.equal(w[:, 1, 2:], torch.zeros(B, S - 2, dtype=torch.float64))
    _, w_short = module(q[:, 1:2], k[:, :2], v[:, :2])
    torch.testing.assert_close(w[:, 1:2, :2], w_short, rtol=0, atol=1e-12)


def test_projected_keys_give_same_result(module, inputs) -> None:
    q, k, v = inputs
    pk = module.project_keys(k)
    assert pk.shape == (B, S, A)
    torch.testing.assert_close(pk, k @ module.w_k.weight.T + module.w_k.bias, rtol=0, atol=1e-12)
    ctx, w = module(q, k, v)
    ctx_p, w_p = module(q, k, v, projected_keys=pk)
    torch.testing.assert_close(ctx_p, ctx, rtol=0, atol=0)
    torch.testing.assert_close(w_p, w, rtol=0, atol=0)
    # The precomputed projection is really what gets used.
    ctx_other, _ = module(q, k, v, projected_keys=pk + 1.0)
    assert (ctx_other - ctx).abs().max() > 1e-6


def test_gradients_match_finite_differences(module, inputs) -> None:
    q, k, v = (t.clone().requires_grad_(True) for t in inputs)
    mask = torch.tensor([[True, True, True, False, False], [True] * S])

    def f(q, k, v):
        return module(q, k, v, mask=mask).out

    assert torch.autograd.gradcheck(f, (q, k, v))
    f(q, k, v).pow(2).sum().backward()
    for name, p in module.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    assert torch.equal(v.grad[0, 3:], torch.zeros(2, DV, dtype=torch.float64))  # padded values


def test_bad_query_or_key_shapes_raise(module, inputs) -> None:
    q, k, v = inputs
    with pytest.raises(ValueError, match="query"):
        module(q[0, 0], k, v)  # 1-D query
    with pytest.raises(ValueError, match="query"):
        module(q.unsqueeze(0), k, v)  # 4-D query
    with pytest.raises(ValueError, match="keys"):
        module(q, k[0], v)  # 2-D keys


@pytest.mark.parametrize(
    "case", ["query width", "values length", "batch", "mask 4-D", "mask query length"]
)
def test_mismatched_shapes_raise_value_error(module, inputs, case: str) -> None:
    # House rule (functional._check_inputs): name the argument, never a deep torch error,
    # and never a silently broadcast result of the wrong shape.
    q, k, v = inputs
    mask = None
    if case == "query width":
        q = torch.randn(B, T, DQ + 1, dtype=torch.float64)
    elif case == "values length":
        v = v[:, : S - 1]
    elif case == "batch":
        k, v = torch.cat([k, k[:1]]), torch.cat([v, v[:1]])
    elif case == "mask 4-D":
        mask = torch.ones(B, 1, T, S, dtype=torch.bool)  # would give a (B, B, T, Dv) result
    else:
        mask = torch.ones(B, T + 1, S, dtype=torch.bool)
    with pytest.raises(ValueError):
        module(q, k, v, mask=mask)


def test_bad_masks_raise(module, inputs) -> None:
    q, k, v = inputs
    with pytest.raises(ValueError, match="bool"):
        module(q, k, v, mask=torch.ones(B, S))
    with pytest.raises(ValueError, match="key positions"):
        module(q, k, v, mask=torch.ones(B, S - 1, dtype=torch.bool))
