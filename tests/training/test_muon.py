"""Muon (torch.optim.Muon) as qkv uses it: which parameters it gets, its update against a
float64 re-derivation from the paper's formulas, and the Trainer's resume with it."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from qkv.models.gpt import GPT, GPTConfig
from qkv.training.optim import Muon, make_optimizers, muon_ns_dtype, muon_params, resolve_optimizer

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon needs torch >= 2.9"),
]


def tiny_gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=40, max_seq_len=16, dim=32, n_layers=2, n_heads=4, bias=True))


def test_muon_gets_the_hidden_matrices_and_adamw_the_rest() -> None:
    m = tiny_gpt()
    hidden, rest = muon_params(m)
    names = {id(p): n for n, p in m.named_parameters()}
    hidden_names = sorted(names[id(p)] for p in hidden)
    # 2 layers x (fused qkv, out_proj, fc_in, fc_out): 8 matrices, nothing else.
    assert len(hidden_names) == 8 and all(p.dim() == 2 for p in hidden)
    assert all(n.startswith("stack.") and n.endswith("weight") for n in hidden_names)
    rest_names = {names[id(p)] for p in rest}
    assert "tok_emb.weight" in rest_names  # tied with lm_head: an embedding, not hidden
    assert all(names[id(p)] not in hidden_names for p in rest)
    assert len(hidden) + len(rest) == len(list(m.parameters()))  # every parameter once


def test_optimizers_cover_every_parameter_once_with_muon_lr_scale() -> None:
    m = tiny_gpt()
    muon, adamw = make_optimizers(m, "muon", lr=4e-3, muon_lr=0.02, weight_decay=0.1,
                                  betas=(0.9, 0.99), device_type="cpu")
    assert isinstance(muon, torch.optim.Muon) and isinstance(adamw, torch.optim.AdamW)
    assert muon.ns_dtype == torch.bfloat16
    assert muon.param_groups[0]["lr_scale"] == pytest.approx(5.0)  # 0.02 / 4e-3
    ids = [id(p) for opt in (muon, adamw) for g in opt.param_groups for p in g["params"]]
    assert len(ids) == len(set(ids)) == len(list(m.parameters()))


def test_auto_is_muon_orthogonalising_where_it_is_fast() -> None:
    assert resolve_optimizer("auto") == "muon"  # on any machine: the dtype of NS differs
    assert resolve_optimizer("adamw") == "adamw"  # asked for: given
    assert muon_ns_dtype("cpu", native_bf16=True) == torch.bfloat16
    assert muon_ns_dtype("cpu", native_bf16=False) == torch.float32  # bf16 would be emulated
    assert muon_ns_dtype("cuda", native_bf16=False) == torch.bfloat16


def newton_schulz64(g: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Keller Jordan's quintic Newton–Schulz iteration, in float64 (the reference)."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g.double()
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    x = x / max(x.norm().item(), 1e-7)
    for _ in range(steps):
        s = x @ x.T
        x = a * x + (b * s + c * s @ s) @ x
    return x.T if tall else x


def test_newton_schulz_pushes_singular_values_towards_one() -> None:
    g = torch.randn(24, 40, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    sv = torch.linalg.svdvals(newton_schulz64(g))
    # The quintic does not converge to 1 exactly: it lands every singular value in ~[0.7, 1.2].
    assert sv.min() > 0.6 and sv.max() < 1.25
    assert torch.linalg.svdvals(g).max() / torch.linalg.svdvals(g).min() > 3  # it was far from that


@pytest.mark.parametrize("ns_dtype", [torch.bfloat16, torch.float32], ids=["torch-bf16", "qkv-fp32"])
@pytest.mark.parametrize("shape", [(12, 20), (20, 12)])
def test_muon_steps_match_a_float64_reference(shape: tuple[int, int], ns_dtype: torch.dtype) -> None:
    """Three Muon steps on one matrix equal the update written out in float64:
    m ← μm + g;  u = g + μm (Nesterov);  W ← W(1 − η·λ) − η·√max(1, rows/cols)·NS(u)
    (PyTorch keeps m as an average, (1 − μ) times this one: NS(u) does not see the scale).
    bf16 is PyTorch's own step; fp32 is qkv's, for CPUs that would emulate bf16."""
    gen = torch.Generator().manual_seed(0)
    w = nn.Parameter(torch.randn(*shape, generator=gen))
    grads = [torch.randn(*shape, generator=gen) for _ in range(3)]
    lr, wd, mu = 0.05, 0.1, 0.95
    opt = Muon([w], lr=lr, weight_decay=wd, momentum=mu, ns_dtype=ns_dtype)
    ref = w.detach().double().clone()
    buf = torch.zeros_like(ref)
    scale = math.sqrt(max(1.0, shape[0] / shape[1]))
    for g in grads:
        w.grad = g.clone()
        opt.step()
        buf = mu * buf + g.double()
        u = g.double() + mu * buf
        ref = ref * (1 - lr * wd) - lr * scale * newton_schulz64(u)
    # In bf16 (8 significant bits) an update of size ~lr agrees to a few per cent of lr; in
    # fp32 to 1e-5 of it. A wrong formula (a missing Nesterov term, the wrong scale or decay)
    # moves W by ~lr.
    err = (w.detach().double() - ref).abs().max().item()
    if ns_dtype == torch.float32:
        assert err < 1e-5 * lr
    assert err < 0.15 * lr
    assert (w.detach().double() - ref).abs().mean().item() < 0.03 * lr


def test_qkv_muon_in_bf16_is_pytorchs_own_step() -> None:
    gen = torch.Generator().manual_seed(3)
    w0 = torch.randn(16, 24, generator=gen)
    a, b = nn.Parameter(w0.clone()), nn.Parameter(w0.clone())
    oa, ob = torch.optim.Muon([a], lr=0.02), Muon([b], lr=0.02)
    for _ in range(2):
        g = torch.randn(16, 24, generator=gen)
        a.grad, b.grad = g.clone(), g.clone()
        oa.step()
        ob.step()
    assert torch.equal(a, b)


@pytest.mark.parametrize("native_bf16", [True, False])
def test_the_cpu_preset_gives_adamw_and_fp32_muon_their_own_recipes(monkeypatch, native_bf16) -> None:
    import qkv.device as device
    from qkv.cli import build_parser
    from qkv.commands.train import configs
    from qkv.families import get_family
    from qkv.presets import get_preset, preset_train

    monkeypatch.setattr(device, "cpu_has_native_bf16", lambda: native_bf16)
    cpu = get_preset("gpt", "cpu")
    muon = cpu["train"] if native_bf16 else {**cpu["train"], **cpu["train_fp32_ns"]}
    assert preset_train(cpu, "muon")["max_iters"] == cpu["train"]["max_iters"]
    fp32_ns = preset_train(cpu, "muon", fp32_newton_schulz=True)
    assert fp32_ns["batch_size"] == cpu["train_fp32_ns"]["batch_size"]
    assert preset_train(cpu, "adamw", fp32_newton_schulz=True)["max_iters"] == cpu["train_adamw"]["max_iters"]
    parser = build_parser()
    for argv, steps, batch in ((["--optimizer", "adamw"], cpu["train_adamw"]["max_iters"],
                                cpu["train_adamw"]["batch_size"]),
                               (["--optimizer", "muon"], muon["max_iters"], muon["batch_size"]),
                               (["--optimizer", "muon", "--device", "cuda"], cpu["train"]["max_iters"],
                                cpu["train"]["batch_size"]),  # GPUs orthogonalise in bf16
                               (["--optimizer", "adamw", "--max_iters", "7"], 7,  # the user's word wins
                                cpu["train_adamw"]["batch_size"])):
        args = parser.parse_args(["train", "gpt", *argv])
        _, train, _, preset = configs(get_family("gpt"), args)
        assert (train.max_iters, train.batch_size, train.optimizer) == (steps, batch, argv[1])
        overlay = "train_adamw" if argv[1] == "adamw" else \
            "train_fp32_ns" if not native_bf16 and "cuda" not in argv else None
        assert preset is not None and (preset.name, preset.overlay) == ("cpu", overlay)  # as recorded
