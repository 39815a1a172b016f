"""Data-parallel training under ``torchrun``: the only file in qkv that touches torch.distributed.

    torchrun --nproc_per_node N -m qkv train ...

Each process trains a replica on its own slice of every global batch; DDP averages the
gradients with an all-reduce during backward (Li et al. 2020, "PyTorch Distributed").
NCCL on GPUs, gloo on CPUs. Only rank 0 logs and writes files.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    device: str = "cpu"

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def pick_device(pref: str = "auto", local_rank: int = 0) -> str:
    """The device this process trains on: ``auto`` is this rank's GPU if there is one, else the
    CPU; ``cuda`` is this rank's GPU (torchrun: one per process). ValueError (one line) for a
    device this machine does not have."""
    from qkv.device import check_device

    check_device(pref, allow_auto=True)
    if pref == "auto":
        return f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu"
    if pref == "cuda":
        return f"cuda:{local_rank}"
    return pref


def init_distributed(device_pref: str = "auto") -> DistInfo:
    """Join the process group when launched by torchrun (RANK/WORLD_SIZE set), else single."""
    if "RANK" not in os.environ or int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return DistInfo(device=pick_device(device_pref))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = pick_device(device_pref, local)
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device.startswith("cuda") else "gloo")
    return DistInfo(rank=rank, local_rank=local, world_size=world, device=device)


def wrap_model(model: nn.Module, info: DistInfo) -> nn.Module:
    """Wrap in DistributedDataParallel when running on several processes."""
    if not info.enabled:
        return model
    from torch.nn.parallel import DistributedDataParallel

    ids = [torch.device(info.device).index] if info.device.startswith("cuda") else None
    return DistributedDataParallel(model, device_ids=ids)


def no_sync(model: nn.Module, sync: bool):
    """Skip DDP's gradient all-reduce on micro-steps that are not the last of an accumulation."""
    if sync or not hasattr(model, "no_sync"):
        return contextlib.nullcontext()
    return model.no_sync()


def mean_across(value: float, info: DistInfo) -> float:
    """Average a Python number over all processes (for logging the same loss everywhere)."""
    if not info.enabled:
        return value
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t.item()) / info.world_size


def broadcast_flag(flag: bool, info: DistInfo) -> bool:
    """Rank 0's boolean, on every rank (e.g. 'stop now')."""
    if not info.enabled:
        return flag
    t = torch.tensor([1 if flag else 0])
    dist.broadcast(t, src=0)
    return bool(t.item())


def barrier(info: DistInfo) -> None:
    """Wait until every rank gets here (no-op without DDP): a run ends together, so no rank
    tears down its process group while another still talks to it."""
    if info.enabled and dist.is_initialized():
        dist.barrier()


def cleanup(info: DistInfo) -> None:
    if info.enabled and dist.is_initialized():
        dist.destroy_process_group()
