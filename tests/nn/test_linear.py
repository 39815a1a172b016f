"""qkv.nn.linear.Linear: the two-core one-row path computes W x + b like F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from qkv.nn.linear import Linear, _row_block_matvec


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("n", [2, 3, 4])
def test_row_blocks_equal_the_matrix_vector_product(bias: bool, n: int) -> None:
    torch.manual_seed(0)
    w = torch.randn(12 * n, 37, dtype=torch.float64)
    b = torch.randn(12 * n, dtype=torch.float64) if bias else None
    x = torch.randn(1, 1, 37, dtype=torch.float64)
    expected = x @ w.T + (0 if b is None else b)  # (1, 1, out), written out independently
    got = _row_block_matvec(x, w, b, n)
    assert got.shape == (1, 1, 12 * n)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)


def _with_threads(n: int):
    class _Ctx:
        def __enter__(self):
            self.before = torch.get_num_threads()
            torch.set_num_threads(n)

        def __exit__(self, *exc):
            torch.set_num_threads(self.before)

    return _Ctx()


def test_fast_path_taken_only_for_one_row_inference(monkeypatch) -> None:
    torch.manual_seed(0)
    lin = Linear(16, 8)
    calls = []
    import qkv.nn.linear as mod

    real = mod._blocks_matvec
    monkeypatch.setattr(mod, "_blocks_matvec", lambda *a: calls.append(1) or real(*a))
    with _with_threads(2):
        x1, xb = torch.randn(1, 16), torch.randn(3, 16)
        with torch.inference_mode():
            y1 = lin(x1)
            assert calls == [1]
            yb = lin(xb)  # a batch: plain F.linear
            assert calls == [1]
        y_train = lin(x1)  # autograd on: plain F.linear, so training is untouched
        assert calls == [1] and y_train.requires_grad
        with torch.inference_mode():
            lin.weight.data = lin.weight.data.double().float()  # new storage: blocks rebuilt
            torch.testing.assert_close(lin(x1), F.linear(x1, lin.weight, lin.bias))
            assert calls == [1, 1]
    torch.testing.assert_close(y1, F.linear(x1, lin.weight, lin.bias), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(yb, F.linear(xb, lin.weight, lin.bias))
    with _with_threads(1), torch.inference_mode():
        lin(x1)
    assert calls == [1, 1]  # one thread: nothing to split over


def test_linear_is_an_nn_linear_with_the_same_parameters() -> None:
    lin = Linear(5, 7, bias=False)
    assert isinstance(lin, torch.nn.Linear)
    assert list(dict(lin.named_parameters())) == ["weight"]
    assert lin.weight.shape == (7, 5)


def test_bf16_many_rows_match_the_bf16_kernel() -> None:
    """The fp32-upcast path for bf16 prompts gives what PyTorch's bf16 GEMM gives (both
    accumulate in fp32; only the accumulation order may differ)."""
    torch.manual_seed(0)
    lin = Linear(64, 48).to(torch.bfloat16)
    x = torch.randn(2, 5, 64).to(torch.bfloat16)
    with torch.inference_mode():
        got = lin(x)
    expected = F.linear(x, lin.weight, lin.bias)
    assert got.dtype == torch.bfloat16 and got.shape == (2, 5, 48)
    exact = (x.double() @ lin.weight.double().T + lin.bias.double())
    assert (got.double() - exact).abs().max() <= (expected.double() - exact).abs().max() + 0.02
    torch.testing.assert_close(got, expected, rtol=1e-2, atol=2e-2)


def test_one_row_path_under_autocast_keeps_the_autocast_dtype() -> None:
    lin = Linear(8, 6)
    x = torch.randn(1, 8)
    with _with_threads(2), torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        one, many = lin(x), lin(torch.randn(3, 8))
    assert one.dtype == many.dtype == torch.bfloat16


def test_blocks_follow_dtype_changes_and_release_the_old_storage() -> None:
    lin = Linear(8, 6, bias=False)
    x = torch.randn(1, 8)
    with _with_threads(2), torch.inference_mode():
        lin(x)
        assert lin._blocks[1] is not None
        lin.to(torch.float64)
        assert lin._blocks[1] is None  # .to() dropped the view of the fp32 storage
        y = lin(x.double())  # fp64: plain F.linear
    torch.testing.assert_close(y, F.linear(x.double(), lin.weight))
