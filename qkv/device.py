"""What this machine's CPU can do, as the speed choices need it (probed once per process)."""

from __future__ import annotations

import functools

import torch
from torch import Tensor


def slow_bf16_gemm(w: Tensor) -> bool:
    """True for a CPU tensor on a CPU whose bf16 matrix products are emulated (no AVX512-BF16 / AMX)."""
    return w.device.type == "cpu" and not cpu_has_native_bf16()


@functools.cache
def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (oneDNN's probe; False without oneDNN)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # no oneDNN in this build: assume emulated
        return False
