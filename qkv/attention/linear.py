"""``Linear``: ``torch.nn.Linear`` with a two-core path for one-row inputs (batch-1 decoding).

Generating a token multiplies one row vector by every weight matrix. PyTorch hands a (1, in)
× (in, out) product to a BLAS matrix-vector kernel that runs on one thread, so on a CPU it
streams the weights at single-core memory bandwidth however many cores there are. Viewing W
as ``n`` stacked blocks of rows (a free view) and computing the blocks with one batched
product lets PyTorch give each block its own core: the same arithmetic, ~1.4× faster per
token on this project's 2-core machine (``benchmarks/pretrained_speed.py``).

The fast path is taken only where it is known to help: inference (no autograd), fp32 on CPU,
one input row, ≥ 2 threads and an output width divisible by the thread count. Everything
else — training, batches, prompts — is exactly ``F.linear``. Checkpoints are unchanged (same
parameter names and shapes as ``nn.Linear``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def _row_block_matvec(x: Tensor, weight: Tensor, bias: Tensor | None, n: int) -> Tensor:
    """x (..., in) holding one row, W (out, in) -> (..., out) as ``n`` parallel row blocks."""
    out_f, in_f = weight.shape
    xb = x.reshape(1, 1, in_f).expand(n, 1, in_f)  # (n, 1, in): the same row for every block
    wb = weight.view(n, out_f // n, in_f).transpose(1, 2)  # (n, in, out/n): a view, no copy
    y = torch.bmm(xb, wb).reshape(*x.shape[:-1], out_f)  # blocks side by side = W x
    return y if bias is None else y + bias


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters, same init, same results up to float rounding) whose
    one-row inference products use every core; see the module docstring."""

    def forward(self, x: Tensor) -> Tensor:
        w = self.weight
        if (x.shape[-1] == x.numel() and w.device.type == "cpu" and w.dtype == torch.float32
                and not (torch.is_grad_enabled() and (w.requires_grad or x.requires_grad))):
            n = torch.get_num_threads()
            if n > 1 and w.shape[0] % n == 0 and w.is_contiguous():
                return _row_block_matvec(x, w, self.bias, n)
        return F.linear(x, w, self.bias)
