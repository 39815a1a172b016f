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


def check_device(device: str, flag: str = "--device", allow_auto: bool = False) -> str:
    """``device`` if this machine can compute on it, else ValueError naming the fix (one line).

    Accepted: ``cpu``, ``cuda``/``cuda:N`` (a CUDA GPU must be present, N below the count),
    ``mps`` where PyTorch has it, and ``auto`` when ``allow_auto``. ``meta`` (no data) and other
    device types are refused: qkv's kernels and checkpoints are for the first three.
    """
    if allow_auto and device == "auto":
        return device
    choices = "auto, cpu or cuda" if allow_auto else "cpu or cuda"
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"{flag} {device!r} is not a device; use {choices}") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"{flag} {device}: this machine has no CUDA GPU (or torch is a CPU build); "
                             f"use {flag} {'auto' if allow_auto else 'cpu'}")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"{flag} {device}: this machine has {torch.cuda.device_count()} CUDA "
                             f"GPU(s), cuda:0 to cuda:{torch.cuda.device_count() - 1}")
    elif dev.type == "mps":
        if not torch.backends.mps.is_available():
            raise ValueError(f"{flag} mps: this machine has no Apple GPU; use {choices}")
    elif dev.type != "cpu":
        raise ValueError(f"{flag} {device!r}: qkv computes on {choices}, not on {dev.type}")
    return device
