"""Learning-rate schedule at hand-computed steps, and AdamW's parameter groups."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from torch import nn

from qkv.models.gpt import GPT, GPTConfig
from qkv.training.optim import lr_at, make_optimizer

LR, MIN_LR, WARMUP, DECAY = 1.0, 0.1, 10, 110


pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


def test_warmup_is_linear_from_lr_over_warmup() -> None:
    assert lr_at(0, LR, MIN_LR, WARMUP, DECAY) == pytest.approx(0.1)  # (0 + 1) / 10
    assert lr_at(4, LR, MIN_LR, WARMUP, DECAY) == pytest.approx(0.5)
    assert lr_at(WARMUP - 1, LR, MIN_LR, WARMUP, DECAY) == pytest.approx(LR)  # end of warmup


def test_cosine_decay_values() -> None:
    assert lr_at(WARMUP, LR, MIN_LR, WARMUP, DECAY) == pytest.approx(LR)  # cos(0) = 1
    mid = WARMUP + (DECAY - WARMUP) // 2  # step 60: half-way through the cosine
    assert lr_at(mid, LR, MIN_LR, WARMUP, DECAY) == pytest.approx((LR + MIN_LR) / 2)
    quarter = WARMUP + (DECAY - WARMUP) // 4  # step 35: (1 + cos(π/4)) / 2 of the way down
    expected = MIN_LR + 0.5 * (1 + math.sqrt(0.5)) * (LR - MIN_LR)
    assert lr_at(quarter, LR, MIN_LR, WARMUP, DECAY) == pytest.approx(expected)
    for step in (DECAY, DECAY + 1, 10 * DECAY):
        assert lr_at(step, LR, MIN_LR, WARMUP, DECAY) == MIN_LR


def test_schedule_shape() -> None:
    lrs = [lr_at(s, 3e-3, 3e-4, 5, 50) for s in range(60)]
    assert all(a < b for a, b in itertools.pairwise(lrs[:5]))  # rising in warmup
    assert all(a >= b for a, b in itertools.pairwise(lrs[4:]))  # never rising after
    assert max(lrs) == pytest.approx(3e-3) and min(lrs) == 3e-4


def test_no_warmup_starts_at_lr() -> None:
    assert lr_at(0, LR, MIN_LR, 0, 100) == pytest.approx(LR)
    assert lr_at(50, LR, MIN_LR, 0, 100) == pytest.approx((LR + MIN_LR) / 2)


def test_decay_shorter_than_warmup_ends_at_min_lr() -> None:
    assert lr_at(9, LR, MIN_LR, 10, 5) == pytest.approx(LR)  # warmup still rules its steps
    assert lr_at(10, LR, MIN_LR, 10, 5) == MIN_LR


# --------------------------------------------------------------------------- parameter groups


def test_groups_split_matrices_from_vectors() -> None:
    m = GPT(GPTConfig(vocab_size=50, max_seq_len=16, dim=32, n_layers=2, n_heads=4, bias=True))
    opt = make_optimizer(m, 1e-3, 0.1, (0.9, 0.95), "cpu")
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(g["lr"] == 1e-3 and g["betas"] == (0.9, 0.95) for g in opt.param_groups)
    names = {id(p): n for n, p in m.named_parameters()}
    decayed = {names[id(p)] for p in decay["params"]}
    plain = {names[id(p)] for p in no_decay["params"]}
    expected_decayed = {n for n, p in m.named_parameters() if p.dim() >= 2}
    assert decayed == expected_decayed and plain == {n for n, _ in m.named_parameters()} - decayed
    assert "tok_emb.weight" in decayed and "pos_emb.weight" in decayed
    assert any(n.endswith("bias") for n in plain) and any("norm" in n for n in plain)


def test_tied_weight_counted_once() -> None:
    m = GPT(GPTConfig(vocab_size=50, max_seq_len=16, dim=32, n_layers=1, n_heads=4))
    assert m.lm_head.weight is m.tok_emb.weight
    opt = make_optimizer(m, 1e-3, 0.1, (0.9, 0.99), "cpu")
    params = [p for g in opt.param_groups for p in g["params"]]
    assert len({id(p) for p in params}) == len(params)  # no parameter twice
    assert sum(p is m.tok_emb.weight for p in params) == 1
    # Every distinct tensor, counted by storage (a tie is one storage).
    storages = {p.data_ptr(): p.numel() for _, p in m.named_parameters(remove_duplicate=False)}
    assert sum(p.numel() for p in params) == sum(storages.values())


def test_tied_weight_in_a_plain_module_counted_once() -> None:
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(4, 4)
            self.b = nn.Linear(4, 4)
            self.b.weight = self.a.weight

    opt = make_optimizer(Tied(), 1e-3, 0.1, (0.9, 0.99), "cpu")
    decay, no_decay = opt.param_groups
    assert len(decay["params"]) == 1 and len(no_decay["params"]) == 2  # one matrix, two biases


def test_frozen_parameters_are_left_out() -> None:
    m = nn.Sequential(nn.Linear(3, 3), nn.LayerNorm(3))
    m[0].weight.requires_grad_(False)
    opt = make_optimizer(m, 1e-3, 0.1, (0.9, 0.99), "cpu")
    params = [p for g in opt.param_groups for p in g["params"]]
    assert all(p is not m[0].weight for p in params) and len(params) == 3


def test_weight_decay_applies_to_matrices_only() -> None:
    """With zero gradients, AdamW's update is pure decay: p ← p·(1 - lr·wd) on the decayed group."""
    m = nn.Sequential(nn.Linear(3, 3), nn.LayerNorm(3))
    before = [p.detach().clone() for p in m.parameters()]
    opt = make_optimizer(m, 0.1, 0.5, (0.9, 0.99), "cpu")
    for p in m.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    for (name, p), b in zip(m.named_parameters(), before, strict=True):
        factor = 1 - 0.1 * 0.5 if p.dim() >= 2 else 1.0
        torch.testing.assert_close(p.detach(), b * factor, msg=name)
