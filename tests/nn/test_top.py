"""qkv.nn.top against PyTorch's own topk and argmax: the same values (top-k) and the same index
(argmax, the first largest), on rows with ties planted where the two passes could go wrong."""

from __future__ import annotations

import pytest
import torch

from qkv.nn.top import BLOCK, argmax_last, top_indices


def _rows(seed: int, M: int = 4, V: int = 384 * BLOCK) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(M, V, generator=g)


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("k", [1, 7, 64])
def test_top_indices_finds_the_values_torch_topk_finds(seed: int, k: int) -> None:
    x = _rows(seed)
    # ties: a row whose largest values sit in one block, another with the k-th value repeated
    # across blocks (the boundary a block-wise pass could cut), a row of one value
    x[0, 5 * BLOCK : 5 * BLOCK + 100] = 50.0 + torch.arange(100.0)
    x[1, ::BLOCK] = 9.0
    x[2] = 0.25
    got = top_indices(x, k)
    want = x.topk(k, dim=-1)
    assert got.shape == (4, k) and got.dtype == torch.int64
    assert torch.equal(x.gather(1, got), want.values)  # the same values, in descending order
    assert all(len(set(r.tolist())) == k for r in got)  # k distinct entries of each row


@pytest.fixture(params=["two passes", "the kernel library"])
def argmax_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """argmax_last's two ways: the two passes below (the library not loaded) and the library's
    op (loaded; tests/kernels/test_qmatmul.py tests the op on every build)."""
    import qkv.kernels as K
    import qkv.nn.top as top

    if request.param == "two passes":
        monkeypatch.setattr(top, "argmax_op", lambda: None)
    else:
        assert K.int4_op() is not None, K.int4_status()
    return request.param


@pytest.mark.parametrize("seed", range(5))
def test_argmax_last_is_the_first_largest_as_torch_argmax(seed: int, argmax_path: str) -> None:
    x = _rows(seed)
    x[0, [300, 3000, 40000]] = 100.0  # the first of three equal maxima, in different blocks
    x[1, [BLOCK * 7 + 5, BLOCK * 7 + 9]] = 100.0  # two in one block
    x[2] = float("-inf")
    x[3, -1] = 100.0  # the very last entry
    assert torch.equal(argmax_last(x), x.argmax(dim=-1))
    assert argmax_last(x).tolist()[:2] == [300, BLOCK * 7 + 5]


def test_rows_that_do_not_pay_take_pytorchs_ops(argmax_path: str) -> None:
    for V in (BLOCK * 4 + 1, 50257, 100):  # not a multiple of the block; too short
        x = torch.randn(2, V, generator=torch.Generator().manual_seed(V))
        assert torch.equal(top_indices(x, 3), x.topk(3, dim=-1).indices)
        assert torch.equal(argmax_last(x), x.argmax(dim=-1))
    ids = torch.randint(0, 9, (2, 384 * BLOCK))  # integers: PyTorch's argmax as it is
    assert torch.equal(argmax_last(ids), ids.argmax(dim=-1))
