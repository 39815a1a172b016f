"""Pictures for image models: confusion matrices and attention overlaid on the image."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor

from qkv.fileio import save_figure
from qkv.viz.plots import _pyplot


def plot_confusion(confusion: Tensor | Sequence[Sequence[int]], classes: Sequence[str], out_path: Path,
                   title: str = "confusion matrix") -> Path:
    """Counts (K, K), row = true class, column = predicted; each cell annotated, each row's
    colour scaled by that class's size so errors stand out whatever the class balance."""
    plt = _pyplot()
    cm = torch.as_tensor(confusion, dtype=torch.float64)
    K = cm.shape[0]
    share = cm / cm.sum(dim=1, keepdim=True).clamp_min(1)
    size = max(5.0, 0.55 * K + 2)
    fig, ax = plt.subplots(figsize=(size + 1, size), dpi=120)
    im = ax.imshow(share.numpy(), cmap="Blues", vmin=0, vmax=1)
    if K <= 30:
        for i in range(K):
            for j in range(K):
                n = int(cm[i, j])
                if n:
                    ax.text(j, i, str(n), ha="center", va="center", fontsize=7 if K > 12 else 8,
                            color="white" if share[i, j] > 0.5 else "black")
        ax.set_xticks(range(K), list(classes), rotation=60, ha="right", fontsize=8)
        ax.set_yticks(range(K), list(classes), fontsize=8)
    ax.set_xlabel("predicted")
    ax.set_ylabel("true")
    ax.set_title(title)
    fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04, label="share of the true class")
    fig.tight_layout()
    save_figure(fig, out_path)
    plt.close(fig)
    return Path(out_path)


def _upsample(grid_map: Tensor, size: tuple[int, int]) -> Tensor:
    """(g, g) weights -> (H, W) for display, each patch a flat block (nearest neighbour)."""
    return torch.nn.functional.interpolate(grid_map[None, None].float(), size=size, mode="nearest")[0, 0]


def plot_image_attention(image: Tensor, maps: Sequence[tuple[str, Tensor]], out_path: Path,
                         title: str = "", cols: int = 6) -> Path:
    """The image, then one panel per (caption, (g, g) weight map) with the map over the image.

    image: uint8 or float (C, H, W), C = 1 or 3. Each map is scaled to its own maximum, so the
    panels show where each head looks, not how sharply (the caption can say that).
    """
    plt = _pyplot()
    img = image.detach().cpu()
    img = img.float() / 255 if img.dtype == torch.uint8 else img.float()
    C, H, W = img.shape
    shown = img[0].numpy() if C == 1 else img.permute(1, 2, 0).numpy()
    n = len(maps) + 1
    cols = min(cols, n)
    rows = -(-n // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(2.2 * cols, 2.4 * rows), dpi=120, squeeze=False)
    for k in range(rows * cols):
        ax = axes[k // cols][k % cols]
        ax.axis("off")
        if k >= n:
            continue
        ax.imshow(shown, cmap="gray" if C == 1 else None, vmin=0, vmax=1)
        if k == 0:
            ax.set_title("image", fontsize=8)
            continue
        caption, m = maps[k - 1]
        m = m.detach().float().cpu()
        up = _upsample(m / m.max().clamp_min(1e-12), (H, W))
        ax.imshow(up.numpy(), cmap="inferno", alpha=0.6, vmin=0, vmax=1)
        ax.set_title(caption, fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    save_figure(fig, out_path)
    plt.close(fig)
    return Path(out_path)
