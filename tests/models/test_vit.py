"""ViT: patches, positions, read-outs, and that it learns."""

from __future__ import annotations

import pytest
import torch

from qkv.models.vit import ViT, ViTConfig, patchify, unpatchify


def _cfg(**kw) -> ViTConfig:
    base = dict(image_size=8, channels=1, patch_size=2, n_classes=3, dim=16, n_layers=2, n_heads=2)
    return ViTConfig(**{**base, **kw})


@pytest.mark.parametrize("C, H, W, P", [(1, 8, 8, 2), (3, 12, 8, 4), (2, 6, 6, 3), (1, 4, 4, 4)])
def test_patchify_round_trip_and_layout(C, H, W, P) -> None:
    img = torch.randn(2, C, H, W)
    patches = patchify(img, P)
    assert patches.shape == (2, (H // P) * (W // P), C * P * P)
    torch.testing.assert_close(unpatchify(patches, P, C, H, W), img, rtol=0, atol=0)
    # patch (row r, column c) holds exactly the pixels img[:, :, rP:(r+1)P, cP:(c+1)P]
    r, c = H // P - 1, 0
    idx = r * (W // P) + c
    block = img[:, :, r * P:(r + 1) * P, c * P:(c + 1) * P]
    torch.testing.assert_close(patches[:, idx], block.reshape(2, -1))


def test_patch_size_must_divide() -> None:
    with pytest.raises(ValueError, match="must divide"):
        patchify(torch.zeros(1, 1, 7, 7), 2)
    with pytest.raises(ValueError, match="patch_size"):
        ViTConfig(image_size=7, patch_size=2)


def _permute_patches(images: torch.Tensor, P: int, perm: torch.Tensor) -> torch.Tensor:
    _, C, H, W = images.shape
    return unpatchify(patchify(images, P)[:, perm], P, C, H, W)


def test_no_positions_and_mean_read_out_ignores_patch_order() -> None:
    torch.manual_seed(0)
    m = ViT(_cfg(positions="none", read_out="mean")).eval().double()
    torch.nn.init.normal_(m.head.weight)  # a non-zero head, so the logits say something
    x = torch.randn(3, 1, 8, 8, dtype=torch.float64)
    perm = torch.randperm(16)
    a, b = m(x).logits, m(_permute_patches(x, 2, perm)).logits
    torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


@pytest.mark.parametrize("positions", ["learned", "sinusoidal"])
def test_positions_make_patch_order_matter(positions) -> None:
    torch.manual_seed(0)
    m = ViT(_cfg(positions=positions, read_out="mean")).eval().double()
    torch.nn.init.normal_(m.head.weight)
    if positions == "learned":
        torch.nn.init.normal_(m.pos_emb.weight)
    x = torch.randn(3, 1, 8, 8, dtype=torch.float64)
    perm = torch.randperm(16)
    a, b = m(x).logits, m(_permute_patches(x, 2, perm)).logits
    assert (a - b).abs().max() > 1e-3


@pytest.mark.parametrize("read_out", ["cls", "mean", "concat"])
def test_shapes_weights_and_wrong_input(read_out) -> None:
    m = ViT(_cfg(read_out=read_out)).eval()
    out = m(torch.randn(4, 1, 8, 8), torch.tensor([0, 1, 2, 0]), backend="reference", return_weights=True)
    T = 16 + (read_out == "cls")
    assert out.logits.shape == (4, 3) and out.loss is not None
    assert len(out.weights) == 2 and out.weights[0].shape == (4, 2, T, T)
    torch.testing.assert_close(out.weights[0].sum(-1), torch.ones(4, 2, T))
    with pytest.raises(ValueError, match="images must be"):
        m(torch.randn(4, 3, 8, 8))


@pytest.mark.parametrize("read_out", ["cls", "mean", "concat"])
def test_each_read_out_overfits_a_small_batch(read_out) -> None:
    torch.manual_seed(0)
    m = ViT(_cfg(read_out=read_out))
    x = torch.randn(12, 1, 8, 8)
    y = torch.arange(12) % 3
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
    first = None
    for _ in range(150):
        loss = m(x, y).loss
        first = first if first is not None else loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert first == pytest.approx(torch.log(torch.tensor(3.0)).item(), abs=1e-4)  # zero head
    assert loss.item() < 0.05
    assert (m(x).logits.argmax(-1) == y).all()


def test_backends_agree() -> None:
    torch.manual_seed(0)
    m = ViT(_cfg()).eval().double()
    torch.nn.init.normal_(m.head.weight)
    x = torch.randn(2, 1, 8, 8, dtype=torch.float64)
    ref = m(x, backend="reference").logits
    for b in ("sdpa", "chunked"):
        torch.testing.assert_close(m(x, backend=b).logits, ref, rtol=0, atol=1e-10)


@pytest.mark.parametrize("overlap", [1, 2])
def test_overlapping_patches_are_padded_windows(overlap: int) -> None:
    """Each token reads the P + 2·overlap square around its patch, zeros past the border, in
    patchify's order (row-major patches, each flattened c, y, x), sliced here by hand."""
    from qkv.models.vit import overlapping_patches

    x = torch.randn(2, 3, 12, 12)
    P, o = 4, overlap
    got = overlapping_patches(x, P, o)
    padded = torch.nn.functional.pad(x, (o, o, o, o))
    want = torch.stack([padded[:, :, i * P:i * P + P + 2 * o, j * P:j * P + P + 2 * o].reshape(2, -1)
                        for i in range(3) for j in range(3)], 1)
    assert got.shape == (2, 9, 3 * (P + 2 * o) ** 2)
    assert torch.equal(got, want)
    assert torch.equal(overlapping_patches(x, P, 0), patchify(x, P))


def test_overlap_widens_the_patch_embedding_and_is_checked() -> None:
    m = ViT(ViTConfig(image_size=28, patch_size=7, patch_overlap=1, dim=32, n_layers=1, n_heads=4))
    assert m.patch_embed.weight.shape == (32, 81)
    assert m(torch.randn(2, 1, 28, 28)).logits.shape == (2, 10)
    with pytest.raises(ValueError, match="patch_overlap"):
        ViTConfig(patch_size=4, patch_overlap=4)


def test_label_smoothing_is_torch_cross_entropy() -> None:
    """The training loss with label_smoothing is PyTorch's label-smoothed cross entropy of the
    same logits; the logits themselves do not change."""
    torch.manual_seed(0)
    plain = ViT(ViTConfig(image_size=8, patch_size=4, dim=16, n_layers=1, n_heads=2))
    torch.manual_seed(0)
    smooth = ViT(ViTConfig(image_size=8, patch_size=4, dim=16, n_layers=1, n_heads=2, label_smoothing=0.2))
    with torch.no_grad():
        for m in (plain, smooth):
            m.head.weight.normal_(generator=torch.Generator().manual_seed(1))
    x, y = torch.randn(4, 1, 8, 8), torch.tensor([0, 3, 9, 3])
    a, b = plain(x, y), smooth(x, y)
    assert torch.equal(a.logits, b.logits)
    torch.testing.assert_close(b.loss, torch.nn.functional.cross_entropy(a.logits, y, label_smoothing=0.2))
    assert not torch.allclose(a.loss, b.loss)
    with pytest.raises(ValueError, match="label_smoothing"):
        ViTConfig(label_smoothing=1.0)


@pytest.mark.parametrize("width, refine, channels, strides", [
    (None, 0, [8, 16, 32], [2, 2, 2]),  # 28 -> 14 -> 7 -> 4: the 4x4 grid
    (16, 1, [16, 16, 32, 32], [2, 1, 2, 2]),  # wider from the start, one stride-1 conv at 14x14
])
def test_conv_stem_is_stride_two_convolutions_down_to_the_patch_grid(width, refine, channels,
                                                                     strides) -> None:
    """stem="conv": ⌈log2 P⌉ 3×3 stride-2 convolutions (BatchNorm, ReLU), ``stem_refine`` stride-1
    ones after the first, widths from ``stem_width`` doubling up to dim, written out here with
    torch's functional ops, then the linear map: the tokens the encoder receives."""
    import torch.nn.functional as F

    torch.manual_seed(0)
    m = ViT(ViTConfig(image_size=28, patch_size=7, dim=32, n_layers=1, n_heads=4, stem="conv",
                      stem_width=width, stem_refine=refine)).eval()
    convs = [c for c in m.stem if isinstance(c, torch.nn.Conv2d)]
    assert [c.out_channels for c in convs] == channels
    assert [c.stride for c in convs] == [(s, s) for s in strides]
    with torch.no_grad():
        for bn in (b for b in m.stem if isinstance(b, torch.nn.BatchNorm2d)):  # statistics that count
            bn.running_mean.normal_()
            bn.running_var.uniform_(0.5, 2.0)
            bn.weight.normal_()
    x = torch.randn(2, 1, 28, 28)
    h = x.double()
    bns = [b for b in m.stem if isinstance(b, torch.nn.BatchNorm2d)]
    for conv, bn, stride in zip(convs, bns, strides, strict=True):
        h = F.conv2d(h, conv.weight.double(), stride=stride, padding=1)
        h = (h - bn.running_mean.double()[:, None, None]) / torch.sqrt(bn.running_var.double()[:, None, None]
                                                                      + bn.eps)
        h = torch.relu(h * bn.weight.double()[:, None, None] + bn.bias.double()[:, None, None])
    assert h.shape == (2, channels[-1], 4, 4)
    tokens = h.flatten(2).transpose(1, 2) @ m.patch_embed.weight.double().T + m.patch_embed.bias.double()
    seen = {}
    m.stack.register_forward_pre_hook(lambda mod, args: seen.setdefault("x", args[0]))
    m(x)
    torch.testing.assert_close(seen["x"][:, 1:] - m.pos_emb(17)[1:], tokens.float(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kw, match", [
    (dict(image_size=28, patch_size=7, patch_overlap=1), "patch_overlap"),
    (dict(image_size=24, patch_size=3), "conv stem halves"),
    (dict(stem_width=0), "stem_width"), (dict(stem_refine=-1), "stem_refine"),
])
def test_conv_stem_is_checked(kw, match) -> None:
    with pytest.raises(ValueError, match=match):
        ViTConfig(stem="conv", **kw)


def test_linear_patches_ignore_the_conv_stem_options() -> None:
    """`--stem linear` on the preset (which sets stem_width and stem_refine): one linear map per
    flattened patch, no convolution anywhere, the same model as without those options."""
    torch.manual_seed(0)
    a = ViT(ViTConfig(image_size=28, patch_size=7, dim=32, n_layers=1, n_heads=4, stem="linear",
                      stem_width=32, stem_refine=1))
    torch.manual_seed(0)
    b = ViT(ViTConfig(image_size=28, patch_size=7, dim=32, n_layers=1, n_heads=4, stem="linear"))
    assert a.stem is None and not any(isinstance(m, torch.nn.Conv2d) for m in a.modules())
    assert a.patch_embed.weight.shape == (32, 49)
    x = torch.randn(2, 1, 28, 28)
    assert torch.equal(a(x).logits, b(x).logits)
