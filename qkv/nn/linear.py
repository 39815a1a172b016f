"""``Linear``: ``torch.nn.Linear`` with a two-core path for one-row inputs (batch-1 decoding).

Generating a token multiplies one row vector by every weight matrix. PyTorch hands a (1, in)
× (in, out) product to a BLAS matrix-vector kernel that runs on one thread, so on a CPU it
streams the weights at single-core memory bandwidth however many cores there are. Viewing W
as ``n`` stacked blocks of rows (a free view) and computing the blocks with one batched
product lets PyTorch give each block its own core: the same arithmetic, ~1.4× faster per
token on this project's 2-core machine (``benchmarks/pretrained_speed.py``).

The fast path is taken only where it is known to help: inference (``torch.no_grad`` or
``inference_mode``), fp32 on CPU, one input row, ≥ 2 threads and an output width divisible
by the thread count (bf16 is not split: its kernel already uses every core). One more CPU
fix, for bf16 prompts: on CPUs without bf16 instructions a many-row bf16 product is computed
from fp32 copies of the weights, ~100× faster than PyTorch's emulated bf16 GEMM. Everything
else — training, batches, prompts — is exactly ``F.linear``. Checkpoints are unchanged (same
parameter names and shapes as ``nn.Linear``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from qkv.device import slow_bf16_gemm


def _row_block_matvec(x: Tensor, weight: Tensor, bias: Tensor | None, n: int) -> Tensor:
    """x (..., in) holding one row, W (out, in) -> (..., out) as ``n`` parallel row blocks."""
    return _blocks_matvec(x, _row_blocks_view(weight, n), bias)


def _row_blocks_view(weight: Tensor, n: int) -> Tensor:
    """W (out, in) as n blocks of rows, transposed for bmm: (n, in, out/n), a view."""
    out_f, in_f = weight.shape
    return weight.view(n, out_f // n, in_f).transpose(1, 2)


def _blocks_matvec(x: Tensor, blocks: Tensor, bias: Tensor | None) -> Tensor:
    """x (..., in) holding one row, blocks (n, in, out/n) -> (..., out)."""
    n, in_f, _ = blocks.shape
    y = torch.bmm(x.view(1, 1, in_f).expand(n, 1, in_f), blocks)  # (n, 1, out/n), one core each
    y = y.view(*x.shape[:-1], -1)  # blocks side by side = W x
    return y if bias is None else y + bias.to(y.dtype)  # (autocast: y may be bf16)


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters, same init, same results up to float rounding) whose
    one-row inference products use every core; see the module docstring."""

    _blocks: tuple[tuple, Tensor | None] = ((), None)  # (key, (n, in, out/n) view of weight)

    def _row_blocks(self) -> Tensor | None:
        """W as (n, in, out/n) row blocks — a view, so in-place updates show through — or
        None where the fast path does not apply. Cached per weight storage and thread count."""
        w = self.weight
        n = torch.get_num_threads()
        key = (w.data_ptr(), w.dtype, w.device, n, w.shape, w.stride())
        if self._blocks[0] != key:
            blocks = _row_blocks_view(w.detach(), n) if _splits(w, n) else None
            self._blocks = (key, blocks)
        return self._blocks[1]

    def _apply(self, fn, recurse: bool = True):
        self._blocks = ((), None)  # .to() / .cuda() / .half(): let the old storage go
        return super()._apply(fn, recurse)

    def forward(self, x: Tensor) -> Tensor:
        if not torch.is_grad_enabled():  # inference
            if x.shape[-1] == x.numel():  # one row
                if torch.compiler.is_compiling():
                    return _compiled_matvec(x, self.weight, self.bias)
                blocks = self._row_blocks()
                if blocks is not None:
                    return _blocks_matvec(x, blocks, self.bias)
            elif self.weight.dtype == torch.bfloat16 and slow_bf16_gemm(self.weight):
                # Many rows (a prompt) in bf16 on a CPU without bf16 instructions: PyTorch's
                # bf16 GEMM is ~100x slower than upcasting the weights and multiplying in fp32,
                # which is what the bf16 kernel computes anyway (fp32 accumulation).
                b = None if self.bias is None else self.bias.float()
                return F.linear(x.float(), self.weight.float(), b).to(x.dtype)
        return F.linear(x, self.weight, self.bias)


def _compiled_matvec(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """x (..., in) holding one row, W (out, in) -> (..., out), written as multiply-and-sum.

    Inside ``torch.compile`` (the compiled decoding step) inductor turns this into one
    vectorised reduction over ``in`` that reads W once, parallel over rows, with fp32
    accumulation: at memory speed, where PyTorch's one-row GEMV is not (streaming 60
    1536×576 matrices on 2 cores: fp32 47 GB/s vs 16, bf16 35 vs 22; BENCHMARKS.md).
    Eagerly it would build the (out, in) product in memory: compiled steps only.
    """
    y = (weight.float() * x.float().unsqueeze(-2)).sum(-1)  # (..., 1, in) * (out, in) -> (..., out)
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def _splits(w: Tensor, n: int) -> bool:
    """Whether a one-row product with W (out, in) takes the n-thread row-block path."""
    return (n > 1 and w.device.type == "cpu" and w.dtype == torch.float32 and w.shape[0] % n == 0
            and w.is_contiguous())
