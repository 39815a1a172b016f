"""Shared by the attention backend tests: the hypothesis strategy of one attention configuration,
and a forward and backward pass of one backend."""

import torch
from hypothesis import strategies as st

HEADS = [(1, 1), (2, 2), (4, 2), (4, 1), (6, 3)]  # (H, K): MHA, GQA, MQA
LENGTHS = [1, 2, 7, 13, 33]


def draw_case(draw) -> dict:
    """Shapes, mask kind, causality, scale, bias and seed, drawn with ``draw``."""
    H, K = draw(st.sampled_from(HEADS))
    D = draw(st.sampled_from([1, 4, 8]))
    return dict(
        B=draw(st.sampled_from([1, 2])),
        H=H,
        K=K,
        T=draw(st.sampled_from(LENGTHS)),
        S=draw(st.sampled_from(LENGTHS)),
        D=D,
        Dv=draw(st.sampled_from([D, 3])),
        mask=draw(st.sampled_from([None, "random", "padding", "both"])),
        bias=draw(st.booleans()),
        is_causal=draw(st.booleans()),
        scale=draw(st.sampled_from([None, 0.3, 2.0])),
        seed=draw(st.integers(0, 2**16)),
    )


def forward_backward(fn, q, k, v, upstream):
    """Forward ``fn(q, k, v) -> Tensor`` and backward with ``upstream``: (out, (dq, dk, dv))."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v)
    return out.detach(), torch.autograd.grad(out, (q, k, v), upstream)
