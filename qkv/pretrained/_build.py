"""Building a qkv model to receive pretrained weights, without paying for a random init."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import TypeVar

import torch
from torch import Tensor, nn

M = TypeVar("M", bound=nn.Module)

_INIT_FUNCTIONS = ("normal_", "uniform_", "kaiming_uniform_", "kaiming_normal_", "trunc_normal_",
                   "xavier_uniform_", "xavier_normal_", "zeros_", "ones_", "constant_")


@contextlib.contextmanager
def skip_init() -> Iterator[None]:
    """Make ``torch.nn.init``'s fill functions no-ops: every value is overwritten by the
    checkpoint anyway, and a 135M-parameter random init costs ~2 s on two cores."""
    saved = {name: getattr(nn.init, name) for name in _INIT_FUNCTIONS}
    try:
        for name in _INIT_FUNCTIONS:
            setattr(nn.init, name, lambda t, *a, **k: t)
        yield
    finally:
        for name, fn in saved.items():
            setattr(nn.init, name, fn)


def parameter_names(factory: Callable[[], nn.Module]) -> list[str]:
    """The state-dict names of ``factory()``'s model, built on the meta device (no memory)."""
    with skip_init(), torch.device("meta"):
        return list(factory().state_dict())


def build_with_weights(factory: Callable[[], M], state_dict: Mapping[str, Tensor], source: str) -> M:
    """``factory()`` with parameters left unfilled, then ``state_dict`` loaded strictly.

    Raises:
        ValueError: keys missing or unexpected, or a shape mismatch (names the first few).
    """
    with skip_init():
        model = factory()
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state_dict))
    extra = sorted(set(state_dict) - set(expected))
    if missing or extra:
        raise ValueError(f"{source}: weights do not fit the model (missing {missing[:3]}, "
                         f"unexpected {extra[:3]})")
    for k, v in state_dict.items():
        if tuple(v.shape) != tuple(expected[k].shape):
            raise ValueError(f"{source}: {k} has shape {tuple(v.shape)}, the model expects "
                             f"{tuple(expected[k].shape)}")
    model.load_state_dict(state_dict, strict=True)
    return model.eval()
