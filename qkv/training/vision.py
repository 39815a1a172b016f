"""The image-classification job behind `qkv train vit`: dataset -> ViT -> the shared training
loop -> test accuracy, confusion matrix, and an attention overlay.

Run directory: as for the GPT (:mod:`qkv.training.checkpoint`), with ``config.json`` of family
``"vit"`` (its ``data`` section holds the class names and the normalisation the model was
trained with), plus ``eval.json`` (test accuracy and confusion matrix) and ``confusion.png``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from qkv import __version__
from qkv.data.images import ImageBatches, ImageData, load_image_dataset
from qkv.models.vit import ViT, ViTConfig
from qkv.training import checkpoint as ckpt
from qkv.training.distributed import DistInfo
from qkv.training.trainer import TrainConfig, Trainer, TrainResult


@dataclass
class ImageDataConfig:
    """Which images, and how they are augmented."""

    dataset: str = "fashion-mnist"  # fashion-mnist, mnist, digits, or a folder of class sub-folders
    val_size: int = 5000  # Fashion-MNIST: training images held out for validation
    shift: int = 0  # random shifts of up to this many pixels while training (0 = none)
    flip: bool = False  # random horizontal flips while training (not for digits or text)
    image_size: int = 28  # folder datasets: every image is resized to this square size
    split_seed: int = 0  # seed of the deterministic train/validation/test split

    def __post_init__(self) -> None:
        if self.val_size < 1:
            raise ValueError(f"val_size must be >= 1, got {self.val_size}")
        if self.shift < 0:
            raise ValueError(f"shift must be >= 0, got {self.shift}")
        if self.image_size < 1:
            raise ValueError(f"image_size must be >= 1, got {self.image_size}")


def load_data(data_cfg: ImageDataConfig, on_note: Callable[[str], None] | None = None) -> ImageData:
    return load_image_dataset(data_cfg.dataset, val_size=data_cfg.val_size, seed=data_cfg.split_seed,
                              image_size=data_cfg.image_size, on_note=on_note)


def fit_model_config(model_cfg: ViTConfig, data: ImageData) -> ViTConfig:
    """The model config with the data's image size, channels and classes; a clear error if the
    patch size does not fit these images."""
    C, H, W = data.shape
    if H != W:
        raise ValueError(f"{data.name} images are {H}x{W}; the ViT needs square images")
    if H % model_cfg.patch_size:
        fits = [p for p in range(2, H + 1) if H % p == 0]
        raise ValueError(f"patch_size {model_cfg.patch_size} does not divide the {H}x{H} images of "
                         f"{data.name}; use --patch_size {' or '.join(map(str, fits[:4]))}")
    return dataclasses.replace(model_cfg, image_size=H, channels=C, n_classes=len(data.classes))


def run_config(model_cfg: ViTConfig, train_cfg: TrainConfig, data_cfg: ImageDataConfig,
               data: ImageData, batches: ImageBatches) -> dict:
    return {
        "family": "vit",
        "qkv_version": __version__,
        "model": model_cfg.to_dict(),
        "train": dataclasses.asdict(train_cfg),
        "data": {**dataclasses.asdict(data_cfg), "name": data.name, "classes": list(data.classes),
                 "mean": batches.mean, "std": batches.std,
                 "sizes": {"train": len(data.train_y), "val": len(data.val_y), "test": len(data.test_y)}},
    }


@torch.no_grad()
def predict(model: ViT, images: Tensor, mean: float, std: float, batch_size: int = 500) -> Tensor:
    """uint8 images (N, C, H, W) -> class probabilities (N, n_classes), in eval mode."""
    model.eval()
    device = next(model.parameters()).device
    out = []
    for i in range(0, len(images), batch_size):
        x = (images[i : i + batch_size].float() / 255 - mean) / std
        out.append(model(x.to(device)).logits.float().softmax(-1).cpu())
    return torch.cat(out) if out else torch.empty(0, model.cfg.n_classes)


def confusion_matrix(labels: Tensor, preds: Tensor, n_classes: int) -> Tensor:
    """(n_classes, n_classes) counts: row = true class, column = predicted class."""
    return torch.bincount(labels * n_classes + preds, minlength=n_classes**2).reshape(n_classes, n_classes)


def evaluate_split(model: ViT, data: ImageData, mean: float, std: float, split: str = "test") -> dict:
    """Accuracy and confusion matrix on one split."""
    x, y = {"train": (data.train_x, data.train_y), "val": (data.val_x, data.val_y),
            "test": (data.test_x, data.test_y)}[split]
    preds = predict(model, x, mean, std).argmax(-1)
    cm = confusion_matrix(y, preds, len(data.classes))
    return {"split": split, "n": len(y), "accuracy": float((preds == y).float().mean()) if len(y) else 0.0,
            "classes": list(data.classes), "confusion": cm.tolist()}


def train_vit(
    model_cfg: ViTConfig,
    train_cfg: TrainConfig,
    data_cfg: ImageDataConfig,
    *,
    resume: bool = False,
    dist: DistInfo | None = None,
    on_log=None,
    on_note: Callable[[str], None] | None = None,
) -> tuple[ViT, ImageData, ImageBatches, TrainResult]:
    """Train (or resume) a ViT into ``train_cfg.out_dir``; returns (model with the best weights,
    data, batches, result)."""
    dist = dist or DistInfo()
    run_dir = Path(train_cfg.out_dir)
    if not resume and (run_dir / "config.json").is_file():
        raise ValueError(f"{run_dir} already holds a run; continue it with --resume {run_dir} "
                         "or choose another --out_dir")
    data = load_data(data_cfg, on_note)
    model_cfg = fit_model_config(model_cfg, data)
    batches = ImageBatches(data, shift=data_cfg.shift, flip=data_cfg.flip)
    torch.manual_seed(train_cfg.seed)
    model = ViT(model_cfg)
    trainer = Trainer(model, train_cfg, batches, run_dir, dist, on_log, tokens_per_batch=1)
    if resume:
        saved = ckpt.read_json(run_dir / "config.json").get("data", {})
        if saved.get("classes") != list(data.classes) or abs(saved.get("mean", 0) - batches.mean) > 1e-6:
            raise ValueError(f"the images of {data_cfg.dataset} changed since {run_dir} was started "
                             "(other classes or statistics); start a new run instead of resuming")
        trainer.load_resume_state()
    elif dist.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        ckpt.write_json(run_dir / "config.json", run_config(model_cfg, train_cfg, data_cfg, data, batches))
    result = trainer.fit()
    if dist.is_main:
        ckpt.load_weights(model, run_dir / "model.safetensors")
    return model, data, batches, result


def load_vit_run(run_dir: Path, device: str = "cpu") -> tuple[ViT, dict[str, Any]]:
    """A trained ViT (best weights, eval mode) and its run's ``data`` section (classes, mean, std)."""
    run_dir = Path(run_dir)
    cfg = ckpt.read_run_config(run_dir, "vit", "an image classifier")
    data = cfg.get("data")
    try:
        model_cfg = ViTConfig(**cfg["model"])
        info = {"classes": list(data["classes"]), "mean": float(data["mean"]), "std": float(data["std"]),
                "dataset": data.get("name", "?")}
    except (TypeError, ValueError, KeyError) as e:
        raise ckpt.CheckpointError(f"{run_dir}/config.json is damaged ({type(e).__name__}: {e})") from None
    if len(info["classes"]) != model_cfg.n_classes:
        raise ckpt.CheckpointError(f"{run_dir}/config.json names {len(info['classes'])} classes "
                                   f"but the model has {model_cfg.n_classes}")
    model = ViT(model_cfg)
    ckpt.load_weights(model, run_dir / "model.safetensors")
    return model.to(device).eval(), info


@torch.no_grad()
def attention_maps(model: ViT, image: Tensor, mean: float, std: float,
                   layer: int = -1) -> tuple[Tensor, Tensor, Tensor]:
    """One uint8 image (C, H, W) -> (class probabilities (K,), read-out attention per head of
    ``layer`` (H, g, g), attention rollout through all layers (g, g)); g = patches per side.

    "Read-out attention" is the class token's row for ``read_out="cls"``, else the mean of all
    rows (see :func:`qkv.attention.rollout.readout_attention`).
    """
    from qkv.attention.rollout import attention_rollout, readout_attention

    model.eval()
    cfg = model.cfg
    x = ((image.float() / 255 - mean) / std)[None].to(next(model.parameters()).device)
    out = model(x, backend="reference", return_weights=True)
    assert out.weights is not None
    g = cfg.grid
    heads = readout_attention(out.weights[layer][0].float(), cfg.read_out).reshape(-1, g, g)
    rollout = readout_attention(attention_rollout(out.weights)[0], cfg.read_out).reshape(g, g)
    return out.logits[0].float().softmax(-1).cpu(), heads.cpu(), rollout.cpu()
